// PipeDream's graph text (plan/profile.h parse_pipedream_graph).
#include "fuzz_common.h"
#include "pipetrain/plan/profile.h"

PIPETRAIN_FUZZ_TARGET({
  const pipetrain::Profile p = pipetrain::parse_pipedream_graph(text, {}, "fuzz.txt");
  pipetrain::validate_profile(p, "fuzz.txt");
})

// Plan files (plan/planner.h plan_from_json_text).
#include "fuzz_common.h"
#include "pipetrain/plan/planner.h"

PIPETRAIN_FUZZ_JSON_TARGET({
  const pipetrain::Plan p = pipetrain::plan_from_json_text(text, "fuzz.json");
  pipetrain::plan_from_json_text(pipetrain::plan_to_json_text(p), "round trip");
})

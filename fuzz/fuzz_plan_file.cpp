// Plan files as train --plan reads them (plan/search.h plan_file_from_json: the plan, its run fields, its
// PipeDream and UMPIPE sections), through the bounded JSON reader.
#include "fuzz_common.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/plan/search.h"

PIPETRAIN_FUZZ_JSON_TARGET({
  const pipetrain::PlanFile f = pipetrain::plan_file_from_json(pipetrain::parse_json_text(text, "fuzz.json"), "fuzz.json");
  pipetrain::plan_file_from_json(pipetrain::parse_json_text(pipetrain::plan_file_to_json(f).dump(2), "round trip"),
                                 "round trip");
})

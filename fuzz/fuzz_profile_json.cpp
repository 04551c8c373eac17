// Profile JSON (plan/profile.h): what the strict reader accepts also validates.
#include "fuzz_common.h"
#include "pipetrain/plan/profile.h"

PIPETRAIN_FUZZ_JSON_TARGET({
  const pipetrain::Profile p = pipetrain::profile_from_json_text(text, "fuzz.json");
  pipetrain::validate_profile(p, "fuzz.json");
  pipetrain::profile_from_json_text(pipetrain::profile_to_json_text(p), "round trip");
})

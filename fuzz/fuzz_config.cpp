// Config files (core/config.h parse_config_text: the JSON-to-flags part of --config).
#include "fuzz_common.h"
#include "pipetrain/core/config.h"

PIPETRAIN_FUZZ_JSON_TARGET({ pipetrain::parse_config_text(text, "fuzz.json"); })

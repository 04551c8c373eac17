// Action text ("0F3", "1BW2", "0S0", ...): parse, and what parses prints back to itself.
#include <stdexcept>

#include "fuzz_common.h"
#include "pipetrain/core/action.h"

PIPETRAIN_FUZZ_TARGET({
  const pipetrain::Action a = pipetrain::parse_action(text);
  if (!(pipetrain::parse_action(pipetrain::to_string(a)) == a)) throw std::logic_error("action does not round-trip");
})

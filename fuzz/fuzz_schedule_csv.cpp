// Schedule CSV (core/schedule.h from_csv); what parses is written and read back unchanged.
#include <stdexcept>

#include "fuzz_common.h"
#include "pipetrain/core/schedule.h"

PIPETRAIN_FUZZ_TARGET({
  const pipetrain::Schedule s = pipetrain::from_csv(text);
  if (!(pipetrain::from_csv(pipetrain::to_csv(s)) == s)) throw std::logic_error("schedule CSV does not round-trip");
})

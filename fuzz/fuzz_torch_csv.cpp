// PyTorch's schedule CSV (core/torch_csv.h from_torch_csv); what parses and can be written is written
// in the letters it was read with and read back unchanged. Writing may refuse a schedule with no
// lock-step layout (an action needing data that nothing makes) with a UsageError, as documented.
#include <stdexcept>

#include "fuzz_common.h"
#include "pipetrain/core/torch_csv.h"

namespace {
void round_trip(const std::string& text) {
  const pipetrain::TorchCsvRead r = pipetrain::from_torch_csv(text);
  pipetrain::TorchCsvWriteOptions w;
  w.letters = r.letters;
  const std::string written = pipetrain::to_torch_csv(r.schedule, w);
  pipetrain::TorchCsvReadOptions o;
  o.letters = r.letters;
  o.name = r.schedule.name;
  if (!(pipetrain::from_torch_csv(written, o).schedule == r.schedule))
    throw std::logic_error("PyTorch schedule CSV does not round-trip");
}
}  // namespace

PIPETRAIN_FUZZ_TARGET(round_trip(text))

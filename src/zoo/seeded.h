// The data sets' shuffles and samples draw from a private generator per (seed, k) (k: the step or the
// epoch), so a batch is a pure function of --seed and k, never of the global generator (internal to zoo).
#pragma once

#include <ATen/core/Generator.h>

#include <cstdint>

namespace pipetrain::zoo {

// ATen's CPU generator keeps only the low 32 bits of its seed, so (seed, k) is hashed (splitmix64,
// core/random.h) rather than combined linearly: every bit of both reaches those 32 bits.
at::Generator seeded_generator(uint64_t seed, uint64_t k);

}  // namespace pipetrain::zoo

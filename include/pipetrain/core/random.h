// splitmix64: the one integer hash pipetrain derives its seeds from (dropout seeds per pass, data
// shuffles per epoch, the UMPIPE planner's generator). Bitwise resume and schedule-independent dropout
// rely on it staying exactly this function. Torch-free; pure; any thread may call it.
#pragma once

#include <cstdint>

namespace pipetrain {

// Steele, Lea and Flood's SplitMix64 step on x: x + golden gamma, then the variant-13 finaliser.
constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace pipetrain

// Test helper: the environment of ranks started by mpirun.
#pragma once

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace pipetrain::testing {

// Under AddressSanitizer, ranks started by mpirun record allocation stacks in full
// (fast_unwind_on_malloc=0), so that blocks Open MPI's plugins keep until exit are attributed to its
// libraries and suppressed (scripts/lsan.supp; the mpi transport checks for leaks before MPI_Finalize).
// Adds ASAN_OPTIONS to `env` (for mpirun to pass on with -x) in such builds; nothing otherwise.
inline void add_asan_mpi_env(std::vector<std::pair<std::string, std::string>>& env) {
#if defined(__SANITIZE_ADDRESS__)
  const char* old = std::getenv("ASAN_OPTIONS");
  env.emplace_back("ASAN_OPTIONS", (old && *old ? std::string(old) + ":" : std::string()) + "fast_unwind_on_malloc=0");
#else
  (void)env;
#endif
}

}  // namespace pipetrain::testing

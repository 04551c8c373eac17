// Test helper: the environment of ranks started by mpirun.
#pragma once

#include <cstdio>
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

// The flags that start ranks of `mpirun` (path `mpirun`) on this host as root: --allow-run-as-root,
// --oversubscribe, the shared-memory transport, and with Open MPI 4 (Debian 12) its out-of-band channel on
// the loopback interface. Open MPI 5 (Debian 13) refuses a loopback-only out-of-band channel ("No network
// interfaces were found for out-of-band communications"), so it is left to its default there.
inline std::vector<std::string> mpirun_local_flags(const std::string& mpirun) {
  static const int major = [&] {
    int v = 0;
    if (FILE* p = ::popen((mpirun + " --version 2>/dev/null").c_str(), "r")) {
      char line[256] = {};
      if (std::fgets(line, sizeof line, p)) {
        const std::string text(line);
        const auto at = text.find_first_of("0123456789");
        if (at != std::string::npos) v = std::atoi(text.c_str() + at);
      }
      ::pclose(p);
    }
    return v;
  }();
  std::vector<std::string> flags{"--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader"};
  if (major < 5) flags.insert(flags.end(), {"--mca", "oob_tcp_if_include", "lo"});
  return flags;
}

}  // namespace pipetrain::testing

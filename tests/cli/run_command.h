// Runs a shell command line for the command-line tests and collects what a user would see.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace pipetrain::testing {

struct CommandResult {
  int code = -1;        // exit code, or 128 + signal
  std::string out;      // stdout and stderr together
  double seconds = 0;   // wall time
  bool has(const std::string& text) const { return out.find(text) != std::string::npos; }
};

// `shell` runs under /bin/sh with stderr joined to stdout (or discarded when `with_stderr` is false).
// A prefix for shell commands that start ranks with mpirun: under AddressSanitizer the ranks record
// allocation stacks in full (fast_unwind_on_malloc=0), so that blocks Open MPI's plugins keep until exit
// are attributed to its libraries and suppressed (scripts/lsan.supp); empty in other builds.
inline std::string asan_mpi_env() {
#if defined(__SANITIZE_ADDRESS__)
  const char* old = std::getenv("ASAN_OPTIONS");
  return std::string("ASAN_OPTIONS='") + (old && *old ? std::string(old) + ":" : "") + "fast_unwind_on_malloc=0' ";
#else
  return "";
#endif
}

inline CommandResult run_command(const std::string& shell, bool with_stderr = true) {
  const auto t0 = std::chrono::steady_clock::now();
  CommandResult r;
  FILE* pipe = popen((shell + (with_stderr ? " 2>&1" : " 2>/dev/null")).c_str(), "r");
  if (!pipe) return r;
  char buf[4096];
  std::size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) r.out.append(buf, n);
  const int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// The pipetrain binary with `args`.
inline CommandResult run_pipetrain(const std::string& args, bool with_stderr = true) {
  return run_command(std::string(PIPETRAIN_BIN) + " " + args, with_stderr);
}

// Whether this build has the gloo transport (`pipetrain info` lists its transports); a build against a
// LibTorch without Gloo headers (pip's PyTorch) has none, and the tests that need it skip there.
inline bool pipetrain_has_gloo() {
  static const bool has = run_pipetrain("info").out.find("Transports: local, shm, mpi, gloo") != std::string::npos;
  return has;
}
#define SKIP_WITHOUT_GLOO() \
  if (!::pipetrain::testing::pipetrain_has_gloo()) GTEST_SKIP() << "this build has no gloo transport (see `pipetrain info`)"

// Whether Debian's bible-kjv (the gpt's default data) is installed; a machine without it (a GPU machine with
// only pip's PyTorch) skips the tests that train on it.
inline bool bible_installed() {
  static const bool has = run_command("command -v bible").code == 0;
  return has;
}
#define SKIP_WITHOUT_BIBLE() \
  if (!::pipetrain::testing::bible_installed()) GTEST_SKIP() << "bible-kjv not installed (the gpt's default data)"

// An empty folder pipetrain-PREFIX-NAME-PID under the system's temporary folder.
inline std::filesystem::path fresh_temp_dir(const std::string& prefix, const std::string& name) {
  const std::filesystem::path d =
      std::filesystem::temp_directory_path() / ("pipetrain-" + prefix + "-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

inline nlohmann::json read_json_file(const std::filesystem::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

// The "loss" of every line of a train --log file, in order.
inline std::vector<double> log_losses(const std::filesystem::path& log) {
  std::vector<double> out;
  std::ifstream in(log);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

}  // namespace pipetrain::testing

// Test helpers for code that reads the environment (the transports' rendezvous and choice): set variables
// for one scope and put the old values back, and the message of a UsageError a call throws.
#pragma once

#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include <unistd.h>

#include "pipetrain/core/error.h"

namespace pipetrain::testing {

// Sets (or, for nullopt, unsets) environment variables for one scope and puts the old values back.
class EnvGuard {
 public:
  explicit EnvGuard(const std::map<std::string, std::optional<std::string>>& values) {
    for (const auto& [name, value] : values) {
      const char* old = std::getenv(name.c_str());
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      set(name, value);
    }
  }
  ~EnvGuard() {
    for (const auto& [name, value] : saved_) set(name, value);
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

 private:
  static void set(const std::string& name, const std::optional<std::string>& value) {
    if (value)
      ::setenv(name.c_str(), value->c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

inline const std::optional<std::string> unset = std::nullopt;

// The message of the UsageError `f` throws, or "(no UsageError)".
inline std::string usage_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(no UsageError)";
}

// This test program's path, for tests that start copies of it as ranks (each child runs one test, named
// by --gtest_filter). gtest's sharding variables (GTEST_TOTAL_SHARDS, GTEST_SHARD_INDEX: a sharded run on
// a many-core machine) are dropped from this process's environment first: a child inheriting them sharded
// its one test away, ran nothing and passed, and the test then failed on ranks that did nothing. gtest
// read them when this process started, so dropping them changes nothing here.
inline std::string self_exe() {
  ::unsetenv("GTEST_TOTAL_SHARDS");
  ::unsetenv("GTEST_SHARD_INDEX");
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string("/proc/self/exe");
}

}  // namespace pipetrain::testing

// Test helpers for code that reads the environment (the transports' rendezvous and choice): set variables
// for one scope and put the old values back, and the message of a UsageError a call throws.
#pragma once

#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>

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

}  // namespace pipetrain::testing

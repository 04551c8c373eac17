// Helpers the misuse tests share: the message of the error a call throws, and a fresh folder.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <stdexcept>
#include <string>

#include "pipetrain/core/error.h"

namespace pipetrain::testing {

// The message of the `E` that `f()` throws (UsageError by default), or "accepted" when it throws none.
template <class E = UsageError, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "accepted";
}

// A new empty folder under the test's temporary folder, named after `prefix`.
inline std::string temp_dir(const std::string& prefix) {
  std::string t = ::testing::TempDir() + prefix + "-XXXXXX";
  if (!::mkdtemp(t.data())) throw std::runtime_error("mkdtemp");
  return t;
}

}  // namespace pipetrain::testing

// Shared by the fuzz targets (fuzz/README.md). Every target feeds one parser of user input and accepts
// exactly two outcomes: a result, or pipetrain::UsageError (bad input, exit 2). Any other exception, a
// crash, a leak or undefined behaviour is a finding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "pipetrain/core/error.h"

// For the JSON inputs, whose messages quote the file only in short, escaped excerpts (core/json_limits.h):
// a UsageError's message must also be short and hold no control byte but newline (issue 23: a 300 KB echo,
// terminal escape sequences).
inline void check_short_escaped_message(const char* what) {
  const std::string m(what);
  if (m.size() > 2048) __builtin_trap();
  for (const char c : m)
    if ((static_cast<unsigned char>(c) < 0x20 && c != '\n') || c == 0x7F) __builtin_trap();
}

#define PIPETRAIN_FUZZ_JSON_TARGET(body)                                             \
  extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { \
    const std::string text(reinterpret_cast<const char*>(data), size);               \
    try {                                                                            \
      body;                                                                          \
    } catch (const pipetrain::UsageError& e) {                                       \
      check_short_escaped_message(e.what());                                         \
    }                                                                                \
    return 0;                                                                        \
  }

#define PIPETRAIN_FUZZ_TARGET(body)                                                  \
  extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { \
    const std::string text(reinterpret_cast<const char*>(data), size);               \
    try {                                                                            \
      body;                                                                          \
    } catch (const pipetrain::UsageError&) {                                         \
    }                                                                                \
    return 0;                                                                        \
  }

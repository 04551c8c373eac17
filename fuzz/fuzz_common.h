// Shared by the fuzz targets (fuzz/README.md). Every target feeds one parser of user input and accepts
// exactly two outcomes: a result, or pipetrain::UsageError (bad input, exit 2). Any other exception, a
// crash, a leak or undefined behaviour is a finding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "pipetrain/core/error.h"

#define PIPETRAIN_FUZZ_TARGET(body)                                                  \
  extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { \
    const std::string text(reinterpret_cast<const char*>(data), size);               \
    try {                                                                            \
      body;                                                                          \
    } catch (const pipetrain::UsageError&) {                                         \
    }                                                                                \
    return 0;                                                                        \
  }

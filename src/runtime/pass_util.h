// Internal to pipetrain_runtime: helpers the executor's interpreter and the UMPIPE pass share.
#pragma once

#include <c10/core/ScalarType.h>
#include <malloc.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace pipetrain::detail {

// Milliseconds on the steady clock: the time base of every measured timeline, so that the timelines of
// the interpreter and the UMPIPE pass (and of all ranks on one host) merge.
inline double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// Bytes the C heap holds now (small blocks in use plus mmapped ones): PipelineOptions::measure_memory.
inline double heap_in_use() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd);
}

// "[8, 16] Float": a shape and dtype in error messages.
inline std::string shape_text(const std::vector<int64_t>& shape, c10::ScalarType dtype) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "] " + c10::toString(dtype);
}

// A tensor header (dtype, rank, then up to kTensorHeaderLen - 2 sizes) as one int64 message: how a
// stage tells its neighbour the dtype and shape of what it will send, once per boundary.
inline constexpr int kTensorHeaderLen = 10;

}  // namespace pipetrain::detail

// Internal: LibTorch's default CPU generator seeded for a scope (executor.cpp's deterministic forwards,
// layers.cpp's per-layer initialisation).
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

#include <cstdint>
#include <mutex>

namespace pipetrain {

// The default CPU generator seeded with `seed` while in scope, then put back as it was. Its state is
// copied directly (the Mersenne Twister and the cached normal samples): a forward of a tiny layer cost
// about as much again in get_state/set_state, which go through a byte tensor of the same state.
class SeededCpuGenerator {
 public:
  SeededCpuGenerator(at::Generator& gen, uint64_t seed)
      : gen_(gen), cpu_(at::check_generator<at::CPUGeneratorImpl>(gen)) {
    std::lock_guard<std::mutex> g(gen_.mutex());
    engine_ = cpu_->engine();
    next_float_ = cpu_->next_float_normal_sample();
    next_double_ = cpu_->next_double_normal_sample();
    cpu_->set_current_seed(seed);
  }
  ~SeededCpuGenerator() {
    std::lock_guard<std::mutex> g(gen_.mutex());
    cpu_->set_engine(engine_);
    cpu_->set_next_float_normal_sample(next_float_);
    cpu_->set_next_double_normal_sample(next_double_);
  }
  SeededCpuGenerator(const SeededCpuGenerator&) = delete;
  SeededCpuGenerator& operator=(const SeededCpuGenerator&) = delete;

 private:
  at::Generator& gen_;
  at::CPUGeneratorImpl* cpu_;
  at::mt19937 engine_;
  c10::optional<float> next_float_;
  c10::optional<double> next_double_;
};

}  // namespace pipetrain

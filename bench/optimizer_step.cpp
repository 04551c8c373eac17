// The optimizer step alone (issue 15): LibTorch's Adam and AdamW against pipetrain's fused loop
// (src/runtime/fused_optimizer.h) on the parameters of one pipeline stage, one intra-op thread, the two
// alternated call by call on identical copies. Prints per case the float count and the median
// milliseconds per step of each, and their ratio.
//
//   build/bench/bench_optimizer_step                 (200 steps per case, after 10 warm-up steps)
//   build/bench/bench_optimizer_step --quick         (the `make test` run: 5 steps)
//   ... --threads N                                  (intra-op threads for both, default 1)
//
// Cases: the issue-15 MLP's first stage (784x256 and 256x256 layers with biases: the 2-stage run's rank 0)
// and a wider stage of 4M floats.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fused_optimizer.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<torch::Tensor> params_of(const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<torch::Tensor> ps;
  for (const auto& s : shapes) {
    ps.push_back(torch::randn(s).requires_grad_(true));
    ps.back().mutable_grad() = torch::randn(s) * 0.01;
  }
  return ps;
}

std::vector<torch::Tensor> copy_of(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  for (const auto& p : ps) {
    out.push_back(p.detach().clone().requires_grad_(true));
    out.back().mutable_grad() = p.grad().clone();
  }
  return out;
}

double time_ms(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int threads = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc && std::atoi(argv[i + 1]) > 0) {
      threads = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "bench_optimizer_step: unknown option %s (takes --quick, --threads N with N >= 1)\n",
                   argv[i]);
      return 2;
    }
  }
  at::set_num_threads(threads);
  std::printf("intra-op threads: %d\n", threads);
  torch::manual_seed(0);
  const int steps = quick ? 5 : 200, warmup = quick ? 1 : 10;
  struct Case {
    std::string name;
    std::vector<std::vector<int64_t>> shapes;
  };
  const std::vector<Case> cases = {{"mlp-stage0", {{256, 784}, {256}, {256, 256}, {256}}},
                                   {"wide-4M", {{2048, 2048}}}};
  std::printf("%-12s %-6s %10s %12s %10s %8s\n", "case", "optim", "floats", "libtorch_ms", "fused_ms", "ratio");
  for (const Case& c : cases)
    for (const std::string optim : {"adam", "adamw"}) {
      std::vector<torch::Tensor> a = params_of(c.shapes), b = copy_of(a);
      std::unique_ptr<torch::optim::Optimizer> oa, ob;
      if (optim == "adam") {
        oa = std::make_unique<torch::optim::Adam>(a, torch::optim::AdamOptions(1e-3));
        ob = std::make_unique<torch::optim::Adam>(b, torch::optim::AdamOptions(1e-3));
      } else {
        oa = std::make_unique<torch::optim::AdamW>(a, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
        ob = std::make_unique<torch::optim::AdamW>(b, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
      }
      if (!pipetrain::detail::fused_step_applies(*ob)) {
        std::fprintf(stderr, "bench_optimizer_step: the fused step does not apply to %s\n", c.name.c_str());
        return 1;
      }
      std::vector<double> ta, tb;
      for (int k = 0; k < warmup + steps; ++k) {
        const double x = time_ms([&] { oa->step(); });
        const double y = time_ms([&] { pipetrain::detail::optimizer_step(*ob); });
        if (k >= warmup) {
          ta.push_back(x);
          tb.push_back(y);
        }
      }
      int64_t floats = 0;
      for (const auto& p : a) floats += p.numel();
      const double ma = median(ta), mb = median(tb);
      std::printf("%-12s %-6s %10lld %12.3f %10.3f %7.2fx\n", c.name.c_str(), optim.c_str(),
                  static_cast<long long>(floats), ma, mb, mb > 0 ? ma / mb : 0.0);
    }
  return 0;
}

// The optimizer step alone (issue 15): LibTorch's Adam and AdamW against pipetrain's fused loop
// (src/runtime/fused_optimizer.h) on the parameters of one pipeline stage, one intra-op thread, the two
// alternated call by call on identical copies. Prints per case the float count and the median
// milliseconds per step of each, and their ratio.
//
//   build/bench/bench_optimizer_step                 (200 steps per case, after 10 warm-up steps)
//   build/bench/bench_optimizer_step --quick         (the `make test` run: 5 steps)
//   ... --threads N                                  (intra-op threads for both, default 1)
//   ... --device cuda                                (on a GPU: LibTorch's step against the multi-tensor
//                                                     one that optimizer_step takes there, issue 26; each
//                                                     step timed to a device synchronisation)
//
// Cases: the issue-15 MLP's first stage (784x256 and 256x256 layers with biases: the 2-stage run's rank 0),
// a wider stage of 4M floats, and (with --device cuda) the parameters of issue 26's GPT (8 blocks, d_model
// 512, context 256, vocabulary 256: 102 tensors, 25.6M floats).
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

#include <torch/cuda.h>

#include "fused_optimizer.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<torch::Tensor> params_of(const std::vector<std::vector<int64_t>>& shapes, const torch::Device& device) {
  std::vector<torch::Tensor> ps;
  for (const auto& s : shapes) {
    ps.push_back(torch::randn(s).to(device).requires_grad_(true));
    ps.back().mutable_grad() = torch::randn(s).to(device) * 0.01;
  }
  return ps;
}

// The parameter shapes of a GPT: token and position embeddings, `blocks` blocks (two layer norms,
// the attention's input and output projections, the two MLP layers, with biases) and the head.
std::vector<std::vector<int64_t>> gpt_shapes(int64_t blocks, int64_t d, int64_t context, int64_t vocab) {
  std::vector<std::vector<int64_t>> s = {{vocab, d}, {context, d}};
  for (int64_t b = 0; b < blocks; ++b)
    for (const std::vector<int64_t>& t : std::vector<std::vector<int64_t>>{
             {d}, {d}, {3 * d, d}, {3 * d}, {d, d}, {d}, {d}, {d}, {4 * d, d}, {4 * d}, {d, 4 * d}, {d}})
      s.push_back(t);
  for (const std::vector<int64_t>& t : std::vector<std::vector<int64_t>>{{d}, {d}, {vocab, d}, {vocab}}) s.push_back(t);
  return s;
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
  std::string device_name = "cpu";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--device") == 0 && i + 1 < argc &&
               (std::strcmp(argv[i + 1], "cpu") == 0 || std::strcmp(argv[i + 1], "cuda") == 0)) {
      device_name = argv[++i];
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc && std::atoi(argv[i + 1]) > 0) {
      threads = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "bench_optimizer_step: unknown option %s (takes --quick, --threads N with N >= 1, --device cpu|cuda)\n",
                   argv[i]);
      return 2;
    }
  }
  const bool cuda = device_name == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_optimizer_step: --device cuda, but this LibTorch sees no CUDA device\n");
    return 2;
  }
  const torch::Device device = cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  at::set_num_threads(threads);
  std::printf("intra-op threads: %d, device: %s (the second column: %s)\n", threads, device.str().c_str(),
              cuda ? "the multi-tensor step" : "the fused loop");
  torch::manual_seed(0);
  const int steps = quick ? 5 : 200, warmup = quick ? 1 : 10;
  struct Case {
    std::string name;
    std::vector<std::vector<int64_t>> shapes;
  };
  std::vector<Case> cases = {{"mlp-stage0", {{256, 784}, {256}, {256, 256}, {256}}}, {"wide-4M", {{2048, 2048}}}};
  if (cuda) cases.push_back({"gpt-8x512", gpt_shapes(8, 512, 256, 256)});
  std::printf("%-12s %-6s %10s %12s %10s %8s\n", "case", "optim", "floats", "libtorch_ms", "fused_ms", "ratio");
  for (const Case& c : cases)
    for (const std::string optim : {"adam", "adamw"}) {
      std::vector<torch::Tensor> a = params_of(c.shapes, device), b = copy_of(a);
      std::unique_ptr<torch::optim::Optimizer> oa, ob;
      if (optim == "adam") {
        oa = std::make_unique<torch::optim::Adam>(a, torch::optim::AdamOptions(1e-3));
        ob = std::make_unique<torch::optim::Adam>(b, torch::optim::AdamOptions(1e-3));
      } else {
        oa = std::make_unique<torch::optim::AdamW>(a, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
        ob = std::make_unique<torch::optim::AdamW>(b, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
      }
      if (!cuda && !pipetrain::detail::fused_step_applies(*ob)) {
        std::fprintf(stderr, "bench_optimizer_step: the fused step does not apply to %s\n", c.name.c_str());
        return 1;
      }
      std::vector<double> ta, tb;
      for (int k = 0; k < warmup + steps; ++k) {
        const double x = time_ms([&] {
          oa->step();
          if (cuda) torch::cuda::synchronize();
        });
        const double y = time_ms([&] {
          pipetrain::detail::optimizer_step(*ob);
          if (cuda) torch::cuda::synchronize();
        });
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

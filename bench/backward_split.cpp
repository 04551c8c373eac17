// Zero-bubble B/W split of one stage's backward (issue 24): pipetrain::nn::Linear's explicit split
// (split_linear.h) against the split through autograd (src/runtime/autograd_split.h), and both against
// the fused backward, on the same stage, the methods alternated repetition by repetition in one run.
// Prints per stage and method the median milliseconds of B, of W and of B+W, and B+W and B over the
// fused backward's median.
//
//   build/bench/bench_backward_split               (30 repetitions after 3 warm-ups, 1 intra-op thread)
//   build/bench/bench_backward_split --quick       (the `make test` run: tiny stages, 3 repetitions)
//   ... --threads N --reps R --batch N --width H --layers L
//
// Stages: "mlp" (L x [Linear(H, H), GELU]) built with torch::nn::Linear or pipetrain::nn::Linear, and
// "block" (a transformer block of plain LibTorch layers: LayerNorm, MultiheadAttention, a 4H MLP) that
// only autograd can split. The stage input requires grad (a middle stage). Methods:
//   fused           torch::autograd::backward, everything in B (1F1B's BW)
//   explicit        nn::Linear's own split: full backward under a WeightGradStore (backward_split explicit,
//                   and auto on a stage whose parameters are all in nn::Linear)
//   mixed           autograd for B, nn::Linear queueing its own W (backward_split auto on a stage that
//                   mixes nn::Linear with other layers)
//   autograd        autograd for B and W, nn::Linear included (backward_split autograd; auto on stages
//                   without nn::Linear)
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "autograd_split.h"
#include "bench_util.h"
#include "pipetrain/runtime/split_linear.h"

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm n1{nullptr}, n2{nullptr};
  torch::nn::MultiheadAttention attn{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
  int64_t tokens;
  BlockImpl(int64_t h, int64_t tokens) : tokens(tokens) {
    n1 = register_module("n1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({h})));
    n2 = register_module("n2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({h})));
    attn = register_module("attn", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(h, 4)));
    up = register_module("up", torch::nn::Linear(h, 4 * h));
    down = register_module("down", torch::nn::Linear(4 * h, h));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // x: [B*T, H]
    const int64_t h = x.size(1);
    const torch::Tensor t = n1(x).view({-1, tokens, h}).transpose(0, 1);
    torch::Tensor y = x + std::get<0>(attn(t, t, t)).transpose(0, 1).reshape({-1, h});
    return y + down(torch::gelu(up(n2(y))));
  }
};
TORCH_MODULE(Block);

struct Stage {
  std::string name;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::vector<torch::Tensor> params;
  int64_t rows, width;
  std::vector<std::string> methods;
};

struct Times {
  std::vector<double> b, w;
};

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int threads = 1, reps = 30;
  int64_t batch = 512, width = 512, layers = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> long { return i + 1 < argc ? std::atol(argv[++i]) : 0; };
    if (a == "--quick") quick = true;
    else if (a == "--threads") threads = static_cast<int>(next());
    else if (a == "--reps") reps = static_cast<int>(next());
    else if (a == "--batch") batch = next();
    else if (a == "--width") width = next();
    else if (a == "--layers") layers = next();
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (quick) {
    batch = 16, width = 16, layers = 2, reps = 3;
  }
  at::set_num_threads(std::max(1, threads));
  torch::manual_seed(0);

  torch::nn::Sequential mlp_torch, mlp_split;
  for (int64_t k = 0; k < layers; ++k) {
    mlp_torch->push_back(torch::nn::Linear(width, width));
    mlp_torch->push_back(torch::nn::GELU());
    mlp_split->push_back(pipetrain::nn::Linear(width, width));
    mlp_split->push_back(torch::nn::GELU());
  }
  Block block(width, 8);
  std::vector<Stage> stages{
      {"mlp-torch-linear", [&](const torch::Tensor& x) { return mlp_torch->forward(x); }, mlp_torch->parameters(), batch,
       width, {"fused", "autograd"}},
      {"mlp-nn-linear", [&](const torch::Tensor& x) { return mlp_split->forward(x); }, mlp_split->parameters(), batch,
       width, {"fused", "explicit", "mixed", "autograd"}},
      {"block", [&](const torch::Tensor& x) { return block->forward(x); }, block->parameters(), batch, width,
       {"fused", "autograd"}},
  };
  std::printf("# backward split: batch %lld, width %lld, mlp layers %lld, intra-op threads %d, %d repetitions%s\n",
              static_cast<long long>(batch), static_cast<long long>(width), static_cast<long long>(layers),
              at::get_num_threads(), reps, quick ? " (quick)" : "");
  std::printf("%-18s %-9s %9s %9s %9s %8s %8s\n", "stage", "method", "B_ms", "W_ms", "BW_ms", "BW/fused", "B/fused");
  for (Stage& st : stages) {
    const torch::Tensor x0 = torch::randn({st.rows, st.width});
    const torch::Tensor g = torch::randn({st.rows, st.width});
    std::vector<Times> times(st.methods.size());
    for (int r = -3; r < reps; ++r) {  // 3 warm-ups
      for (std::size_t k = 0; k < st.methods.size(); ++k) {
        const std::string& method = st.methods[k];
        for (auto& p : st.params) p.mutable_grad() = torch::Tensor();
        torch::Tensor x = x0.clone().requires_grad_(true);
        torch::Tensor y = st.forward(x);
        pipetrain::WeightGradStore store;
        auto t0 = Clock::now();
        if (method == "fused") {
          torch::autograd::backward({y}, {g});
        } else if (method == "explicit") {
          pipetrain::WeightGradStore::Scope scope(&store);
          torch::autograd::backward({y}, {g});
        } else {
          pipetrain::detail::backward_input({y}, {g}, {x}, store, method == "mixed");
        }
        const double b = ms_since(t0);
        y = torch::Tensor();
        t0 = Clock::now();
        store.run();
        const double w = ms_since(t0);
        if (r >= 0) {
          times[k].b.push_back(b);
          times[k].w.push_back(w);
        }
      }
    }
    std::vector<double> fused_bw;
    for (std::size_t k = 0; k < st.methods.size(); ++k) {
      const double b = pipetrain::bench::median(times[k].b), w = pipetrain::bench::median(times[k].w);
      std::vector<double> bw;
      for (std::size_t i = 0; i < times[k].b.size(); ++i) bw.push_back(times[k].b[i] + times[k].w[i]);
      const double total = pipetrain::bench::median(bw);
      if (k == 0) fused_bw.push_back(total);
      std::printf("%-18s %-9s %9.3f %9.3f %9.3f %8.2f %8.2f\n", st.name.c_str(), st.methods[k].c_str(), b, w, total,
                  total / fused_bw[0], b / fused_bw[0]);
    }
  }
  return 0;
}

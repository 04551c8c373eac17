// The fused optimizer step (src/runtime/fused_optimizer.h) against LibTorch's own Adam and AdamW: same
// parameters, gradients and state after many steps, to rounding; the cases it does not cover fall back to
// LibTorch's step unchanged.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fused_optimizer.h"
#include "torch_compat.h"

namespace pipetrain {
namespace {

std::vector<torch::Tensor> make_params(torch::ScalarType dtype = torch::kFloat) {
  torch::manual_seed(3);
  // Odd sizes, so vector loops have tails; a scalar; one parameter that never gets a gradient.
  std::vector<torch::Tensor> ps;
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{37, 29}, {29}, {}, {5, 3, 7}, {11}})
    ps.push_back(torch::randn(shape, dtype).requires_grad_(true));
  return ps;
}

// Gives every parameter but the last a gradient (fused_step_applies looks at the gradients).
void give_gradients(std::vector<torch::Tensor>& ps) {
  for (std::size_t i = 0; i + 1 < ps.size(); ++i) ps[i].mutable_grad() = torch::randn_like(ps[i]);
}

std::vector<torch::Tensor> clone_params(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// Steps `a` with LibTorch's step and `b` with detail::optimizer_step on the same gradients, `steps` times;
// the last parameter never gets a gradient.
void step_both(torch::optim::Optimizer& a, std::vector<torch::Tensor>& pa, torch::optim::Optimizer& b,
               std::vector<torch::Tensor>& pb, int steps) {
  for (int k = 0; k < steps; ++k) {
    for (std::size_t i = 0; i + 1 < pa.size(); ++i) {
      const torch::Tensor g = torch::randn_like(pa[i]) * (k % 3 == 0 ? 10.0 : 0.1);
      pa[i].mutable_grad() = g.clone();
      pb[i].mutable_grad() = g.clone();
    }
    a.step();
    detail::optimizer_step(b);
  }
}

double max_abs(const torch::Tensor& t) { return t.abs().max().item<double>(); }

// The loop and LibTorch may round a multiply-add differently: at most an ulp or two of an update of
// size lr (1e-2 here, 6e-8 relative) per step, so about 1e-8 after 25 steps. 1e-6 leaves room and is still
// three orders below what a wrong formula moves (a missing bias correction changes the first steps by ~lr).
void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, const std::string& what) {
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double diff = (a[i] - b[i]).abs().max().item<double>();
    EXPECT_LT(diff, 1e-6) << what << ": parameter " << i << " differs by " << diff;
  }
}

template <class Opt, class Options, class State>
void check_against_libtorch(const Options& options, const std::string& what) {
  std::vector<torch::Tensor> pa = make_params(), pb = clone_params(pa);
  const std::vector<torch::Tensor> start = clone_params(pa);
  Opt a(pa, options), b(pb, options);
  give_gradients(pb);
  ASSERT_TRUE(detail::fused_step_applies(b)) << what;
  step_both(a, pa, b, pb, 25);
  expect_close(pa, pb, what);
  // The steps moved the weights (a loop that did nothing would fail here), all but the one with no gradient:
  // Adam moves an element by about lr (1e-2 or 3e-3 here) per step, so 25 steps move it well past 1e-3.
  for (std::size_t i = 0; i + 1 < pb.size(); ++i)
    EXPECT_GT((pb[i] - start[i]).abs().max().item<double>(), 1e-3) << what << ": parameter " << i << " did not move";
  EXPECT_TRUE(torch::equal(pb.back(), start.back())) << what << ": a parameter without a gradient moved";
  // LibTorch's state, in LibTorch's form: checkpoints and weight prediction read it as before.
  for (std::size_t i = 0; i + 1 < pa.size(); ++i) {
    const auto key_a = compat::optimizer_state_key(pa[i]);
    const auto key_b = compat::optimizer_state_key(pb[i]);
    ASSERT_EQ(b.state().count(key_b), 1u) << what;
    const auto& sa = static_cast<const State&>(*a.state().at(key_a));
    const auto& sb = static_cast<const State&>(*b.state().at(key_b));
    EXPECT_EQ(sa.step(), sb.step()) << what;
    EXPECT_LT(max_abs(sa.exp_avg() - sb.exp_avg()), 1e-6) << what;
    EXPECT_LT(max_abs((sa.exp_avg_sq() - sb.exp_avg_sq()) / (sa.exp_avg_sq().abs() + 1e-12)), 1e-5) << what;
  }
  EXPECT_EQ(b.state().count(compat::optimizer_state_key(pb.back())), 0u) << what;
}

TEST(FusedOptimizer, AdamMatchesLibTorch) {
  check_against_libtorch<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState>(
      torch::optim::AdamOptions(1e-2), "adam");
  check_against_libtorch<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState>(
      torch::optim::AdamOptions(3e-3).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.05), "adam with weight decay");
}

TEST(FusedOptimizer, AdamWMatchesLibTorch) {
  check_against_libtorch<torch::optim::AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      torch::optim::AdamWOptions(1e-2).weight_decay(0.1), "adamw");
  check_against_libtorch<torch::optim::AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      torch::optim::AdamWOptions(1e-2).weight_decay(0), "adamw without decay");
}

TEST(FusedOptimizer, ContinuesFromLibTorchsStateAndBack) {
  // A resumed run: LibTorch's steps made the state, the fused step continues it (and the other way round).
  std::vector<torch::Tensor> pa = make_params(), pb = clone_params(pa);
  torch::optim::Adam a(pa, torch::optim::AdamOptions(1e-2)), b(pb, torch::optim::AdamOptions(1e-2));
  for (int k = 0; k < 3; ++k) {
    for (std::size_t i = 0; i + 1 < pa.size(); ++i) {
      const torch::Tensor g = torch::randn_like(pa[i]);
      pa[i].mutable_grad() = g.clone();
      pb[i].mutable_grad() = g.clone();
    }
    a.step();
    b.step();
  }
  step_both(a, pa, b, pb, 10);
  expect_close(pa, pb, "fused after LibTorch");
}

TEST(FusedOptimizer, OtherCasesFallBackToLibTorchExactly) {
  struct Case {
    std::string what;
    torch::ScalarType dtype;
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)> make;
  };
  const std::vector<Case> cases = {
      {"sgd", torch::kFloat,
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9));
       }},
      {"adam with amsgrad", torch::kFloat,
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2).amsgrad(true));
       }},
      {"adam on doubles", torch::kDouble,
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2));
       }},
  };
  for (const Case& c : cases) {
    std::vector<torch::Tensor> pa = make_params(c.dtype), pb = clone_params(pa);
    auto a = c.make(pa);
    auto b = c.make(pb);
    give_gradients(pb);
    EXPECT_FALSE(detail::fused_step_applies(*b)) << c.what;
    step_both(*a, pa, *b, pb, 5);
    for (std::size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << c.what << " parameter " << i;
  }
  // A non-contiguous gradient is not fused either.
  std::vector<torch::Tensor> p = make_params();
  torch::optim::Adam opt(p, torch::optim::AdamOptions(1e-2));
  p[0].mutable_grad() = torch::randn({29, 37}).t();
  EXPECT_FALSE(detail::fused_step_applies(opt));
}

// The multi-tensor step (what optimizer_step takes on a GPU) against LibTorch's step: Adam and AdamW, with
// and without weight decay, over 25 steps; one parameter gets a gradient every other step only, so a group
// holds two step counts; the last never gets one. Run here on the CPU by calling it directly, and on a GPU
// through optimizer_step where one is present.
void check_multi_tensor(torch::optim::Optimizer& a, std::vector<torch::Tensor>& pa, torch::optim::Optimizer& b,
                        std::vector<torch::Tensor>& pb, const std::function<bool(torch::optim::Optimizer&)>& step,
                        const std::string& what) {
  const std::vector<torch::Tensor> start = clone_params(pb);
  for (int k = 0; k < 25; ++k) {
    for (std::size_t i = 0; i + 1 < pa.size(); ++i) {
      if (i == 1 && k % 2 == 1) {  // no gradient this step
        pa[i].mutable_grad() = torch::Tensor();
        pb[i].mutable_grad() = torch::Tensor();
        continue;
      }
      const torch::Tensor g = torch::randn_like(pa[i]) * (k % 3 == 0 ? 10.0 : 0.1);
      pa[i].mutable_grad() = g.clone();
      pb[i].mutable_grad() = g.clone();
    }
    a.step();
    ASSERT_TRUE(step(b)) << what << ": the multi-tensor step refused at step " << k;
  }
  for (std::size_t i = 0; i < pa.size(); ++i) {
    const double diff = (pa[i] - pb[i]).abs().max().item<double>();
    EXPECT_LT(diff, 1e-6) << what << ": parameter " << i << " differs by " << diff;
  }
  // Each moved (a step that did nothing would fail here; with weight decay the scalar's steps partly cancel,
  // so the bar is 1e-4, still far above the 1e-6 agreement).
  for (std::size_t i = 0; i + 1 < pb.size(); ++i)
    EXPECT_GT((pb[i] - start[i]).abs().max().item<double>(), 1e-4) << what << ": parameter " << i << " did not move";
  EXPECT_TRUE(torch::equal(pb.back(), start.back())) << what << ": a parameter without a gradient moved";
  for (std::size_t i = 0; i + 1 < pa.size(); ++i) {
    const auto& sa = *a.state().at(compat::optimizer_state_key(pa[i]));
    const auto& sb = *b.state().at(compat::optimizer_state_key(pb[i]));
    if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(&sa)) {
      EXPECT_EQ(adam->step(), dynamic_cast<const torch::optim::AdamParamState&>(sb).step()) << what;
    } else {
      EXPECT_EQ(dynamic_cast<const torch::optim::AdamWParamState&>(sa).step(),
                dynamic_cast<const torch::optim::AdamWParamState&>(sb).step()) << what;
    }
  }
}

std::vector<torch::Tensor> params_on(const torch::Device& device) {
  std::vector<torch::Tensor> out;
  for (const auto& p : make_params()) out.push_back(p.detach().to(device).requires_grad_(true));
  return out;
}

TEST(FusedOptimizer, MultiTensorAdamAndAdamWMatchLibTorch) {
  const auto multi = [](torch::optim::Optimizer& o) { return detail::multi_tensor_adam_step(o); };
  for (double decay : {0.0, 0.05}) {
    std::vector<torch::Tensor> pa = make_params(), pb = clone_params(pa);
    torch::optim::Adam a(pa, torch::optim::AdamOptions(1e-2).weight_decay(decay)),
        b(pb, torch::optim::AdamOptions(1e-2).weight_decay(decay));
    check_multi_tensor(a, pa, b, pb, multi, "adam, decay " + std::to_string(decay));
    std::vector<torch::Tensor> qa = make_params(), qb = clone_params(qa);
    torch::optim::AdamW c(qa, torch::optim::AdamWOptions(1e-2).weight_decay(decay)),
        d(qb, torch::optim::AdamWOptions(1e-2).weight_decay(decay));
    check_multi_tensor(c, qa, d, qb, multi, "adamw, decay " + std::to_string(decay));
  }
  // What it does not cover it refuses, changing nothing: SGD, amsgrad.
  std::vector<torch::Tensor> p = make_params();
  give_gradients(p);
  torch::optim::SGD sgd(p, torch::optim::SGDOptions(0.1));
  EXPECT_FALSE(detail::multi_tensor_adam_step(sgd));
  torch::optim::Adam ams(p, torch::optim::AdamOptions(1e-2).amsgrad(true));
  EXPECT_FALSE(detail::multi_tensor_adam_step(ams));
  EXPECT_TRUE(ams.state().empty());
}

TEST(FusedOptimizer, OnAGpuTheStepIsTheMultiTensorOne) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here: this check runs on a GPU machine";
  const torch::Device cuda(torch::kCUDA, 0);
  const auto via_optimizer_step = [](torch::optim::Optimizer& o) {
    detail::optimizer_step(o);
    return true;
  };
  std::vector<torch::Tensor> pa = params_on(cuda), pb = params_on(cuda);
  torch::optim::AdamW a(pa, torch::optim::AdamWOptions(1e-2).weight_decay(0.1)),
      b(pb, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  give_gradients(pb);
  EXPECT_FALSE(detail::fused_step_applies(b));  // the CPU loop does not take GPU tensors
  check_multi_tensor(a, pa, b, pb, via_optimizer_step, "adamw on cuda through optimizer_step");
  std::vector<torch::Tensor> qa = params_on(cuda), qb = params_on(cuda);
  torch::optim::Adam c(qa, torch::optim::AdamOptions(1e-2)), d(qb, torch::optim::AdamOptions(1e-2));
  check_multi_tensor(c, qa, d, qb, via_optimizer_step, "adam on cuda through optimizer_step");
}

// The flush's squared gradient norm in one pass: every size from 0 to 19 (the 8-wide partial sums and the
// tail), a large one, a non-contiguous gradient (LibTorch's path) and a parameter without a gradient,
// against the sum of squares in double.
TEST(FusedOptimizer, GradientSumOfSquaresMatchesDoubleArithmetic) {
  torch::manual_seed(5);
  std::vector<torch::Tensor> params;
  double want = 0;
  auto add = [&](const torch::Tensor& p, const torch::Tensor& g) {
    params.push_back(p);
    if (!g.defined()) return;
    params.back().mutable_grad() = g;
    want += g.to(torch::kDouble).pow(2).sum().item<double>();
  };
  for (int64_t n = 0; n < 20; ++n) add(torch::zeros({n}).requires_grad_(true), torch::randn({n}));
  add(torch::zeros({1000, 3}).requires_grad_(true), torch::randn({1000, 3}) * 1e3);
  add(torch::zeros({7, 5}).requires_grad_(true), torch::randn({5, 7}).t());
  add(torch::zeros({4}).requires_grad_(true), torch::Tensor());
  const double got = detail::gradient_sum_of_squares(params);
  // Both sum about 3,200 positive doubles in different orders: each is within n x 2^-53 (4e-13) of the
  // exact sum, so they agree within 1e-12.
  EXPECT_NEAR(got, want, 1e-12 * want);
  EXPECT_EQ(detail::gradient_sum_of_squares({}), 0.0);
  // One element, exactly: 3^2.
  torch::Tensor one = torch::zeros({1}).requires_grad_(true);
  one.mutable_grad() = torch::full({1}, 3.0f);
  EXPECT_EQ(detail::gradient_sum_of_squares({one}), 9.0);
}

}  // namespace
}  // namespace pipetrain

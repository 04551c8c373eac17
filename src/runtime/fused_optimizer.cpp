// The fused optimizer step (fused_optimizer.h).
#include "fused_optimizer.h"

#include <ATen/Parallel.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fused_adam_kernel.h"
#include "torch_compat.h"

namespace pipetrain::detail {
namespace {

bool dense_float_cpu(const torch::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous() &&
         t.layout() == torch::kStrided;
}

compat::OptimizerStateKey key_of(const torch::Tensor& p) { return compat::optimizer_state_key(p); }

// One parameter the fused loop steps, with its state (null: not made yet).
template <class State>
struct Item {
  torch::Tensor* p;
  State* state;
};

// Per group, the parameters with a gradient and their states, looked up once; nullopt when any of them (or a
// group's options) is not what the loop covers, so the caller falls back before anything changed.
template <class Options, class State>
std::optional<std::vector<std::vector<Item<State>>>> fused_items(torch::optim::Optimizer& opt) {
  std::vector<std::vector<Item<State>>> items;
  for (auto& group : opt.param_groups()) {
    items.emplace_back();
    if (static_cast<const Options&>(group.options()).amsgrad()) return std::nullopt;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (!dense_float_cpu(p) || !dense_float_cpu(p.grad()) || p.grad().numel() != p.numel()) return std::nullopt;
      State* st = nullptr;
      auto it = opt.state().find(key_of(p));
      if (it != opt.state().end()) {
        st = dynamic_cast<State*>(it->second.get());
        if (!st || !dense_float_cpu(st->exp_avg()) || !dense_float_cpu(st->exp_avg_sq()) ||
            st->exp_avg().numel() != p.numel() || st->exp_avg_sq().numel() != p.numel())
          return std::nullopt;
      }
      items.back().push_back({&p, st});
    }
  }
  return items;
}

// One step of Adam (decoupled = false) or AdamW (true) over every group, the arithmetic of LibTorch's step.
// Returns false, having changed nothing, when the loop does not cover the optimizer.
template <class Options, class State>
bool fused_adam(torch::optim::Optimizer& opt, bool decoupled) {
  auto items = fused_items<Options, State>(opt);
  if (!items) return false;
  torch::NoGradGuard no_grad;
  for (std::size_t g = 0; g < items->size(); ++g) {
    const auto& o = static_cast<const Options&>(opt.param_groups()[g].options());
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    for (const Item<State>& item : (*items)[g]) {
      torch::Tensor& p = *item.p;
      State* st = item.state;
      if (!st) {  // as LibTorch makes it on a parameter's first step
        auto fresh = std::make_unique<State>();
        fresh->step(0);
        fresh->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        st = fresh.get();
        opt.state()[key_of(p)] = std::move(fresh);
      }
      st->step(st->step() + 1);
      const auto step = static_cast<double>(st->step());
      AdamScalars s;
      s.beta1 = static_cast<float>(beta1);
      s.one_minus_beta1 = static_cast<float>(1 - beta1);
      s.beta2 = static_cast<float>(beta2);
      s.one_minus_beta2 = static_cast<float>(1 - beta2);
      s.sqrt_bias_correction2 = static_cast<float>(std::sqrt(1 - std::pow(beta2, step)));
      s.eps = static_cast<float>(o.eps());
      s.neg_step_size = static_cast<float>(-(o.lr() / (1 - std::pow(beta1, step))));
      if (o.weight_decay() != 0) {
        if (decoupled)
          s.decay_factor = static_cast<float>(1 - o.lr() * o.weight_decay());
        else
          s.l2 = static_cast<float>(o.weight_decay());
      }
      torch::Tensor& m = st->exp_avg();
      torch::Tensor& v = st->exp_avg_sq();
      float* pp = p.data_ptr<float>();
      const float* gp = p.grad().data_ptr<float>();
      float* mp = m.data_ptr<float>();
      float* vp = v.data_ptr<float>();
      // Element by element, so the intra-op threads may split it anywhere without changing a bit.
      at::parallel_for(0, p.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
        adam_update(pp + begin, gp + begin, mp + begin, vp + begin, end - begin, s);
      });
      // Written through raw pointers: tell autograd the tensors changed, as an in-place operation would.
      p.unsafeGetTensorImpl()->bump_version();
      m.unsafeGetTensorImpl()->bump_version();
      v.unsafeGetTensorImpl()->bump_version();
    }
  }
  return true;
}

}  // namespace

double gradient_sum_of_squares(const std::vector<torch::Tensor>& params) {
  double sq = 0;
  for (const auto& p : params) {
    const torch::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (dense_float_cpu(g))
      sq += sum_of_squares(g.data_ptr<float>(), g.numel());
    else
      sq += g.detach().to(torch::kDouble).pow(2).sum().item<double>();
  }
  return sq;
}

bool fused_step_applies(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer))
    return fused_items<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(optimizer).has_value();
  if (dynamic_cast<torch::optim::Adam*>(&optimizer))
    return fused_items<torch::optim::AdamOptions, torch::optim::AdamParamState>(optimizer).has_value();
  return false;
}

void optimizer_step(torch::optim::Optimizer& optimizer) {
  bool done = false;
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer))
    done = fused_adam<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(optimizer, true);
  else if (dynamic_cast<torch::optim::Adam*>(&optimizer))
    done = fused_adam<torch::optim::AdamOptions, torch::optim::AdamParamState>(optimizer, false);
  if (!done) optimizer.step();
}

}  // namespace pipetrain::detail

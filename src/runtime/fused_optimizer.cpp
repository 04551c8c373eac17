// The fused optimizer step (fused_optimizer.h).
#include "fused_optimizer.h"

#include <ATen/Parallel.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <string>

#include "fused_adam_kernel.h"

namespace pipetrain::detail {
namespace {

bool dense_float_cpu(const torch::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous() &&
         t.layout() == torch::kStrided;
}

std::string key_of(const torch::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

template <class State>
bool state_fits(torch::optim::Optimizer& opt, const torch::Tensor& p) {
  auto it = opt.state().find(key_of(p));
  if (it == opt.state().end()) return true;  // made below, as LibTorch makes it
  const auto* st = dynamic_cast<const State*>(it->second.get());
  return st && dense_float_cpu(st->exp_avg()) && dense_float_cpu(st->exp_avg_sq()) &&
         st->exp_avg().numel() == p.numel() && st->exp_avg_sq().numel() == p.numel();
}

template <class Options, class State>
bool fits(torch::optim::Optimizer& opt) {
  for (auto& group : opt.param_groups()) {
    if (static_cast<const Options&>(group.options()).amsgrad()) return false;
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (!dense_float_cpu(p) || !dense_float_cpu(p.grad()) || p.grad().numel() != p.numel()) return false;
      if (!state_fits<State>(opt, p)) return false;
    }
  }
  return true;
}

// One step of Adam (decoupled = false) or AdamW (true) over every group, the arithmetic of LibTorch's step.
template <class Options, class State>
void fused_adam(torch::optim::Optimizer& opt, bool decoupled) {
  torch::NoGradGuard no_grad;
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const Options&>(group.options());
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& slot = opt.state()[key_of(p)];
      if (!slot) {
        auto fresh = std::make_unique<State>();
        fresh->step(0);
        fresh->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        slot = std::move(fresh);
      }
      auto& st = static_cast<State&>(*slot);
      st.step(st.step() + 1);
      const auto step = static_cast<double>(st.step());
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
      torch::Tensor& m = st.exp_avg();
      torch::Tensor& v = st.exp_avg_sq();
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
    return fits<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(optimizer);
  if (dynamic_cast<torch::optim::Adam*>(&optimizer))
    return fits<torch::optim::AdamOptions, torch::optim::AdamParamState>(optimizer);
  return false;
}

void optimizer_step(torch::optim::Optimizer& optimizer) {
  if (!fused_step_applies(optimizer)) {
    optimizer.step();
    return;
  }
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer))
    fused_adam<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(optimizer, true);
  else
    fused_adam<torch::optim::AdamOptions, torch::optim::AdamParamState>(optimizer, false);
}

}  // namespace pipetrain::detail

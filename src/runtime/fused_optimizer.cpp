// The fused optimizer step (fused_optimizer.h).
#include "fused_optimizer.h"

#include <ATen/Parallel.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fused_adam_kernel.h"
#include "torch_compat.h"

namespace pipetrain::detail {
namespace {

bool dense_float_cpu(const torch::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous() &&
         t.layout() == torch::kStrided;
}

// What the multi-tensor step covers: dense floating-point tensors (optimizer_step takes it on devices only).
bool dense_floating(const torch::Tensor& t) {
  return t.defined() && t.is_floating_point() && t.layout() == torch::kStrided;
}

// Whether some parameter with a gradient lives on a device (not the CPU).
bool on_device(torch::optim::Optimizer& opt) {
  for (auto& group : opt.param_groups())
    for (auto& p : group.params())
      if (p.grad().defined() && !p.device().is_cpu()) return true;
  return false;
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
// `fits`: what a tensor must be for the loop (dense_float_cpu) or the multi-tensor step
// (dense_floating); a parameter, its gradient and its state must also agree in size and dtype.
template <class Options, class State>
std::optional<std::vector<std::vector<Item<State>>>> fused_items(torch::optim::Optimizer& opt,
                                                                  bool (*fits)(const torch::Tensor&)) {
  std::vector<std::vector<Item<State>>> items;
  for (auto& group : opt.param_groups()) {
    items.emplace_back();
    if (static_cast<const Options&>(group.options()).amsgrad()) return std::nullopt;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (!fits(p) || !fits(p.grad()) || p.grad().sizes() != p.sizes() || p.grad().scalar_type() != p.scalar_type() ||
          p.grad().device() != p.device())
        return std::nullopt;
      State* st = nullptr;
      auto it = opt.state().find(key_of(p));
      if (it != opt.state().end()) {
        st = dynamic_cast<State*>(it->second.get());
        if (!st || !fits(st->exp_avg()) || !fits(st->exp_avg_sq()) || st->exp_avg().sizes() != p.sizes() ||
            st->exp_avg_sq().sizes() != p.sizes() || st->exp_avg().scalar_type() != p.scalar_type() ||
            st->exp_avg_sq().scalar_type() != p.scalar_type() || st->exp_avg().device() != p.device() ||
            st->exp_avg_sq().device() != p.device())
          return std::nullopt;
      }
      items.back().push_back({&p, st});
    }
  }
  return items;
}

// State as LibTorch makes it on a parameter's first step.
template <class State>
State* fresh_state(torch::optim::Optimizer& opt, const torch::Tensor& p) {
  auto fresh = std::make_unique<State>();
  fresh->step(0);
  fresh->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
  fresh->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
  State* st = fresh.get();
  opt.state()[key_of(p)] = std::move(fresh);
  return st;
}

// One step of Adam (decoupled = false) or AdamW (true) over every group, the arithmetic of LibTorch's step.
// Returns false, having changed nothing, when the loop does not cover the optimizer.
template <class Options, class State>
bool fused_adam(torch::optim::Optimizer& opt, bool decoupled) {
  auto items = fused_items<Options, State>(opt, dense_float_cpu);
  if (!items) return false;
  torch::NoGradGuard no_grad;
  for (std::size_t g = 0; g < items->size(); ++g) {
    const auto& o = static_cast<const Options&>(opt.param_groups()[g].options());
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    for (const Item<State>& item : (*items)[g]) {
      torch::Tensor& p = *item.p;
      State* st = item.state ? item.state : fresh_state<State>(opt, p);
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

// One step of Adam (decoupled = false) or AdamW (true) on a device: LibTorch's arithmetic, operation by
// operation, each done for every parameter of a group at once by LibTorch's multi-tensor (_foreach)
// kernels, a handful of launches per group instead of per parameter. Parameters of a group at different
// step counts (one that had no gradient at some step) go in separate batches. Returns false, having
// changed nothing, when the tensors are not what it covers.
template <class Options, class State>
bool multi_tensor_adam(torch::optim::Optimizer& opt, bool decoupled) {
  auto items = fused_items<Options, State>(opt, dense_floating);
  if (!items) return false;
  torch::NoGradGuard no_grad;
  for (std::size_t g = 0; g < items->size(); ++g) {
    const auto& o = static_cast<const Options&>(opt.param_groups()[g].options());
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    // Batches by (step, device, dtype): the multi-tensor kernels take one device and dtype per call.
    std::map<std::tuple<int64_t, int, int, int>, std::vector<Item<State>>> batches;
    for (Item<State> item : (*items)[g]) {
      if (!item.state) item.state = fresh_state<State>(opt, *item.p);
      item.state->step(item.state->step() + 1);
      const torch::Device d = item.p->device();  // no string per parameter and step: type and index
      batches[{item.state->step(), static_cast<int>(d.type()), static_cast<int>(d.index()),
               static_cast<int>(item.p->scalar_type())}]
          .push_back(item);
    }
    for (const auto& [key, batch] : batches) {
      const auto step = static_cast<double>(std::get<0>(key));
      std::vector<torch::Tensor> ps, gs, ms, vs;
      for (const Item<State>& item : batch) {
        ps.push_back(*item.p);
        gs.push_back(item.p->grad());
        ms.push_back(item.state->exp_avg());
        vs.push_back(item.state->exp_avg_sq());
      }
      const double bias_correction1 = 1 - std::pow(beta1, step), bias_correction2 = 1 - std::pow(beta2, step);
      if (o.weight_decay() != 0) {
        if (decoupled) at::_foreach_mul_(ps, 1 - o.lr() * o.weight_decay());
        else gs = at::_foreach_add(gs, ps, o.weight_decay());
      }
      at::_foreach_mul_(ms, beta1);
      at::_foreach_add_(ms, gs, 1 - beta1);
      at::_foreach_mul_(vs, beta2);
      at::_foreach_addcmul_(vs, gs, gs, 1 - beta2);
      std::vector<torch::Tensor> denom = at::_foreach_sqrt(vs);
      at::_foreach_div_(denom, std::sqrt(bias_correction2));
      at::_foreach_add_(denom, o.eps());
      at::_foreach_addcdiv_(ps, ms, denom, -(o.lr() / bias_correction1));
    }
  }
  return true;
}

}  // namespace

bool multi_tensor_adam_step(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer))
    return multi_tensor_adam<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(optimizer, true);
  if (dynamic_cast<torch::optim::Adam*>(&optimizer))
    return multi_tensor_adam<torch::optim::AdamOptions, torch::optim::AdamParamState>(optimizer, false);
  return false;
}

double gradient_sum_of_squares(const std::vector<torch::Tensor>& params) {
  double sq = 0;
  std::map<std::string, torch::Tensor> on_device;  // per device: one sum read back, not one per gradient
  for (const auto& p : params) {
    const torch::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (dense_float_cpu(g)) {
      sq += sum_of_squares(g.data_ptr<float>(), g.numel());
    } else if (g.device().is_cpu()) {
      sq += g.detach().to(torch::kDouble).pow(2).sum().item<double>();
    } else {
      const torch::Tensor s = g.detach().to(torch::kDouble).pow(2).sum();
      torch::Tensor& total = on_device[g.device().str()];
      total = total.defined() ? total + s : s;
    }
  }
  for (const auto& [device, total] : on_device) sq += total.item<double>();
  return sq;
}

bool fused_step_applies(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer))
    return fused_items<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(optimizer, dense_float_cpu).has_value();
  if (dynamic_cast<torch::optim::Adam*>(&optimizer))
    return fused_items<torch::optim::AdamOptions, torch::optim::AdamParamState>(optimizer, dense_float_cpu).has_value();
  return false;
}

void optimizer_step(torch::optim::Optimizer& optimizer) {
  bool done = false;
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer))
    done = fused_adam<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(optimizer, true);
  else if (dynamic_cast<torch::optim::Adam*>(&optimizer))
    done = fused_adam<torch::optim::AdamOptions, torch::optim::AdamParamState>(optimizer, false);
  if (!done && on_device(optimizer)) done = multi_tensor_adam_step(optimizer);
  if (!done) optimizer.step();
}

}  // namespace pipetrain::detail

#include "pipetrain/runtime/split_linear.h"

#include <torch/autograd.h>
#include <torch/nn/init.h>

#include <atomic>
#include <cmath>

#include "torch_compat.h"

namespace pipetrain {
namespace {

// The store a thread has made active (WeightGradStore::Scope). A cell of its own that a forward keeps a
// reference to: on a GPU the engine runs the backward on its own device thread, where this thread's
// scope is not seen, so the backward reads the store through the forward thread's cell (a reference,
// so it stays valid after that thread ends). The cell is read while the thread that set it waits in
// the backward it started.
struct StoreCell : torch::CustomClassHolder {
  std::atomic<WeightGradStore*> store{nullptr};
};
thread_local c10::intrusive_ptr<StoreCell> store_cell = c10::make_intrusive<StoreCell>();

void accumulate_grad(torch::Tensor& param, const torch::Tensor& grad) {
  torch::NoGradGuard no_grad;
  if (!param.grad().defined())
    param.mutable_grad() = grad.clone();
  else
    param.mutable_grad().add_(grad);
}

// y = x A^T (+ b). `bias` is passed only when defined: autograd functions take no undefined inputs.
template <bool kBias>
struct SplitLinearFunction : public torch::autograd::Function<SplitLinearFunction<kBias>> {
  template <class... Bias>
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
                               const torch::Tensor& weight, const Bias&... bias) {
    ctx->saved_data["weight"] = weight;  // kept by reference: the parameter whose .grad W accumulates into
    ctx->saved_data["store"] = c10::IValue::make_capsule(store_cell);  // this thread's store, for the backward
    torch::Tensor b;
    ((b = bias), ...);
    if (kBias) ctx->saved_data["bias"] = b;
    // Under autocast (bf16 runs), the product is in autocast's dtype, as torch::linear's would be: the
    // operands are cast here and saved so, and the backward's products run in that dtype too (the
    // gradients reach the float32 parameters converted).
    if (const auto dtype = compat::autocast_dtype(input.device().type());
        dtype && input.is_floating_point() && weight.scalar_type() != *dtype) {
      const torch::Tensor x = input.to(*dtype), w = weight.to(*dtype);
      ctx->save_for_backward({x, w});
      return torch::linear(x, w, b.defined() ? b.to(*dtype) : b);
    }
    ctx->save_for_backward({input, weight});
    return torch::linear(input, weight, b);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor input = saved[0];
    const torch::Tensor w = saved[1];
    const torch::Tensor grad = grad_outputs[0];
    torch::Tensor weight = ctx->saved_data["weight"].toTensor();
    torch::Tensor bias = kBias ? ctx->saved_data["bias"].toTensor() : torch::Tensor();
    WeightGradStore* active = WeightGradStore::current();
    if (active == nullptr)  // the engine's device thread (GPU): the store of the thread that ran the forward
      active = static_cast<StoreCell*>(ctx->saved_data["store"].toCapsule().get())->store.load();
    const bool all = active != nullptr && active->queue_all();  // B through autograd: W wants them all the same
    const bool need_weight = ctx->needs_input_grad(1) || (all && weight.requires_grad());
    const bool need_bias = kBias && (ctx->needs_input_grad(2) || (all && bias.requires_grad()));
    torch::Tensor grad_input = ctx->needs_input_grad(0) ? grad.matmul(w) : torch::Tensor();
    // The weight's and the bias's gradients from the saved input and the output gradient.
    const auto weight_grads_of = [need_weight, need_bias](const torch::Tensor& x, const torch::Tensor& g) {
      const int64_t out = g.size(-1), in = x.size(-1);
      const torch::Tensor g2 = g.reshape({-1, out});
      return std::make_pair(need_weight ? g2.t().mm(x.reshape({-1, in})) : torch::Tensor(),
                            need_bias ? g2.sum(0) : torch::Tensor());
    };
    if (WeightGradStore* store = active) {
      // The queue keeps the tensors' data, not their graph: the saved input holds its producer's node.
      store->push([weight, bias, weight_grads_of, x = input.detach(), g = grad.detach()]() mutable {
        auto [gw, gb] = weight_grads_of(x, g);
        if (gw.defined()) accumulate_grad(weight, gw.to(weight.scalar_type()));
        if (gb.defined()) accumulate_grad(bias, gb.to(bias.scalar_type()));
      });
      if (kBias) return {grad_input, torch::Tensor(), torch::Tensor()};
      return {grad_input, torch::Tensor()};
    }
    auto [gw, gb] = weight_grads_of(input, grad);
    if (gw.defined()) gw = gw.to(weight.scalar_type());
    if (gb.defined()) gb = gb.to(bias.scalar_type());
    if (kBias) return {grad_input, gw, gb};
    return {grad_input, gw};
  }
};

}  // namespace

WeightGradStore::Scope::Scope(WeightGradStore* store) : previous_(store_cell->store.load()) { store_cell->store = store; }
WeightGradStore::Scope::~Scope() { store_cell->store = previous_; }
WeightGradStore* WeightGradStore::current() { return store_cell->store.load(); }

void WeightGradStore::run() {
  auto work = std::move(work_);
  work_.clear();
  for (auto& w : work) w();
}

torch::Tensor split_linear(const torch::Tensor& input, const torch::Tensor& weight, const torch::Tensor& bias) {
  if (bias.defined()) return SplitLinearFunction<true>::apply(input, weight, bias);
  return SplitLinearFunction<false>::apply(input, weight);
}

bool is_split_linear_node(const torch::autograd::Node& node) {
  return dynamic_cast<const torch::autograd::CppNode<SplitLinearFunction<true>>*>(&node) != nullptr ||
         dynamic_cast<const torch::autograd::CppNode<SplitLinearFunction<false>>*>(&node) != nullptr;
}

namespace nn {

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool with_bias)
    : LinearImpl(torch::nn::LinearOptions(in_features, out_features).bias(with_bias)) {}

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options_) : options(options_) { reset(); }

void LinearImpl::reset() {
  // Same parameters, registration order and initialisation as torch::nn::Linear, so a model built with
  // either from the same seed has the same weights.
  weight = register_parameter("weight", torch::empty({options.out_features(), options.in_features()}));
  if (options.bias())
    bias = register_parameter("bias", torch::empty(options.out_features()));
  else
    bias = register_parameter("bias", {}, /*requires_grad=*/false);
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5));
  if (bias.defined()) {
    int64_t fan_in, fan_out;
    std::tie(fan_in, fan_out) = torch::nn::init::_calculate_fan_in_and_fan_out(weight);
    const double bound = 1 / std::sqrt(static_cast<double>(fan_in));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "pipetrain::nn::Linear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << options.bias() << ", split backward)";
}

torch::Tensor LinearImpl::forward(const torch::Tensor& input) { return split_linear(input, weight, bias); }

}  // namespace nn
}  // namespace pipetrain

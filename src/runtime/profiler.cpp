#include "pipetrain/runtime/profiler.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/split_linear.h"
#include "pipetrain/runtime/stage.h"

namespace pipetrain {
namespace {

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

torch::Tensor leaf_input(const torch::Tensor& x) {
  torch::Tensor in = x.detach();
  if (in.is_floating_point()) in.requires_grad_(true);
  return in;
}

// Input rows [0, size): cut, or tiled when the batch has fewer.
torch::Tensor resized(const torch::Tensor& x, int64_t size) {
  if (x.size(0) >= size) return x.slice(0, 0, size);
  const int64_t reps = (size + x.size(0) - 1) / x.size(0);
  std::vector<int64_t> r(static_cast<std::size_t>(x.dim()), 1);
  r[0] = reps;
  return x.repeat(r).slice(0, 0, size);
}

struct LayerTimes {
  double forward = 0, backward = 0, b = 0, w = 0;
  bool split = false;
  torch::Tensor output;
};

LayerTimes time_layer(const std::shared_ptr<torch::nn::Module>& module, torch::nn::AnyModule& any,
                      const torch::Tensor& x, const ProfilerOptions& o) {
  (void)module;
  LayerTimes t;
  std::vector<double> fwd, bwd, bs, ws;
  torch::Tensor grad;
  for (int k = 0; k < o.warmup + o.repeats; ++k) {
    const bool timed = k >= o.warmup;
    torch::Tensor in = leaf_input(x);
    double t0 = now_ms();
    torch::Tensor out = any.forward(in);
    if (timed) fwd.push_back(now_ms() - t0);
    if (!t.output.defined()) t.output = out.detach();
    if (!out.requires_grad()) continue;  // nothing to differentiate (e.g. a parameter-free first layer on ids)
    if (!grad.defined()) grad = torch::randn_like(out);
    t0 = now_ms();
    torch::autograd::backward({out}, {grad});
    if (timed) bwd.push_back(now_ms() - t0);
    // B and W separately, on a fresh forward.
    in = leaf_input(x);
    out = any.forward(in);
    WeightGradStore store;
    {
      WeightGradStore::Scope scope(&store);
      t0 = now_ms();
      torch::autograd::backward({out}, {grad});
      if (timed) bs.push_back(now_ms() - t0);
    }
    t.split = !store.empty();
    t0 = now_ms();
    store.run();
    if (timed) ws.push_back(now_ms() - t0);
  }
  t.forward = median(fwd);
  t.backward = median(bwd);
  t.b = median(bs);
  t.w = median(ws);
  return t;
}

}  // namespace

Profile profile_model(torch::nn::Sequential model, const torch::Tensor& input, const ProfilerOptions& o) {
  if (o.repeats < 1) throw UsageError("profiler repeats must be >= 1, got " + std::to_string(o.repeats));
  if (o.warmup < 0) throw UsageError("profiler warm-up runs must be >= 0, got " + std::to_string(o.warmup));
  double state_factor = 0;
  if (o.optimizer == "adam" || o.optimizer == "adamw")
    state_factor = 2;
  else if (o.optimizer == "sgd-momentum")
    state_factor = 1;
  else if (o.optimizer != "sgd")
    throw UsageError("profiler optimizer '" + o.optimizer + "' is unknown: use adam, adamw, sgd or sgd-momentum");
  for (int s : o.extra_sizes)
    if (s < 1) throw UsageError("profiler micro-batch sizes must be >= 1, got " + std::to_string(s));
  if (!input.defined() || input.dim() < 1 || input.size(0) < 1)
    throw UsageError("the profiler needs an input batch with at least one sample");
  model->train();
  Profile p;
  p.model = o.model_name;
  p.micro_batch_size = static_cast<int>(input.size(0));
  p.threads = at::get_num_threads();
  p.source = "pipetrain profile";
  torch::Tensor x = input;
  std::vector<torch::Tensor> extra_inputs;
  for (int s : o.extra_sizes) extra_inputs.push_back(resized(input, s));
  const std::vector<std::string> types = layer_type_names(model);
  std::size_t index = 0;
  for (auto& any : *model) {
    auto module = model->ptr(index);
    LayerProfile l;
    l.type = types[index];
    l.name = std::to_string(index) + ":" + l.type;
    const LayerTimes t = time_layer(module, any, x, o);
    l.forward_ms = t.forward;
    l.backward_ms = t.backward;
    l.bw_split = t.split;
    l.input_grad_ms = t.split ? t.b : t.backward;
    l.weight_grad_ms = t.split ? t.w : 0.0;
    l.activation_bytes = static_cast<double>(t.output.numel() * t.output.element_size());
    for (const auto& param : module->parameters())
      if (param.requires_grad()) l.parameter_bytes += static_cast<double>(param.numel() * param.element_size());
    l.optimizer_bytes = state_factor * l.parameter_bytes;
    for (std::size_t e = 0; e < extra_inputs.size(); ++e) {
      const LayerTimes te = time_layer(module, any, extra_inputs[e], o);
      l.by_micro_batch.push_back(SizeMeasurement{o.extra_sizes[e], te.forward, te.backward});
      extra_inputs[e] = te.output;
    }
    std::sort(l.by_micro_batch.begin(), l.by_micro_batch.end(),
              [](const SizeMeasurement& a, const SizeMeasurement& b) { return a.micro_batch_size < b.micro_batch_size; });
    p.layers.push_back(l);
    x = t.output;
    ++index;
  }
  model->zero_grad();
  validate_profile(p, "measured profile");
  return p;
}

}  // namespace pipetrain

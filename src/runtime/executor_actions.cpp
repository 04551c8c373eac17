// PipelineRank's compute actions (F, B, BW, W): a stage's forward under its pass's weights and seed, the
// last stage's loss, the backward (whole, or split into B and W). Declared in executor_impl.h.
#include "executor_impl.h"

#include <torch/autograd.h>

#include <ATen/core/Generator.h>

#include <cstdint>
#include <mutex>
#include <optional>

#include "pipetrain/core/error.h"
#include "pipetrain/core/random.h"
#include "autograd_split.h"
#include "seeded_generator.h"
#include "torch_compat.h"

namespace pipetrain {

namespace {

constexpr uint64_t mix(uint64_t x) { return splitmix64(x); }

// The value of a one-element tensor, as item<double>() gives it; read in place (no operator call) for a
// float or double tensor in host memory.
double scalar_value(const torch::Tensor& t) {
  if (t.is_cpu() && t.numel() == 1) {
    if (t.scalar_type() == torch::kFloat) return static_cast<double>(*t.data_ptr<float>());
    if (t.scalar_type() == torch::kDouble) return *t.data_ptr<double>();
  }
  return t.item<double>();
}

// Whether each entry of a stage's output gets a gradient back (bundle.h): floating-point entries the
// stage computed, or received with a gradient and passed on; never the very tensor the stage received
// without one (a mask or ids passed along).
std::vector<char> gradient_entries(const Bundle& in, const std::vector<char>& in_grad, const Bundle& out) {
  std::vector<char> flags;
  flags.reserve(out.size());
  for (const auto& [name, t] : out.items()) {
    bool grad = t.defined() && t.is_floating_point();
    for (std::size_t k = 0; grad && k < in.size(); ++k)
      if (in.items()[k].second.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) grad = k < in_grad.size() && in_grad[k];
    flags.push_back(grad ? 1 : 0);
  }
  return flags;
}

}  // namespace

bool PipelineRank::Impl::checkpointed(int micro) const {
  const int m = per_step;
  const int stop = options.checkpoint == Checkpoint::Always ? m : options.checkpoint == Checkpoint::ExceptLast ? m - 1 : 0;
  return micro % m < stop;
}

const PassWeights* PipelineRank::Impl::enter_weights(int s, int i, bool is_forward, PassWeightsScope& scope) {
  if (!async || forward_mode) return nullptr;
  const PassWeights& pw = plan->of(s, i, is_forward);
  StageWeights& w = weights.at(s);
  const int version = w.enter(pw, is_forward, slot(s, i).scratch);
  scope.w = &w;
  stats.weight_uses.push_back(
      WeightUse{s, i, is_forward ? ActionKind::F : ActionKind::BW, step + version, pw.predict});
  return &pw;
}

void PipelineRank::Impl::finish_weights(int s, int i, bool is_forward, const PassWeights* pw, PassWeightsScope& scope) {
  if (!pw) return;
  scope.w->leave();
  scope.w = nullptr;
  weights.at(s).finish(*pw, is_forward, slot(s, i).scratch);
}

Bundle PipelineRank::Impl::run_forward(int s, int i, const Bundle& x) {
  // bf16: under autocast on the rank's device (thread-local, so per rank thread).
  const compat::AutocastGuard autocast(
      options.device.type(), options.precision == "bf16" ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt);
  Slot& sl = slot(s, i);
  if (!options.deterministic_rng) return stage_of(s).forward(x);
  std::unique_lock<std::mutex> lock(default_generator_mutex(), std::defer_lock);
  if (transport->shares_process()) lock.lock();
  auto gen = at::globalContext().defaultGenerator(options.device);
  if (gen.device().is_cpu()) {  // the state copied as it is: no tensor made, no state validated
    SeededCpuGenerator seeded(gen, sl.seed);
    return stage_of(s).forward(x);
  }
  torch::Tensor saved;
  {
    std::lock_guard<std::mutex> g(gen.mutex());
    saved = gen.get_state();
    gen.set_current_seed(sl.seed);
  }
  struct Restore {
    at::Generator& gen;
    const torch::Tensor& state;
    ~Restore() {
      std::lock_guard<std::mutex> g(gen.mutex());
      gen.set_state(state);
    }
  } restore{gen, saved};
  return stage_of(s).forward(x);
}

void PipelineRank::Impl::forward(int s, int i) {
  Slot& sl = slot(s, i);
  Bundle x;
  if (s == 0) {
    if (input.empty() || !input.items().front().second.defined())
      throw UsageError("rank " + std::to_string(rank()) + " holds stage 0 but train_step got no input batch");
    x = on_device(input.slice(ranges[static_cast<std::size_t>(i)].first, ranges[static_cast<std::size_t>(i)].second));
    sl.in_grad.assign(x.size(), 0);
  } else if (pass->rank_of(s - 1, i) == rank()) {
    x = outgoing(s - 1, slot(s - 1, i), sl.in_grad);
    // A forward-only pass (evaluate, forward_only) records no gradient flags on the stage before: its
    // entries need none (on a V placement a rank holds stages s - 1 and s, and this read past the flags).
    sl.in_grad.resize(x.size(), 0);
  } else {
    x = on_device(sl.input);  // received by RF (on the host unless the transport carries device tensors)
    if (x.empty()) throw std::logic_error("forward " + std::to_string(s) + "F" + std::to_string(i) + " has no input");
  }
  if (!skips.empty()) take_skips(s, i, x, sl.in_grad);
  for (std::size_t k = 0; k < x.size(); ++k) {
    torch::Tensor& t = x.items()[k].second;
    const bool leaf = sl.in_grad[k] && !forward_mode;
    if (leaf || t.requires_grad()) t = t.detach();  // otherwise it has no graph to cut, and stays as is
    if (leaf) t.requires_grad_(true);
  }
  sl.input = x;
  // The step of micro-batch i and its index within the step: a call of K steps draws the same
  // masks as K calls of one step.
  const auto global_step = static_cast<uint64_t>(step + i / per_step);
  // A data-parallel copy of the pipeline (options.data_parallel) holds other samples and draws its own
  // masks: copy c > 0 mixes c into the seed; copy 0 keeps the seed of a run without copies.
  const int copy = options.data_parallel ? options.data_parallel->rank() : 0;
  const uint64_t seed = copy > 0 ? options.seed ^ mix(0x5eed0000ULL + static_cast<uint64_t>(copy)) : options.seed;
  sl.seed = mix(seed ^ mix(global_step * 1000003ULL + static_cast<uint64_t>(s) * 7919ULL +
                                   static_cast<uint64_t>(i % per_step)));
  sl.checkpointed = !forward_mode && checkpointed(i) && s != last_stage();
  PassWeightsScope scope;
  const PassWeights* pw = enter_weights(s, i, true, scope);
  Bundle out;
  if (sl.checkpointed) {
    torch::NoGradGuard no_grad;
    out = run_forward(s, i, x);
  } else {
    out = run_forward(s, i, x);
  }
  finish_weights(s, i, true, pw, scope);
  if (s == last_stage() && !forward_mode) {
    sl.loss = scaled_loss(out, i);
    return;
  }
  if (!forward_mode) sl.out_grad = gradient_entries(sl.input, sl.in_grad, out);
  sl.output = std::move(out);
  if (!skips.empty()) hand_over_skips(s, i);
}

Bundle PipelineRank::Impl::full_precision(const Bundle& out) const {
  if (options.precision != "bf16") return out;
  Bundle o;
  for (const auto& [name, t] : out.items())
    o.set(name, t.defined() && t.is_floating_point() && t.scalar_type() != torch::kFloat && t.scalar_type() != torch::kDouble
                    ? t.to(torch::kFloat)
                    : t);
  return o;
}

torch::Tensor PipelineRank::Impl::scaled_loss(const Bundle& out, int i) {
  if (!has_target())
    throw UsageError("rank " + std::to_string(rank()) + " holds the last stage but train_step got no target batch");
  const auto [b, e] = ranges[static_cast<std::size_t>(i)];
  LossTerm term = loss(full_precision(out), on_device(target.slice(b, e)), i);
  const auto k = static_cast<std::size_t>(i / per_step);
  torch::Tensor l = term.value.reshape({});
  if (per_token) {
    if (async) {
      l = l / std::max(term.count, 1.0);
    } else {
      step_count[k] += term.count;
      step_loss[k] += scalar_value(l);
      return l;
    }
  } else {
    l = l * (static_cast<double>(e - b) / static_cast<double>(step_sizes[k]));
  }
  step_loss[k] += scalar_value(l);
  return l;
}

namespace {

// While alive, the BatchNorm layers of a stage do not move their running statistics (momentum 0), and
// their batch counts are put back at the end: what a re-materialised forward must leave as it found.
class RecomputeNormScope {
 public:
  explicit RecomputeNormScope(const Stage& st) {
    for (int k = 0; k < st.num_layers(); ++k)
      for (const auto& m : st.layer(k)->modules(/*include_self=*/true)) {
        if (auto* b = dynamic_cast<torch::nn::BatchNorm1dImpl*>(m.get())) keep(b->options, b->num_batches_tracked);
        if (auto* b = dynamic_cast<torch::nn::BatchNorm2dImpl*>(m.get())) keep(b->options, b->num_batches_tracked);
        if (auto* b = dynamic_cast<torch::nn::BatchNorm3dImpl*>(m.get())) keep(b->options, b->num_batches_tracked);
      }
  }
  ~RecomputeNormScope() {
    torch::NoGradGuard no_grad;
    for (auto& k : kept_) {
      k.options->momentum(k.momentum);
      if (k.count.defined()) k.count.copy_(k.count_before);
    }
  }
  RecomputeNormScope(const RecomputeNormScope&) = delete;
  RecomputeNormScope& operator=(const RecomputeNormScope&) = delete;

 private:
  struct Kept {
    torch::nn::BatchNormOptions* options;
    std::decay_t<decltype(std::declval<torch::nn::BatchNormOptions&>().momentum())> momentum;  // c10::optional on 1.13
    torch::Tensor count, count_before;
  };
  void keep(torch::nn::BatchNormOptions& o, const torch::Tensor& count) {
    if (!o.track_running_stats()) return;
    kept_.push_back({&o, o.momentum(), count, count.defined() ? count.clone() : torch::Tensor()});
    o.momentum(0.0);
  }
  std::vector<Kept> kept_;
};

}  // namespace

void PipelineRank::Impl::backward(int s, int i, bool split) {
  Slot& sl = slot(s, i);
  Bundle out = sl.output;
  PassWeightsScope scope;
  const PassWeights* pw = enter_weights(s, i, false, scope);
  if (sl.checkpointed) {  // re-materialise with the forward's RNG seed, so dropout masks match
    // The forward runs again in training mode: BatchNorm's running statistics would take a second
    // update per micro-batch, and evaluation then differed from a run without re-materialisation. Its
    // momentum is 0 for the recompute (the statistics stay; they are inputs of the recomputed graph, so
    // they cannot be written back after it), and its batch count is put back.
    RecomputeNormScope keep_statistics(stages.at(s));
    out = run_forward(s, i, sl.input);
  }
  std::vector<torch::Tensor> roots, grads;
  if (s == last_stage()) {
    if (sl.loss.requires_grad()) {
      roots.push_back(sl.loss);
    } else {
      // A loss without a graph although the stage learns (a trainable weight, or an input that carries
      // a gradient) trained nothing, step after step, without a word: plain LibTorch's backward refuses it.
      bool learns = false;
      if (const auto it = stage_params.find(s); it != stage_params.end())
        for (const torch::Tensor& w : it->second) learns = learns || w.requires_grad();
      for (const auto& [name, t] : sl.input.items()) learns = learns || (t.defined() && t.requires_grad());
      if (learns)
        throw UsageError("the loss of micro-batch " + std::to_string(i) + " has no autograd graph, so nothing would "
                         "train: the loss function must compute it from the last stage's output without detach(), "
                         ".item(), a NoGradGuard or new tensors made from its values");
    }
  } else {
    const bool local = pass->rank_of(s + 1, i) == rank();
    Bundle g = local ? slot(s + 1, i).input_grad : sl.recv_grad;
    if (!skips.empty()) take_skip_grads(s, i, g);
    for (std::size_t k = 0; k < out.size(); ++k) {
      if (!sl.out_grad[k]) continue;
      const auto& [name, t] = out.items()[k];
      if (!g.has(name))
        throw std::logic_error("backward of stage " + std::to_string(s) + " has no gradient for '" + name + "'");
      if (!t.requires_grad()) continue;  // computed without a path to a parameter or an input
      roots.push_back(t);
      grads.push_back(on_device(g.at(name)));
    }
  }
  if (!roots.empty() && split && !async && options.backward_split != "explicit" && !linear_only(s)) {
    std::vector<torch::Tensor> leaves;  // B through autograd: input gradients now, W from the kept graph
    for (std::size_t k = 0; k < sl.input.size(); ++k)
      if (sl.in_grad[k] && sl.input.items()[k].second.requires_grad()) leaves.push_back(sl.input.items()[k].second);
    detail::backward_input(roots, grads, leaves, sl.deferred, options.backward_split == "auto");
  } else if (!roots.empty()) {
    std::unique_ptr<WeightGradStore::Scope> scope;
    if (split) scope = std::make_unique<WeightGradStore::Scope>(&sl.deferred);
    torch::autograd::backward(roots, grads);
  }
  finish_weights(s, i, false, pw, scope);
  if (s > 0) {
    Bundle g;
    for (std::size_t k = 0; k < sl.input.size(); ++k) {
      if (!sl.in_grad[k]) continue;
      const auto& [name, t] = sl.input.items()[k];
      g.set(name, t.grad().defined() ? t.grad() : torch::zeros_like(t));
    }
    if (!skips.empty()) route_skip_grads(s, i, g);
    sl.input_grad = std::move(g);
  }
  sl.input = Bundle();   // W keeps what it needs in its own queue
  sl.output = Bundle();  // frees the graph and the activations
  sl.loss = torch::Tensor();
  sl.recv_grad = Bundle();
  if (s + 1 <= last_stage() && pass->rank_of(s + 1, i) == rank()) slot(s + 1, i).input_grad = Bundle();
}

bool PipelineRank::Impl::linear_only(int s) {
  if (options.backward_split != "auto") return false;
  auto it = linear_only_stages.find(s);
  if (it != linear_only_stages.end()) return it->second;
  bool all = true;
  for (int k = 0; k < stage_of(s).num_layers() && all; ++k)
    all = detail::only_split_linear_parameters(stage_of(s).layer(k));
  return linear_only_stages[s] = all;
}

}  // namespace pipetrain

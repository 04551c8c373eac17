#include "pipetrain/runtime/profiler.h"

#include <ATen/CPUGeneratorImpl.h>

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "pipetrain/core/error.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/runtime/device.h"
#include "autograd_split.h"
#include "fused_optimizer.h"
#include "pass_util.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/layers.h"
#include "pipetrain/runtime/transport.h"
#include "pipetrain/runtime/split_linear.h"
#include "pipetrain/runtime/stage.h"

namespace pipetrain {
namespace {

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// The host clock once `x`'s device has done what was queued: a GPU's operations return at their launch,
// so timing them needs the wait (the profiler runs one layer at a time, where waiting costs nothing).
double now_after(const torch::Tensor& x) {
  if (x.is_cuda()) torch::cuda::synchronize(x.device().index());
  return now_ms();
}

// What the layers' tensors use: the host heap on the CPU; on a GPU the caching allocator's bytes in
// tensors, where this LibTorch offers them (device.h), else the host heap, which then misses them.
double memory_in_use(const torch::Tensor& x) { return pipetrain::memory_in_use(x.device()); }

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

// Cold caches (ProfilerOptions::cold_caches): before each timed run the profiler writes a buffer the size of
// the last-level cache (at least 16 MiB, at most 32 MiB: a VM may report its host's), so what the run touches (weights, saved activations,
// optimizer state) comes from memory, as in training, where every other layer and micro-batch has passed
// through the caches since. profile_layers owns the buffer for its duration (g_scratch); CPU runs only.
thread_local std::vector<char>* g_scratch = nullptr;

void evict_caches(const torch::Tensor& on) {
  if (g_scratch == nullptr || !on.device().is_cpu()) return;
  std::vector<char>& b = *g_scratch;
  if (b.empty()) {
    const long l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
    b.assign(static_cast<std::size_t>(std::clamp<long>(l3 > 0 ? l3 : 0, 16L << 20, 32L << 20)), 0);
  }
  const char round = static_cast<char>(b[0] + 1);
  for (std::size_t i = 0; i < b.size(); i += 64) b[i] = round;
}

// Calls per timed run on a GPU (time_layer, time_optimizer_step).
constexpr int kGpuBurst = 4;

struct LayerTimes {
  double forward = 0, backward = 0, b = 0, w = 0;
  double saved_bytes = 0;  // heap growth of one forward with autograd on, output included
  double w_held_bytes = -1;  // split layers: heap growth still there after B (kept for W); < 0: not measured
  bool split = false;
  torch::Tensor output;
};

// `target` defined: the loss on the layer's output is part of the forward and the backward (the last
// layer); its scalar needs no output gradient.
LayerTimes time_layer(torch::nn::AnyModule& any, const torch::Tensor& x, const ProfilerOptions& o,
                      const torch::Tensor& target, bool measure_saved) {
  LayerTimes t;
  std::vector<double> fwd, bwd, bs, ws;
  torch::Tensor grad;
  const bool with_loss = target.defined() && o.loss;
  auto run = [&](const torch::Tensor& in) {
    torch::Tensor out = any.forward(in);
    if (!t.output.defined()) t.output = out.detach();
    return with_loss ? o.loss(out, target) : out;
  };
  auto backward = [&](const torch::Tensor& out) {
    if (with_loss)
      torch::autograd::backward({out});
    else
      torch::autograd::backward({out}, {grad});
  };
  // B as the runtime runs it (PipelineOptions::backward_split): pipetrain::nn::Linear's explicit split
  // alone where the layer holds nothing else ("auto") or always ("explicit"), else autograd's split of
  // any layer; the weight gradients wait on `store` for W.
  const bool autograd_split = o.backward_split == "autograd" ||
                              (o.backward_split == "auto" && !detail::only_split_linear_parameters(any.ptr()));
  auto backward_b = [&](const torch::Tensor& out, const torch::Tensor& in, WeightGradStore& store) {
    WeightGradStore::Scope scope(&store);
    if (!autograd_split) return backward(out);
    std::vector<torch::Tensor> inputs;
    if (in.requires_grad()) inputs.push_back(in);
    detail::backward_input({out}, with_loss ? std::vector<torch::Tensor>{} : std::vector<torch::Tensor>{grad}, inputs,
                           store, o.backward_split == "auto");
  };
  // On a GPU each timed run is a burst of kGpuBurst calls back to back, timed as one and divided: a lone
  // call, launched and then waited for, adds the launch of its first kernel and the wait to its time,
  // which a stage's chain of layers hides behind the GPU's work (one call per layer measured the 8-block
  // GPT's step 37% over what train measured on an H200). On the CPU a run is one call, as before.
  const int burst = x.is_cuda() ? kGpuBurst : 1;
  auto leaves = [&] {
    std::vector<torch::Tensor> v;
    for (int i = 0; i < burst; ++i) v.push_back(leaf_input(x));
    return v;
  };
  for (int k = 0; k < o.warmup + o.repeats; ++k) {
    const bool timed = k >= o.warmup;
    std::vector<torch::Tensor> ins = leaves(), outs;
    if (timed) evict_caches(x);
    double t0 = now_after(x);
    for (const auto& in : ins) outs.push_back(run(in));
    if (timed) fwd.push_back((now_after(x) - t0) / burst);
    if (!outs[0].requires_grad()) continue;  // nothing to differentiate (e.g. a parameter-free first layer on ids)
    if (!grad.defined() && !with_loss) grad = torch::randn_like(outs[0]);
    if (timed) evict_caches(x);
    t0 = now_after(x);
    for (const auto& out : outs) backward(out);
    if (timed) bwd.push_back((now_after(x) - t0) / burst);
    // B and W separately, on fresh forwards.
    ins = leaves();
    outs.clear();
    for (const auto& in : ins) outs.push_back(run(in));
    std::vector<WeightGradStore> stores(static_cast<std::size_t>(burst));
    if (timed) evict_caches(x);
    t0 = now_after(x);
    for (int i = 0; i < burst; ++i) backward_b(outs[i], ins[i], stores[i]);
    if (timed) bs.push_back((now_after(x) - t0) / burst);
    t.split = !stores[0].empty();
    if (timed) evict_caches(x);
    t0 = now_after(x);
    for (auto& store : stores) store.run();
    if (timed) ws.push_back((now_after(x) - t0) / burst);
  }
  // What the forward keeps until its backward: the heap in use before and after one forward whose
  // graph is still alive (LibTorch's CPU allocator caches nothing, so freed blocks leave the count).
  if (measure_saved) {
    torch::Tensor in = leaf_input(x);
    const double before = memory_in_use(x);
    torch::Tensor out = run(in);
    t.saved_bytes = std::max(0.0, memory_in_use(x) - before);
    // And what a split layer still holds after its B, for its W: B runs under a weight-gradient store, the
    // store keeps what W needs. The input gradient B made leaves the stage (it is sent), so it does not
    // count; the parameters' gradients exist already (the timed runs made them), so B adds none. The
    // output gradient is a fresh copy made inside the window, as a received one is: it counts when W
    // keeps it (a split Linear whose output is the layer's, directly or through a residual sum), and
    // is freed with B otherwise.
    if (t.split && out.requires_grad()) {
      const torch::Tensor received = grad;
      if (!with_loss) grad = grad.clone();
      WeightGradStore store;
      backward_b(out, in, store);
      out = torch::Tensor();
      grad = received;
      double input_grad = 0;
      if (in.grad().defined()) input_grad = static_cast<double>(in.grad().numel() * in.grad().element_size());
      t.w_held_bytes = std::max(0.0, memory_in_use(x) - before - input_grad);
      store.run();
    }
  }
  t.forward = median(fwd);
  t.backward = median(bwd);
  t.b = median(bs);
  t.w = median(ws);
  return t;
}

// One optimizer step over a layer's trainable weights as a stage's flush takes it: the gradient norm's
// pass, the gradients' scaling (by 1 / tokens, here by 1 so the gradients stay what they are) and the
// optimizer's update through the runtime's step (the fused loop on the CPU, the multi-tensor kernels on a
// GPU). Median of `repeats` after `warmup` (at least one: the first step makes the optimizer's state). The
// weights are put back afterwards, so profiling leaves the model as it found it. 0 for a layer without
// trainable weights.
double time_optimizer_step(torch::nn::Module& module, const ProfilerOptions& o) {
  std::vector<torch::Tensor> params;
  for (auto& p : module.parameters())
    if (p.requires_grad()) params.push_back(p);
  if (params.empty()) return 0.0;
  std::vector<torch::Tensor> kept;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : params) {
      kept.push_back(p.detach().clone());
      if (!p.grad().defined()) p.mutable_grad() = torch::full_like(p, 1e-3);  // no draw from the caller's generator
    }
  }
  std::unique_ptr<torch::optim::Optimizer> opt;
  const double lr = 1e-6;  // small: the weights barely move between the repeats
  if (o.optimizer == "adam")
    opt = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(lr));
  else if (o.optimizer == "adamw")
    opt = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(lr));
  else
    opt = std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(lr).momentum(o.optimizer == "sgd-momentum" ? 0.9 : 0.0));
  std::vector<double> times;
  const int warmup = std::max(1, o.warmup);
  for (int i = 0; i < warmup + o.repeats; ++i) {
    if (i >= warmup) evict_caches(params.front());
    const int burst = params.front().is_cuda() ? kGpuBurst : 1;  // as in time_layer
    const double t0 = now_after(params.front());
    for (int b = 0; b < burst; ++b) {
      (void)detail::gradient_sum_of_squares(params);  // the flush's norm pass, timed with the step
      {
        torch::NoGradGuard no_grad;
        for (auto& p : params) p.mutable_grad().mul_(1.0);
      }
      detail::optimizer_step(*opt);
    }
    const double t1 = now_after(params.front());
    if (i >= warmup) times.push_back((t1 - t0) / burst);
  }
  torch::NoGradGuard no_grad;
  for (std::size_t k = 0; k < params.size(); ++k) params[k].copy_(kept[k]);
  return median(times);
}

}  // namespace

namespace {

// The layers to profile: `count` of them, layer(i) gives layer i (valid until the next call, which
// may drop it), `type(i)` its type name.
struct LayerSource {
  int count = 0;
  std::function<torch::nn::AnyModule(int)> layer;
  std::function<std::string(int)> type;
};

Profile profile_layers(const LayerSource& layers, const torch::Tensor& input, const ProfilerOptions& o) {
  if (o.repeats < 1) throw UsageError("profiler repeats must be >= 1, got " + std::to_string(o.repeats));
  if (o.warmup < 0) throw UsageError("profiler warm-up runs must be >= 0, got " + std::to_string(o.warmup));
  double state_factor = 0;
  if (o.optimizer == "adam" || o.optimizer == "adamw")
    state_factor = 2;
  else if (o.optimizer == "sgd-momentum")
    state_factor = 1;
  else if (o.optimizer != "sgd")
    throw UsageError("profiler optimizer '" + o.optimizer + "' is unknown: use adam, adamw, sgd or sgd-momentum");
  if (o.backward_split != "auto" && o.backward_split != "autograd" && o.backward_split != "explicit")
    throw UsageError("profiler backward split '" + o.backward_split + "' is unknown: use auto, autograd or explicit");
  for (int s : o.extra_sizes)
    if (s < 1) throw UsageError("profiler micro-batch sizes must be >= 1, got " + std::to_string(s));
  if (!input.defined() || input.dim() < 1 || input.size(0) < 1)
    throw UsageError("the profiler needs an input batch with at least one sample");
  Profile p;
  p.model = o.device.is_cpu() ? o.model_name : o.model_name + " on " + o.device.str();
  p.micro_batch_size = static_cast<int>(input.size(0));
  p.threads = at::get_num_threads();
  p.source = "pipetrain profile";
  torch::Tensor x = input.to(o.device);
  std::vector<torch::Tensor> extra_inputs;
  for (int s : o.extra_sizes) extra_inputs.push_back(resized(x, s));
  const torch::Tensor target = o.target.defined() ? o.target.to(o.device) : o.target;
  const bool with_loss = o.loss && o.target.defined();
  std::vector<char> scratch;  // the cold-cache buffer, allocated at its first use and freed on return
  struct ScratchScope {
    std::vector<char>* previous;
    explicit ScratchScope(std::vector<char>* s) : previous(g_scratch) { g_scratch = s; }
    ~ScratchScope() { g_scratch = previous; }
  } scratch_scope(o.cold_caches ? &scratch : nullptr);
  if (with_loss && (o.target.dim() < 1 || o.target.size(0) != input.size(0)))
    throw UsageError("the profiler's target batch has " + std::to_string(o.target.dim() < 1 ? 0 : o.target.size(0)) +
                     " rows but the input has " + std::to_string(input.size(0)) + ": give one target per sample");
  for (int index = 0; index < layers.count; ++index) {
    torch::nn::AnyModule any = layers.layer(index);
    auto module = any.ptr();
    LayerProfile l;
    l.type = layers.type(index);
    if (std::dynamic_pointer_cast<BundleModule>(module))
      throw UsageError("layer " + std::to_string(index) + " (" + l.type + ") maps bundles (runtime/bundle.h); the profiler "
                       "times one-tensor layers only: balance this model by layer counts or parameters "
                       "(--balance uniform, parameters or a list) instead of a measured profile");
    l.name = std::to_string(index) + ":" + l.type;
    const bool last = index + 1 == layers.count;
    const LayerTimes t = time_layer(any, x, o, last && with_loss ? target : torch::Tensor(), true);
    l.forward_ms = t.forward;
    l.backward_ms = t.backward;
    l.bw_split = t.split;
    l.input_grad_ms = t.split ? t.b : t.backward;
    l.weight_grad_ms = t.split ? t.w : 0.0;
    l.activation_bytes = static_cast<double>(t.output.numel() * t.output.element_size());
    l.saved_bytes = t.saved_bytes;
    l.w_held_bytes = t.w_held_bytes;  // < 0 unless the layer splits
    for (const auto& param : module->parameters())
      if (param.requires_grad()) l.parameter_bytes += static_cast<double>(param.numel() * param.element_size());
    l.optimizer_bytes = state_factor * l.parameter_bytes;
    l.optimizer_ms = time_optimizer_step(*module, o);
    for (std::size_t e = 0; e < extra_inputs.size(); ++e) {
      const LayerTimes te =
          time_layer(any, extra_inputs[e], o, last && with_loss ? resized(target, o.extra_sizes[e]) : torch::Tensor(), false);
      l.by_micro_batch.push_back(SizeMeasurement{o.extra_sizes[e], te.forward, te.backward});
      extra_inputs[e] = te.output;
    }
    std::sort(l.by_micro_batch.begin(), l.by_micro_batch.end(),
              [](const SizeMeasurement& a, const SizeMeasurement& b) { return a.micro_batch_size < b.micro_batch_size; });
    module->zero_grad();
    p.layers.push_back(l);
    x = t.output;
  }
  validate_profile(p, "measured profile");
  return p;
}

}  // namespace

Profile profile_model(torch::nn::Sequential model, const torch::Tensor& input, const ProfilerOptions& o) {
  model->train();
  model->to(o.device);
  const std::vector<std::string> types = layer_type_names(model);
  LayerSource source;
  source.count = static_cast<int>(model->size());
  source.layer = [&](int i) { return *(model->begin() + i); };
  source.type = [&](int i) { return types[static_cast<std::size_t>(i)]; };
  return profile_layers(source, input, o);
}

Profile profile_model(const LayerwiseModel& model, const torch::Tensor& input, const ProfilerOptions& o) {
  LayerSource source;
  source.count = model.layers;
  torch::nn::AnyModule current;  // the one layer alive
  source.layer = [&](int i) {
    current = torch::nn::AnyModule();  // drop the previous layer before building the next
    current = build_layer(model, i);
    current.ptr()->train();
    current.ptr()->to(o.device);
    return current;
  };
  source.type = [&](int) { return layer_info(*current.ptr()).type; };
  return profile_layers(source, input, o);
}

namespace {

// n layers 1 -> 1 with fixed weights. Building a layer draws its initial weights from LibTorch's default
// generator, which belongs to the caller: its state is put back afterwards (it was reseeded with
// torch::manual_seed(1) here, so a caller's random numbers after profiling depended on profiling).
torch::nn::Sequential unit_layers(int n) {
  torch::nn::Sequential m;
  {
    std::lock_guard<std::mutex> lk(default_generator_mutex());
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    const at::Tensor state = gen.get_state();
    for (int i = 0; i < n; ++i) m->push_back(torch::nn::Linear(1, 1));
    gen.set_state(state);
  }
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.fill_(0.5);
  return m;
}

torch::Tensor squared_error(const torch::Tensor& out, const torch::Tensor& target) { return (out - target).pow(2).mean(); }

// One value from rank 0 to every rank (an all-reduce of rank 0's value and zeros).
std::vector<double> from_rank0(Transport& t, const std::vector<double>& mine) {
  torch::Tensor v = torch::zeros({static_cast<int64_t>(mine.size())}, torch::kDouble);
  if (t.rank() == 0)
    for (std::size_t k = 0; k < mine.size(); ++k) v[static_cast<int64_t>(k)] = mine[k];
  t.all_reduce_sum(v);
  std::vector<double> out;
  for (std::size_t k = 0; k < mine.size(); ++k) out.push_back(v[static_cast<int64_t>(k)].item<double>());
  return out;
}

}  // namespace

RuntimeCosts profile_runtime(const std::shared_ptr<Transport>& transport, const std::string& name,
                             const RuntimeProfilerOptions& o) {
  Transport& t = *transport;
  const int p = t.world_size();
  if (p < 2) throw UsageError("measuring transfers needs at least 2 ranks, the transport has " + std::to_string(p));
  if (o.iters < 1 || o.warmup < 0 || o.steps < 1 || o.microbatches < 1)
    throw UsageError("runtime profiling needs iters, steps and micro-batches >= 1 and warm-up >= 0");
  if (o.sizes.empty()) throw UsageError("runtime profiling needs at least one message size");
  if (o.allreduce_iters < 1)
    throw UsageError("runtime profiling's all-reduce iterations must be >= 1, got " + std::to_string(o.allreduce_iters) +
                     ": give at least one, or no allreduce_sizes to skip the all-reduce");
  for (int64_t b : o.allreduce_sizes)
    if (b < 8 || b % 4 != 0)
      throw UsageError("all-reduce size " + std::to_string(b) + " bytes must be a multiple of 4 (float tensors), >= 8");
  for (int64_t b : o.sizes)
    if (b < 4 || b % 4 != 0)
      throw UsageError("message size " + std::to_string(b) + " bytes must be a multiple of 4 (float tensors), >= 4");

  // Transfers: ping-pong between ranks 0 and 1; the other ranks wait at the barrier.
  std::vector<TransferSample> samples;
  for (int64_t bytes : o.sizes) {
    torch::Tensor x = torch::ones({bytes / 4}, torch::kFloat);
    std::vector<double> rtt;
    t.barrier();
    for (int i = 0; i < o.warmup + o.iters; ++i) {
      if (t.rank() == 0) {
        const double t0 = now_ms();
        t.send(x, 1, 7);
        t.recv(x, 1, 7);
        if (i >= o.warmup) rtt.push_back(now_ms() - t0);
      } else if (t.rank() == 1) {
        t.recv(x, 0, 7);
        t.send(x, 0, 7);
      }
    }
    const double one_way = from_rank0(t, {t.rank() == 0 ? median(rtt) / 2 : 0.0})[0];
    samples.push_back(TransferSample{static_cast<double>(bytes), one_way});
  }
  RuntimeCosts rc = fit_transfers(samples);
  rc.transport = name;

  // The data-parallel step's all-reduce, as PipelineRank's flush runs it over every rank (a group of all).
  if (!o.allreduce_sizes.empty()) {
    std::vector<int> members(static_cast<std::size_t>(p));
    for (int q = 0; q < p; ++q) members[static_cast<std::size_t>(q)] = q;
    const std::shared_ptr<Transport> group = make_group_transport(transport, members);
    rc.allreduce_ranks = p;
    for (int64_t bytes : o.allreduce_sizes) {
      // Two "parameters" of half the bytes each, so the copy in is a concatenation as in the flush.
      const int64_t n = bytes / 4, half = n / 2;
      torch::Tensor g1 = torch::ones({half}), g2 = torch::ones({n - half});
      const torch::Tensor divisor = torch::scalar_tensor(static_cast<double>(p), torch::kDouble);
      std::vector<double> times;
      for (int i = 0; i < o.warmup + o.allreduce_iters; ++i) {
        t.barrier();
        const double t0 = now_ms();
        torch::Tensor all = torch::cat({g1.reshape({-1}), g2.reshape({-1})});
        group->all_reduce_sum(all);
        at::div_out(g1, all.slice(0, 0, half), divisor);
        at::div_out(g2, all.slice(0, half, n), divisor);
        if (i >= o.warmup) times.push_back(now_ms() - t0);
      }
      const double ms = from_rank0(t, {t.rank() == 0 ? median(times) : 0.0})[0];
      rc.allreduce.push_back(TransferSample{static_cast<double>(bytes), ms});
    }
  }

  // Overhead: a pipeline of 1x1 layers, one per rank, micro-batches of one sample.
  PipelineOptions po;
  po.schedule = o.schedule;
  po.microbatches = o.microbatches;
  po.threads = 1;
  po.optimizer.lr = 1e-3;
  PipelineRank rank(unit_layers(p), squared_error, transport, po);
  const torch::Tensor x = torch::ones({o.microbatches, 1}), y = torch::zeros({o.microbatches, 1});
  // Per step, this rank's time between its actions (measured_runtime: neither compute, receive nor
  // Step) over its compute actions; the median over steps, then the mean over ranks.
  std::vector<double> per_step;
  for (int k = 0; k < o.warmup + o.steps; ++k) {
    t.barrier();
    const StepStats stats = rank.train_step(x, y, o.microbatches);
    if (k >= o.warmup) per_step.push_back(measured_runtime(stats.timeline).overhead);
  }
  torch::Tensor mean = torch::full({1}, median(per_step) / p, torch::kDouble);
  t.all_reduce_sum(mean);
  rc.overhead_ms = mean.item<double>();
  return rc;
}

}  // namespace pipetrain

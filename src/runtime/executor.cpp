#include "pipetrain/runtime/executor.h"

#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/optim.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

#include <fmt/format.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/random.h"
#include "pipetrain/core/validate.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/runtime/split_linear.h"
#include "autograd_split.h"
#include "bundle_wire.h"
#include "device_context.h"
#include "fused_optimizer.h"
#include "seeded_generator.h"
#include "pass_util.h"
#include "torch_compat.h"
#include "umpipe_pass.h"

namespace pipetrain {

std::vector<std::pair<int64_t, int64_t>> split_equal(int64_t batch_size, int microbatches) {
  if (microbatches < 1)
    throw UsageError("micro-batches must be >= 1, got " + std::to_string(microbatches));
  if (batch_size < 1) throw UsageError("batch size must be >= 1, got " + std::to_string(batch_size));
  if (microbatches > batch_size)
    throw UsageError(std::to_string(microbatches) + " micro-batches but the batch has only " +
                     std::to_string(batch_size) + " samples: use --microbatches <= " + std::to_string(batch_size) +
                     " or a larger --batch-size");
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t begin = 0;
  for (int k = 0; k < microbatches; ++k) {
    const int64_t size = batch_size / microbatches + (k < batch_size % microbatches ? 1 : 0);
    out.emplace_back(begin, begin + size);
    begin += size;
  }
  return out;
}

std::mutex& default_generator_mutex() {
  static std::mutex mu;
  return mu;
}

Timeline gather_timeline(const Timeline& mine, Transport& transport) {
  const int p = transport.world_size();
  torch::Tensor counts = torch::zeros({p}, torch::kDouble);
  counts[transport.rank()] = static_cast<double>(mine.events.size());
  transport.all_reduce_sum(counts);
  int64_t offset = 0, total = 0;
  for (int r = 0; r < p; ++r) {
    const auto c = static_cast<int64_t>(counts[r].item<double>());
    if (r < transport.rank()) offset += c;
    total += c;
  }
  torch::Tensor rows = torch::zeros({std::max<int64_t>(total, 1), 7}, torch::kDouble);
  auto acc = rows.accessor<double, 2>();
  for (std::size_t k = 0; k < mine.events.size(); ++k) {
    const TimedAction& e = mine.events[k];
    const int64_t row = offset + static_cast<int64_t>(k);
    acc[row][0] = e.rank;
    acc[row][1] = static_cast<double>(e.action.kind);
    acc[row][2] = e.action.stage;
    acc[row][3] = e.action.index;
    acc[row][4] = e.start;
    acc[row][5] = e.end;
    acc[row][6] = e.action.peer;  // a skip transfer's peer stage (-1: the neighbour)
  }
  transport.all_reduce_sum(rows);
  Timeline out = mine;
  out.events.clear();
  auto all = rows.accessor<double, 2>();
  for (int64_t row = 0; row < total; ++row) {
    Action a{static_cast<ActionKind>(static_cast<int>(all[row][1])), static_cast<int>(all[row][2]),
             static_cast<int>(all[row][3])};
    a.peer = static_cast<int>(all[row][6]);
    out.events.push_back(TimedAction{static_cast<int>(all[row][0]), a, all[row][4], all[row][5]});
  }
  return out;
}

namespace {


constexpr uint64_t mix(uint64_t x) { return splitmix64(x); }

using detail::heap_in_use;
using detail::now_ms;
using detail::shape_text;

// The values of a reduced tensor of doubles, read in place (no operator call per value, as t[k].item()
// would make). A transport may have replaced the tensor (Transport is the user's to implement): then a
// CPU copy is read.
const double* host_doubles(torch::Tensor& t) {
  if (!t.device().is_cpu() || t.scalar_type() != torch::kDouble || !t.is_contiguous())
    t = t.to(torch::kCPU, torch::kDouble).contiguous();
  return t.data_ptr<double>();
}

// A loss or norm for a message: NaN without its sign bit ("-nan" read as a negative number).
std::string number_text(double v) { return std::isnan(v) ? "NaN" : fmt::format("{:g}", v); }

// A host tensor of doubles holding `values`: one operator call (clone), where torch::tensor({a, b}) fills
// it element by element.
torch::Tensor host_tensor(const std::vector<double>& values) {
  return torch::from_blob(const_cast<double*>(values.data()), {static_cast<int64_t>(values.size())}, torch::kDouble)
      .clone();
}

// The value of a one-element tensor, as item<double>() gives it; read in place (no operator call) for a
// float or double tensor in host memory.
double scalar_value(const torch::Tensor& t) {
  if (t.is_cpu() && t.numel() == 1) {
    if (t.scalar_type() == torch::kFloat) return static_cast<double>(*t.data_ptr<float>());
    if (t.scalar_type() == torch::kDouble) return *t.data_ptr<double>();
  }
  return t.item<double>();
}


}  // namespace

WeightPolicy weight_policy_of(const PipelineOptions& o) {
  const std::string& s = o.schedule;
  if (s != "pipedream") {
    if (o.vertical_sync)
      throw UsageError("vertical sync applies to --schedule pipedream only, not '" + s + "'" +
                       (s == "2bw" ? ": 2bw gives every stage the same version already; drop --vertical-sync"
                                   : ": drop --vertical-sync or use --schedule pipedream"));
    if (!o.weight_stashing)
      throw UsageError("--no-stash applies to --schedule pipedream only, not '" + s +
                       "': drop --no-stash or use --schedule pipedream");
  }
  if (schedule_traits(s).one_microbatch_per_step && o.microbatches != 1)
    throw UsageError(s + " steps after every micro-batch, so a mini-batch is one micro-batch: got " +
                     std::to_string(o.microbatches) + " micro-batches per step; use --microbatches 1 (the batch "
                     "size sets the mini-batch) or --schedule 2bw to accumulate micro-batches");
  if (s == "pipedream") {
    if (o.vertical_sync && !o.weight_stashing)
      throw UsageError("vertical sync is a weight-stashing policy: drop --no-stash or --vertical-sync");
    if (!o.weight_stashing) return WeightPolicy::Current;
    return o.vertical_sync ? WeightPolicy::VerticalSync : WeightPolicy::Stash;
  }
  if (s == "2bw") return WeightPolicy::TwoBuffered;
  if (s == "spectrain") {
    if (o.optimizer.name == "adam" || o.optimizer.name == "adamw") return WeightPolicy::PipeOptim;
    if (o.optimizer.name == "sgd" && !(o.optimizer.momentum > 0))
      throw UsageError("spectrain predicts weights along the smoothed gradient (the momentum buffer): SGD needs "
                       "--momentum > 0 (e.g. 0.9), or use adam/adamw (PipeOptim's prediction)");
    return WeightPolicy::SpecTrain;
  }
  return WeightPolicy::Current;
}

namespace {

using detail::BundleLayout;

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

// A skip connection whose stash and pop are more than one stage apart: sent straight from stage `from`
// to stage `to` (bundle.h). Names stashed on one stage for the same later stage travel together.
struct SkipRoute {
  int from = 0, to = 0;
  std::vector<std::string> names;
};

// The skips of `model` cut by `balance`, checked: each name stashed once and popped once, by a later
// layer. Throws UsageError naming the layers and the fix.
std::vector<SkipRoute> skip_routes(const std::vector<LayerInfo>& infos, const std::vector<int>& balance) {
  std::vector<int> stage_of_layer;
  for (std::size_t s = 0; s < balance.size(); ++s)
    for (int k = 0; k < balance[s]; ++k) stage_of_layer.push_back(static_cast<int>(s));
  auto layer_text = [&](std::size_t l) { return "layer " + std::to_string(l) + " (" + infos[l].type + ")"; };
  std::map<std::string, std::size_t> live;  // stashed, not yet popped: name -> stashing layer
  std::vector<SkipRoute> routes;
  for (std::size_t l = 0; l < infos.size(); ++l) {
    for (const std::string& name : infos[l].pops) {
      auto it = live.find(name);
      if (it == live.end())
        throw UsageError(layer_text(l) + " pops '" + name + "' but no earlier layer stashes it: declare it in the " +
                         "stashes() of the layer that adds it, before this one");
      const int from = stage_of_layer[it->second], to = stage_of_layer[l];
      live.erase(it);
      if (to <= from + 1) continue;  // same or next stage: the entry rides the bundle
      auto route = std::find_if(routes.begin(), routes.end(), [&](const SkipRoute& r) { return r.from == from && r.to == to; });
      if (route == routes.end()) route = routes.insert(routes.end(), SkipRoute{from, to, {}});
      route->names.push_back(name);
    }
    for (const std::string& name : infos[l].stashes) {
      auto it = live.find(name);
      if (it != live.end())
        throw UsageError("'" + name + "' is stashed twice, by " + layer_text(it->second) + " and " + layer_text(l) +
                         " before any layer pops it: give each skip its own name");
      live.emplace(name, l);
    }
  }
  if (!live.empty())
    throw UsageError("'" + live.begin()->first + "' is stashed by " + layer_text(live.begin()->second) +
                     " but no later layer pops it: declare it in the pops() of the layer that takes it");
  return routes;
}

// The routes as the schedule's skip edges (schedule.h), in the same order, so a skip transfer's route
// (skip_carried) indexes both. A route weighs one stage activation per tensor it carries: the memory unit
// of the cost models built from measured timelines (measured_costs gives every stage an activation of
// 1), which measure no bytes.
std::vector<SkipEdge> skip_edges(const std::vector<SkipRoute>& routes) {
  std::vector<SkipEdge> out;
  for (const SkipRoute& r : routes) out.push_back(SkipEdge{r.from, r.to, static_cast<double>(r.names.size())});
  return out;
}

// 52 bits of FNV-1a over the tensor's bytes: exact as a double, so all-reducible.
double value_hash(const torch::Tensor& t) {
  const torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  uint64_t h = 1469598103934665603ull;
  for (int64_t i = 0, n = c.numel() * static_cast<int64_t>(c.element_size()); i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return static_cast<double>(h >> 12);
}

// The tensors of each tie group (PipelineOptions::tied) of a model of `layers` layers, checked: two or
// more members, each an existing parameter of its layer, all of one shape and dtype, each its own
// tensor, none in two groups. `module_of(layer)` gives a layer's module, or null for a layer not built
// here (a model built layer by layer): such members are undefined tensors, checked at the first pass.
std::vector<std::vector<torch::Tensor>> resolve_ties(int layers,
                                                     const std::function<std::shared_ptr<torch::nn::Module>(int)>& module_of,
                                                     const std::vector<std::vector<ParameterRef>>& groups) {
  std::vector<std::vector<torch::Tensor>> out;
  std::vector<const void*> seen;  // storages of the members so far
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::string group = "tie group " + std::to_string(g);
    if (groups[g].size() < 2)
      throw UsageError(group + " has " + std::to_string(groups[g].size()) +
                       " member(s): a tie joins two or more parameters of different layers");
    std::vector<torch::Tensor> members;
    for (const ParameterRef& ref : groups[g]) {
      const std::string what = group + " member " + std::to_string(ref.layer) + ":" + ref.name;
      if (ref.layer < 0 || ref.layer >= layers)
        throw UsageError(what + ": the model has layers 0.." + std::to_string(layers - 1));
      const auto module = module_of(ref.layer);
      if (!module) {
        members.emplace_back();
        continue;
      }
      auto params = module->named_parameters(true);
      const torch::Tensor* found = params.find(ref.name);
      if (!found) {
        std::string names;
        for (const auto& item : params) names += (names.empty() ? "" : ", ") + item.key();
        throw UsageError(what + ": layer " + std::to_string(ref.layer) + " has no parameter '" + ref.name +
                         "'; it has: " + (names.empty() ? "none" : names));
      }
      const torch::Tensor t = *found;
      const auto like = std::find_if(members.begin(), members.end(), [](const torch::Tensor& m) { return m.defined(); });
      if (like != members.end() && (t.sizes() != like->sizes() || t.scalar_type() != like->scalar_type()))
        throw UsageError(what + " is " + shape_text(t.sizes().vec(), t.scalar_type()) + " but the group's member " +
                         std::to_string(groups[g][static_cast<std::size_t>(like - members.begin())].layer) + ":" +
                         groups[g][static_cast<std::size_t>(like - members.begin())].name + " is " +
                         shape_text(like->sizes().vec(), like->scalar_type()) +
                         ": tied parameters must have one shape and dtype");
      const void* storage = t.storage().data();
      if (std::find(seen.begin(), seen.end(), storage) != seen.end())
        throw UsageError(what + " is a tensor already tied (the same tensor as another member, or listed twice): give "
                         "each layer its own parameter and list each once; pipetrain keeps the copies equal");
      seen.push_back(storage);
      members.push_back(t);
    }
    out.push_back(std::move(members));
  }
  return out;
}

}  // namespace

struct PipelineRank::Impl {
  Loss loss;
  bool per_token = false;  // loss.normalization() == Token
  LossFn umpipe_loss;      // UMPIPE's tensor loss (Sample normalisation only)
  bool layerwise = false;  // built from a LayerwiseModel: this rank built its own layers only
  std::shared_ptr<Transport> transport;
  PipelineOptions options;
  // The rank's device: on CUDA its stream and event timing (src/runtime/device.cpp); set at construction.
  std::optional<detail::RankDevice> rank_device;
  Schedule schedule;          // lowered
  std::vector<int> balance;   // per virtual stage
  std::map<int, Stage> stages;  // stage id -> stage, for this rank's stages
  std::map<int, std::unique_ptr<torch::optim::Optimizer>> optimizers;
  // Per stage, its parameters as Stage::parameters() lists them, taken once at construction (a Step
  // needs them and listing them walks the modules): the handles stay valid, as the optimizers' and the
  // weight versions' do (moves between devices and loaded states change their data in place).
  std::map<int, std::vector<torch::Tensor>> stage_params;
  int step = 0;
  // 1F1B-RR: this rank's stage's replicas (null without replication) and whether this rank adds its
  // stage's squared gradient norm to the global one (one replica per stage does).
  std::shared_ptr<Transport> stage_replicas;
  bool norm_leader = true;
  const Schedule* pass = nullptr;  // the lowered schedule of the pass in progress (its rank map)
  GeneratorOptions generator;               // how `schedule` was generated (one step)
  bool async = false;                       // pipedream, 2bw, spectrain
  WeightPolicy policy = WeightPolicy::Current;
  std::map<int, StageWeights> weights;      // stage id -> its weight versions (weights.h)
  std::map<int, Schedule> by_steps;         // lowered schedules for calls of several steps
  std::map<int, WeightPlan> plans;          // weight plans by steps per call
  const WeightPlan* plan = nullptr;         // its weight plan (training passes)
  int per_step = 1;                         // micro-batches per step of the pass in progress
  bool forward_mode = false;                // forward_only(): no graph, no loss, outputs kept
  std::map<int, Schedule> forward_schedules;  // lowered forward-only schedules by micro-batch count

  // Bundle layouts agreed at first use, per (boundary stage, direction, micro-batch size, peer rank):
  // with replicated stages one boundary has several peers, and each needs the header once. With
  // variable_shapes every transfer carries its header instead.
  std::map<std::tuple<int, int, int64_t, int, bool>, BundleLayout> agreed;  // ..., forward-only pass

  // Per-step state of one (stage, micro-batch).
  struct Slot {
    Bundle input;               // the stage input; entries that carry a gradient are leaves requiring grad
    std::vector<char> in_grad;  // per input entry: carries a gradient (gets one sent back)
    Bundle output;              // forward output (with graph unless checkpointed)
    std::vector<char> out_grad; // per output entry: gets a gradient back from the next stage
    torch::Tensor loss;         // last stage: the micro-batch's scaled loss
    Bundle input_grad;          // dL/d input of the entries that carry a gradient, made by B or BW
    Bundle recv_grad;           // dL/d output of the entries that carry a gradient, received
    Bundle skip_in;             // skips into this stage, handed over on this rank or received, with their flags
    std::vector<char> skip_in_grad;
    Bundle skip_grad;           // gradients of this stage's skips out, handed back on this rank or received
    Bundle skip_grad_out;       // gradients of the skips this stage popped, for their SB@ transfers
    std::vector<int> pending_skips;  // fast path: keys in `posted_skips` waited for by this slot's F, B or BW
    bool checkpointed = false;
    uint64_t seed = 0;
    int pending_input = -1;  // fast path: key in `posted` of the input's receive, waited for by F
    int pending_grad = -1;   // fast path: key in `posted` of the output gradient's receive, waited for by B/BW
    WeightGradStore deferred;
    std::vector<torch::Tensor> scratch;  // predicted weights (spectrain), from F to BW
  };
  std::map<std::pair<int, int>, Slot> slots;

  // Tied weights (PipelineOptions::tied): the copies this rank holds. One copy per group (that of the
  // group's lowest layer, on one rank) counts in the global norm and is what checkpoints store.
  struct TiedCopy {
    int group = 0;
    int layer = 0;
    std::string name;
    torch::Tensor param;
    bool primary = false;
  };
  std::vector<TiedCopy> tied_copies;
  std::vector<SkipRoute> skips;  // skip connections sent straight between stages
  std::vector<int64_t> tied_numel;  // per group
  UmpipeLinks umpipe_links;  // UMPIPE: activation shapes agreed with the neighbouring stages, kept across steps

  struct PendingRecv {
    torch::Tensor buffer;
    const BundleLayout* layout = nullptr;  // an entry of `agreed`
    std::unique_ptr<Work> work;
  };
  std::map<int, PendingRecv> posted;  // posted, unconsumed receives by action position (nodes stay put)
  // Fast path: skip receives posted at their place in the list, waited for by the action that needs them.
  struct PendingSkip {
    PendingRecv recv;
    Action action;  // the skip receive, recorded in the timeline when waited for
  };
  std::map<int, PendingSkip> posted_skips;
  std::size_t prefetch_cursor = 0;    // next action position the fast path may post a receive for
  std::vector<std::pair<torch::Tensor, std::unique_ptr<Work>>> pending_sends;

  // Call inputs.
  Bundle input;
  Bundle target;
  int64_t batch_size = 0;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // per micro-batch of the call
  std::vector<int64_t> step_sizes;                  // samples per mini-batch (step) of the call
  std::vector<double> step_loss, step_sq;           // per step: this rank's loss terms, squared gradient norms
  std::vector<double> step_count;                   // per step, per-token loss: this rank's token counts
  std::vector<char> step_reduced;                   // synchronous: step's reduction done
  std::vector<char> step_skipped;                   // synchronous: non-finite, no optimizer step (nonfinite "skip")
  StepStats stats;

  int rank() const { return transport->rank(); }
  // `t` on the stages' device; `t` itself (no operator call) when it is there already.
  torch::Tensor on_device(const torch::Tensor& t) const { return t.device() == options.device ? t : t.to(options.device); }
  int last_stage() const { return schedule.stages - 1; }
  int64_t micro_size(int i) const { return ranges[static_cast<std::size_t>(i)].second - ranges[static_cast<std::size_t>(i)].first; }
  Slot& slot(int stage, int micro) { return slots[{stage, micro}]; }
  Stage& stage_of(int s) { return stages.at(s); }

  int tag(int stage, int micro, int dir, int header) const {
    return ((micro * schedule.stages + stage) * 2 + dir) * 2 + header;
  }
  // Skip route `r`'s tags follow every boundary tag of the pass.
  int skip_tag(std::size_t r, int micro, int dir, int header) const {
    const int base = static_cast<int>(ranges.size()) * schedule.stages * 4;
    return base + ((micro * static_cast<int>(skips.size()) + static_cast<int>(r)) * 2 + dir) * 2 + header;
  }
  // Whether `name` leaves stage `s` by a skip route rather than with the bundle to the next stage.
  bool routed(int s, const std::string& name) const {
    for (const auto& r : skips)
      if (r.from == s && std::find(r.names.begin(), r.names.end(), name) != r.names.end()) return true;
    return false;
  }
  // Stage s's output minus its skip routes: what goes to the next stage (with its gradient flags).
  Bundle outgoing(int s, const Slot& sl, std::vector<char>& flags) const {
    if (skips.empty()) {  // everything goes on
      flags = sl.out_grad;
      return sl.output;
    }
    Bundle out;
    flags.clear();
    for (std::size_t k = 0; k < sl.output.size(); ++k) {
      const auto& [name, t] = sl.output.items()[k];
      if (routed(s, name)) continue;
      out.set(name, t);
      flags.push_back(k < sl.out_grad.size() ? sl.out_grad[k] : 0);
    }
    return out;
  }

  bool checkpointed(int micro) const {
    const int m = per_step;
    const int stop = options.checkpoint == Checkpoint::Always ? m : options.checkpoint == Checkpoint::ExceptLast ? m - 1 : 0;
    return micro % m < stop;
  }

  // Sets stage s's parameters to the weights the plan gives pass (s, i) and puts them back when it goes
  // out of scope; records the use. Does nothing for synchronous schedules and forward-only passes.
  struct PassWeightsScope {
    StageWeights* w = nullptr;
    ~PassWeightsScope() {
      if (w) w->leave();
    }
  };
  const PassWeights* enter_weights(int s, int i, bool is_forward, PassWeightsScope& scope) {
    if (!async || forward_mode) return nullptr;
    const PassWeights& pw = plan->of(s, i, is_forward);
    StageWeights& w = weights.at(s);
    const int version = w.enter(pw, is_forward, slot(s, i).scratch);
    scope.w = &w;
    stats.weight_uses.push_back(
        WeightUse{s, i, is_forward ? ActionKind::F : ActionKind::BW, step + version, pw.predict});
    return &pw;
  }
  void finish_weights(int s, int i, bool is_forward, const PassWeights* pw, PassWeightsScope& scope) {
    if (!pw) return;
    scope.w->leave();
    scope.w = nullptr;
    weights.at(s).finish(*pw, is_forward, slot(s, i).scratch);
  }

  // A seeded forward draws its dropout masks from the default generator seeded with the pass's own
  // seed, and then puts the generator back as the caller left it: the caller's stream of random numbers
  // (batches drawn with torch::randn after torch::manual_seed, say) is the same with or without the
  // pipeline (PipelineRank's contract, executor.h).
  Bundle run_forward(int s, int i, const Bundle& x) {
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

  // ---- actions -----------------------------------------------------------------------------------
  void forward(int s, int i) {
    Slot& sl = slot(s, i);
    Bundle x;
    if (s == 0) {
      if (input.empty() || !input.items().front().second.defined())
        throw UsageError("rank " + std::to_string(rank()) + " holds stage 0 but train_step got no input batch");
      x = input.slice(ranges[static_cast<std::size_t>(i)].first, ranges[static_cast<std::size_t>(i)].second)
              .to(options.device);
      sl.in_grad.assign(x.size(), 0);
    } else if (pass->rank_of(s - 1, i) == rank()) {
      x = outgoing(s - 1, slot(s - 1, i), sl.in_grad);
    } else {
      x = sl.input.to(options.device);  // received by RF (on the host unless the transport carries device tensors)
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
    sl.seed = mix(options.seed ^ mix(global_step * 1000003ULL + static_cast<uint64_t>(s) * 7919ULL +
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

  // ---- skip connections ------------------------------------------------------------------------------
  // The schedule carries the routes as skip edges (Schedule::skips, same order), so lowering puts each
  // transfer between ranks in the list: <from>SF<i>@<to> after F(from, i), <to>RF<i>@<from> before
  // F(to, i), <to>SB<i>@<from> after the consumer's backward, <from>RB<i>@<to> before the producer's. They
  // run like boundary transfers: sends never wait; a receive blocks at its place, except on the fast path
  // once its layout is agreed, where it is posted there and waited for (and timed) by the action that
  // needs it. A route whose ends are on one rank has no transfers: its data is handed over in memory.

  // The index of the route a skip transfer moves.
  std::size_t route_of(const Action& a) const {
    const bool at_from = a.kind == ActionKind::SendAct || a.kind == ActionKind::RecvGrad;
    const int from = at_from ? a.stage : a.peer, to = at_from ? a.peer : a.stage;
    for (std::size_t r = 0; r < skips.size(); ++r)
      if (skips[r].from == from && skips[r].to == to) return r;
    throw std::logic_error("skip transfer " + to_string(a) + " names no skip route of the model");
  }

  // Route r's entries of stage `from`'s output for micro-batch i, with their gradient flags.
  Bundle skip_part(std::size_t r, int i, std::vector<char>& flags) {
    const Slot& sl = slot(skips[r].from, i);
    Bundle part;
    flags.clear();
    for (const std::string& name : skips[r].names) {
      std::size_t k = 0;
      while (k < sl.output.size() && sl.output.items()[k].first != name) ++k;
      if (k == sl.output.size())
        throw UsageError("stage " + std::to_string(skips[r].from) + " stashes '" + name + "' for stage " +
                         std::to_string(skips[r].to) + " but its output " + describe(sl.output) +
                         " lacks it: the layer that declares the stash must add the entry");
      part.set(name, sl.output.items()[k].second);
      flags.push_back(k < sl.out_grad.size() ? sl.out_grad[k] : 0);
    }
    return part;
  }

  // After F of stage s: the routes out of s whose popping stage is on this rank get their entries now
  // (the others at their SF@ action).
  void hand_over_skips(int s, int i) {
    for (std::size_t r = 0; r < skips.size(); ++r) {
      if (skips[r].from != s || pass->rank_of(skips[r].to, i) != rank()) continue;
      std::vector<char> flags;
      const Bundle part = skip_part(r, i, flags);
      Slot& dst = slot(skips[r].to, i);
      for (std::size_t k = 0; k < part.size(); ++k) {
        dst.skip_in.set(part.items()[k].first, part.items()[k].second);
        dst.skip_in_grad.push_back(flags[k]);
      }
    }
  }

  // <from>SF<i>@<to>: route r's entries straight to the popping stage's rank.
  void send_skip(const Action& a) {
    const std::size_t r = route_of(a);
    std::vector<char> flags;
    const Bundle part = skip_part(r, a.index, flags);
    send_bundle(-1 - static_cast<int>(r), 0, a.index, part, flags, pass->rank_of(skips[r].to, a.index),
                skip_tag(r, a.index, 0, 0), skip_tag(r, a.index, 0, 1), true);
  }

  // Whether any entry of route r carries a gradient back for micro-batch i (known on both ends: the
  // producer's flags travel in the route's layout).
  bool skip_has_grad(std::size_t r, int i) {
    const Slot& sl = slot(skips[r].from, i);
    for (std::size_t k = 0; k < sl.output.size() && k < sl.out_grad.size(); ++k)
      if (sl.out_grad[k] && std::find(skips[r].names.begin(), skips[r].names.end(), sl.output.items()[k].first) !=
                                skips[r].names.end())
        return true;
    return false;
  }

  // <to>SB<i>@<from>: the gradients of route r that the consumer's backward left for it. Returns false
  // when no entry carries one (nothing is sent, nothing timed).
  bool send_skip_grad(const Action& a) {
    const std::size_t r = route_of(a);
    Slot& sl = slot(a.stage, a.index);
    Bundle part;
    for (const std::string& name : skips[r].names)
      if (sl.skip_grad_out.has(name)) part.set(name, sl.skip_grad_out.take(name));
    if (part.empty()) return false;
    send_bundle(-1 - static_cast<int>(r), 1, a.index, part, {}, pass->rank_of(skips[r].from, a.index),
                skip_tag(r, a.index, 1, 0), skip_tag(r, a.index, 1, 1), true);
    return true;
  }

  // Stores a received skip bundle where F (activations) or the backward (gradients) takes it.
  void deliver_skip(const Action& a, const torch::Tensor& buffer, const BundleLayout& l) {
    const Bundle part = detail::unpack(buffer, l);
    Slot& sl = slot(a.stage, a.index);
    for (std::size_t k = 0; k < part.size(); ++k) {
      if (a.kind == ActionKind::RecvAct) {
        sl.skip_in.set(part.items()[k].first, part.items()[k].second);
        sl.skip_in_grad.push_back(l.entries[k].grad ? 1 : 0);
      } else {
        sl.skip_grad.set(part.items()[k].first, part.items()[k].second);
      }
    }
  }

  // <to>RF<i>@<from> and <from>RB<i>@<to>. Returns false when nothing was received here: a gradient
  // receive of a route without gradients, or (fast path) a receive posted for its consumer to wait for.
  bool receive_skip(const Action& a, int pos) {
    const std::size_t r = route_of(a);
    const bool act = a.kind == ActionKind::RecvAct;
    if (!act && !skip_has_grad(r, a.index)) return false;
    const int dir = act ? 0 : 1;
    const int src = pass->rank_of(a.peer, a.index);
    const int key = -1 - static_cast<int>(r);
    const int data_tag = skip_tag(r, a.index, dir, 0), header_tag = skip_tag(r, a.index, dir, 1);
    if (!options.reference) {
      if (const BundleLayout* l = recv_layout(key, dir, a.index, src, false, header_tag)) {
        PendingSkip& p = posted_skips[pos];
        p.action = a;
        p.recv.buffer = receive_buffer(*l);
        p.recv.layout = l;
        p.recv.work = transport->irecv(p.recv.buffer, src, data_tag);
        slot(a.stage, a.index).pending_skips.push_back(pos);
        return false;
      }
    }
    const auto [buf, l] = recv_bundle(key, dir, a.index, src, data_tag, header_tag);
    deliver_skip(a, buf, l);
    return true;
  }

  // Before F of stage s: the skips popped on s join its input bundle with their gradient flags, in route
  // order (the bundle's layout must not depend on the order they arrived in).
  void take_skips(int s, int i, Bundle& x, std::vector<char>& flags) {
    Slot& sl = slot(s, i);
    for (const SkipRoute& route : skips) {
      if (route.to != s) continue;
      for (const std::string& name : route.names) {
        std::size_t k = 0;
        while (k < sl.skip_in.size() && sl.skip_in.items()[k].first != name) ++k;
        if (k == sl.skip_in.size())
          throw std::logic_error("forward " + std::to_string(s) + "F" + std::to_string(i) + " has no skip '" + name + "'");
        x.set(name, on_device(sl.skip_in.items()[k].second));
        flags.push_back(sl.skip_in_grad[k]);
      }
    }
    sl.skip_in = Bundle();
    sl.skip_in_grad.clear();
  }

  // After the backward of stage s: the gradients of the skips popped on s leave `grads` (which keeps what
  // goes to the previous stage): handed back when the stashing stage is on this rank, else kept for SB@.
  void route_skip_grads(int s, int i, Bundle& grads) {
    for (const SkipRoute& route : skips) {
      if (route.to != s) continue;
      const bool local = pass->rank_of(route.from, i) == rank();
      Bundle& dst = local ? slot(route.from, i).skip_grad : slot(s, i).skip_grad_out;
      for (const std::string& name : route.names)
        if (grads.has(name)) dst.set(name, grads.take(name));
    }
  }

  // Before the backward of stage s: the gradients of its skips out (received or handed back), added to `g`.
  void take_skip_grads(int s, int i, Bundle& g) {
    Slot& sl = slot(s, i);
    for (const auto& [name, t] : sl.skip_grad.items()) g.set(name, t);
    sl.skip_grad = Bundle();
  }

  bool has_target() const { return !target.empty() && target.items().front().second.defined(); }

  // The micro-batch's loss as its backward root. Sample: the mean times b_k / N. Per token: the sum,
  // counted in the step's count (the division by the step's total count waits for the flush, when the
  // total is known, see reduce_and_clip); with one micro-batch per step (pipedream, spectrain) the count
  // is the total already, so the sum is divided at once.
  // The last stage's outputs for the loss: with bf16, its floating-point tensors in float32, so the loss is
  // computed in float32 (as autocast does for its losses).
  Bundle full_precision(const Bundle& out) const {
    if (options.precision != "bf16") return out;
    Bundle o;
    for (const auto& [name, t] : out.items())
      o.set(name, t.defined() && t.is_floating_point() && t.scalar_type() != torch::kFloat && t.scalar_type() != torch::kDouble
                      ? t.to(torch::kFloat)
                      : t);
    return o;
  }

  torch::Tensor scaled_loss(const Bundle& out, int i) {
    if (!has_target())
      throw UsageError("rank " + std::to_string(rank()) + " holds the last stage but train_step got no target batch");
    const auto [b, e] = ranges[static_cast<std::size_t>(i)];
    LossTerm term = loss(full_precision(out), target.slice(b, e).to(options.device), i);
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

  void backward(int s, int i, bool split) {
    Slot& sl = slot(s, i);
    Bundle out = sl.output;
    PassWeightsScope scope;
    const PassWeights* pw = enter_weights(s, i, false, scope);
    if (sl.checkpointed) {  // re-materialise with the forward's RNG seed, so dropout masks match
      out = run_forward(s, i, sl.input);
    }
    std::vector<torch::Tensor> roots, grads;
    if (s == last_stage()) {
      if (sl.loss.requires_grad()) roots.push_back(sl.loss);
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

  void weight(int s, int i) { slot(s, i).deferred.run(); }

  // backward_split "auto": whether stage s's trainable parameters are all in pipetrain::nn::Linear, whose
  // explicit split then does B/W alone (autograd_split.h), cached per stage.
  std::map<int, bool> linear_only_stages;
  bool linear_only(int s) {
    if (options.backward_split != "auto") return false;
    auto it = linear_only_stages.find(s);
    if (it != linear_only_stages.end()) return it->second;
    bool all = true;
    for (int k = 0; k < stage_of(s).num_layers() && all; ++k)
      all = detail::only_split_linear_parameters(stage_of(s).layer(k));
    return linear_only_stages[s] = all;
  }

  // Fast path: waits for the oldest sends once more than `prefetch` are in flight, so sent tensors are
  // released during the step rather than at its end. Safe: the sends were posted in the lowered order,
  // so the receiver reaches each of them without needing anything this rank does later.
  void reap_sends() {
    const std::size_t keep = static_cast<std::size_t>(std::max(1, options.prefetch));
    while (pending_sends.size() > keep) {
      pending_sends.front().second->wait();
      pending_sends.erase(pending_sends.begin());
    }
  }

  // Waits for every send still in flight (the flush, the end of a call).
  void finish_sends() {
    for (auto& [t, work] : pending_sends) work->wait();
    pending_sends.clear();
  }

  // ---- communication --------------------------------------------------------------------------------
  // dir 0: activations of stage `boundary` going to boundary+1; dir 1: input gradients of stage
  // `boundary` going to boundary-1. `grad` flags the entries that get a gradient back (dir 0).
  void send(int boundary, int dir, int i, const Bundle& b, const std::vector<char>& grad, int dst) {
    send_bundle(boundary, dir, i, b, grad, dst, tag(boundary, i, dir, 0), tag(boundary, i, dir, 1), false);
  }
  // `key` names the boundary for the agreed layouts (a stage, or -1 - r for skip route r); `async`
  // sends without waiting even on the reference path.
  void send_bundle(int key_boundary, int dir, int i, const Bundle& b, const std::vector<char>& grad, int dst,
                   int data_tag, int header_tag, bool async) {
    const auto key = std::make_tuple(key_boundary, dir, micro_size(i), dst, forward_mode);
    auto it = agreed.find(key);
    BundleLayout fresh;  // this transfer's layout, when it carries a header
    if (options.variable_shapes || it == agreed.end()) {
      fresh = detail::layout_of(b, grad);
      torch::Tensor header = detail::encode_header(fresh);
      if (async)  // a skip's header: never wait for a stage that is still waiting for this rank's sends
        pending_sends.emplace_back(header, transport->isend(header, dst, header_tag));
      else
        transport->send(header, dst, header_tag);
      if (!options.variable_shapes) it = agreed.emplace(key, std::move(fresh)).first;
    } else if (!detail::matches(it->second, b, grad)) {
      const std::string where = key_boundary >= 0 ? "stage " + std::to_string(key_boundary)
                                                  : "skip connection " + std::to_string(-1 - key_boundary);
      throw std::runtime_error(std::string(dir == 0 ? "activations" : "gradients") + " of " + where + " for micro-batch " + std::to_string(i) + " are " +
                               detail::describe(detail::layout_of(b, grad)) + " but what was agreed at first use is " +
                               detail::describe(it->second) +
                               ": a stage's outputs must keep their names, dtypes and shapes between micro-batches of "
                               "the same size, unless the pipeline runs with variable shapes (variable_shapes, "
                               "--variable-length)");
    }
    torch::Tensor t = detail::pack(b, options.variable_shapes ? fresh : it->second);
    // A GPU tensor goes as it is where the transport carries device tensors (ordered by events: the
    // local transport); else through host memory.
    if (!t.device().is_cpu() && !transport->carries_device_tensors()) t = t.cpu();
    if (options.reference && !async) {
      transport->send(t, dst, data_tag);
    } else {
      auto work = transport->isend(t, dst, data_tag);
      pending_sends.emplace_back(t, std::move(work));
    }
  }

  // Where a receive lands: on this rank's GPU when the transport carries device tensors and the bundle
  // is one tensor (sent as it is); else in host memory (several tensors travel packed in host bytes).
  torch::Tensor receive_buffer(const BundleLayout& l) const {
    if (l.entries.size() == 1 && !options.device.is_cpu() && transport->carries_device_tensors())
      return torch::empty(l.entries.front().shape,
                          torch::TensorOptions().dtype(l.entries.front().dtype).device(options.device));
    return detail::empty_buffer(l);
  }

  // The layout of a receive, receiving its header first if it is not agreed yet (always, with
  // variable shapes); null when that would block and `may_block` is false.
  const BundleLayout* recv_layout(int boundary, int dir, int i, int src, bool may_block) {
    return recv_layout(boundary, dir, i, src, may_block, tag(boundary, i, dir, 1));
  }
  const BundleLayout* recv_layout(int key_boundary, int dir, int i, int src, bool may_block, int header_tag) {
    const auto key = std::make_tuple(key_boundary, dir, micro_size(i), src, forward_mode);
    auto it = agreed.find(key);
    if (it != agreed.end() && !options.variable_shapes) return &it->second;
    if (!may_block) return nullptr;
    torch::Tensor header = torch::zeros({detail::kBundleHeaderLen}, torch::kLong);
    transport->recv(header, src, header_tag);
    BundleLayout l = detail::decode_header(header);
    if (it == agreed.end())
      it = agreed.emplace(key, std::move(l)).first;
    else
      it->second = std::move(l);  // variable shapes: this transfer's layout, used at once
    return &it->second;
  }

  // A blocking receive of one bundle (its header first when the layout is not agreed yet).
  std::pair<torch::Tensor, BundleLayout> recv_bundle(int key_boundary, int dir, int i, int src, int data_tag,
                                                     int header_tag) {
    BundleLayout l = *recv_layout(key_boundary, dir, i, src, true, header_tag);
    torch::Tensor buf = receive_buffer(l);
    transport->recv(buf, src, data_tag);
    return {buf, std::move(l)};
  }

  // Stores a received bundle where the consuming action looks for it.
  void deliver(const Action& a, const torch::Tensor& buffer, const BundleLayout& l) {
    Slot& sl = slot(a.stage, a.index);
    if (a.kind == ActionKind::RecvAct) {
      sl.input = detail::unpack(buffer, l);
      sl.in_grad.clear();
      for (const auto& e : l.entries) sl.in_grad.push_back(e.grad ? 1 : 0);
    } else {
      sl.recv_grad = detail::unpack(buffer, l);
    }
  }

  // Runs a receive action. On the fast path a receive is not waited for here: it was posted ahead, or
  // is posted now, and the action that consumes the data waits (await_inputs), so a receive placed early
  // by the lowering never holds up unrelated work. Only a receive whose layout is not agreed yet blocks
  // here (its header comes first). Returns false when the wait was deferred.
  bool receive(const Action& a, int pos) {
    const bool act = a.kind == ActionKind::RecvAct;
    if (!options.reference && (posted.count(pos) || post_receive(a, pos))) {
      Slot& sl = slot(a.stage, a.index);
      (act ? sl.pending_input : sl.pending_grad) = pos;
      return false;
    }
    const int boundary = act ? a.stage - 1 : a.stage + 1;
    const int dir = act ? 0 : 1;
    const int src = pass->rank_of(boundary, a.index);
    const auto [buf, l] = recv_bundle(boundary, dir, a.index, src, tag(boundary, a.index, dir, 0), tag(boundary, a.index, dir, 1));
    deliver(a, buf, l);
    return true;
  }

  // Before a compute action: waits for its deferred receives, if any (its boundary's and its skips'),
  // and records each wait as the receive action in the timeline.
  void await_inputs(const Action& a, Timeline& timeline) {
    if (a.kind != ActionKind::F && a.kind != ActionKind::B && a.kind != ActionKind::BW) return;
    Slot& sl = slot(a.stage, a.index);
    if (!sl.pending_skips.empty()) {
      const ActionKind want = a.kind == ActionKind::F ? ActionKind::RecvAct : ActionKind::RecvGrad;
      std::vector<int> later;  // the other direction's (a stage both pops and stashes)
      for (int key : sl.pending_skips) {
        auto it = posted_skips.find(key);
        if (it->second.action.kind != want) {
          later.push_back(key);
          continue;
        }
        const double t0 = now_ms();
        it->second.recv.work->wait();
        deliver_skip(it->second.action, it->second.recv.buffer, *it->second.recv.layout);
        timeline.events.push_back(TimedAction{rank(), it->second.action, t0, now_ms()});
        posted_skips.erase(it);
      }
      sl.pending_skips = std::move(later);
    }
    int& pending = a.kind == ActionKind::F ? sl.pending_input : sl.pending_grad;
    if (pending < 0) return;
    const double t0 = now_ms();
    auto it = posted.find(pending);
    it->second.work->wait();
    pending = -1;
    const Action recv{a.kind == ActionKind::F ? ActionKind::RecvAct : ActionKind::RecvGrad, a.stage, a.index};
    deliver(recv, it->second.buffer, *it->second.layout);
    posted.erase(it);
    timeline.events.push_back(TimedAction{rank(), recv, t0, now_ms()});
  }

  // Fast path: posts the receive `a` at list position `pos` unless its layout is not agreed yet (always,
  // with variable shapes: its header must be received in order, at its action). Returns whether it did.
  bool post_receive(const Action& a, int pos) {
    const bool act = a.kind == ActionKind::RecvAct;
    const int boundary = act ? a.stage - 1 : a.stage + 1;
    const int dir = act ? 0 : 1;
    const int src = pass->rank_of(boundary, a.index);
    const BundleLayout* l = recv_layout(boundary, dir, a.index, src, false);
    if (!l) return false;
    PendingRecv& p = posted[pos];
    p.buffer = receive_buffer(*l);
    p.layout = l;
    p.work = transport->irecv(p.buffer, src, tag(boundary, a.index, dir, 0));
    return true;
  }

  // Fast path: keeps up to `prefetch` receives posted and not yet consumed, walking the rank's list in
  // order from `prefetch_cursor` (so each step costs O(actions), not O(actions x window)). A receive
  // whose layout is not agreed yet stops the walk. A full window only delays posting: a receive whose
  // place is reached before the walk posted it is posted there (receive), never waited for there. Skip
  // receives are not prefetched: each is posted at its own place (receive_skip).
  void prefetch_from(const std::vector<Action>& actions, std::size_t pos) {
    prefetch_cursor = std::max(prefetch_cursor, pos);
    while (prefetch_cursor < actions.size() && posted.size() < static_cast<std::size_t>(options.prefetch)) {
      const Action& a = actions[prefetch_cursor];
      if ((a.kind == ActionKind::RecvAct || a.kind == ActionKind::RecvGrad) && a.peer < 0)  // not a skip's
        if (!post_receive(a, static_cast<int>(prefetch_cursor))) return;
      ++prefetch_cursor;
    }
  }

  // ---- optimizer --------------------------------------------------------------------------------------
  // Multiplies the gradients by `scale` (a per-token loss's 1 / count), then clips them to the global
  // norm `norm` (of the scaled gradients) if it exceeds `clip`: one pass over the gradients.
  static void clip_to(const std::vector<torch::Tensor>& params, double norm, double clip, double scale = 1.0) {
    double coef = scale;
    if (clip > 0 && norm > clip) coef *= clip / (norm + 1e-6);
    if (coef == 1.0) return;
    torch::NoGradGuard no_grad;
    for (const auto& p : params)
      if (p.grad().defined()) p.mutable_grad().mul_(coef);
  }

  // Synchronous schedules, at the rank's first Step of step k: the step's loss and global gradient norm
  // (a collective), then clipping by the global norm.
  void reduce_and_clip(int k) {
    const auto uk = static_cast<std::size_t>(k);
    // The step's last sends complete before the flush's collectives. Their receivers take them before
    // their own Step, so this cannot deadlock; and a send left in flight may need this rank's transport
    // threads while the collective keeps its core busy: over gloo with ranks bound to one core each, the
    // MLP's last gradient then arrived 5 ms late whenever the Step reached its all-reduce quickly.
    finish_sends();
    std::vector<torch::Tensor> params;
    for (const auto& [s, ps] : stage_params)
      for (const auto& p : ps) params.push_back(p);
    if (options.data_parallel && options.data_parallel->world_size() > 1)
      all_reduce_gradients(*options.data_parallel, params, &step_loss[uk], per_token ? &step_count[uk] : nullptr);
    if (stage_replicas) all_reduce_gradients(*stage_replicas, params, nullptr);
    sum_tied_gradients();
    std::vector<torch::Tensor> counted;  // each tied weight once
    for (const auto& p : params)
      if (std::none_of(tied_copies.begin(), tied_copies.end(), [&](const TiedCopy& c) {
            return !c.primary && c.param.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
          }))
        counted.push_back(p);
    // Only the norm leader's share is counted (its replicas hold the same, already reduced, gradients), so
    // only it pays for the pass over them. Third entry: a bit per rank (the first 52; exact in a double)
    // whose share of the gradients is not finite.
    const double sq = norm_leader ? detail::gradient_sum_of_squares(counted) : 0.0;
    const double flag = std::isfinite(sq) ? 0.0 : std::ldexp(1.0, std::min(rank(), 51));
    // Fourth entry (per-token loss): the step's token count, by which the summed losses and gradients are
    // divided here (a step without tokens counts 1: its sums are zero).
    torch::Tensor t = per_token ? host_tensor({step_loss[uk], sq, flag, step_count[uk]}) : host_tensor({step_loss[uk], sq, flag});
    transport->all_reduce_sum(t);
    const double* sums = host_doubles(t);
    const double count = per_token && sums[3] > 0 ? sums[3] : 1.0;
    step_loss[uk] = sums[0] / count;
    step_sq[uk] = sums[1] / (count * count);
    if (!std::isfinite(step_loss[uk]) || !std::isfinite(step_sq[uk])) nonfinite_step(k, sums[2]);
    clip_to(params, std::sqrt(step_sq[uk]), options.optimizer.clip_grad_norm, 1.0 / count);
    step_reduced[uk] = 1;
    if (options.on_gradients) options.on_gradients(rank(), params);
  }

  // A synchronous step k with a non-finite loss or global norm, the same on every rank (its values are
  // all-reduced): "stop" throws, "skip" marks it so that no stage steps. `rank_bits` has bit r set when
  // rank r's own gradients were not finite (ranks past 51 share bit 51).
  void nonfinite_step(int k, double rank_bits) {
    const auto uk = static_cast<std::size_t>(k);
    if (options.optimizer.nonfinite == "ignore") return;
    if (options.optimizer.nonfinite == "skip") {
      step_skipped[uk] = 1;
      return;
    }
    std::string stages;
    const auto bits = static_cast<uint64_t>(rank_bits);
    for (int s = 0; s < schedule.stages; ++s) {
      const int r = std::min(schedule.rank_of(s), 51);
      if (bits >> r & 1u) stages += (stages.empty() ? "" : ", ") + std::to_string(s);
    }
    throw NonFiniteError(fmt::format(
        "training diverged at step {}: the loss is {} and the gradient norm {}{}; no optimizer step was taken. "
        "Lower the learning rate, clip gradients (--clip), or resume from the last checkpoint{}",
        step + k + 1, number_text(step_loss[uk]), number_text(std::sqrt(step_sq[uk])),
        stages.empty() ? "" : " (gradients not finite on stage " + stages + ")",
        " (or skip such steps: --nonfinite skip)"));
  }

  // Tied weights: before the first pass (a collective, so not in the constructor, which programs may
  // call for every rank on one thread), every copy of each group must hold the same values on every
  // rank holding one; ranks built with other seeds would train the copies apart. Throws UsageError
  // naming the group and the ranks on each rank alike.
  bool ties_checked = false;
  void check_ties_agree() {
    if (ties_checked || options.tied.empty()) return;
    if (layerwise) return share_ties();
    const int p = transport->world_size();
    const auto n = static_cast<int64_t>(options.tied.size());
    torch::Tensor hashes = torch::zeros({p, n}, torch::kDouble);  // 0: no copy; else 1 + value_hash
    for (const auto& c : tied_copies) hashes[rank()][c.group] = 1 + value_hash(c.param);
    transport->all_reduce_sum(hashes);
    ties_checked = true;
    const auto h = hashes.accessor<double, 2>();
    for (int64_t g = 0; g < n; ++g) {
      int first = -1;
      std::string same, other;
      for (int r = 0; r < p; ++r) {
        if (h[r][g] == 0) continue;
        if (first < 0) first = r;
        std::string& list = h[r][g] == h[first][g] ? same : other;
        list += (list.empty() ? "" : ", ") + std::to_string(r);
      }
      if (other.empty()) continue;
      std::string members;
      for (const ParameterRef& m : options.tied[static_cast<std::size_t>(g)])
        members += (members.empty() ? "" : ", ") + std::to_string(m.layer) + ":" + m.name;
      throw UsageError("tie group " + std::to_string(g) + " (" + members + ") has other values on rank(s) " + other +
                       " than on rank(s) " + same + ", so its copies would train apart: build the model the same way "
                       "on every rank (e.g. torch::manual_seed with one seed before building it), or load one "
                       "checkpoint into every rank");
    }
  }

  // Tied weights of a model built layer by layer (layers.h), at the first pass (a collective): each
  // group's size is agreed (ranks without a member learn it, a member of another size is refused), then
  // the value of the group's first member (as the Sequential constructor copies it within a whole model)
  // goes from the rank holding it to every other member.
  void share_ties() {
    const auto n = static_cast<int64_t>(options.tied.size());
    torch::Tensor sizes = torch::zeros({n, 3}, torch::kDouble);  // numel sum, holders, squared numel sum
    for (const auto& c : tied_copies) {
      const double k = static_cast<double>(c.param.numel());
      sizes[c.group][0] += k;
      sizes[c.group][1] += 1;
      sizes[c.group][2] += k * k;
    }
    transport->all_reduce_sum(sizes);
    ties_checked = true;
    const auto z = sizes.accessor<double, 2>();
    tied_numel.assign(static_cast<std::size_t>(n), 0);
    std::vector<int64_t> offset{0};
    for (int64_t g = 0; g < n; ++g) {
      const double mean = z[g][1] > 0 ? z[g][0] / z[g][1] : 0;
      if (z[g][1] > 0 && z[g][2] != mean * mean * z[g][1]) {
        std::string members;
        for (const ParameterRef& m : options.tied[static_cast<std::size_t>(g)])
          members += (members.empty() ? "" : ", ") + std::to_string(m.layer) + ":" + m.name;
        throw UsageError("tie group " + std::to_string(g) + " (" + members + ") has members of different sizes on "
                         "different ranks: tied parameters must have one shape and dtype");
      }
      tied_numel[static_cast<std::size_t>(g)] = static_cast<int64_t>(mean);
      offset.push_back(offset.back() + tied_numel[static_cast<std::size_t>(g)]);
    }
    torch::Tensor flat = torch::zeros({offset.back()}, torch::kDouble);
    for (const auto& c : tied_copies) {
      const ParameterRef& first = options.tied[static_cast<std::size_t>(c.group)].front();
      if (c.layer == first.layer && c.name == first.name)
        flat.slice(0, offset[static_cast<std::size_t>(c.group)], offset[static_cast<std::size_t>(c.group) + 1])
            .copy_(c.param.detach().reshape({-1}).to(torch::kCPU, torch::kDouble));
    }
    transport->all_reduce_sum(flat);
    torch::NoGradGuard no_grad;
    for (auto& c : tied_copies) {
      const auto g = static_cast<std::size_t>(c.group);
      c.param.copy_(flat.slice(0, offset[g], offset[g + 1]).view(c.param.sizes()));
    }
  }

  // Tied weights: every copy's gradient becomes the sum over all copies of its group (one all-reduce
  // over the pipeline's ranks; ranks without a copy add zeros), so all copies step the same.
  void sum_tied_gradients() {
    if (options.tied.empty()) return;
    std::vector<int64_t> offset(tied_numel.size() + 1, 0);
    for (std::size_t g = 0; g < tied_numel.size(); ++g) offset[g + 1] = offset[g] + tied_numel[g];
    torch::Tensor flat = torch::zeros({offset.back()}, torch::kDouble);
    for (const auto& c : tied_copies)
      if (c.param.grad().defined())
        flat.slice(0, offset[static_cast<std::size_t>(c.group)], offset[static_cast<std::size_t>(c.group) + 1])
            .add_(c.param.grad().detach().reshape({-1}).to(torch::kCPU, torch::kDouble));
    transport->all_reduce_sum(flat);
    torch::NoGradGuard no_grad;
    for (auto& c : tied_copies) {
      const auto g = static_cast<std::size_t>(c.group);
      torch::Tensor sum = flat.slice(0, offset[g], offset[g + 1]).view(c.param.sizes()).to(c.param.device(), c.param.scalar_type());
      if (c.param.grad().defined())
        c.param.mutable_grad().copy_(sum);
      else
        c.param.mutable_grad() = sum.clone();
    }
  }

  // One all-reduce of this rank's gradients over a stage's replicas. Hybrid parallelism (`loss` given:
  // the copy's step-loss share goes along): each copy's loss is the mean over its share of the batch, so
  // gradients and loss are averaged. 1F1B-RR (`loss` null): each replica's gradients are its
  // micro-batches' share of the full-batch gradient, so they are summed (the step loss is summed over
  // all ranks later). Parameters without a gradient contribute zeros, so every replica sends the same
  // layout.
  // Per-token loss (`count` given): the copies' gradient sums, loss sums and counts are summed instead
  // (divided by the total count at the flush).
  // The gradients travel in their own dtype (the parameters' common one; float32 usually): one copy into
  // a flat host buffer, reduced in place, and one pass back that also divides by the replicas. The loss
  // and count are summed exactly, as doubles, in a second (small) all-reduce.
  void all_reduce_gradients(Transport& group, const std::vector<torch::Tensor>& params, double* loss,
                            double* count = nullptr) {
    const int64_t replicas = loss && !count ? group.world_size() : 1;
    torch::NoGradGuard no_grad;
    if (!params.empty()) {
      c10::ScalarType dtype = params.front().scalar_type();
      for (const auto& p : params) dtype = c10::promoteTypes(dtype, p.scalar_type());
      std::vector<torch::Tensor> parts;
      parts.reserve(params.size());
      for (const auto& p : params)
        parts.push_back(p.grad().defined() ? p.grad().detach().reshape({-1}).to(torch::kCPU, dtype)
                                           : torch::zeros({p.numel()}, torch::TensorOptions().dtype(dtype)));
      torch::Tensor all = torch::cat(parts);
      parts.clear();
      group.all_reduce_sum(all);
      const torch::Tensor divisor = torch::scalar_tensor(static_cast<double>(replicas), torch::kDouble);
      int64_t at = 0;
      for (const auto& p : params) {
        const torch::Tensor sum = all.slice(0, at, at + p.numel()).view(p.sizes());
        at += p.numel();
        if (!p.grad().defined()) {
          const_cast<torch::Tensor&>(p).mutable_grad() =
              (replicas != 1 ? sum.div(divisor) : sum.clone()).to(p.device(), p.scalar_type());
        } else if (replicas == 1) {
          p.mutable_grad().copy_(sum);
        } else if (p.grad().is_cpu() && p.grad().scalar_type() == dtype) {
          torch::Tensor g = p.mutable_grad();
          at::div_out(g, sum, divisor);  // the mean, written straight into the gradient
        } else {
          p.mutable_grad().copy_(sum.div(divisor));
        }
      }
    }
    if (loss || count) {
      torch::Tensor exact = torch::tensor({loss ? *loss : 0.0, count ? *count : 0.0}, torch::kDouble);
      group.all_reduce_sum(exact);
      if (loss) *loss = exact[0].item<double>() / static_cast<double>(replicas);
      if (count) *count = exact[1].item<double>();
    }
  }

  void optimizer_step(int s, int k) {
    if (k < 0 || k >= static_cast<int>(step_sizes.size()))
      throw std::logic_error("Step " + std::to_string(k) + " outside the call's " + std::to_string(step_sizes.size()) +
                             " steps");
    if (!async) {
      if (!step_reduced[static_cast<std::size_t>(k)]) reduce_and_clip(k);
    } else {
      // No stage knows the others' gradients of this mini-batch yet: clip by the stage's own norm; the
      // global norm is summed at the end of the call.
      const std::vector<torch::Tensor>& params = stage_params.at(s);
      const double sq = detail::gradient_sum_of_squares(params);
      step_sq[static_cast<std::size_t>(k)] += sq;
      if (!std::isfinite(sq) && options.optimizer.nonfinite == "stop")
        throw NonFiniteError(fmt::format(
            "training diverged at step {}: stage {}'s gradient norm is {}; no optimizer step was taken there. Lower "
            "the learning rate, clip gradients (--clip), or resume from the last checkpoint (or skip such steps: "
            "--nonfinite skip)", step + k + 1, s, number_text(std::sqrt(sq))));
      if (!std::isfinite(sq) && options.optimizer.nonfinite == "skip") {
        for (auto& p : params) const_cast<torch::Tensor&>(p).mutable_grad() = torch::Tensor();
        stats.skipped_steps += 1;
        return;
      }
      clip_to(params, std::sqrt(sq), options.optimizer.clip_grad_norm);
      if (options.on_gradients) options.on_gradients(rank(), params);
    }
    auto it = optimizers.find(s);
    if (it != optimizers.end() && options.learning_rate) {
      const double lr = options.learning_rate(step + k);
      if (!(lr > 0))
        throw UsageError("learning rate of step " + std::to_string(step + k) + " must be > 0, got " +
                         std::to_string(lr));
      for (auto& group : it->second->param_groups()) group.options().set_lr(lr);
    }
    if (!async && step_skipped[static_cast<std::size_t>(k)]) {  // nonfinite "skip": no stage steps
      for (auto& p : stage_params.at(s)) p.mutable_grad() = torch::Tensor();
      stats.skipped_steps += 1;
      return;
    }
    weights.at(s).step([&] { if (it != optimizers.end()) detail::optimizer_step(*it->second); }, async);
    for (auto& p : stage_params.at(s)) p.mutable_grad() = torch::Tensor();
  }

  // Returns false when the action's work was deferred (a posted receive) and so should not be timed.
  bool run_action(const Action& a, int pos) {
    switch (a.kind) {
      case ActionKind::F: forward(a.stage, a.index); break;
      case ActionKind::B: backward(a.stage, a.index, true); break;
      case ActionKind::BW: backward(a.stage, a.index, false); break;
      case ActionKind::W: weight(a.stage, a.index); break;
      case ActionKind::SendAct: {
        if (a.peer >= 0) {
          send_skip(a);
          break;
        }
        std::vector<char> flags;
        const Bundle out = outgoing(a.stage, slot(a.stage, a.index), flags);
        send(a.stage, 0, a.index, out, flags, pass->rank_of(a.stage + 1, a.index));
        break;
      }
      case ActionKind::SendGrad:
        if (a.peer >= 0) return send_skip_grad(a);
        send(a.stage, 1, a.index, slot(a.stage, a.index).input_grad, {}, pass->rank_of(a.stage - 1, a.index));
        slot(a.stage, a.index).input_grad = Bundle();
        break;
      case ActionKind::RecvAct:
      case ActionKind::RecvGrad: return a.peer >= 0 ? receive_skip(a, pos) : receive(a, pos);
      case ActionKind::Step: optimizer_step(a.stage, a.index); break;
    }
    return true;
  }

  // ---- passes --------------------------------------------------------------------------------------
  // `steps` mini-batches of `m` micro-batches each over the batch of n samples.
  void begin_pass(const Bundle& in, const Bundle& tgt, int64_t n, int steps, int m) {
    if (steps > n)
      throw UsageError("a call of " + std::to_string(steps) + " steps needs at least one sample per step but the " +
                       "batch has " + std::to_string(n) + ": pass more samples or fewer steps");
    ranges.clear();
    step_sizes.clear();
    for (const auto& [b, e] : split_equal(n, steps)) {
      step_sizes.push_back(e - b);
      for (const auto& [mb, me] : split_equal(e - b, m)) ranges.emplace_back(b + mb, b + me);
    }
    per_step = m;
    input = in;
    target = tgt;
    batch_size = n;
    step_loss.assign(static_cast<std::size_t>(steps), 0.0);
    step_sq.assign(static_cast<std::size_t>(steps), 0.0);
    step_count.assign(static_cast<std::size_t>(steps), 0.0);
    step_reduced.assign(static_cast<std::size_t>(steps), 0);
    step_skipped.assign(static_cast<std::size_t>(steps), 0);
    slots.clear();
    posted.clear();
    posted_skips.clear();
    prefetch_cursor = 0;
    pending_sends.clear();
    stats = StepStats{};
    stats.step = step;
    stats.steps = steps;
    stats.timeline.schedule = schedule.name;
    stats.timeline.ranks = schedule.ranks;
    stats.timeline.microbatches = m;
    stats.timeline.virtual_stages = schedule.virtual_stages_per_rank();
    stats.timeline.unit = "ms";
  }

  // The interpreter: runs one rank's action list, timing each action. On failure aborts the transport
  // with a message naming the rank and the action, so every rank stops.
  void run_list(const std::vector<Action>& actions) {
    const double heap0 = options.measure_memory ? heap_in_use() : 0.0;
    stats.timeline.events.reserve(2 * actions.size());  // an action and its receive's wait at most
    // On a GPU the host clock around an action measures its kernel launches, not its work: the action's
    // time is read from events on the rank's stream instead (timed_on_device: timeline index, handle).
    detail::RankDevice* gpu = rank_device && rank_device->cuda() ? &*rank_device : nullptr;
    std::vector<std::pair<std::size_t, std::size_t>> timed_on_device;
    if (gpu) gpu->begin_timing();
    std::size_t pos = 0;
    try {
      for (; pos < actions.size(); ++pos) {
        if (!options.reference) prefetch_from(actions, pos);
        if (options.before_action && !forward_mode) options.before_action(rank(), step, actions[pos]);
        await_inputs(actions[pos], stats.timeline);
        const double t0 = now_ms();
        const std::size_t handle = gpu ? gpu->start_action() : 0;
        if (run_action(actions[pos], static_cast<int>(pos))) {
          if (gpu) {
            gpu->end_action(handle);
            timed_on_device.emplace_back(stats.timeline.events.size(), handle);
          }
          stats.timeline.events.push_back(TimedAction{rank(), actions[pos], t0, now_ms()});
        }
        if (!options.reference) reap_sends();
        if (options.measure_memory) stats.peak_heap_growth = std::max(stats.peak_heap_growth, heap_in_use() - heap0);
      }
      finish_sends();
      if (!forward_mode) finish_call();
      if (gpu) {
        const std::vector<std::pair<double, double>> times = gpu->finish_timing();
        for (const auto& [event, handle] : timed_on_device) {
          stats.timeline.events[event].start = times[handle].first;
          stats.timeline.events[event].end = times[handle].second;
        }
      }
    } catch (const RemoteFailure&) {
      throw;
    } catch (const std::exception& e) {
      const std::string where = pos < actions.size() ? " at " + to_string(actions[pos]) : std::string();
      // LibTorch's errors carry a C++ backtrace in what(); the user needs the message only.
      const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
      const std::string what = torch_error ? torch_error->what_without_backtrace() : e.what();
      const std::string msg = "rank " + std::to_string(rank()) + where + ": " + what;
      transport->abort(msg);
      if (dynamic_cast<const UsageError*>(&e)) throw UsageError(msg);
      if (dynamic_cast<const NonFiniteError*>(&e)) throw NonFiniteError(msg);
      throw std::runtime_error(msg);
    }
  }

  // After a training pass: the per-step losses and global norms on every rank, and the call's totals.
  void finish_call() {
    const std::size_t K = step_sizes.size();
    if (!async) {
      for (std::size_t k = 0; k < K; ++k)  // a rank without Step actions still joins the reductions
        if (!step_reduced[k]) reduce_and_clip(static_cast<int>(k));
    } else {
      std::vector<double> values(step_loss);
      values.insert(values.end(), step_sq.begin(), step_sq.end());
      torch::Tensor t = host_tensor(values);
      transport->all_reduce_sum(t);
      const double* sums = host_doubles(t);
      for (std::size_t k = 0; k < K; ++k) {
        step_loss[k] = sums[k];
        step_sq[k] = sums[K + k];
      }
      // The call's losses and norms, the same on every rank: a non-finite one stops every rank here
      // (a stage's own non-finite norm already stopped the call at its Step).
      for (std::size_t k = 0; k < K && options.optimizer.nonfinite == "stop"; ++k)
        if (!std::isfinite(step_loss[k]) || !std::isfinite(step_sq[k]))
          throw NonFiniteError(fmt::format("training diverged at step {}: the loss is {} and the gradient norm {}. "
                                           "Lower the learning rate, clip gradients (--clip), or resume from the last "
                                           "checkpoint", step + static_cast<int>(k) + 1, number_text(step_loss[k]),
                                           number_text(std::sqrt(step_sq[k]))));
      for (const auto& [s, w] : weights)
        stats.weight_memory.push_back(WeightMemory{s, w.peak_extra_sets(), w.set_bytes()});
    }
    double weighted = 0;
    int64_t total = 0;
    for (std::size_t k = 0; k < K; ++k) {
      stats.losses.push_back(step_loss[k]);
      stats.grad_norms.push_back(std::sqrt(step_sq[k]));
      weighted += step_loss[k] * static_cast<double>(step_sizes[k]);
      total += step_sizes[k];
    }
    stats.loss = K == 1 ? step_loss[0] : weighted / static_cast<double>(std::max<int64_t>(total, 1));
    stats.grad_norm = stats.grad_norms.empty() ? 0.0 : stats.grad_norms.back();
  }

  // The unlowered schedule of a call of `steps` steps: the generator's, or round robin over replicas;
  // with the model's skip routes as its skip edges.
  Schedule make_plain(int steps) const {
    Schedule s;
    if (!options.replication.empty()) {
      s = round_robin(options.schedule, options.replication, generator.microbatches, steps);
    } else {
      GeneratorOptions g = generator;
      g.steps = steps;
      s = generate(options.schedule, g);
    }
    s.skips = skip_edges(skips);
    return s;
  }

  // The lowered schedule and weight plan for a call of `steps` steps (made once per count).
  const Schedule& schedule_for(int steps) {
    if (steps == 1) return schedule;
    auto it = by_steps.find(steps);
    if (it != by_steps.end()) return it->second;
    Schedule plain = make_plain(steps);
    validate(plain);
    Schedule lowered = insert_communication(plain, options.costs);
    validate(lowered);
    return by_steps.emplace(steps, std::move(lowered)).first->second;
  }
  const WeightPlan& plan_for(int steps) {
    auto it = plans.find(steps);
    if (it != plans.end()) return it->second;
    return plans.emplace(steps, plan_weights(schedule_for(steps), policy, options.costs)).first->second;
  }

  // Forward-only schedule for m micro-batches: each rank runs the forwards of its stages, stage by stage
  // in micro-batch order (GPipe's forward phase), lowered like a training schedule.
  const Schedule& forward_schedule(int m) {
    auto it = forward_schedules.find(m);
    if (it != forward_schedules.end()) return it->second;
    Schedule plain;
    plain.name = "forward";
    plain.ranks = schedule.ranks;
    plain.stages = schedule.stages;
    plain.microbatches = m;
    plain.microbatches_per_step = m;
    plain.stage_rank = schedule.stage_rank;
    plain.skips = schedule.skips;
    plain.actions.resize(static_cast<std::size_t>(schedule.ranks));
    for (int s = 0; s < schedule.stages; ++s)
      for (int i = 0; i < m; ++i)
        plain.actions[static_cast<std::size_t>(schedule.rank_of(s))].push_back(Action{ActionKind::F, s, i});
    return forward_schedules.emplace(m, insert_communication(plain, options.costs)).first->second;
  }

  // The optimizer state of parameter `p` of stage `s` (null when it has none yet).
  torch::optim::OptimizerParamState* optim_state(int s, const torch::Tensor& p) {
    auto it = optimizers.find(s);
    if (it == optimizers.end()) return nullptr;
    auto& state = it->second->state();
    auto found = state.find(compat::optimizer_state_key(p));
    return found == state.end() ? nullptr : found->second.get();
  }

  int stage_of_layer(int layer) const {
    for (const auto& [s, st] : stages)
      if (layer >= st.first_layer() && layer < st.first_layer() + st.num_layers()) return s;
    throw std::invalid_argument("layer " + std::to_string(layer) + " is not held by rank " + std::to_string(rank()));
  }
};

namespace {

// 1F1B-RR's requirements; an all-ones replication is dropped (the plain pipeline).
void check_replication(PipelineOptions& o, int ranks) {
  if (o.replication.empty()) return;
  int total = 0;
  std::string list;
  for (int r : o.replication) {
    if (r < 1) throw UsageError("stage replication " + std::to_string(r) + " must be >= 1 (one rank per replica)");
    total += r;
    list += (list.empty() ? "" : ",") + std::to_string(r);
  }
  if (std::all_of(o.replication.begin(), o.replication.end(), [](int r) { return r == 1; })) {
    if (static_cast<int>(o.replication.size()) != ranks)
      throw UsageError("replication " + list + " has " + std::to_string(o.replication.size()) + " stages but there are " +
                       std::to_string(ranks) + " ranks: give one count per stage");
    o.replication.clear();
    return;
  }
  if (total != ranks)
    throw UsageError("replication " + list + " needs " + std::to_string(total) + " ranks (their sum) but there are " +
                     std::to_string(ranks) + ": launch " + std::to_string(total) + " ranks");
  if (o.schedule != "gpipe" && o.schedule != "1f1b")
    throw UsageError("replicated stages (" + list + ") run with --schedule 1f1b or gpipe (round robin over the "
                     "replicas), not '" + o.schedule + "'");
  if (o.virtual_stages != 1)
    throw UsageError("replicated stages (" + list + ") run without virtual stages: drop --virtual");
  if (o.data_parallel && o.data_parallel->world_size() > 1)
    throw UsageError("replicated stages (" + list + ") and copies of the whole pipeline (--replicas) do not combine: "
                     "use one or the other");
}

}  // namespace

namespace {

// check_pipeline_options, optionally without generating the schedule (the constructor generates it
// anyway, with the same errors).
void check_options(const PipelineOptions& options, int ranks, bool generate_schedule) {
  PipelineOptions o = options;
  const bool async = !schedule_traits(o.schedule).synchronous;  // throws for an unknown name
  if (async && o.data_parallel && o.data_parallel->world_size() > 1)
    throw UsageError("schedule '" + o.schedule + "' is asynchronous; data parallelism across pipelines "
                     "(replicas) runs with the synchronous schedules: use gpipe, 1f1b, interleaved or zb-*");
  weight_policy_of(o);
  if (o.prefetch < 0) throw UsageError("prefetch must be >= 0, got " + std::to_string(o.prefetch));
  if (o.backward_split != "auto" && o.backward_split != "autograd" && o.backward_split != "explicit")
    throw UsageError("unknown backward split '" + o.backward_split + "': use auto, autograd or explicit");
  check_replication(o, ranks);
  if (o.virtual_stages < 1) throw UsageError("virtual stages must be >= 1, got " + std::to_string(o.virtual_stages));
  if (schedule_traits(o.schedule).virtual_stages && o.virtual_stages == 1)
    throw UsageError("schedule '" + o.schedule + "' loops several stages over each rank, but virtual_stages is 1 " +
                     "(--virtual 1), which would run " +
                     (o.schedule == "interleaved" ? std::string("plain 1F1B") : "it without a loop") +
                     ": set virtual_stages (--virtual) to 2 or more" +
                     (o.schedule == "interleaved" ? ", or ask for 1f1b" : ""));
  if (o.precision != "fp32" && o.precision != "bf16")
    throw UsageError("precision '" + o.precision + "' is unknown: use fp32 or bf16 (autocast to bfloat16)");
  const OptimizerOptions& opt = o.optimizer;
  if (opt.name != "sgd" && opt.name != "adam" && opt.name != "adamw")
    throw UsageError("unknown optimizer '" + opt.name + "': use sgd, adam or adamw");
  if (!(opt.lr > 0)) throw UsageError("learning rate must be > 0, got " + std::to_string(opt.lr));
  // Every number finite (NaN passed the old `< 0` checks and turned clipping off silently).
  const auto finite_at_least = [](const char* what, double v, double lo, const char* fix) {
    if (!std::isfinite(v) || v < lo) throw UsageError(fmt::format("{} must be a finite number >= {:g}, got {}{}", what, lo, v, fix));
  };
  if (!std::isfinite(opt.lr)) throw UsageError(fmt::format("learning rate must be a finite number > 0, got {}", opt.lr));
  finite_at_least("gradient clipping norm", opt.clip_grad_norm, 0.0, " (0 turns clipping off)");
  finite_at_least("momentum", opt.momentum, 0.0, "");
  finite_at_least("weight decay", opt.weight_decay, 0.0, "");
  finite_at_least("eps", opt.eps, 0.0, "");
  for (const auto& [what, beta] : {std::pair<const char*, double>{"beta1", opt.beta1}, {"beta2", opt.beta2}})
    if (!(beta >= 0 && beta < 1)) throw UsageError(fmt::format("{} must be in [0, 1), got {}", what, beta));
  if (opt.nonfinite != "stop" && opt.nonfinite != "skip" && opt.nonfinite != "ignore")
    throw UsageError("nonfinite must be stop, skip or ignore, got '" + opt.nonfinite + "'");
  if (!o.tied.empty()) {
    if (async)
      throw UsageError("tied weights need a synchronous schedule (their copies are summed at the flush); '" + o.schedule +
                       "' has none: use gpipe, 1f1b, interleaved or a zero-bubble schedule");
    if (!o.replication.empty())
      throw UsageError("tied weights and stage replication (1F1B-RR) do not combine: drop one of them");
    if (o.umpipe) throw UsageError("tied weights and UMPIPE do not combine: drop one of them");
  }
  if (generate_schedule && o.replication.empty()) {  // the generator's own checks (m against p, v, the memory limit)
    GeneratorOptions g;
    g.ranks = ranks;
    g.microbatches = o.microbatches;
    g.virtual_stages = o.virtual_stages;
    g.costs = o.costs;
    g.memory_limit = o.memory_limit;
    generate(o.schedule, g);
  }
}

}  // namespace

void check_pipeline_options(const PipelineOptions& options, int ranks) { check_options(options, ranks, true); }

namespace {

// A schedule with W actions defers weight gradients only for layers that split their backward
// (pipetrain::nn::Linear); every other parameter's gradient stays in B. When that is more than a tenth
// of this rank's trainable parameters, says so once per PipelineRank, on stderr, with the share and the
// layers: a program that asked for zero bubble learns without having to ask that it does not get it
// (the CLI's ranks print it too). Below a tenth (a transformer's norms) W is what the schedule assumes.
template <class Stages>
void warn_unsplit_weights(int rank, const std::string& schedule_name, const Schedule& schedule, const Stages& stages) {
  const auto& mine = schedule.actions[static_cast<std::size_t>(rank)];
  if (std::none_of(mine.begin(), mine.end(), [](const Action& a) { return a.kind == ActionKind::W; })) return;
  int64_t total = 0, fused = 0;
  std::string layers;
  for (const auto& [s, st] : stages)
    for (int k = 0; k < st.num_layers(); ++k) {
      int64_t layer_fused = 0;
      for (const auto& m : st.layer(k)->modules(/*include_self=*/true)) {
        const bool split = dynamic_cast<const nn::LinearImpl*>(m.get()) != nullptr;
        for (const auto& t : m->parameters(/*recurse=*/false))
          if (t.requires_grad()) {
            total += t.numel();
            if (!split) layer_fused += t.numel();
          }
      }
      fused += layer_fused;
      if (layer_fused > 0) {
        std::string type = st.layer(k)->name();  // e.g. torch::nn::LinearImpl
        if (type.size() > 4 && type.compare(type.size() - 4, 4, "Impl") == 0) type.resize(type.size() - 4);
        layers += (layers.empty() ? "" : ", ") + std::to_string(st.first_layer() + k) + " (" + type + ")";
      }
    }
  if (fused * 10 <= total) return;
  std::fprintf(stderr,
               "pipetrain rank %d: warning: schedule '%s' splits the backward into B and W, but %.0f%% of this "
               "rank's trainable parameters (%lld of %lld, in layers %s) are in modules without a split (only "
               "pipetrain::nn::Linear has one): their weight gradients are computed in B, and W is empty for "
               "them. Use backward_split \"auto\" (the default: autograd splits any layer), pipetrain::nn::Linear "
               "for torch::nn::Linear, or a schedule without W (1f1b)\n",
               rank, schedule_name.c_str(), 100.0 * static_cast<double>(fused) / static_cast<double>(total),
               static_cast<long long>(fused), static_cast<long long>(total), layers.c_str());
}

}  // namespace

PipelineRank::PipelineRank(torch::nn::Sequential model, Loss loss, std::shared_ptr<Transport> transport,
                           PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  construct(&model, nullptr, std::move(loss), std::move(transport), std::move(options));
}

PipelineRank::PipelineRank(const LayerwiseModel& model, Loss loss, std::shared_ptr<Transport> transport,
                           PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  construct(nullptr, &model, std::move(loss), std::move(transport), std::move(options));
}

void PipelineRank::construct(const torch::nn::Sequential* whole, const LayerwiseModel* layerwise, Loss loss,
                             std::shared_ptr<Transport> transport, PipelineOptions options) {
  Impl& d = *impl_;
  d.loss = std::move(loss);
  d.transport = std::move(transport);
  d.options = std::move(options);
  const int p = d.transport->world_size();
  check_options(d.options, p, /*generate_schedule=*/false);  // make_plain below generates it
  d.async = !schedule_traits(d.options.schedule).synchronous;
  d.per_token = d.loss.normalization() == LossNormalization::Token;
  if (d.per_token && d.async && !schedule_traits(d.options.schedule).one_microbatch_per_step)
    throw UsageError("a per-token loss divides the step's gradients by its total token count at the flush, which '" +
                     d.options.schedule + "' does not have (its stages step at different times): use a synchronous " +
                     "schedule, pipedream or spectrain (one micro-batch per step), or a loss normalised per sample");
  if (d.options.umpipe) {
    if (d.per_token)
      throw UsageError("UMPIPE re-chunks the mini-batch per stage and scales each chunk's mean loss by its size: a "
                       "per-token loss (Loss::per_token) does not combine with it; use a loss normalised per sample");
    const Loss l = d.loss;
    d.umpipe_loss = d.loss.tensor_loss() ? d.loss.tensor_loss() : LossFn([l](const torch::Tensor& out, const torch::Tensor& t) {
      return l(Bundle(out), Bundle(t), 0).value;
    });
  }
  if (layerwise && d.options.umpipe)
    throw UsageError("UMPIPE checks the whole model's layers before it runs: build the model whole (build_all, "
                     "layers.h) to run UMPIPE");
  // What every rank knows of every layer: read from the whole model, or from the layerwise model's info
  // (layers.h) without building the layers of other ranks.
  std::vector<LayerInfo> infos;
  if (whole) {
    for (std::size_t l = 0; l < (*whole)->size(); ++l) infos.push_back(layer_info(*(*whole)->ptr(l)));
  } else {
    infos = layer_infos(*layerwise);
  }
  const int layers = static_cast<int>(infos.size());
  d.layerwise = layerwise != nullptr;
  d.policy = weight_policy_of(d.options);
  check_replication(d.options, p);  // drops an all-ones replication
  // Stages per rank: --virtual for the looped schedules, always 2 for the V shapes (generators.h).
  const int per_rank = stages_per_rank(d.options.schedule, d.options.virtual_stages);
  const int total_stages =
      d.options.replication.empty() ? p * per_rank : static_cast<int>(d.options.replication.size());
  if (total_stages > layers && !d.options.replication.empty())
    throw UsageError(std::to_string(total_stages) + " replicated stages but the model has " +
                     std::to_string(layers) + " layers: replicate fewer stages");
  if (total_stages > layers)
    throw UsageError(std::to_string(p) + " ranks x " + std::to_string(per_rank) +
                     " virtual stages = " + std::to_string(total_stages) + " stages but the model has " +
                     std::to_string(layers) + " layers: use fewer stages (ranks) or virtual stages");
  if (d.options.layers_per_stage.empty()) {
    std::vector<std::string> types;
    std::vector<double> counts;
    for (const LayerInfo& info : infos) {
      types.push_back(info.type);
      counts.push_back(info.parameters);
    }
    d.balance = choose_balance(types, counts, total_stages, d.options.balance);
  } else {
    if (static_cast<int>(d.options.layers_per_stage.size()) != total_stages)
      throw UsageError("layers_per_stage lists " + std::to_string(d.options.layers_per_stage.size()) + " stages but " +
                       std::to_string(total_stages) + " are needed: give one layer count per (virtual) stage");
    check_balance(d.options.layers_per_stage, layers);
    d.balance = d.options.layers_per_stage;
  }
  GeneratorOptions g;
  g.ranks = p;
  g.microbatches = d.options.microbatches;
  g.virtual_stages = d.options.virtual_stages;
  g.costs = d.options.costs;
  g.memory_limit = d.options.memory_limit;
  d.generator = g;
  d.skips = skip_routes(infos, d.balance);
  if (!d.skips.empty() && d.options.umpipe)
    throw UsageError("UMPIPE pipelines one tensor per boundary; this model has skip connections across stages");
  Schedule plain = d.make_plain(1);
  validate(plain);
  d.schedule = insert_communication(plain, d.options.costs);
  validate(d.schedule);
  d.pass = &d.schedule;

  if (d.options.device.is_cuda() && !torch::cuda::is_available())
    throw UsageError("device " + d.options.device.str() +
                     " requested but this LibTorch has no CUDA device: build against a CUDA LibTorch (make build "
                     "TORCH_DIR=...) on a machine with a GPU, or use the cpu device");
  if (!d.options.device.is_cpu() && !d.options.device.is_cuda())
    throw UsageError("device " + d.options.device.str() + " is not supported: use cpu or cuda[:N]");
  d.rank_device.emplace(d.options.device);
  std::vector<std::vector<torch::Tensor>> tied;
  if (whole && !d.options.tied.empty()) {
    const torch::nn::Sequential& model = *whole;
    tied = resolve_ties(layers, [&](int l) { return model->ptr(static_cast<std::size_t>(l)); }, d.options.tied);
    torch::NoGradGuard no_grad;  // the copies start equal
    for (auto& group : tied)
      for (std::size_t k = 1; k < group.size(); ++k) group[k].copy_(group.front());
  }
  std::vector<int> first_layer{0};
  for (int n : d.balance) first_layer.push_back(first_layer.back() + n);
  for (int s = 0; s < total_stages; ++s)
    if (d.schedule.holds(d.transport->rank(), s)) {
      const int first = first_layer[static_cast<std::size_t>(s)], n = d.balance[static_cast<std::size_t>(s)];
      Stage st = [&] {
        if (whole) return Stage(*whole, first, n);
        torch::nn::Sequential part;  // this stage's layers only, each from its own seed
        for (int l = first; l < first + n; ++l) part->push_back(std::to_string(l), build_layer(*layerwise, l));
        return Stage(part, first);
      }();
      st.to(d.options.device);  // before the optimizers see the parameters
      d.stages.emplace(s, st);
      if (d.schedule.replicas_of(s) > 1) {
        d.stage_replicas = make_group_transport(d.transport, d.schedule.stage_replicas[static_cast<std::size_t>(s)]);
        d.norm_leader = d.schedule.rank_of(s) == d.transport->rank();
      }
    }
  if (layerwise && !d.options.tied.empty())  // the members this rank built; the others' sizes come at the first pass
    tied = resolve_ties(layers, [&](int l) -> std::shared_ptr<torch::nn::Module> {
      for (const auto& [s, st] : d.stages)
        if (l >= st.first_layer() && l < st.first_layer() + st.num_layers()) return st.layer(l - st.first_layer());
      return nullptr;
    }, d.options.tied);
  for (std::size_t g = 0; g < tied.size(); ++g) {
    const auto& refs = d.options.tied[g];
    const auto lowest = std::min_element(refs.begin(), refs.end(),
                                         [](const ParameterRef& a, const ParameterRef& b) { return a.layer < b.layer; });
    d.tied_numel.push_back(whole ? tied[g].front().numel() : 0);
    for (std::size_t k = 0; k < refs.size(); ++k) {
      const bool held = std::any_of(d.stages.begin(), d.stages.end(), [&](const auto& item) {
        return refs[k].layer >= item.second.first_layer() && refs[k].layer < item.second.first_layer() + item.second.num_layers();
      });
      if (held)
        d.tied_copies.push_back(Impl::TiedCopy{static_cast<int>(g), refs[k].layer, refs[k].name, tied[g][k],
                                               &refs[k] == &*lowest});
    }
  }
  if (d.options.backward_split == "explicit")  // otherwise every layer's weight gradients wait for W
    warn_unsplit_weights(d.transport->rank(), d.options.schedule, d.schedule, d.stages);
  const OptimizerOptions& o = d.options.optimizer;
  for (auto& [s, st] : d.stages) {
    d.stage_params[s] = st.parameters();
    std::vector<torch::Tensor> params;  // the trainable ones: the optimizer's and the weight versions'
    for (auto& t : d.stage_params[s])
      if (t.requires_grad()) {
        params.push_back(t);
        t.mutable_grad() = torch::Tensor();
      }
    torch::optim::Optimizer* optimizer = nullptr;
    if (!params.empty()) {
      std::unique_ptr<torch::optim::Optimizer> opt;
      if (o.name == "sgd")
        opt = std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
      else if (o.name == "adam")
        opt = std::make_unique<torch::optim::Adam>(
            params, torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
      else
        opt = std::make_unique<torch::optim::AdamW>(
            params, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
      optimizer = opt.get();
      d.optimizers.emplace(s, std::move(opt));
    }
    d.weights.emplace(s, StageWeights(params, optimizer));
  }
  if (d.options.umpipe)
    check_umpipe_pipeline(*whole, *d.options.umpipe, d.options.schedule, d.options.virtual_stages,
                          d.options.data_parallel ? d.options.data_parallel->world_size() : 1, d.schedule, p);
}

PipelineRank::~PipelineRank() = default;
PipelineRank::PipelineRank(PipelineRank&&) noexcept = default;

StepStats PipelineRank::train_step(const torch::Tensor& input, const torch::Tensor& target, int64_t batch_size) {
  return train_steps(Bundle(input), Bundle(target), batch_size, 1);
}

StepStats PipelineRank::train_step(const Bundle& input, const torch::Tensor& target, int64_t batch_size) {
  return train_steps(input, Bundle(target), batch_size, 1);
}

StepStats PipelineRank::train_step(const Bundle& input, const Bundle& target, int64_t batch_size) {
  return train_steps(input, target, batch_size, 1);
}

StepStats PipelineRank::train_steps(const torch::Tensor& input, const torch::Tensor& target, int64_t batch_size,
                                    int steps) {
  return train_steps(Bundle(input), Bundle(target), batch_size, steps);
}

StepStats PipelineRank::train_steps(const Bundle& input, const torch::Tensor& target, int64_t batch_size, int steps) {
  return train_steps(input, Bundle(target), batch_size, steps);
}

StepStats PipelineRank::train_steps(const Bundle& input, const Bundle& target, int64_t batch_size, int steps) {
  Impl& d = *impl_;
  if (steps < 1) throw UsageError("steps per call must be >= 1, got " + std::to_string(steps));
  const detail::RankDevice::Scope on_stream(*d.rank_device);
  d.check_ties_agree();
  if (d.options.umpipe) {  // the plan's partitions instead of the schedule (src/runtime/umpipe_pass.h)
    if (steps != 1)
      throw UsageError("UMPIPE runs one optimizer step per call (its plan cuts one mini-batch), got " +
                       std::to_string(steps) + " steps");
    d.begin_pass(input, target, batch_size, 1, 1);
    const int s = d.stages.begin()->first;
    UmpipePassContext c{*d.transport,      d.stages.at(s),     s,
                        d.schedule.stages, d.umpipe_loss,      *d.options.umpipe,
                        d.options.device,  d.options.threads,  d.options.measure_memory,
                        d.step,            &d.options.before_action, d.umpipe_links,
                        d.stats.timeline};
    if (input.size() > 1)
      throw UsageError("UMPIPE pipelines one tensor per boundary; the input bundle has " + describe(input));
    if (target.size() > 1)
      throw UsageError("UMPIPE scores one target tensor; the target bundle has " + describe(target));
    const UmpipePassResult r = run_umpipe_pass(c, input.empty() ? torch::Tensor() : input.items().front().second,
                                               target.empty() ? torch::Tensor() : target.items().front().second, batch_size);
    d.step_loss[0] += r.loss;
    d.stats.peak_heap_growth = r.peak_heap_growth;
    try {  // the flush of a synchronous step: global loss and norm, clipping, the optimizer step
      d.optimizer_step(s, 0);
      d.finish_call();
    } catch (const RemoteFailure&) {
      throw;
    } catch (const std::exception& e) {
      d.transport->abort("rank " + std::to_string(d.rank()) + " at its optimizer step: " + e.what());
      throw;
    }
    d.step += 1;
    return d.stats;
  }
  if (d.options.threads > 0) at::set_num_threads(d.options.threads);
  if (steps > 1 && d.schedule.replicated())
    throw UsageError("replicated stages (1F1B-RR) run one optimizer step per call, got " + std::to_string(steps) +
                     ": call train_step once per step (a replica's Step is a collective over its stage, which the "
                     "multi-step lowering does not order)");
  const Schedule& plan = d.schedule_for(steps);
  d.pass = &plan;
  d.plan = &d.plan_for(steps);
  d.begin_pass(input, target, batch_size, steps, plan.microbatches_per_step);
  for (auto& [s, w] : d.weights) w.begin_call(*d.plan, s);
  d.run_list(plan.actions[static_cast<std::size_t>(d.rank())]);
  d.slots.clear();
  d.step += steps;
  return d.stats;
}

namespace {

// The last stage's "x" of every micro-batch, in sample order; with variable shapes, micro-batches of
// other lengths are padded with zeros to the longest, per dimension.
torch::Tensor concat_main(const std::vector<Bundle>& bundles) {
  std::vector<torch::Tensor> outs;
  for (const Bundle& b : bundles) outs.push_back(b.at(kMainTensor));
  std::vector<int64_t> size = outs.front().sizes().vec();
  for (const auto& o : outs)
    for (std::size_t k = 1; k < size.size() && static_cast<int64_t>(k) < o.dim(); ++k) size[k] = std::max(size[k], o.size(static_cast<int64_t>(k)));
  for (auto& o : outs) {
    if (o.dim() != static_cast<int64_t>(size.size()) || o.sizes().slice(1) == c10::IntArrayRef(size).slice(1)) continue;
    std::vector<int64_t> pad;  // last dimension first, (before, after) each
    for (std::size_t k = size.size(); k-- > 1;) pad.insert(pad.end(), {0, size[k] - o.size(static_cast<int64_t>(k))});
    o = torch::constant_pad_nd(o, pad, 0);
  }
  return torch::cat(outs, 0);
}

}  // namespace

std::vector<Bundle> PipelineRank::forward_outputs(const Bundle& input, int64_t batch_size, int microbatches) {
  Impl& d = *impl_;
  d.check_ties_agree();
  if (d.options.threads > 0) at::set_num_threads(d.options.threads);
  const int m = microbatches > 0 ? microbatches
                                 : static_cast<int>(std::min<int64_t>(d.options.microbatches, std::max<int64_t>(batch_size, 1)));
  const Schedule& plan = d.forward_schedule(m);
  d.pass = &plan;
  d.begin_pass(input, Bundle(), batch_size, 1, m);
  // Back to training mode however the pass ends.
  struct Restore {
    Impl& d;
    ~Restore() {
      d.forward_mode = false;
      for (auto& [s, st] : d.stages) st.train(true);
      d.slots.clear();
    }
  } restore{d};
  d.forward_mode = true;
  for (auto& [s, st] : d.stages) st.train(false);
  torch::NoGradGuard no_grad;
  std::vector<Bundle> outs;
  {
    const detail::RankDevice::Scope on_stream(*d.rank_device);
    d.run_list(plan.actions[static_cast<std::size_t>(d.rank())]);
  }
  if (d.schedule.rank_of(d.last_stage()) != d.rank()) return outs;
  for (int i = 0; i < m; ++i) {
    outs.push_back(d.full_precision(d.slot(d.last_stage(), i).output));  // bf16 runs: float32 outputs
    for (const auto& item : outs.back().items()) d.rank_device->hand_over(item.second);
  }
  return outs;
}

torch::Tensor PipelineRank::forward_only(const Bundle& input, int64_t batch_size, int microbatches) {
  const std::vector<Bundle> outs = forward_outputs(input, batch_size, microbatches);
  return outs.empty() ? torch::Tensor() : concat_main(outs);
}

EvalStats PipelineRank::evaluate(const Bundle& input, const torch::Tensor& target, int64_t batch_size,
                                 int microbatches) {
  return evaluate(input, Bundle(target), batch_size, microbatches);
}

EvalStats PipelineRank::evaluate(const Bundle& input, const Bundle& target, int64_t batch_size, int microbatches) {
  Impl& d = *impl_;
  const std::vector<Bundle> outs = forward_outputs(input, batch_size, microbatches);
  // loss sum, correct predictions, predictions, whether accuracy applies, token count (per-token loss)
  double sums_v[5] = {0, 0, 0, 0, 0};
  if (!outs.empty()) {
    if (target.empty() || !target.items().front().second.defined())
      throw UsageError("rank " + std::to_string(d.rank()) + " holds the last stage but evaluate got no target batch");
    torch::NoGradGuard no_grad;
    const torch::Tensor out = concat_main(outs);
    const torch::Tensor t = target.has(kMainTensor) ? target.at(kMainTensor).to(out.device()) : torch::Tensor();
    if (d.loss.normalization() == LossNormalization::Sample && d.loss.tensor_loss()) {
      sums_v[0] = d.loss.tensor_loss()(out, t).item<double>() * static_cast<double>(batch_size);  // the whole batch at once
    } else {
      for (std::size_t i = 0; i < outs.size(); ++i) {
        const auto [b, e] = d.ranges[i];
        const LossTerm term = d.loss(outs[i], target.slice(b, e).to(d.options.device), static_cast<int>(i));
        if (d.per_token) {
          sums_v[0] += term.value.item<double>();
          sums_v[4] += term.count;
        } else {
          sums_v[0] += term.value.item<double>() * static_cast<double>(e - b);
        }
      }
    }
    if (t.defined() && !t.is_floating_point() && out.dim() == t.dim() + 1) {
      // Negative targets are padding (ignored, as zoo::cross_entropy ignores -1); outputs of trimmed
      // micro-batches cover the first positions only.
      torch::Tensor tt = t;
      if (tt.dim() >= 2 && out.size(1) < tt.size(1)) tt = tt.slice(1, 0, out.size(1));
      const torch::Tensor real = tt >= 0;
      sums_v[1] = out.argmax(-1).eq(tt).logical_and(real).sum().item<double>();
      sums_v[2] = real.sum().item<double>();
      sums_v[3] = 1;
    }
  }
  torch::Tensor sums = host_tensor(std::vector<double>(sums_v, sums_v + 5));
  d.transport->all_reduce_sum(sums);
  const double* v = host_doubles(sums);
  EvalStats e;
  e.samples = batch_size;
  e.loss = d.per_token ? v[0] / (v[4] > 0 ? v[4] : 1.0) : v[0] / static_cast<double>(batch_size);
  e.accuracy = v[3] > 0 ? v[1] / v[2] : std::numeric_limits<double>::quiet_NaN();
  return e;
}

void PipelineRank::set_learning_rate(double lr) {
  if (!(lr > 0)) throw UsageError("learning rate must be > 0, got " + std::to_string(lr));
  for (auto& [s, opt] : impl_->optimizers)
    for (auto& group : opt->param_groups()) group.options().set_lr(lr);
  impl_->options.optimizer.lr = lr;
}

int PipelineRank::step() const { return impl_->step; }
void PipelineRank::set_step(int step) {
  if (step < 0) throw UsageError("step must be >= 0, got " + std::to_string(step));
  impl_->step = step;
}

std::vector<int> PipelineRank::local_layers() const {
  std::vector<int> out;
  for (const auto& [s, st] : impl_->stages)
    for (int k = 0; k < st.num_layers(); ++k) out.push_back(st.first_layer() + k);
  return out;
}

std::vector<int> PipelineRank::owned_layers() const {
  std::vector<int> out;
  for (const auto& [s, st] : impl_->stages)
    if (impl_->schedule.rank_of(s) == impl_->rank())
      for (int k = 0; k < st.num_layers(); ++k) out.push_back(st.first_layer() + k);
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> PipelineRank::layer_state(int layer) const {
  Impl& d = *impl_;
  const int s = d.stage_of_layer(layer);
  const Stage& st = d.stages.at(s);
  auto module = st.layer(layer - st.first_layer());
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : module->named_parameters(true)) {
    if (std::any_of(d.tied_copies.begin(), d.tied_copies.end(), [&](const Impl::TiedCopy& c) {
          return !c.primary && c.layer == layer && c.name == item.key();
        }))
      continue;  // stored with its group's lowest layer
    out.emplace_back("param/" + item.key(), item.value().detach().cpu().clone());
    auto* state = d.optim_state(s, item.value());
    if (!state) continue;
    const std::string o = "optim/" + item.key() + "/";
    if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(state)) {
      out.emplace_back(o + "step", torch::tensor(a->step(), torch::kLong));
      out.emplace_back(o + "exp_avg", a->exp_avg().cpu().clone());
      out.emplace_back(o + "exp_avg_sq", a->exp_avg_sq().cpu().clone());
    } else if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(state)) {
      out.emplace_back(o + "step", torch::tensor(w->step(), torch::kLong));
      out.emplace_back(o + "exp_avg", w->exp_avg().cpu().clone());
      out.emplace_back(o + "exp_avg_sq", w->exp_avg_sq().cpu().clone());
    } else if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(state)) {
      if (g->momentum_buffer().defined()) out.emplace_back(o + "momentum_buffer", g->momentum_buffer().cpu().clone());
    }
  }
  for (const auto& item : module->named_buffers(true))
    out.emplace_back("buffer/" + item.key(), item.value().detach().cpu().clone());
  return out;
}

std::vector<std::pair<std::string, ParameterRef>> PipelineRank::tied_sources(int layer) const {
  const Impl& d = *impl_;
  std::vector<std::pair<std::string, ParameterRef>> out;
  for (const auto& c : d.tied_copies) {
    if (c.primary || c.layer != layer) continue;
    const auto& refs = d.options.tied[static_cast<std::size_t>(c.group)];
    const auto lowest = std::min_element(refs.begin(), refs.end(),
                                         [](const ParameterRef& a, const ParameterRef& b) { return a.layer < b.layer; });
    out.emplace_back(c.name, *lowest);
  }
  return out;
}

void PipelineRank::load_layer_state(int layer, const std::vector<std::pair<std::string, torch::Tensor>>& state) {
  Impl& d = *impl_;
  const int s = d.stage_of_layer(layer);
  const Stage& st = d.stages.at(s);
  auto module = st.layer(layer - st.first_layer());
  std::map<std::string, torch::Tensor> given(state.begin(), state.end());
  auto take = [&](const std::string& name, bool required) {
    auto it = given.find(name);
    if (it == given.end()) {
      if (required) throw UsageError("layer " + std::to_string(layer) + " has no tensor '" + name + "' in the checkpoint");
      return torch::Tensor();
    }
    torch::Tensor t = it->second;
    given.erase(it);
    return t;
  };
  // A tensor of another type (a float64 file into a float32 model) failed deep inside LibTorch.
  auto same_type = [&](const std::string& name, const torch::Tensor& src, const torch::Tensor& like) {
    if (src.scalar_type() != like.scalar_type())
      throw UsageError("layer " + std::to_string(layer) + " tensor '" + name + "' is " + c10::toString(src.scalar_type()) +
                       " in the checkpoint but " + c10::toString(like.scalar_type()) + " in the model: convert it, or "
                       "build the model with that type");
    return src;
  };
  auto copy_into = [&](const std::string& name, torch::Tensor dst) {
    torch::Tensor src = same_type(name, take(name, true), dst);
    if (src.sizes() != dst.sizes())
      throw UsageError("layer " + std::to_string(layer) + " tensor '" + name + "' has shape " +
                       c10::str(src.sizes()) + " in the checkpoint but " + c10::str(dst.sizes()) + " in the model");
    torch::NoGradGuard no_grad;
    dst.copy_(src);
  };
  const std::string optimizer = d.options.optimizer.name;
  for (const auto& item : module->named_parameters(true)) {
    copy_into("param/" + item.key(), item.value());
    if (!d.optimizers.count(s)) continue;
    const std::string o = "optim/" + item.key() + "/";
    auto& map = d.optimizers.at(s)->state();
    const auto key = compat::optimizer_state_key(item.value());
    const auto dev = item.value().device();
    if (optimizer == "adam" || optimizer == "adamw") {
      torch::Tensor step = take(o + "step", false);
      if (!step.defined()) continue;  // not stepped yet when saved
      torch::Tensor m1 = same_type(o + "exp_avg", take(o + "exp_avg", true), item.value()).to(dev),
                    m2 = same_type(o + "exp_avg_sq", take(o + "exp_avg_sq", true), item.value()).to(dev);
      if (optimizer == "adam") {
        auto a = std::make_unique<torch::optim::AdamParamState>();
        a->step(step.item<int64_t>());
        a->exp_avg(m1);
        a->exp_avg_sq(m2);
        map[key] = std::move(a);
      } else {
        auto a = std::make_unique<torch::optim::AdamWParamState>();
        a->step(step.item<int64_t>());
        a->exp_avg(m1);
        a->exp_avg_sq(m2);
        map[key] = std::move(a);
      }
    } else {
      torch::Tensor buf = take(o + "momentum_buffer", false);
      if (!buf.defined()) continue;
      auto g = std::make_unique<torch::optim::SGDParamState>();
      g->momentum_buffer(same_type(o + "momentum_buffer", buf, item.value()).to(dev));
      map[key] = std::move(g);
    }
  }
  for (const auto& item : module->named_buffers(true)) copy_into("buffer/" + item.key(), item.value());
  if (!given.empty())
    throw UsageError("layer " + std::to_string(layer) + " checkpoint holds '" + given.begin()->first +
                     "', which this model and optimizer (" + optimizer + ") do not have: was it saved with another "
                     "model or optimizer?");
}

const Schedule& PipelineRank::schedule() const { return impl_->schedule; }
const Schedule& PipelineRank::schedule_for(int steps) {
  if (steps < 1) throw UsageError("steps per call must be >= 1, got " + std::to_string(steps));
  return impl_->schedule_for(steps);
}
WeightPolicy PipelineRank::weight_policy() const { return impl_->policy; }
const std::vector<int>& PipelineRank::balance() const { return impl_->balance; }
int PipelineRank::rank() const { return impl_->rank(); }
torch::Device PipelineRank::device() const { return impl_->options.device; }
std::vector<int> PipelineRank::local_stages() const {
  std::vector<int> out;
  for (const auto& [s, st] : impl_->stages) out.push_back(s);
  return out;
}
std::vector<torch::Tensor> PipelineRank::parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& [s, ps] : impl_->stage_params) out.insert(out.end(), ps.begin(), ps.end());
  return out;
}

LocalPipeline::LocalPipeline(torch::nn::Sequential model, Loss loss, int stages, PipelineOptions options) {
  if (stages < 1) throw UsageError("stages must be >= 1, got " + std::to_string(stages));
  transports_ = make_local_transports(stages);
  for (int r = 0; r < stages; ++r)
    ranks_.push_back(std::make_unique<PipelineRank>(model, loss, transports_[static_cast<std::size_t>(r)], options));
}

LocalPipeline::LocalPipeline(const LayerwiseModel& model, Loss loss, int stages, PipelineOptions options) {
  if (stages < 1) throw UsageError("stages must be >= 1, got " + std::to_string(stages));
  transports_ = make_local_transports(stages);
  for (int r = 0; r < stages; ++r)
    ranks_.push_back(std::make_unique<PipelineRank>(model, loss, transports_[static_cast<std::size_t>(r)], options));
}

LocalPipeline::~LocalPipeline() = default;

StepStats LocalPipeline::train_step(const torch::Tensor& input, const torch::Tensor& target) {
  return train_steps(input, target, 1);
}

StepStats LocalPipeline::train_steps(const torch::Tensor& input, const torch::Tensor& target, int steps) {
  return train_steps(Bundle(input), target, input.size(0), steps);
}

namespace {

// f(rank) on every rank, each on its own thread (run_on_threads); the results in rank order.
template <class Result, class F>
std::vector<Result> on_every_rank(const std::vector<std::unique_ptr<PipelineRank>>& ranks, F f) {
  std::vector<Result> out(ranks.size());
  run_on_threads(static_cast<int>(ranks.size()), [&](int r) {
    at::init_num_threads();
    out[static_cast<std::size_t>(r)] = f(*ranks[static_cast<std::size_t>(r)]);
  });
  return out;
}

}  // namespace

StepStats LocalPipeline::train_steps(const Bundle& input, const torch::Tensor& target, int64_t batch_size, int steps) {
  return train_steps(input, Bundle(target), batch_size, steps);
}

StepStats LocalPipeline::train_step(const Bundle& input, const Bundle& target, int64_t batch_size) {
  return train_steps(input, target, batch_size, 1);
}

StepStats LocalPipeline::train_steps(const Bundle& input, const Bundle& target, int64_t batch_size, int steps) {
  const auto stats = on_every_rank<StepStats>(
      ranks_, [&](PipelineRank& rank) { return rank.train_steps(input, target, batch_size, steps); });
  StepStats out = stats[0];
  for (std::size_t r = 1; r < stats.size(); ++r) {
    const StepStats& s = stats[r];
    out.timeline.events.insert(out.timeline.events.end(), s.timeline.events.begin(), s.timeline.events.end());
    out.weight_uses.insert(out.weight_uses.end(), s.weight_uses.begin(), s.weight_uses.end());
    out.weight_memory.insert(out.weight_memory.end(), s.weight_memory.begin(), s.weight_memory.end());
  }
  return out;
}

StepStats LocalPipeline::train_step(const Bundle& input, const torch::Tensor& target, int64_t batch_size) {
  return train_steps(input, target, batch_size, 1);
}

torch::Tensor LocalPipeline::forward_only(const Bundle& input, int64_t batch_size, int microbatches) {
  for (const auto& t : on_every_rank<torch::Tensor>(
           ranks_, [&](PipelineRank& rank) { return rank.forward_only(input, batch_size, microbatches); }))
    if (t.defined()) return t;  // the rank of the last stage's
  return torch::Tensor();
}

EvalStats LocalPipeline::evaluate(const Bundle& input, const torch::Tensor& target, int64_t batch_size,
                                  int microbatches) {
  return evaluate(input, Bundle(target), batch_size, microbatches);
}

EvalStats LocalPipeline::evaluate(const Bundle& input, const Bundle& target, int64_t batch_size, int microbatches) {
  return on_every_rank<EvalStats>(
             ranks_, [&](PipelineRank& rank) { return rank.evaluate(input, target, batch_size, microbatches); })
      .front();  // known on every rank
}

const Schedule& LocalPipeline::schedule() const { return ranks_.front()->schedule(); }
const std::vector<int>& LocalPipeline::balance() const { return ranks_.front()->balance(); }

}  // namespace pipetrain

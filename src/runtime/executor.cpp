#include "pipetrain/runtime/executor.h"

#include <torch/cuda.h>
#include <torch/optim.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <mutex>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/looped.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/validate.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/runtime/split_linear.h"
#include "device_context.h"
#include "executor_impl.h"
#include "pass_util.h"
#include "torch_compat.h"
#include "transport_util.h"
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

using detail::host_doubles;
using detail::host_tensor;
using detail::shape_text;
using detail::SkipRoute;

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
  refuse_looped_without_loops(o.schedule, o.virtual_stages, "virtual_stages", " (--virtual on the command line)");
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
  if (!d.options.tied.empty()) {  // members given by path (ParameterRef::path) become layer indexes
    std::vector<std::string> names;
    if (whole) {
      for (const auto& child : (*whole)->named_children()) names.push_back(child.key());
    } else {
      names = layer_names(*layerwise);
    }
    d.options.tied = resolve_parameter_paths(d.options.tied, names);
  }
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
    d.check_options_agree();  // after this call's own checks: a collective
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
  d.check_options_agree();  // after this call's own checks: a collective
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
  d.check_options_agree();
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
      try {
        sums_v[0] = d.loss.tensor_loss()(out, t).item<double>() * static_cast<double>(batch_size);  // the whole batch at once
      } catch (const UsageError&) {
        throw;
      } catch (const std::exception& e) {
        throw std::runtime_error("rank " + std::to_string(d.rank()) + " evaluating: " +
                                 loss_failure(e, Bundle(out), Bundle(t), -1));
      }
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
  e.loss_units = d.per_token ? v[4] : static_cast<double>(batch_size);
  e.predictions = v[3] > 0 ? v[2] : 0.0;
  return e;
}

void PipelineRank::set_learning_rate(double lr) {
  if (!(lr > 0) || !std::isfinite(lr))
    throw UsageError("learning rate must be a finite number > 0, got " + std::to_string(lr));
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

// A call that failed inside its ranks (a layer's error, a refused save) may have stopped them part-way
// through a step, some having stepped their optimizer and others not: the pipeline's weights, gradients and
// optimizer state are out of step with each other, and a later call used to fail again with the old error,
// as if that call had caused it. Every later call is refused saying so.
void refuse_after_failure(const std::vector<std::shared_ptr<Transport>>& transports) {
  if (transports.empty()) return;
  const auto failure = detail::local_transport_failure(*transports.front());
  if (!failure) return;
  // A RemoteFailure, as the failure itself was: a caller that catches it to rebuild the pipeline still does.
  throw RemoteFailure(failure->first, "this LocalPipeline stopped at that failure earlier (" + failure->second +
                                          "); its ranks may have stopped part-way through a step, so their weights, "
                                          "gradients and optimizer state need not agree: build a new LocalPipeline "
                                          "(for instance from a checkpoint saved before the failure)");
}

}  // namespace

StepStats LocalPipeline::train_steps(const Bundle& input, const torch::Tensor& target, int64_t batch_size, int steps) {
  return train_steps(input, Bundle(target), batch_size, steps);
}

StepStats LocalPipeline::train_step(const Bundle& input, const Bundle& target, int64_t batch_size) {
  return train_steps(input, target, batch_size, 1);
}

StepStats LocalPipeline::train_steps(const Bundle& input, const Bundle& target, int64_t batch_size, int steps) {
  refuse_after_failure(transports_);
  // Here, before the ranks start, a refusal does not end the pipeline (inside them it stops every rank).
  check_steps_per_call(steps, batch_size);
  check_batch_rows(input, target, batch_size, true);
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
  refuse_after_failure(transports_);
  check_batch_rows(input, Bundle(), batch_size, true);
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
  refuse_after_failure(transports_);
  check_batch_rows(input, target, batch_size, true);
  return on_every_rank<EvalStats>(
             ranks_, [&](PipelineRank& rank) { return rank.evaluate(input, target, batch_size, microbatches); })
      .front();  // known on every rank
}

const Schedule& LocalPipeline::schedule() const { return ranks_.front()->schedule(); }
const std::vector<int>& LocalPipeline::balance() const { return ranks_.front()->balance(); }

}  // namespace pipetrain

// Internal to pipetrain_runtime: the state and the interpreter of one pipeline rank (PipelineRank's
// Impl). Its member functions live in one file per part: executor_actions.cpp (F, B, BW, W),
// executor_comm.cpp (boundary transfers, skip connections), executor_optimizer.cpp (the flush and the
// optimizer step), executor_passes.cpp (the interpreter, the call's schedules); executor.cpp builds it.
// What the rank's device changes (streams, timing, where buffers live) goes through detail::RankDevice
// (device_context.h).
#pragma once

#include <torch/optim/optimizer.h>

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "pipetrain/core/generators.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/split_linear.h"
#include "bundle_wire.h"
#include "device_context.h"
#include "umpipe_pass.h"

namespace pipetrain {

// Every defined entry of `in` and `tgt` has `n` rows (and with `every_entry_defined`, every entry is defined):
// UsageError naming the entry otherwise. LocalPipeline checks a batch so before its ranks start, where a
// refusal leaves the pipeline usable; each rank checks again at the start of a pass.
void check_batch_rows(const Bundle& in, const Bundle& tgt, int64_t n, bool every_entry_defined);
// A call of `steps` optimizer steps over `n` samples: at least one step, and one sample per step.
void check_steps_per_call(int steps, int64_t n);

namespace detail {

// A skip connection whose stash and pop are more than one stage apart: sent straight from stage `from`
// to stage `to` (bundle.h). Names stashed on one stage for the same later stage travel together.
struct SkipRoute {
  int from = 0, to = 0;
  std::vector<std::string> names;
};

// The values of a reduced tensor of doubles, read in place (no operator call per value, as t[k].item()
// would make). A transport may have replaced the tensor (Transport is the user's to implement): then a
// CPU copy is read.
inline const double* host_doubles(torch::Tensor& t) {
  if (!t.device().is_cpu() || t.scalar_type() != torch::kDouble || !t.is_contiguous())
    t = t.to(torch::kCPU, torch::kDouble).contiguous();
  return t.data_ptr<double>();
}

// A loss or norm for a message: NaN without its sign bit ("-nan" read as a negative number).
inline std::string number_text(double v) { return std::isnan(v) ? "NaN" : fmt::format("{:g}", v); }

// A host tensor of doubles holding `values`: one operator call (clone), where torch::tensor({a, b}) fills
// it element by element.
inline torch::Tensor host_tensor(const std::vector<double>& values) {
  return torch::from_blob(const_cast<double*>(values.data()), {static_cast<int64_t>(values.size())}, torch::kDouble)
      .clone();
}

}  // namespace detail

struct PipelineRank::Impl {
  using BundleLayout = detail::BundleLayout;
  using SkipRoute = detail::SkipRoute;

  Loss loss;
  bool per_token = false;  // loss.normalization() == Token
  LossFn umpipe_loss;      // UMPIPE's tensor loss (Sample normalisation only)
  bool layerwise = false;  // built from a LayerwiseModel: this rank built its own layers only
  std::shared_ptr<Transport> transport;
  PipelineOptions options;
  // The rank's device (device_context.h): how actions are timed and where tensors and buffers live; on
  // CUDA also its stream. Set at construction, for every device (the CPU's keeps the host clock and
  // host memory).
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
  // `t` (each tensor of `b`) on the stages' device; itself (no operator call) when it is there already.
  torch::Tensor on_device(const torch::Tensor& t) const { return rank_device->place(t); }
  Bundle on_device(const Bundle& b) const { return rank_device->place(b); }
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

  // ---- actions (executor_actions.cpp): F, B, BW, W ----------------------------------------------
  bool checkpointed(int micro) const;

  // Sets stage s's parameters to the weights the plan gives pass (s, i) and puts them back when it goes
  // out of scope; records the use. Does nothing for synchronous schedules and forward-only passes.
  struct PassWeightsScope {
    StageWeights* w = nullptr;
    ~PassWeightsScope() {
      if (w) w->leave();
    }
  };
  const PassWeights* enter_weights(int s, int i, bool is_forward, PassWeightsScope& scope);
  void finish_weights(int s, int i, bool is_forward, const PassWeights* pw, PassWeightsScope& scope);

  // A seeded forward draws its dropout masks from the default generator seeded with the pass's own
  // seed, and then puts the generator back as the caller left it: the caller's stream of random numbers
  // (batches drawn with torch::randn after torch::manual_seed, say) is the same with or without the
  // pipeline (PipelineRank's contract, executor.h).
  Bundle run_forward(int s, int i, const Bundle& x);
  void forward(int s, int i);
  bool has_target() const { return !target.empty() && target.items().front().second.defined(); }

  // The last stage's outputs for the loss: with bf16, its floating-point tensors in float32, so the loss is
  // computed in float32 (as autocast does for its losses).
  Bundle full_precision(const Bundle& out) const;
  // The micro-batch's loss as its backward root. Sample: the mean times b_k / N. Per token: the sum,
  // counted in the step's count (the division by the step's total count waits for the flush, when the
  // total is known, see reduce_and_clip); with one micro-batch per step (pipedream, spectrain) the count
  // is the total already, so the sum is divided at once.
  torch::Tensor scaled_loss(const Bundle& out, int i);
  void backward(int s, int i, bool split);
  void weight(int s, int i) { slot(s, i).deferred.run(); }

  // backward_split "auto": whether stage s's trainable parameters are all in pipetrain::nn::Linear, whose
  // explicit split then does B/W alone (autograd_split.h), cached per stage.
  std::map<int, bool> linear_only_stages;
  bool linear_only(int s);

  // ---- skip connections (executor_comm.cpp) -----------------------------------------------------
  // The schedule carries the routes as skip edges (Schedule::skips, same order), so lowering puts each
  // transfer between ranks in the list: <from>SF<i>@<to> after F(from, i), <to>RF<i>@<from> before
  // F(to, i), <to>SB<i>@<from> after the consumer's backward, <from>RB<i>@<to> before the producer's. They
  // run like boundary transfers: sends never wait; a receive blocks at its place, except on the fast path
  // once its layout is agreed, where it is posted there and waited for (and timed) by the action that
  // needs it. A route whose ends are on one rank has no transfers: its data is handed over in memory.

  // The index of the route a skip transfer moves.
  std::size_t route_of(const Action& a) const;

  // Whether `name` leaves stage `s` by a skip route rather than with the bundle to the next stage.
  bool routed(int s, const std::string& name) const;

  // Stage s's output minus its skip routes: what goes to the next stage (with its gradient flags).
  Bundle outgoing(int s, const Slot& sl, std::vector<char>& flags) const;

  // Route r's entries of stage `from`'s output for micro-batch i, with their gradient flags.
  Bundle skip_part(std::size_t r, int i, std::vector<char>& flags);

  // After F of stage s: the routes out of s whose popping stage is on this rank get their entries now
  // (the others at their SF@ action).
  void hand_over_skips(int s, int i);

  // <from>SF<i>@<to>: route r's entries straight to the popping stage's rank.
  void send_skip(const Action& a);

  // Whether any entry of route r carries a gradient back for micro-batch i (known on both ends: the
  // producer's flags travel in the route's layout).
  bool skip_has_grad(std::size_t r, int i);

  // <to>SB<i>@<from>: the gradients of route r that the consumer's backward left for it. Returns false
  // when no entry carries one (nothing is sent, nothing timed).
  bool send_skip_grad(const Action& a);

  // Stores a received skip bundle where F (activations) or the backward (gradients) takes it.
  void deliver_skip(const Action& a, const torch::Tensor& buffer, const BundleLayout& l);

  // <to>RF<i>@<from> and <from>RB<i>@<to>. Returns false when nothing was received here: a gradient
  // receive of a route without gradients, or (fast path) a receive posted for its consumer to wait for.
  bool receive_skip(const Action& a, int pos);

  // Before F of stage s: the skips popped on s join its input bundle with their gradient flags, in route
  // order (the bundle's layout must not depend on the order they arrived in).
  void take_skips(int s, int i, Bundle& x, std::vector<char>& flags);

  // After the backward of stage s: the gradients of the skips popped on s leave `grads` (which keeps what
  // goes to the previous stage): handed back when the stashing stage is on this rank, else kept for SB@.
  void route_skip_grads(int s, int i, Bundle& grads);

  // Before the backward of stage s: the gradients of its skips out (received or handed back), added to `g`.
  void take_skip_grads(int s, int i, Bundle& g);

  // ---- communication (executor_comm.cpp) --------------------------------------------------------
  // dir 0: activations of stage `boundary` going to boundary+1; dir 1: input gradients of stage
  // `boundary` going to boundary-1. `grad` flags the entries that get a gradient back (dir 0).
  void send(int boundary, int dir, int i, const Bundle& b, const std::vector<char>& grad, int dst);

  // `key` names the boundary for the agreed layouts (a stage, or -1 - r for skip route r); `async`
  // sends without waiting even on the reference path.
  void send_bundle(int key_boundary, int dir, int i, const Bundle& b, const std::vector<char>& grad, int dst,
                   int data_tag, int header_tag, bool async);

  // Where a receive lands: on the rank's GPU when the transport carries device tensors and the bundle is
  // one tensor; else in host memory (RankDevice::receive_buffer).
  torch::Tensor receive_buffer(const BundleLayout& l) const {
    return rank_device->receive_buffer(l, transport->carries_device_tensors());
  }

  // The layout of a receive, receiving its header first if it is not agreed yet (always, with
  // variable shapes); null when that would block and `may_block` is false.
  const BundleLayout* recv_layout(int boundary, int dir, int i, int src, bool may_block);
  const BundleLayout* recv_layout(int key_boundary, int dir, int i, int src, bool may_block, int header_tag);

  // A blocking receive of one bundle (its header first when the layout is not agreed yet).
  std::pair<torch::Tensor, BundleLayout> recv_bundle(int key_boundary, int dir, int i, int src, int data_tag,
                                                     int header_tag);

  // Stores a received bundle where the consuming action looks for it.
  void deliver(const Action& a, const torch::Tensor& buffer, const BundleLayout& l);

  // Runs a receive action. On the fast path a receive is not waited for here: it was posted ahead, or
  // is posted now, and the action that consumes the data waits (await_inputs), so a receive placed early
  // by the lowering never holds up unrelated work. Only a receive whose layout is not agreed yet blocks
  // here (its header comes first). Returns false when the wait was deferred.
  bool receive(const Action& a, int pos);

  // Before a compute action: waits for its deferred receives, if any (its boundary's and its skips'),
  // and records each wait as the receive action in the timeline.
  void await_inputs(const Action& a, Timeline& timeline);

  // Fast path: posts the receive `a` at list position `pos` unless its layout is not agreed yet (always,
  // with variable shapes: its header must be received in order, at its action). Returns whether it did.
  bool post_receive(const Action& a, int pos);

  // Fast path: keeps up to `prefetch` receives posted and not yet consumed, walking the rank's list in
  // order from `prefetch_cursor` (so each step costs O(actions), not O(actions x window)). A receive
  // whose layout is not agreed yet stops the walk. A full window only delays posting: a receive whose
  // place is reached before the walk posted it is posted there (receive), never waited for there. Skip
  // receives are not prefetched: each is posted at its own place (receive_skip).
  void prefetch_from(const std::vector<Action>& actions, std::size_t pos);

  // Fast path: waits for the oldest sends once more than `prefetch` are in flight, so sent tensors are
  // released during the step rather than at its end. Safe: the sends were posted in the lowered order,
  // so the receiver reaches each of them without needing anything this rank does later.
  void reap_sends();

  // Waits for every send still in flight (the flush, the end of a call).
  void finish_sends();

  // ---- optimizer (executor_optimizer.cpp) -------------------------------------------------------
  // Multiplies the gradients by `scale` (a per-token loss's 1 / count), then clips them to the global
  // norm `norm` (of the scaled gradients) if it exceeds `clip`: one pass over the gradients.
  static void clip_to(const std::vector<torch::Tensor>& params, double norm, double clip, double scale = 1.0);

  // Synchronous schedules, at the rank's first Step of step k: the step's loss and global gradient norm
  // (a collective), then clipping by the global norm.
  void reduce_and_clip(int k);

  // A synchronous step k with a non-finite loss or global norm, the same on every rank (its values are
  // all-reduced): "stop" throws, "skip" marks it so that no stage steps. `rank_bits` has bit r set when
  // rank r's own gradients were not finite (ranks past 51 share bit 51).
  void nonfinite_step(int k, double rank_bits);

  // Tied weights: before the first pass (a collective, so not in the constructor, which programs may
  // call for every rank on one thread), every copy of each group must hold the same values on every
  // rank holding one; ranks built with other seeds would train the copies apart. Throws UsageError
  // naming the group and the ranks on each rank alike.
  bool ties_checked = false;
  bool options_checked = false;  // check_options_agree ran (the first call)
  void check_ties_agree();
  void check_options_agree();  // the ranks' schedule, m, v, stages and balance agree (once; a collective)

  // Tied weights of a model built layer by layer (layers.h), at the first pass (a collective): each
  // group's size is agreed (ranks without a member learn it, a member of another size is refused), then
  // the value of the group's first member (as the Sequential constructor copies it within a whole model)
  // goes from the rank holding it to every other member.
  void share_ties();

  // Tied weights: every copy's gradient becomes the sum over all copies of its group (one all-reduce
  // over the pipeline's ranks; ranks without a copy add zeros), so all copies step the same.
  void sum_tied_gradients();

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
                            double* count = nullptr);
  void optimizer_step(int s, int k);

  // The optimizer state of parameter `p` of stage `s` (null when it has none yet).
  torch::optim::OptimizerParamState* optim_state(int s, const torch::Tensor& p);

  // ---- passes (executor_passes.cpp) -------------------------------------------------------------
  // Returns false when the action's work was deferred (a posted receive) and so should not be timed.
  bool run_action(const Action& a, int pos);

  // `steps` mini-batches of `m` micro-batches each over the batch of n samples.
  void begin_pass(const Bundle& in, const Bundle& tgt, int64_t n, int steps, int m);

  // The interpreter: runs one rank's action list, timing each action. On failure aborts the transport
  // with a message naming the rank and the action, so every rank stops.
  void run_list(const std::vector<Action>& actions);

  // After a training pass: the per-step losses and global norms on every rank, and the call's totals.
  void finish_call();

  // The unlowered schedule of a call of `steps` steps: the generator's, or round robin over replicas;
  // with the model's skip routes as its skip edges.
  Schedule make_plain(int steps) const;

  // The lowered schedule and weight plan for a call of `steps` steps (made once per count).
  const Schedule& schedule_for(int steps);
  const WeightPlan& plan_for(int steps);

  // Forward-only schedule for m micro-batches: each rank runs the forwards of its stages, stage by stage
  // in micro-batch order (GPipe's forward phase), lowered like a training schedule.
  const Schedule& forward_schedule(int m);
  int stage_of_layer(int layer) const;
};

}  // namespace pipetrain

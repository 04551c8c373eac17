// Weight versions for asynchronous schedules (docs/ALGORITHMS.md §5 PipeDream and 2BW, §6 SpecTrain and
// PipeOptim): which weights each pass of each micro-batch uses, and how a stage keeps them.
//
// A *version* of a stage is its weights after some number of its own optimizer steps. Versions are
// counted within one executor call (train_steps): version 0 is the weights the call started with, and
// version k those after the stage's k-th Step action of the call. Every call starts and ends with an
// empty pipeline, so a call never needs a version from an earlier call.
//
// The plan (which version, or which prediction, each pass uses) is a pure function of the schedule's
// action lists, so every rank derives the same plan without messages; vertical sync's tag (the version
// stage 0 used) is read off stage 0's list instead of being sent along with the activations.
//
// How versions are kept (StageWeights): the stage's module parameters always hold the newest weights
// except during a pass that needs another version, when their data is swapped (Tensor::set_data, which
// keeps the parameter's identity, gradient and optimizer state) for the stashed tensors and swapped
// back after. A version is stashed copy-on-write: an optimizer step first moves the parameters to a copy
// and steps that copy, but only if a pass still to run needs the version being replaced; the old
// storage, which the in-flight autograd graphs already reference, becomes the stash entry without a
// further copy, and is dropped as soon as no pass needs it. So PipeDream's stage s holds at most p - s
// weight sets (P-WS-2), 2BW at most two (P-2BW-1), and a stage whose in-flight passes all use the newest
// weights (the last stage of PipeDream) holds one.
//
// Autograd: an optimizer step between a micro-batch's forward and backward would fail LibTorch's saved
// tensor version check ("modified by an inplace operation"). A Step therefore gives each parameter a
// fresh version counter before stepping and restores the counter's value after: the graphs still see
// the version they saved. That is sound because the weights a graph sees at its backward are exactly
// those the policy chooses: a graph's saved references to a parameter read its data at backward time,
// which StageWeights sets to the pass's version, and views of the parameter taken in the forward keep
// the storage of the forward's version, which is never written again (copy-on-write), except under
// Current with a step in flight (pipedream --no-stash), where the update in place is the point: the
// backward then sees the current weights, with the forward's activations. Derived copies of a weight
// saved by an operator (a dtype cast, say) would keep the forward's values; the zoo's layers save none.
//
// Thread use: a StageWeights belongs to one rank's thread.
#pragma once

#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "pipetrain/core/cost.h"
#include "pipetrain/core/schedule.h"

namespace pipetrain {

enum class WeightPolicy {
  Current,       // synchronous schedules and pipedream --no-stash: a pass uses the weights as they are then
  Stash,         // pipedream (§5.1.2): F uses the newest version, BW the version its F used
  VerticalSync,  // pipedream --vertical-sync (§5.1.3): every stage uses the version stage 0's F used
  TwoBuffered,   // 2bw (§5.2): all micro-batches of the call's step k use version max(0, k - 1)
  SpecTrain,     // spectrain with momentum SGD (§6.1): F and BW use W - s lr v, s counted on the schedule
  PipeOptim,     // spectrain with Adam/AdamW (§6.2): F uses W - s lr dW, s = own steps between F and BW
};
std::string to_string(WeightPolicy p);

// The weights of one pass (F or BW of one micro-batch on one stage).
struct PassWeights {
  int version = -1;  // Stash, VerticalSync, TwoBuffered: the version (within the call); -1: current weights
  int predict = -1;  // SpecTrain, PipeOptim: steps s to extrapolate (0: the current weights); -1: none
};

struct WeightPlan {
  WeightPolicy policy = WeightPolicy::Current;
  std::map<std::pair<int, int>, PassWeights> forward, backward;  // by (stage, micro-batch)
  bool versioned() const;  // Stash, VerticalSync, TwoBuffered
  bool predicted() const;  // SpecTrain, PipeOptim
  const PassWeights& of(int stage, int micro, bool is_forward) const;
};

// Steps of the stage that the simulated run of `schedule` (core/simulate.h, with `costs`; empty: unit
// costs) completes in (start of the pass, start of the mini-batch's backward on stage 0]: SpecTrain's
// version difference s of §6.1, for every F (`forward`) and BW (`backward`) by (stage, micro-batch).
// Counted on the schedule, not taken from a formula; for a straight pipeline with equal F and B times
// it equals the closed forms s_F(r) = p-1-floor(r/2), s_B(r) = ceil(r/2) once the pipeline is full
// (tested), and is smaller during the fill and drain of a call.
struct StepCounts {
  std::map<std::pair<int, int>, int> forward, backward;
};
StepCounts count_spectrain_steps(const Schedule& schedule, const CostModel& costs);

// The plan of a policy for `schedule` (plain or lowered; one call). Throws std::logic_error if the
// schedule does not suit the policy (e.g. a stage step between a TwoBuffered micro-batch's passes that
// would need a version not yet made).
WeightPlan plan_weights(const Schedule& schedule, WeightPolicy policy, const CostModel& costs);

// The direction v of the stage's recent updates that prediction extrapolates, for parameter `p` from its
// optimizer's state: the momentum buffer for SGD (its update is lr * buf), m_hat / (sqrt(v_hat) + eps)
// for Adam, plus weight_decay * p for AdamW (decoupled decay). Undefined before the first step (no
// state), and for SGD without momentum.
torch::Tensor update_direction(torch::optim::Optimizer& optimizer, const torch::Tensor& p);

// W - s * lr * v as a new tensor (a copy of W when s == 0 or v is undefined: bitwise W, P-WP-1).
torch::Tensor predict_weight(const torch::Tensor& w, const torch::Tensor& v, int s, double lr);

// The versions of one stage's weights during a call (see the file comment).
class StageWeights {
 public:
  StageWeights() = default;
  // `params`: the stage's trainable parameters, which `optimizer` steps (null: a stage without one).
  StageWeights(std::vector<torch::Tensor> params, torch::optim::Optimizer* optimizer);

  // Starts a call under `plan` for stage `stage`: counts the passes that will need each version.
  void begin_call(const WeightPlan& plan, int stage);
  // Makes the parameters hold the weights of a pass. `scratch` is the micro-batch's own buffer for
  // predicted weights (kept by the caller from its F to its BW). Returns the version the pass uses
  // (the newest version for current and predicted weights). Undo with leave().
  int enter(const PassWeights& w, bool is_forward, std::vector<torch::Tensor>& scratch);
  void leave();
  // After the pass: a stashed version that no later pass needs is dropped, and after a backward the
  // micro-batch's prediction buffer is released.
  void finish(const PassWeights& w, bool is_forward, std::vector<torch::Tensor>& scratch);
  // Applies `apply` (the optimizer step) to the newest weights, stashing them first if a pass still
  // needs them, with the version counters kept (see the file comment). `in_flight` = false (synchronous
  // schedules, nothing in flight) calls `apply` alone.
  void step(const std::function<void()>& apply, bool in_flight);

  int latest() const { return latest_; }
  // Weight sets alive beyond the newest (stashed versions and predicted scratch buffers), now and at
  // most since begin_call, and their size in bytes.
  int extra_sets() const { return static_cast<int>(stash_.size()) + scratch_live_; }
  int peak_extra_sets() const { return peak_extra_; }
  double set_bytes() const;

 private:
  void note_peak();

  std::vector<torch::Tensor> params_;
  torch::optim::Optimizer* optimizer_ = nullptr;
  WeightPolicy policy_ = WeightPolicy::Current;
  std::map<int, std::vector<torch::Tensor>> stash_;  // version -> tensors sharing the version's storage
  std::map<int, int> needs_;                         // version -> passes still to run that use it
  std::vector<torch::Tensor> newest_;                // during a swapped pass: the newest weights' tensors
  int latest_ = 0;
  int scratch_live_ = 0;
  int peak_extra_ = 0;
};

}  // namespace pipetrain

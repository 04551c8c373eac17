// The executor: runs a lowered schedule (core/lower.h) on real tensors, one PipelineRank per rank.
// Every schedule goes through the same interpreter; no schedule has a loop of its own.
//
//   PipelineRank  one rank's share of a pipeline: its stages of the model, its optimizers, its transport.
//                 train_step() runs the rank's action list for one optimizer step, train_steps() for K
//                 steps in one pass. Each rank calls them in the same order, in its own process (gloo,
//                 mpi) or thread (local).
//   LocalPipeline all ranks as threads of this process over the local transport, for tests and
//                 single-process use: one call trains on every rank.
//
// Semantics (docs/ALGORITHMS.md §1.8, bundles §1.10): micro-batch k is the sample range [begin_k, end_k) of the mini-batch
// (sizes differ by at most one, the first N mod m larger); its loss is the loss function's mean over
// the micro-batch times b_k / N, so the accumulated gradient is the full-batch gradient for any split.
// A per-token loss (loss.h, Loss::per_token) returns (sum, count) instead: the step's loss and gradient
// are the sums over the micro-batches divided by the step's total count, the full batch's token mean.
// The loss sees the last stage's whole output bundle and the micro-batch's rows of the target bundle.
// The step's loss (sum of those terms) and the global gradient norm are all-reduced, so every rank
// knows them; clipping by the global norm happens before any stage steps.
//
// Several steps per call (train_steps with K steps): the schedule is generated with K steps laid out
// back to back (micro-batch i belongs to step i / microbatches_per_step) and run as one pass; the batch
// of the call is cut into K mini-batches (split_equal), each into its micro-batches. For a synchronous
// schedule this is exactly K calls of train_step (the flush separates the steps; tested bitwise), and
// the reductions happen per step.
//
// Asynchronous schedules (docs/ALGORITHMS.md §5, §6; weights.h has the versions and predictions):
//   pipedream  PipeDream's 1F1B without flush: every mini-batch is one micro-batch (microbatches = 1)
//              and each stage steps after each backward. With weight_stashing (default) a forward uses
//              the stage's newest weights and its backward the same version (§5.1.2): within a call,
//              mini-batch i uses version max(0, i - (p-1-s)) of stage s. vertical_sync: every stage uses
//              the version stage 0 used, max(0, i - (p-1)) (§5.1.3). weight_stashing = false is the
//              stale baseline: the backward sees the weights as they are then (updated in place), with
//              the forward's activations. Batch-norm running statistics are never versioned.
//   2bw        PipeDream-2BW: m >= p micro-batches per step, gradients accumulated over them; step k of
//              the call uses version max(0, k-1) in both passes, so W(k+1) = W(k) - lr grad(W(k-1))
//              (§5.2), with at most two versions per stage.
//   spectrain  PipeDream's action list (microbatches = 1) without stashing. With SGD (momentum > 0):
//              SpecTrain (§6.1), F and BW use W - s lr v, v the momentum buffer, s the stage's steps
//              between the pass and the start of the mini-batch's backward on stage 0, counted on the
//              simulated schedule. With Adam/AdamW: PipeOptim (§6.2), the forward only, v the Adam
//              direction (+ weight decay for AdamW), s the stage's own steps between F and BW. Master
//              weights and optimizer state are never changed by a prediction.
// A call fills and drains the pipeline once: it is PipeDream's flush-free run over its K mini-batches,
// and the versions restart at every call (the first mini-batches of a call see no delay). Callers that
// want the asynchronous throughput pass many steps per call (the train command: up to the next
// evaluation or checkpoint). No stage can know a mini-batch's global gradient norm when it steps, so
// asynchronous schedules clip each stage's gradient by the stage's own norm, and on_gradients is
// called per stage at each Step. The per-step losses and global norms are all-reduced once, at the end
// of the call. Between calls the pipeline is empty and the parameters hold the newest weights, so
// evaluation and checkpoints see plain master weights.
//
// Two execution paths share the interpreter: the reference path (`reference = true`) does every send
// and receive blocking, exactly where the lowered schedule puts it; the default fast path sends without
// waiting, keeps up to `prefetch` receives posted ahead of their place in the list, posts a receive at its
// place if the window was full, and waits for each only at the action that consumes it. Tests check the
// two paths give identical numbers.
//
// Bundles (bundle.h): a stage maps a bundle of named tensors to a bundle; a model of plain one-tensor
// layers passes the single entry "x". Every entry crosses the boundary; only those that carry a gradient
// get one back (never a mask or ids passed along). The input batch is a bundle cut along dimension 0.
//
// Shapes: the first transfer over a stage boundary (per direction and micro-batch size) carries a small
// header with the entries' names, dtypes and shapes; later transfers are checked against it, so a
// drifting shape is an error naming the stage, micro-batch and both layouts, never a hang. With
// variable_shapes every transfer carries its header, so shapes (a sequence length, say) may differ
// between micro-batches and steps; such receives are not posted ahead of their action.
//
// Failure: an exception on a rank aborts the transport with a message naming the rank, the action and
// the error; the other ranks stop with RemoteFailure (or exit, for process transports).
//
// Thread use: a PipelineRank is driven by one thread at a time.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pipetrain/core/cost.h"
#include "pipetrain/core/schedule.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/runtime/bundle.h"
#include "pipetrain/runtime/layers.h"
#include "pipetrain/runtime/stage.h"
#include "pipetrain/runtime/transport.h"
#include "pipetrain/runtime/weights.h"

namespace pipetrain {

struct UmpipePlan;  // plan/umpipe.h: per-stage sample partitions (PipelineOptions::umpipe)

struct OptimizerOptions {
  std::string name = "sgd";     // sgd | adam | adamw
  double lr = 0.01;             // learning rate
  double momentum = 0.0;        // SGD momentum
  double weight_decay = 0.0;    // L2 (sgd, adam) or decoupled (adamw) weight decay
  double beta1 = 0.9;           // Adam/AdamW
  double beta2 = 0.999;         // Adam/AdamW
  double eps = 1e-8;            // Adam/AdamW
  double clip_grad_norm = 0.0;  // clip by the global norm over all stages; 0 = off
  // A step whose loss or gradient norm is NaN or infinite (a diverged run): "stop" throws NonFiniteError
  // before its optimizer step (synchronous schedules: on every rank, weights untouched; asynchronous ones:
  // on the rank of the stage whose own gradient norm is not finite, which stops the others); "skip" drops
  // that step's gradients and takes no optimizer step (asynchronous: the stage's own step), counted in
  // StepStats::skipped_steps; "ignore" steps anyway (the weights become NaN).
  std::string nonfinite = "stop";
};

struct PipelineOptions {
  // gpipe | 1f1b | interleaved | zb-h1 | zb-h2 | zb-auto (synchronous) | pipedream | 2bw | spectrain
  std::string schedule = "1f1b";
  int microbatches = 4;                   // m per step (pipedream and spectrain: 1)
  bool weight_stashing = true;            // pipedream: false = the stale no-stash baseline (§5.1)
  bool vertical_sync = false;             // pipedream: every stage uses stage 0's version (§5.1.3)
  int virtual_stages = 1;                 // v (interleaved, interleaved-zb, looped-bfs; the V shapes hold 2)
  std::string balance = "uniform";        // uniform | parameters | "3,2,2" (one count per (virtual) stage)
  std::vector<int> layers_per_stage;      // the balance itself, one count per (virtual) stage; overrides `balance`
  Checkpoint checkpoint = Checkpoint::Never;  // re-materialisation mode (torchgpipe's default is except_last)
  // Schedules with W actions (zb-*, v-*, dualpipev, interleaved-zb): how B and W split a stage's backward.
  // "auto": B asks autograd for the stage input's gradient only and W computes every parameter's gradient
  // later from the kept graph, for any layer (torch::nn::Linear, attention, convolutions, ...), except that
  // pipetrain::nn::Linear queues its own (its explicit split, the faster path: docs/BENCHMARKS.md);
  // "autograd": every layer through autograd, pipetrain::nn::Linear too; "explicit": only
  // pipetrain::nn::Linear defers, every other layer's weight gradients are computed in B (W empty for
  // them; the pipeline warns when that is most of a rank's parameters). With `checkpoint`, B re-runs the
  // forward and W keeps that graph until it runs. Asynchronous schedules have no W and ignore it.
  std::string backward_split = "auto";
  OptimizerOptions optimizer;
  uint64_t seed = 0;                      // forward RNG of (step, stage, micro-batch) derives from it
  // Seed every forward from (seed, step, stage, micro-batch), and the data-parallel copy (data_parallel's
  // rank; copy 0 as a run without copies), so dropout masks do not depend on the
  // schedule or the stage count and copies draw different ones; in-process ranks then take turns in forwards. The caller's default
  // generator is restored after each forward: it never sees the pipeline's draws (see PipelineRank).
  bool deterministic_rng = true;
  bool reference = false;                 // blocking reference path instead of the fast path
  int prefetch = 4;                       // fast path: receives posted ahead of their place and not yet consumed, at most
  int threads = 0;                        // intra-op threads of this rank (at::set_num_threads); 0 = as is
  // Device of this rank's stages: cpu, or cuda[:N] with a CUDA LibTorch. Inputs, targets and received
  // tensors are moved there; on CUDA each rank computes on its own stream (runtime/device.h), and the
  // local transport passes single-tensor transfers GPU to GPU; the others go through host memory.
  torch::Device device = torch::kCPU;
  // "fp32", or "bf16": every forward (and re-materialisation) runs under autocast to bfloat16 on the
  // rank's device, so activations, their gradients and the transfers are bf16, while the weights, their
  // gradients, the optimizer state, the loss and the norm reductions stay float32.
  std::string precision = "fp32";
  bool measure_memory = false;            // sample the heap after every action (StepStats::peak_heap_growth)
  // Shapes may change between micro-batches and steps (variable sequence lengths): every transfer carries
  // its layout (see the file comment). Off: shapes are agreed once and checked.
  bool variable_shapes = false;
  CostModel costs;                        // per-stage costs for zb-h2/zb-auto and lowering; empty = unit
  double memory_limit = 0;                // zb-auto's limit in micro-batches (0 = p)
  // If set, the learning rate of global step k (0-based, counting every step since construction or
  // set_step): each stage sets it just before its Step action of step k. Lets one call of several
  // steps follow a learning-rate schedule; otherwise set_learning_rate holds for the whole call.
  std::function<double(int step)> learning_rate;
  // Called on each rank once per step, after the loss and gradient norm are reduced and the gradients
  // clipped, before any optimizer step: the gradients of the rank's stages are final here (for
  // inspection, logging, tests). Arguments: the rank and the parameters of its stages. Runs on the
  // rank's thread; in-process ranks run it concurrently, so touch only the parameters given.
  // Asynchronous schedules: called at every Step action with the parameters of that stage only.
  std::function<void(int rank, const std::vector<torch::Tensor>& parameters)> on_gradients;
  // Called on each rank before each action of its list (a debugging and fault-injection aid; the
  // `train` command sets it from PIPETRAIN_FAULT). `step` is the call's first step (train_steps runs
  // several). An exception it throws fails the rank as the action would. Empty by default.
  std::function<void(int rank, int step, const Action& action)> before_action;
  // Data parallelism across pipelines (hybrid): the group of this stage's replicas in the other pipeline
  // copies (runtime/transport.h make_group_transport), each copy training on its own share of the
  // mini-batch. Before the global norm and the step, the replicas' gradients and step losses are
  // averaged over this group (equal shares give the full-batch gradient), so every copy steps the same
  // weights. Null or a group of one: no data parallelism. Synchronous schedules only.
  std::shared_ptr<Transport> data_parallel;
  // Stage replication with round-robin micro-batches (PipeDream's 1F1B-RR, core/generators.h
  // round_robin): per stage its number of replicas; the transport then has their sum of ranks, stage 0's
  // replicas first. Micro-batch i of stage s runs on replica i mod r_s; before the step the replicas of
  // a stage sum their gradients (each holds its micro-batches' share of the full-batch loss), so they
  // step bitwise the same weights. Evaluation (forward_only) runs on each stage's first replica. gpipe
  // or 1f1b only. Empty (or all ones): one rank per stage.
  std::vector<int> replication;
  // UMPIPE (docs/ALGORITHMS.md §7, docs/UMPIPE.md): when set, every training step runs these per-stage forward
  // and backward partitions of the mini-batch instead of the schedule's equal micro-batches: stage j on
  // rank j re-chunks the sample stream by its own rows, GPipe order, forward without a graph and each
  // backward chunk re-materialised from the stage's stashed inputs, losses scaled by b/N (so the
  // accumulated gradient is the full-batch one). One step per call; the flush (global norm, clipping,
  // step) is the synchronous schedules'. Needs schedule gpipe, one stage per rank, no replicas, plan rows
  // that are compositions of the batch size, and per-sample, deterministic layers (no BatchNorm, no
  // dropout): the constructor refuses others with UsageError. Evaluation (forward_only) is unaffected.
  std::shared_ptr<const UmpipePlan> umpipe;
  // Tied weights (DeepSpeed's TiedLayerSpec, Megatron's embedding group): each group lists parameters of
  // different layers that are one weight, such as a language model's token embedding and output head.
  // Each member is its own tensor of the same shape (not one tensor shared by two modules); the
  // constructor copies the first member's values into the others, and the first pass (train_step or
  // forward_only; a collective) checks that every rank holding a copy holds the same values (ranks that
  // built the model from different seeds would not): UsageError naming the group and the ranks
  // otherwise. Every stage holding a member keeps
  // its copy; at the flush the copies' gradients are summed over the group (one all-reduce per step)
  // before the global norm (which counts the weight once) and the step, so the copies stay bitwise
  // equal. Checkpoints store the weight once, with its lowest layer. Synchronous schedules without
  // stage replication or UMPIPE; the constructor refuses the rest with UsageError naming the fix.
  std::vector<std::vector<ParameterRef>> tied;
};

// How the passes of `options.schedule` choose their weights (weights.h): Current for synchronous
// schedules. Throws UsageError naming the value and the fix on a bad combination: vertical sync or no
// stash with a schedule other than pipedream, both at once, pipedream or spectrain with more than one
// micro-batch per step, spectrain with SGD without momentum.
WeightPolicy weight_policy_of(const PipelineOptions& options);

// The checks of PipelineRank's constructor that need neither the model nor a transport, for a pipeline
// of `ranks` ranks (one per stage, or the sum of `replication`): the schedule and whether it can order
// this many micro-batches on this many ranks, the weight policy (weight_policy_of), the optimizer,
// prefetch, virtual stages, replication, and tied weights against the schedule. Throws UsageError naming
// the value and the fix. The command line calls it before any rank starts; the constructor calls it too.
void check_pipeline_options(const PipelineOptions& options, int ranks);


// Which weights a pass used (asynchronous schedules; for tests and the record of a run).
struct WeightUse {
  int stage = 0;
  int micro = 0;              // micro-batch index within the call
  ActionKind kind = ActionKind::F;  // F or BW
  int version = 0;            // the stage's version used or predicted from: its steps since construction
  int predicted = -1;         // SpecTrain/PipeOptim: steps s extrapolated; -1: none
};

// Extra weight memory of one stage in a call (asynchronous schedules): weight sets alive beyond the
// newest one (stashed versions, prediction buffers), at most, and their size.
struct WeightMemory {
  int stage = 0;
  int peak_extra_sets = 0;
  double set_bytes = 0;  // bytes of one set (the stage's trainable parameters)
  double peak_extra_bytes() const { return peak_extra_sets * set_bytes; }
};

struct StepStats {
  int step = 0;            // index of the (first) step of the call (0-based)
  int steps = 1;           // steps taken by the call
  double loss = 0.0;       // full-batch loss of the call's batch (the steps' losses weighted by their sizes)
  double grad_norm = 0.0;  // global gradient norm before clipping, of the call's last step
  std::vector<double> losses;      // per step of the call, on every rank
  std::vector<double> grad_norms;  // per step of the call
  int skipped_steps = 0;  // OptimizerOptions::nonfinite == "skip": steps (this rank's stages) not taken
  std::vector<WeightUse> weight_uses;     // asynchronous schedules: every F and BW of this rank (LocalPipeline: all)
  std::vector<WeightMemory> weight_memory;  // asynchronous schedules: per stage of this rank (LocalPipeline: all)
  // With measure_memory: the largest growth of this process's heap in use (malloc's count, which holds
  // every CPU tensor) over its level when the step started, in bytes. It covers the activations kept
  // for backward, received buffers and new gradients; a per-process (per-rank) figure.
  double peak_heap_growth = 0.0;
  Timeline timeline;       // what this rank (LocalPipeline: every rank) did, in ms
};

struct EvalStats {
  double loss = 0.0;      // mean loss per sample (micro-batch means weighted by their sizes); per token
                          // for a per-token loss (the sums over the count)
  // Fraction of predictions argmax(output, -1) equal to the target, when the targets are class ids
  // (integer, one dimension fewer than the output: per sample, or per token for a language model;
  // negative ids are padding and not counted); NaN otherwise.
  double accuracy = 0.0;
  int64_t samples = 0;
  // For combining the evaluations of several batches: what `loss` is the mean over (the samples, or the
  // units counted by a per-token loss: a batch of short lines weighs less than one of long lines), and
  // the predictions `accuracy` counted (0 where accuracy does not apply).
  double loss_units = 0.0;
  double predictions = 0.0;
};

// Guards LibTorch's default generator among ranks that share a process (threads): seeded forwards take
// it, and so must anything that seeds the generator and then draws from it, such as building a model
// after torch::manual_seed; otherwise one rank's forward can reseed the generator while another rank
// is drawing its initial weights, and the ranks end up with different models.
std::mutex& default_generator_mutex();

// Merges every rank's timeline on every rank (a collective over `transport`); events keep their
// clock (a monotonic clock shared by processes on one host).
Timeline gather_timeline(const Timeline& mine, Transport& transport);

// Sample ranges of m micro-batches over N samples: sizes differ by at most one, the first N mod m
// larger. Throws UsageError if m > N or either is < 1.
std::vector<std::pair<int64_t, int64_t>> split_equal(int64_t batch_size, int microbatches);

// Random numbers: with deterministic_rng (the default) each forward seeds LibTorch's default generator
// of its device with its own seed and restores the generator's previous state afterwards, so the
// pipeline neither disturbs nor depends on what the caller draws: a program that seeds, then draws
// its batches with torch::randn on every rank, gets the same batches on every rank at every step.
// (Only a forward's own draws, such as dropout, come from the pipeline's seed.)
class PipelineRank {
 public:
  // `model` is the whole model (every rank builds it the same way, e.g. from the same seed); this rank
  // keeps the stages the schedule gives it. Throws UsageError on bad options (names the value and fix).
  // `loss`: a tensor loss (LossFn), a bundle loss or Loss::per_token (loss.h).
  PipelineRank(torch::nn::Sequential model, Loss loss, std::shared_ptr<Transport> transport,
               PipelineOptions options);
  // A model given layer by layer (layers.h): this rank builds, initialises and holds the layers of its
  // own stages only, each from its own seed, so their weights are those of build_all(model) whatever the
  // cut. Tied members on other ranks get the group's first member's value at the first pass. Not with
  // UMPIPE (UsageError).
  PipelineRank(const LayerwiseModel& model, Loss loss, std::shared_ptr<Transport> transport,
               PipelineOptions options);
  ~PipelineRank();
  PipelineRank(PipelineRank&&) noexcept;

  // One optimizer step. `input` is needed on the rank of stage 0 and `target` on the rank of the last
  // stage (others may pass undefined tensors); every rank passes the same `batch_size`.
  StepStats train_step(const torch::Tensor& input, const torch::Tensor& target, int64_t batch_size);
  // The same with a bundle of inputs (bundle.h), each entry cut into micro-batches along dimension 0.
  StepStats train_step(const Bundle& input, const torch::Tensor& target, int64_t batch_size);
  // A bundle of targets: each entry cut like the input; the loss gets the micro-batch's rows of every
  // entry (a tensor loss reads "x").
  StepStats train_step(const Bundle& input, const Bundle& target, int64_t batch_size);
  // `steps` optimizer steps in one pass of the schedule laid out for `steps` steps (see the file
  // comment): the batch of `batch_size` samples is cut into `steps` mini-batches. Collective: every rank
  // passes the same `steps` and `batch_size`.
  StepStats train_steps(const torch::Tensor& input, const torch::Tensor& target, int64_t batch_size, int steps);
  StepStats train_steps(const Bundle& input, const torch::Tensor& target, int64_t batch_size, int steps);
  StepStats train_steps(const Bundle& input, const Bundle& target, int64_t batch_size, int steps);

  // Forward pass only, for evaluation and inference: the modules in evaluation mode (dropout off), no
  // autograd graph, the batch cut into `microbatches` micro-batches (0: the training m, capped at the
  // batch size) that flow through the stages as in GPipe's forward phase, over the same transport.
  // Collective: every rank calls it with the same batch_size. Returns, on the rank holding the last
  // stage, the outputs of the whole batch in sample order; an undefined tensor on the other ranks.
  // The result is the last stage's "x".
  torch::Tensor forward_only(const Bundle& input, int64_t batch_size, int microbatches = 0);
  // The same pass, returning the last stage's whole output bundle of each micro-batch, in order (on the
  // rank holding the last stage; empty on the others).
  std::vector<Bundle> forward_outputs(const Bundle& input, int64_t batch_size, int microbatches = 0);
  // forward_only, then the loss (and accuracy, see EvalStats) of the batch, known on every rank.
  // `target` is needed on the rank of the last stage only. A tensor loss normalised per sample scores the
  // whole batch's "x" at once; a bundle or per-token loss each micro-batch, combined as in training.
  EvalStats evaluate(const Bundle& input, const torch::Tensor& target, int64_t batch_size, int microbatches = 0);
  EvalStats evaluate(const Bundle& input, const Bundle& target, int64_t batch_size, int microbatches = 0);

  // Sets the learning rate of every optimizer of this rank (a schedule calls it before each step).
  void set_learning_rate(double lr);

  // Steps taken so far; the forward RNG of a step derives from it, so a resumed run sets it.
  int step() const;
  void set_step(int step);
  // Per-layer state for checkpoints (runtime/checkpoint.h). Global layer indices held by this rank,
  // and a layer's named tensors: "param/NAME", "buffer/NAME" and its optimizer state "optim/NAME/FIELD"
  // (FIELD: step, exp_avg, exp_avg_sq for Adam/AdamW; momentum_buffer for SGD with momentum), on the CPU.
  std::vector<int> local_layers() const;
  // The layers of the stages this rank owns: all of local_layers(), except that of a replicated stage
  // (1F1B-RR) only its first replica owns the layers. Checkpoints write each layer once, from its owner.
  std::vector<int> owned_layers() const;
  // A tied parameter (PipelineOptions::tied) is stored once, with its group's lowest layer: the other
  // members' layers leave it out, and tied_sources tells the loader where to find it.
  std::vector<std::pair<std::string, torch::Tensor>> layer_state(int layer) const;
  // For a layer holding tied members stored elsewhere: (member name in this layer, where it is stored).
  std::vector<std::pair<std::string, ParameterRef>> tied_sources(int layer) const;
  // Restores what layer_state returned (same names and shapes; a missing or extra name is an error
  // naming it). The optimizer state is recreated; parameters are copied in place.
  void load_layer_state(int layer, const std::vector<std::pair<std::string, torch::Tensor>>& state);

  // Lowered: with sends and receives (one step); its `skips` are the model's skip routes across stages
  // (bundle.h), whose transfers it lists like the boundary ones (`0SF2@2`).
  const Schedule& schedule() const;
  const Schedule& schedule_for(int steps);     // lowered, for a call of `steps` steps (made on first use)
  WeightPolicy weight_policy() const;          // how passes choose their weights (weights.h)
  const std::vector<int>& balance() const;     // layers per (virtual) stage
  std::vector<int> local_stages() const;       // stages held by this rank
  std::vector<torch::Tensor> parameters() const;  // parameters of this rank's stages
  int rank() const;
  torch::Device device() const;                // where this rank's stages compute (PipelineOptions::device)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  void construct(const torch::nn::Sequential* whole, const LayerwiseModel* layerwise, Loss loss,
                 std::shared_ptr<Transport> transport, PipelineOptions options);
};

class LocalPipeline {
 public:
  LocalPipeline(torch::nn::Sequential model, Loss loss, int stages, PipelineOptions options);
  // Each rank builds only its own layers (PipelineRank's layerwise constructor).
  LocalPipeline(const LayerwiseModel& model, Loss loss, int stages, PipelineOptions options);
  ~LocalPipeline();
  // Runs one step on all ranks (one thread each). If any rank fails, rethrows the first failure that is
  // not merely another rank's report of it.
  StepStats train_step(const torch::Tensor& input, const torch::Tensor& target);
  StepStats train_steps(const torch::Tensor& input, const torch::Tensor& target, int steps);
  // With a bundle of inputs; `batch_size` samples (every entry has that many rows).
  StepStats train_step(const Bundle& input, const torch::Tensor& target, int64_t batch_size);
  StepStats train_steps(const Bundle& input, const torch::Tensor& target, int64_t batch_size, int steps);
  // With a bundle of targets (PipelineRank::train_step).
  StepStats train_step(const Bundle& input, const Bundle& target, int64_t batch_size);
  StepStats train_steps(const Bundle& input, const Bundle& target, int64_t batch_size, int steps);
  // PipelineRank::forward_only on every rank: the outputs of the whole batch (the last stage's "x").
  torch::Tensor forward_only(const Bundle& input, int64_t batch_size, int microbatches = 0);
  // PipelineRank::evaluate on every rank.
  EvalStats evaluate(const Bundle& input, const torch::Tensor& target, int64_t batch_size, int microbatches = 0);
  EvalStats evaluate(const Bundle& input, const Bundle& target, int64_t batch_size, int microbatches = 0);
  const Schedule& schedule() const;
  PipelineRank& rank(int r) { return *ranks_.at(static_cast<std::size_t>(r)); }
  // Rank r's transport, for what takes one next to its PipelineRank (checkpoints, a Trainer); call those
  // for every rank at once, e.g. with run_on_threads.
  std::shared_ptr<Transport> transport(int r) const { return transports_.at(static_cast<std::size_t>(r)); }
  const std::vector<int>& balance() const;

 private:
  std::vector<std::shared_ptr<Transport>> transports_;
  std::vector<std::unique_ptr<PipelineRank>> ranks_;
};

}  // namespace pipetrain

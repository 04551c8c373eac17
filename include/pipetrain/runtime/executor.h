// The executor: runs a lowered schedule (core/lower.h) on real tensors, one PipelineRank per rank.
// Every schedule goes through the same interpreter; no schedule has a loop of its own.
//
//   PipelineRank  one rank's share of a pipeline: its stages of the model, its optimizers, its transport.
//                 train_step() runs the rank's action list for one optimizer step. Each rank calls it
//                 once per step, in its own process (gloo, mpi) or thread (local).
//   LocalPipeline all ranks as threads of this process over the local transport, for tests and
//                 single-process use: one call trains one step on every rank.
//
// Semantics (ALGORITHMS.md §1.8): micro-batch k is the sample range [begin_k, end_k) of the mini-batch
// (sizes differ by at most one, the first N mod m larger); its loss is the loss function's mean over
// the micro-batch times b_k / N, so the accumulated gradient is the full-batch gradient for any split.
// The step's loss (sum of those terms) and the global gradient norm are all-reduced, so every rank
// knows them; clipping by the global norm happens before any stage steps.
//
// Two execution paths share the interpreter: the reference path (`reference = true`) does every send
// and receive blocking, exactly where the lowered schedule puts it; the default fast path sends without
// waiting and keeps up to `prefetch` receives posted ahead of need. Tests check they give identical numbers.
//
// Shapes: the first transfer over a stage boundary (per direction and micro-batch size) carries a small
// header with dtype and shape; later transfers are checked against it, so a drifting shape is an error
// naming the stage, micro-batch and both shapes, never a hang.
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
#include "pipetrain/runtime/stage.h"
#include "pipetrain/runtime/transport.h"

namespace pipetrain {

struct OptimizerOptions {
  std::string name = "sgd";     // sgd | adam | adamw
  double lr = 0.01;             // learning rate
  double momentum = 0.0;        // SGD momentum
  double weight_decay = 0.0;    // L2 (sgd, adam) or decoupled (adamw) weight decay
  double beta1 = 0.9;           // Adam/AdamW
  double beta2 = 0.999;         // Adam/AdamW
  double eps = 1e-8;            // Adam/AdamW
  double clip_grad_norm = 0.0;  // clip by the global norm over all stages; 0 = off
};

struct PipelineOptions {
  std::string schedule = "1f1b";          // gpipe | 1f1b | interleaved | zb-h1 | zb-h2 | zb-auto
  int microbatches = 4;                   // m per step
  int virtual_stages = 1;                 // v (interleaved)
  std::string balance = "uniform";        // uniform | parameters | "3,2,2" (one count per (virtual) stage)
  Checkpoint checkpoint = Checkpoint::Never;  // re-materialisation mode (torchgpipe's default is except_last)
  OptimizerOptions optimizer;
  uint64_t seed = 0;                      // forward RNG of (step, stage, micro-batch) derives from it
  bool deterministic_rng = true;          // seed every forward; in-process ranks then take turns in forwards
  bool reference = false;                 // blocking reference path instead of the fast path
  int prefetch = 4;                       // fast path: receives posted ahead and not yet consumed, at most
  int threads = 0;                        // intra-op threads of this rank (at::set_num_threads); 0 = as is
  // Device of this rank's stages: cpu, or cuda[:N] with a CUDA LibTorch. Inputs, targets and received
  // tensors are moved there; transfers go through host memory (gloo, mpi, local).
  torch::Device device = torch::kCPU;
  bool measure_memory = false;            // sample the heap after every action (StepStats::peak_heap_growth)
  CostModel costs;                        // per-stage costs for zb-h2/zb-auto and lowering; empty = unit
  double memory_limit = 0;                // zb-auto's limit in micro-batches (0 = p)
  // Called on each rank once per step, after the loss and gradient norm are reduced and the gradients
  // clipped, before any optimizer step: the gradients of the rank's stages are final here (for
  // inspection, logging, tests). Arguments: the rank and the parameters of its stages. Runs on the
  // rank's thread; in-process ranks run it concurrently, so touch only the parameters given.
  std::function<void(int rank, const std::vector<torch::Tensor>& parameters)> on_gradients;
  // Called on each rank before each action of its list (a debugging and fault-injection aid; the
  // `train` command sets it from PIPETRAIN_FAULT). An exception it throws fails the rank as the action
  // would. Empty by default.
  std::function<void(int rank, int step, const Action& action)> before_action;
};

// Loss of one micro-batch: the mean over its samples (pipetrain scales it by b_k / N).
using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

struct StepStats {
  int step = 0;            // index of the step just taken (0-based)
  double loss = 0.0;       // full-batch loss of the step, on every rank
  double grad_norm = 0.0;  // global gradient norm before clipping
  // With measure_memory: the largest growth of this process's heap in use (malloc's count, which holds
  // every CPU tensor) over its level when the step started, in bytes. It covers the activations kept
  // for backward, received buffers and new gradients; a per-process (per-rank) figure.
  double peak_heap_growth = 0.0;
  Timeline timeline;       // what this rank (LocalPipeline: every rank) did, in ms
};

struct EvalStats {
  double loss = 0.0;      // mean loss per sample (micro-batch means weighted by their sizes)
  // Fraction of predictions argmax(output, -1) equal to the target, when the targets are class ids
  // (integer, one dimension fewer than the output: per sample, or per token for a language model);
  // NaN otherwise.
  double accuracy = 0.0;
  int64_t samples = 0;
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

class PipelineRank {
 public:
  // `model` is the whole model (every rank builds it the same way, e.g. from the same seed); this rank
  // keeps the stages the schedule gives it. Throws UsageError on bad options (names the value and fix).
  PipelineRank(torch::nn::Sequential model, LossFn loss, std::shared_ptr<Transport> transport,
               PipelineOptions options);
  ~PipelineRank();
  PipelineRank(PipelineRank&&) noexcept;

  // One optimizer step. `input` is needed on the rank of stage 0 and `target` on the rank of the last
  // stage (others may pass undefined tensors); every rank passes the same `batch_size`.
  StepStats train_step(const torch::Tensor& input, const torch::Tensor& target, int64_t batch_size);

  // Forward pass only, for evaluation and inference: the modules in evaluation mode (dropout off), no
  // autograd graph, the batch cut into `microbatches` micro-batches (0: the training m, capped at the
  // batch size) that flow through the stages as in GPipe's forward phase, over the same transport.
  // Collective: every rank calls it with the same batch_size. Returns, on the rank holding the last
  // stage, the outputs of the whole batch in sample order; an undefined tensor on the other ranks.
  torch::Tensor forward_only(const torch::Tensor& input, int64_t batch_size, int microbatches = 0);
  // forward_only, then the loss (and accuracy, see EvalStats) of the batch, known on every rank.
  // `target` is needed on the rank of the last stage only.
  EvalStats evaluate(const torch::Tensor& input, const torch::Tensor& target, int64_t batch_size,
                     int microbatches = 0);

  // Sets the learning rate of every optimizer of this rank (a schedule calls it before each step).
  void set_learning_rate(double lr);

  // Steps taken so far; the forward RNG of a step derives from it, so a resumed run sets it.
  int step() const;
  void set_step(int step);
  // Per-layer state for checkpoints (runtime/checkpoint.h). Global layer indices held by this rank,
  // and a layer's named tensors: "param/NAME", "buffer/NAME" and its optimizer state "optim/NAME/FIELD"
  // (FIELD: step, exp_avg, exp_avg_sq for Adam/AdamW; momentum_buffer for SGD with momentum), on the CPU.
  std::vector<int> local_layers() const;
  std::vector<std::pair<std::string, torch::Tensor>> layer_state(int layer) const;
  // Restores what layer_state returned (same names and shapes; a missing or extra name is an error
  // naming it). The optimizer state is recreated; parameters are copied in place.
  void load_layer_state(int layer, const std::vector<std::pair<std::string, torch::Tensor>>& state);

  const Schedule& schedule() const;            // lowered: with sends and receives
  const std::vector<int>& balance() const;     // layers per (virtual) stage
  std::vector<int> local_stages() const;       // stages held by this rank
  std::vector<torch::Tensor> parameters() const;  // parameters of this rank's stages
  int rank() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class LocalPipeline {
 public:
  LocalPipeline(torch::nn::Sequential model, LossFn loss, int stages, PipelineOptions options);
  ~LocalPipeline();
  // Runs one step on all ranks (one thread each). If any rank fails, rethrows the first failure that is
  // not merely another rank's report of it.
  StepStats train_step(const torch::Tensor& input, const torch::Tensor& target);
  const Schedule& schedule() const;
  const std::vector<int>& balance() const;

 private:
  std::vector<std::unique_ptr<PipelineRank>> ranks_;
};

}  // namespace pipetrain

// The training loop as a library: a Trainer runs one rank's share of a pipeline training run (steps or
// epochs, a learning-rate schedule with warm-up, evaluation on held-out data, checkpoints that resume
// bitwise, several steps per executor call for asynchronous schedules, a cooperative stop) and reports
// each step through callbacks. `pipetrain train` is this class plus flags and printing.
//
// Every rank of the run constructs its Trainer with the same options and calls run(); the calls are
// collective (they all-reduce over the world transport), so ranks must agree on the options.
//
//   PipelineRank rank(model, loss, transport, options);
//   TrainerOptions o;  o.steps = 1000;  o.batch_size = 64;  o.lr = {3e-3, "cosine"};
//   TrainerCallbacks cb;  cb.on_step = [](const StepRecord& s) { std::cout << s.loss << "\n"; };
//   Trainer trainer(rank, world, transport, data_or_null, o, cb);
//   TrainResult r = trainer.run();
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pipetrain/core/simulate.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/transport.h"

namespace pipetrain {

// Learning rate of step k (0-based) of `total`: linear warm-up over warmup_steps(total) steps, then
// constant, or a cosine or linear decay to a tenth of the peak at the last step. A pure function of k,
// so a resumed run continues the same schedule.
class CheckpointDirLock;  // checkpoint.h

struct LrSchedule {
  double peak = 3e-3;
  std::string kind = "cosine";  // constant | cosine | linear
  int warmup = -1;              // steps; -1: 5% of the run, at most 100
  int warmup_steps(int total) const;
  double at(int k, int total) const;
};

// The data, as the trainer sees it. Only ranks that hold the first or the last stage need one (pass
// nullptr elsewhere); the first reads inputs, the last targets. World rank 0 must have one: it tells the
// other ranks the sizes of the splits.
struct TrainData {
  int64_t train_size = 0;  // samples in the training split; 0: endless (give steps, not epochs)
  int64_t eval_size = 0;   // held-out samples; 0: no evaluation
  // Step k's mini-batch of `batch_size` samples: {input, target}. A pure function of (k, batch_size), so
  // that a resumed run sees the same data. The input is a bundle (bundle.h; a tensor converts to one).
  std::function<std::pair<Bundle, torch::Tensor>(int step, int64_t batch_size)> batch;
  // Held-out samples begin..begin+count-1: {input, target}.
  std::function<std::pair<Bundle, torch::Tensor>(int64_t begin, int64_t count)> eval_batch;
};

struct TrainerOptions {
  int steps = 0;                 // steps of the run; 0: from `epochs`
  double epochs = 0;             // with steps == 0: ceil(epochs * train_size / batch_size) steps
  int64_t batch_size = 32;       // samples per step over all data-parallel copies of the pipeline
  LrSchedule lr;
  int eval_every = -1;           // steps between evaluations; -1: ten per run; 0: none
  int64_t eval_samples = 0;      // held-out samples per evaluation; 0: all
  int64_t eval_batch = 0;        // samples per evaluation call; 0: 4 x batch_size
  std::string save_dir;          // checkpoints (checkpoint.h); empty: none. World rank 0 holds its run
                                 // lock (CheckpointDirLock) from prepare() until the Trainer is destroyed:
                                 // prepare() refuses (UsageError, every rank) a folder another run saves to
  int save_every = 0;            // steps between checkpoints; 0: only at the end
  bool save_on_interrupt = false;  // a stop writes one more checkpoint at the step reached
  std::string resume_dir;        // continue from this checkpoint
  // The run as stored in checkpoints (what must match to resume); given the run's total steps.
  std::function<nlohmann::json(int total_steps)> run_description;
  int steps_per_call = 0;        // asynchronous schedules: steps per executor call; 0: up to the next
                                 // evaluation (where one runs: data without a held-out split has none)
                                 // or checkpoint, at most kMaxStepsPerCall
  bool stage_times = false;      // per step, each stage's busy time, the pipeline's span and each rank's
                                 // memory (one more all-reduce per call; StepRecord::busy_ms, pass_ms,
                                 // heap_growth_mib, device_peak_allocated_mib)
  // Polled at the start of every call and once after the last: a signal number (or any non-zero code)
  // asks the run to stop. The ranks agree (one all-reduce), so they all stop after the same step. A call
  // is not cut short: an asynchronous call (steps_per_call steps, up to kMaxStepsPerCall) finishes
  // first, so a stop takes effect within one call's time (bound it with steps_per_call). Where the
  // request came during the run's last call, the run still ends with stopped_by set (after the end's
  // checkpoint). Call boundaries are never chosen by time: an asynchronous pipeline drains at each, so
  // moving them changes the losses (a run cut into calls of 10 steps differs from one call of 40 from
  // step 11 on).
  std::function<int()> stop_requested;
};

// The default cap on the steps of one asynchronous call: the call's batch is held at once, and one fill
// and drain per 256 steps costs (p-1)/(256+p-1) of the time.
constexpr int kMaxStepsPerCall = 256;

struct EvalResult {
  double loss = 0, accuracy = 0;
  int64_t samples = 0;
};

// One optimizer step as it happened (the same on every rank).
struct StepRecord {
  int step = 0;  // 1-based: the number of steps done
  double loss = 0, grad_norm = 0, lr = 0;
  double ms = 0;                 // wall time of the step (a call's time over its steps)
  std::vector<double> busy_ms;   // per stage (stage_times): compute time in this step
  double pass_ms = 0;            // (stage_times) first action to last over all ranks, per step
  // (stage_times) per pipeline rank: the heap growth of this step's call in MiB (PipelineOptions::
  // measure_memory; else 0), and its device's peak allocated MiB since the run began (-1 where not
  // measured: the CPU, or a LibTorch without the allocator's statistics, device.h).
  std::vector<double> heap_growth_mib, device_peak_allocated_mib;
  // The target units of the step's mini-batch (all copies): with integer targets (class ids, tokens)
  // those >= 0, so a language model's real tokens without padding; else the samples. On the ranks that
  // read the batch (the first and last stages'); 0 elsewhere.
  double units = 0;
  std::optional<EvalResult> eval;  // evaluated after this step
};

struct TrainerCallbacks {
  std::function<void(const StepRecord&)> on_step;  // after each step (and its evaluation)
  std::function<void(int step, const EvalResult&)> on_eval;  // also at step 0 before a fresh run
  std::function<void(int step, const std::string& dir)> on_checkpoint;
};

struct TrainResult {
  int start = 0;                 // the step the run began at (a resumed run: the checkpoint's)
  int total = 0;                 // steps of the run
  int reached = 0;               // steps done when run() returned
  int stopped_by = 0;            // the stop code that ended the run early; 0: it ran to the end
  int last_saved = 0;            // the step of the last checkpoint written (0: none)
  double first_loss = 0, last_loss = 0;
  std::vector<double> step_ms;   // per step of this run
  double units = 0;              // StepRecord::units summed over this run's steps
  std::optional<EvalResult> first_eval, last_eval;
  StepStats last;                // the last call's statistics (its timeline included)
  std::map<int, WeightMemory> weight_memory;  // asynchronous: peak extra weight sets per local stage
  double median_step_ms() const;
};

// What the run looked like, gathered from every rank (collective): the last call's timeline from all
// ranks (shifted to start at 0), its metrics, the simulator's prediction from the measured stage
// costs, and per rank its peak heap growth in a step and peak resident set.
struct RunReport {
  Timeline timeline;
  Metrics measured;
  SimResult predicted;  // from the measured compute alone (transfers, overhead and the step free)
  // The run's own transfer, per-action overhead and step terms (measured_runtime) and the prediction
  // from the measured compute with them.
  MeasuredRuntime runtime;
  SimResult predicted_with_runtime;
  std::vector<double> heap_growth_bytes, peak_rss_mib;  // per rank
  // Per rank, on a GPU: the caching allocator's peaks on the rank's device since the process started, in
  // MiB (ranks that share a GPU report the same device's); negative where not measured (CPU ranks,
  // LibTorch without c10's allocator statistics: pipetrain/runtime/device.h).
  std::vector<double> device_peak_allocated_mib, device_peak_reserved_mib;
  std::vector<double> extra_weight_sets, weight_set_bytes;  // per stage (asynchronous schedules)
};

class Trainer {
 public:
  // `world`: every rank of the run; `pipeline`: this rank's pipeline (== world unless the world holds
  // several data-parallel copies of the pipeline, each a contiguous block of ranks). `data` may be null
  // on ranks that hold neither the first nor the last stage.
  Trainer(PipelineRank& rank, std::shared_ptr<Transport> world, std::shared_ptr<Transport> pipeline,
          const TrainData* data, TrainerOptions options, TrainerCallbacks callbacks = {});

  // Loads resume_dir (when given), sizes the run; collective. Called by run() when not called before;
  // call it first to learn total() and start() (e.g. to print a banner).
  void prepare();
  int total() const { return total_; }
  int start() const { return start_; }
  int64_t train_size() const { return train_size_; }
  int64_t eval_size() const { return eval_size_; }

  TrainResult run();

  // Evaluates on the first `count` held-out samples (all when count <= 0); collective.
  EvalResult evaluate(int64_t count);

  // Collective: see RunReport. Call after run().
  RunReport report(const TrainResult& result);

 private:
  int next_boundary(int step, int eval_every) const;

  PipelineRank& rank_;
  std::shared_ptr<Transport> world_, pipeline_;
  const TrainData* data_;
  TrainerOptions o_;
  TrainerCallbacks cb_;
  bool prepared_ = false;
  int total_ = 0, start_ = 0;
  int64_t train_size_ = 0, eval_size_ = 0;
  std::shared_ptr<CheckpointDirLock> save_lock_;  // world rank 0's, with a save_dir
};

// Samples `n` tokens from a language model one at a time: the first stage's rank gives `context`
// ([1, T] token ids; ignored elsewhere), the last stage's output at the final position is sampled at
// `temperature` with a generator seeded by `seed`, and the token travels back to the first stage by an
// all-reduce over `pipeline`. Collective over the pipeline; returns the tokens on every rank.
std::vector<int64_t> generate_tokens(PipelineRank& rank, Transport& pipeline, torch::Tensor context, int n,
                                     double temperature, uint64_t seed);

// The steps of `epochs` passes over `train_size` samples: ceil(epochs * train_size / batch_size); refused
// past 1e9 steps.
int steps_for_epochs(double epochs, int64_t train_size, int64_t batch_size);

}  // namespace pipetrain

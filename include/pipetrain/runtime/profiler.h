// The profiler: measures a model layer by layer, as the planners need it (plan/profile.h). For each
// top-level layer of a torch::nn::Sequential, at one micro-batch size and the current thread count:
//   forward_ms      the layer's forward with autograd recording (as in training), median over repeats;
//   backward_ms     its whole backward for a random output gradient (input and weight gradients);
//   input_grad_ms / weight_grad_ms   B and W measured separately, for layers whose backward splits
//                   (they hold pipetrain::nn::Linear; bw_split says so): B under a WeightGradStore, W
//                   running the store's queue; for other layers bw_split is false (W is empty);
//   activation_bytes  its output for one micro-batch; parameter_bytes its trainable weights;
//   optimizer_bytes   the optimizer's state for them (Adam/AdamW 2x, SGD with momentum 1x, SGD 0);
//   optimizer_ms    one optimizer step over them as a stage's flush takes it (the gradient norm, the
//                   gradients' scaling and the runtime's step of `optimizer`), median over repeats; the
//                   weights are restored afterwards.
// Each layer runs on the previous layer's real output, so shapes and data are those of training.
// Timings are medians of `repeats` runs after `warmup` runs, so one noisy run does not move them.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pipetrain/plan/profile.h"

namespace pipetrain {

struct LayerwiseModel;

struct ProfilerOptions {
  int repeats = 10;               // timed runs per measurement (median)
  int warmup = 2;                 // untimed runs first
  std::string optimizer = "adam"; // adam | adamw | sgd | sgd-momentum: sets optimizer_bytes and optimizer_ms
  // Extra micro-batch sizes to measure forward and backward at (Profile's by_micro_batch, for UMPIPE);
  // the input is cut or tiled to each size.
  std::vector<int> extra_sizes;
  std::string model_name = "model";
  // The training loss and a target batch (rows matching the input's): when both are given, the last
  // layer's forward and backward times include the loss on its output (a micro-batch-mean loss and its
  // backward), as the last stage runs them in training; its activation_bytes stay the layer's output.
  std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)> loss;
  torch::Tensor target;
  // Where to measure: the model (moved there), the input and the target. On a GPU every timing waits for
  // the device, so the times are the kernels' and not their launches', and each timed run is a burst of 4
  // calls back to back (divided by 4), so that the launch and the wait of a lone call, which a stage's
  // chain of layers hides, are not counted per layer; the memory columns (saved_bytes,
  // w_held_bytes) count the caching allocator's bytes in tensors where LibTorch offers them
  // (runtime/device.h; 2.9 on), else the host heap, which a GPU's layers do not use.
  torch::Device device = torch::kCPU;
  // How B and W are measured, as PipelineOptions::backward_split runs them: "auto" (pipetrain::nn::Linear's
  // explicit split for layers of nothing else, autograd's split for any other layer), "autograd" or
  // "explicit" (only nn::Linear splits; other layers' backward is all B).
  std::string backward_split = "auto";
  // Before each timed run (forward, backward, B, W, optimizer step) on the CPU, write a buffer the size of
  // the last-level cache (16-32 MiB), so the run finds its weights, activations and optimizer state in memory as training
  // does (a layer's repeats would otherwise find them in the cache: on the zoo GPT at d_model 128 the runs of
  // a pipeline computed 13-20% slower than such warm timings). false: warm repeats, as before.
  bool cold_caches = true;
};

// Profiles `model` on `input`, one micro-batch (its first dimension is the micro-batch size). The
// model is left in training mode with its gradients cleared. Throws UsageError on bad options.
Profile profile_model(torch::nn::Sequential model, const torch::Tensor& input, const ProfilerOptions& options);
// The same for a model given layer by layer (layers.h): each layer is built (with its own seed, as the
// ranks build it), measured and dropped before the next is built, so no more than one layer's
// parameters are alive at once: a model that does not fit one process can be profiled (and balanced by
// measured time or memory).
Profile profile_model(const LayerwiseModel& model, const torch::Tensor& input, const ProfilerOptions& options);

class Transport;

// What the runtime costs besides compute (plan/profile.h's RuntimeCosts), measured over `transport`:
//  - transfers: ranks 0 and 1 ping-pong float tensors of each of `sizes` bytes (`warmup` untimed, then
//    `iters` timed exchanges); half the median round trip is one sample, fitted to latency + bytes /
//    bandwidth (fit_transfers);
//  - overhead: every rank runs `steps` steps of `schedule` with `microbatches` micro-batches of one
//    sample on a model of one 1x1 linear layer per rank (near-empty layers, as
//    bench/executor_overhead.cpp does); per step and rank, the time between its recorded actions (not
//    compute, receives or the Step: measured_runtime in core/timeline.h) over its compute actions; the
//    median over steps, averaged over the ranks (the train summary's definition of the term).
// Collective over every rank of `transport` (at least 2); returns the same costs on every rank (rank
// 0's transfer samples). `name` is recorded as RuntimeCosts::transport. Throws UsageError on bad options.
//  - the data-parallel all-reduce (RuntimeCosts::allreduce): every rank all-reduces float32 gradients of each
//    of `allreduce_sizes` bytes as a data-parallel step does (one copy into a buffer, the group all-reduce
//    over all ranks, the sum written back divided by the ranks), `warmup` untimed then `allreduce_iters`
//    timed; rank 0's median is one sample. Empty sizes: not measured.
struct RuntimeProfilerOptions {
  std::vector<int64_t> sizes{64, 4096, 65536, 1048576};  // bytes per message (multiples of 4)
  std::vector<int64_t> allreduce_sizes{262144, 1048576, 4194304};  // bytes of gradients (multiples of 4)
  int allreduce_iters = 20;
  int iters = 50;
  int warmup = 5;
  std::string schedule = "1f1b";
  int microbatches = 8;
  int steps = 50;
};
RuntimeCosts profile_runtime(const std::shared_ptr<Transport>& transport, const std::string& name,
                             const RuntimeProfilerOptions& options = {});

}  // namespace pipetrain

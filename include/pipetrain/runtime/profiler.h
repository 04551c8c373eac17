// The profiler: measures a model layer by layer, as the planners need it (plan/profile.h). For each
// top-level layer of a torch::nn::Sequential, at one micro-batch size and the current thread count:
//   forward_ms      the layer's forward with autograd recording (as in training), median over repeats;
//   backward_ms     its whole backward for a random output gradient (input and weight gradients);
//   input_grad_ms / weight_grad_ms   B and W measured separately, for layers whose backward splits
//                   (they hold pipetrain::nn::Linear; bw_split says so): B under a WeightGradStore, W
//                   running the store's queue; for other layers bw_split is false (W is empty);
//   activation_bytes  its output for one micro-batch; parameter_bytes its trainable weights;
//   optimizer_bytes   the optimizer's state for them (Adam/AdamW 2x, SGD with momentum 1x, SGD 0).
// Each layer runs on the previous layer's real output, so shapes and data are those of training.
// Timings are medians of `repeats` runs after `warmup` runs, so one noisy run does not move them.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <string>
#include <vector>

#include "pipetrain/plan/profile.h"

namespace pipetrain {

struct ProfilerOptions {
  int repeats = 10;               // timed runs per measurement (median)
  int warmup = 2;                 // untimed runs first
  std::string optimizer = "adam"; // adam | adamw | sgd | sgd-momentum: sets optimizer_bytes
  // Extra micro-batch sizes to measure forward and backward at (Profile's by_micro_batch, for UMPIPE);
  // the input is cut or tiled to each size.
  std::vector<int> extra_sizes;
  std::string model_name = "model";
  // The training loss and a target batch (rows matching the input's): when both are given, the last
  // layer's forward and backward times include the loss on its output (a micro-batch-mean loss and its
  // backward), as the last stage runs them in training; its activation_bytes stay the layer's output.
  std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)> loss;
  torch::Tensor target;
};

// Profiles `model` on `input`, one micro-batch (its first dimension is the micro-batch size). The
// model is left in training mode with its gradients cleared. Throws UsageError on bad options.
Profile profile_model(torch::nn::Sequential model, const torch::Tensor& input, const ProfilerOptions& options);

}  // namespace pipetrain

// Transparency check (docs/ALGORITHMS.md §1.8, P-SYNC-1) on live ranks: one pipelined step against plain
// LibTorch gradient accumulation over the same micro-batches, on any transport. Each rank builds the
// model twice from `factory` (which must be deterministic, e.g. seeded), runs one pipelined step on one
// copy and the plain accumulation on the other, and compares the gradients of the parameters it holds.
// Collective: every rank calls it with the same arguments; every rank gets the same result.
// With options.data_parallel (copies of the pipeline, `transport` being this copy's pipeline): copy k
// trains on the k-th of as many equal shares of the batch as there are copies (the batch size must be a
// multiple of their number: UsageError otherwise), and the averaged gradients are compared with plain
// accumulation over the whole batch; every rank of every copy gets the worst error of all.
#pragma once

#include <functional>
#include <memory>

#include "pipetrain/runtime/executor.h"

namespace pipetrain {

struct VerifyResult {
  double pipeline_loss = 0;
  double reference_loss = 0;
  double max_grad_error = 0;  // max over all parameters of max|g_pipe - g_ref| / (max|g_ref| + 1e-12)
  double loss_error = 0;      // |loss_pipe - loss_ref| / |loss_ref|
  bool ok(double tolerance) const { return max_grad_error <= tolerance && loss_error <= tolerance; }
};

// `loss` is any Loss (loss.h): a tensor loss, a loss over the output and target bundles, or one
// normalised per token (the reference then divides the sum of the micro-batches' sums by their total
// count, as the full batch would).
VerifyResult verify_transparency(const std::function<torch::nn::Sequential()>& factory, const Loss& loss,
                                 const std::shared_ptr<Transport>& transport, PipelineOptions options,
                                 const torch::Tensor& input, const torch::Tensor& target);
// The same with a bundle of inputs (bundle.h) of `batch_size` samples, for models of BundleModules.
VerifyResult verify_transparency(const std::function<torch::nn::Sequential()>& factory, const Loss& loss,
                                 const std::shared_ptr<Transport>& transport, PipelineOptions options,
                                 const Bundle& input, const torch::Tensor& target, int64_t batch_size);
// The same with a bundle of targets (a mask, several labels) for a loss over bundles.
VerifyResult verify_transparency(const std::function<torch::nn::Sequential()>& factory, const Loss& loss,
                                 const std::shared_ptr<Transport>& transport, PipelineOptions options,
                                 const Bundle& input, const Bundle& target, int64_t batch_size);

}  // namespace pipetrain

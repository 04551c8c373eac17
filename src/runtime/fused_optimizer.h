// Internal to pipetrain_runtime: the flush's optimizer step and squared gradient norm, each one pass over
// each parameter.
//
// LibTorch's Adam runs about eight whole-tensor operations per parameter (and allocates the denominator).
// On short steps that is most of the flush: about 0.9 ms for the 266k floats of the MLP's first stage,
// against 0.1-0.2 ms for one loop that reads each element once (docs/BENCHMARKS.md, issue 15).
#pragma once

#include <torch/optim/optimizer.h>

#include <vector>

namespace pipetrain::detail {

// Does what optimizer.step() does. Adam and AdamW without amsgrad, on contiguous float32 CPU parameters and
// gradients, run one loop per parameter (fused_adam_kernel.h) on LibTorch's own state (step, exp_avg,
// exp_avg_sq: checkpoints and weight prediction read it unchanged). The results agree with LibTorch's to a
// few units in the last place (LibTorch may fuse a multiply-add where the loop does not). Anything else
// (SGD, amsgrad, other dtypes) is optimizer.step(); on a device, Adam and AdamW take multi_tensor_adam_step.
void optimizer_step(torch::optim::Optimizer& optimizer);

// On a device (a GPU), Adam and AdamW without amsgrad on dense floating-point tensors take one step of
// LibTorch's arithmetic through its multi-tensor (_foreach) kernels, a handful of launches per parameter
// group instead of about eight per parameter. optimizer_step takes it for parameters on a device; called
// directly it runs on any device (its tests run it on the CPU too). False, with nothing changed, for
// anything else.
bool multi_tensor_adam_step(torch::optim::Optimizer& optimizer);

// Whether optimizer_step would take the fused loop for `optimizer` as it stands now.
bool fused_step_applies(torch::optim::Optimizer& optimizer);

// The sum of the squares of every defined gradient of `params`, in double: one pass per contiguous
// float32 CPU gradient (fused_adam_kernel.h's sum_of_squares), LibTorch operations for any other.
double gradient_sum_of_squares(const std::vector<torch::Tensor>& params);

}  // namespace pipetrain::detail

// Internal to pipetrain_runtime: the Adam/AdamW update as one loop over a parameter's elements, and the
// squared gradient norm as one pass (fused_optimizer.cpp calls them for the executor's flush; fused_adam_kernel.cpp is compiled without errno-setting math so the loop
// vectorises, and without floating-point contraction so every build and CPU computes the same bits).
#pragma once

#include <cstdint>

namespace pipetrain::detail {

// The scalars of one parameter's step, already rounded to float as LibTorch rounds them for a float tensor.
struct AdamScalars {
  float beta1 = 0.9f, one_minus_beta1 = 0.1f;
  float beta2 = 0.999f, one_minus_beta2 = 0.001f;
  float sqrt_bias_correction2 = 1.0f;  // sqrt(1 - beta2^step)
  float eps = 1e-8f;
  float neg_step_size = -1e-3f;  // -lr / (1 - beta1^step)
  float l2 = 0.0f;               // Adam's weight decay: the gradient gains l2 * p
  float decay_factor = 1.0f;     // AdamW's decoupled weight decay: p is first scaled by 1 - lr * wd
};

// For each k < n, in this order and with these roundings (LibTorch's Adam and AdamW, one element at a time):
//   p *= decay_factor                      (AdamW only: decay_factor != 1)
//   g' = g + l2 * p                        (Adam only: l2 != 0)
//   m  = m * beta1 + one_minus_beta1 * g'
//   v  = v * beta2 + one_minus_beta2 * g' * g'
//   p  = p + neg_step_size * (m / (sqrt(v) / sqrt_bias_correction2 + eps))
// The four arrays must not overlap.
void adam_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamScalars& s);

// The sum of g[k]^2 over k < n, each square and sum in double: eight partial sums over k mod 8, added
// pairwise at the end, then the tail in order. One pass, no temporaries (the flush's gradient norm).
double sum_of_squares(const float* g, int64_t n);

}  // namespace pipetrain::detail

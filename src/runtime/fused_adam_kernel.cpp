// The fused Adam/AdamW loop (fused_adam_kernel.h). No LibTorch here: this file gets its own flags in
// CMakeLists.txt (-fno-math-errno so sqrt vectorises, -ffp-contract=off so no multiply-add is fused) and
// a copy for AVX2 picked at load time; with contraction off both copies give the same bits.
#include "fused_adam_kernel.h"

#include <cmath>

namespace pipetrain::detail {

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && defined(__linux__)
#define PIPETRAIN_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define PIPETRAIN_CLONES
#endif

namespace {
template <bool kL2>
inline void adam_loop(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                      int64_t n, const AdamScalars& s) {
  const float b1 = s.beta1, a1 = s.one_minus_beta1, b2 = s.beta2, a2 = s.one_minus_beta2;
  const float sbc2 = s.sqrt_bias_correction2, eps = s.eps, step = s.neg_step_size, l2 = s.l2;
  for (int64_t k = 0; k < n; ++k) {
    const float gk = kL2 ? g[k] + l2 * p[k] : g[k];
    const float mk = m[k] * b1 + a1 * gk;
    const float vk = v[k] * b2 + a2 * gk * gk;
    m[k] = mk;
    v[k] = vk;
    p[k] = p[k] + step * (mk / (std::sqrt(vk) / sbc2 + eps));
  }
}
}  // namespace

PIPETRAIN_CLONES
void adam_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamScalars& s) {
  if (s.decay_factor != 1.0f)
    for (int64_t k = 0; k < n; ++k) p[k] = p[k] * s.decay_factor;
  if (s.l2 != 0.0f)
    adam_loop<true>(p, g, m, v, n, s);
  else
    adam_loop<false>(p, g, m, v, n, s);
}

PIPETRAIN_CLONES
double sum_of_squares(const float* g, int64_t n) {
  double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) {
      const double x = g[k + j];
      part[j] += x * x;
    }
  double sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; k < n; ++k) {
    const double x = g[k];
    sum += x * x;
  }
  return sum;
}

}  // namespace pipetrain::detail

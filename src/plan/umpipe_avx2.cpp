// The AVX2 copy of the vectorised evaluator's kernel (umpipe_kernel.h, docs/ALGORITHMS.md §7.3): 4 lanes per
// vector, hardware gathers for the cost tables. Compiled for AVX2 by the pragma below whatever the
// build's flags; umpipe_vector.cpp calls it only when the CPU has AVX2.
#include "umpipe_kernel.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#endif

namespace pipetrain::umpipe_detail {
namespace {
struct Gather {
  template <class vd, class vi>
  static inline __attribute__((always_inline)) vd load(const double* table, const vi& index) {
    static_assert(sizeof(vd) == 32 && sizeof(vi) == 16, "4 doubles, 4 int32 indices");
    // The masked form with a zero source: the unmasked one reads an undefined source, which GCC 12 warns about.
    const __m256d all = _mm256_castsi256_pd(_mm256_set1_epi64x(-1));
    return (vd)_mm256_mask_i32gather_pd(_mm256_setzero_pd(), table, (__m128i)index, all, 8);
  }
};
}  // namespace
}  // namespace pipetrain::umpipe_detail

#define PIPETRAIN_UMPIPE_KERNEL_BODY
#include "umpipe_kernel.h"

namespace pipetrain::umpipe_detail {
void run_avx2(const Job& job) { run_tiles<4>(job); }
}  // namespace pipetrain::umpipe_detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
namespace pipetrain::umpipe_detail {
void run_avx2(const Job&) {}  // never called off x86-64
}  // namespace pipetrain::umpipe_detail
#endif

// The AVX-512 copy of the vectorised evaluator's kernel (umpipe_kernel.h, docs/ALGORITHMS.md §7.3): 8 lanes per
// vector, hardware gathers for the cost tables. Compiled for AVX-512 F, DQ (mask-to-vector moves) and VL by
// the pragma below whatever the build's flags; umpipe_vector.cpp calls it only when the CPU has all three.
#include "umpipe_kernel.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512vl"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl")
#endif

namespace pipetrain::umpipe_detail {
namespace {
struct Gather {
  template <class vd, class vi>
  static inline __attribute__((always_inline)) vd load(const double* table, const vi& index) {
    static_assert(sizeof(vd) == 64 && sizeof(vi) == 32, "8 doubles, 8 int32 indices");
    // The masked form with a zero source: the unmasked one reads an undefined source, which GCC 12 warns about.
    return (vd)_mm512_mask_i32gather_pd(_mm512_setzero_pd(), 0xFF, (__m256i)index, table, 8);
  }
};
}  // namespace
}  // namespace pipetrain::umpipe_detail

#define PIPETRAIN_UMPIPE_KERNEL_BODY
#include "umpipe_kernel.h"

namespace pipetrain::umpipe_detail {
void run_avx512(const Job& job) { run_tiles<8>(job); }
}  // namespace pipetrain::umpipe_detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
namespace pipetrain::umpipe_detail {
void run_avx512(const Job&) {}  // never called off x86-64
}  // namespace pipetrain::umpipe_detail
#endif

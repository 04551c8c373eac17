// Private to src/plan/umpipe_*.cpp: the vectorised evaluator's kernel (docs/ALGORITHMS.md §7.3; the method
// is described at the top of umpipe_vector.cpp).
//
// Why a header included by several files: GCC lowers vector-extension code for the instruction set of
// the function that *defines* it, so a template compiled once for the baseline and inlined into an
// AVX-512 function still runs as scalar code (measured: 10x slower than compiled for AVX-512). Each
// umpipe_<isa>.cpp therefore sets its target with a pragma and then includes this header, and gets
// its own copy of the templates: it includes this header once plainly (the declarations, compiled for
// the baseline, since Job::table is an inline function every file shares), then sets its target, defines
// `struct Gather { template <class vd, class vi> static vd load(const double* table, const vi& index); }`
// in pipetrain::umpipe_detail's unnamed namespace, defines PIPETRAIN_UMPIPE_KERNEL_BODY and includes it
// again. The templates live in an unnamed namespace, so the copies compiled for different instruction
// sets never meet at link time; standard headers must come before the target pragma for the same reason.
#ifndef PIPETRAIN_SRC_PLAN_UMPIPE_KERNEL_H
#define PIPETRAIN_SRC_PLAN_UMPIPE_KERNEL_H

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace pipetrain {
namespace umpipe_detail {

constexpr int kLanes = 8;  // UmpipePopulation::kLanes

// One evaluate() call: the population's arrays, the cost tables and scratch space.
struct Job {
  int p = 0, n = 0, tiles = 0;
  const int32_t* sizes = nullptr;         // [tile][dir][stage][s][lane]
  const int32_t* active = nullptr;        // per row: the slots where some lane ends a micro-batch
  const int32_t* active_count = nullptr;  // per row
  const double* tables = nullptr;         // [kind][stage][b], kind 0 f, 1 g, 2 cF, 3 cB
  double* out = nullptr;                  // kLanes per tile: T
  double* sent = nullptr;                 // scratch [n][kLanes]: R of the row just computed
  double* fill = nullptr;                 // scratch [n][kLanes]: the arrival A at the next row's ends
  double* forward_finish = nullptr;       // scratch [p][kLanes]: EF(j, n_j), the backward rows' e0
  const double* table(int kind, int stage) const {
    return tables + (static_cast<std::size_t>(kind) * static_cast<std::size_t>(p) + static_cast<std::size_t>(stage)) *
                        static_cast<std::size_t>(n + 1);
  }
};

// The kernels, one per instruction set (defined in umpipe_vector.cpp, umpipe_avx2.cpp, umpipe_avx512.cpp).
void run_vector_128(const Job& job);
void run_avx2(const Job& job);
void run_avx512(const Job& job);

}  // namespace umpipe_detail
}  // namespace pipetrain
#endif  // PIPETRAIN_SRC_PLAN_UMPIPE_KERNEL_H

#if defined(PIPETRAIN_UMPIPE_KERNEL_BODY) && !defined(PIPETRAIN_UMPIPE_KERNEL_BODY_DONE)
#define PIPETRAIN_UMPIPE_KERNEL_BODY_DONE
namespace pipetrain {
namespace umpipe_detail {
namespace {

#define PIPETRAIN_INLINE inline __attribute__((always_inline))

template <int W>
struct Vec {
  typedef double d __attribute__((vector_size(8 * W)));
  typedef int32_t i __attribute__((vector_size(4 * W)));
};

// One row of one tile, slots in `list` order (increasing samples). kArrival: the row has a neighbour
// (A is read from `fill`); kSend: its link row R is needed by the next row (written to `sent`).
// Running state per lane: S = sum of t, Sl = S before the current micro-batch, M = the running maximum
// of A_l - S_{l-1}; the same three for the link row (S2, S2l, M2) with E in the place of A.
template <int W, bool kArrival, bool kSend>
PIPETRAIN_INLINE void run_row(const int32_t* z, const int32_t* list, int count, const double* t, const double* c,
                              const double* e0, const double* fill, double* sent, double* finish) {
  typedef typename Vec<W>::d vd;
  typedef typename Vec<W>::i vi;
  constexpr int U = kLanes / W;
  const double inf = std::numeric_limits<double>::infinity();
  const vd zero = {};
  vd S[U], Sl[U], M[U], E[U], E0[U], S2[U], S2l[U], M2[U];
  for (int u = 0; u < U; ++u) {
    S[u] = zero;
    Sl[u] = zero;
    M[u] = zero - inf;
    S2[u] = zero;
    S2l[u] = zero;
    M2[u] = zero - inf;
    std::memcpy(&E0[u], e0 + u * W, sizeof(vd));
    E[u] = E0[u];
  }
  for (int a = 0; a < count; ++a) {
    const std::size_t s = static_cast<std::size_t>(list[a]) * kLanes;
    for (int u = 0; u < U; ++u) {
      vi xi;
      std::memcpy(&xi, z + s + u * W, sizeof(vi));
      const vd x = __builtin_convertvector(xi, vd);
      const auto end = x > zero;  // lanes whose micro-batch ends at this sample
      const vd s1 = S[u] + Gather::template load<vd, vi>(t, xi);
      vd arr = zero;
      if (kArrival) std::memcpy(&arr, fill + s + u * W, sizeof(vd));
      const vd d = arr - Sl[u];
      M[u] = end ? (M[u] > d ? M[u] : d) : M[u];
      Sl[u] = end ? s1 : Sl[u];
      S[u] = s1;
      E[u] = s1 + (E0[u] > M[u] ? E0[u] : M[u]);
      if (kSend) {
        const vd s2 = S2[u] + Gather::template load<vd, vi>(c, xi);
        const vd d2 = E[u] - S2l[u];
        M2[u] = end ? (M2[u] > d2 ? M2[u] : d2) : M2[u];
        S2l[u] = end ? s2 : S2l[u];
        S2[u] = s2;
        const vd r = s2 + (M2[u] > zero ? M2[u] : zero);
        std::memcpy(sent + s + u * W, &r, sizeof(vd));
      }
    }
  }
  for (int u = 0; u < U; ++u) std::memcpy(finish + u * W, &E[u], sizeof(vd));
}

// For every slot of the next row's list, the R of the first micro-batch of this row that ends at or
// after it (§7.3's idx): a reverse merge of the two sorted slot lists. Sample N-1 ends a micro-batch in
// every lane of both rows, so the first slot visited sets every lane.
template <int W>
PIPETRAIN_INLINE void carry_back(const int32_t* z, const int32_t* list, int count, const int32_t* next, int next_count,
                                 const double* sent, double* fill) {
  typedef typename Vec<W>::d vd;
  typedef typename Vec<W>::i vi;
  constexpr int U = kLanes / W;
  const vd zero = {};
  vd cur[U];
  for (int u = 0; u < U; ++u) cur[u] = zero;
  int a = count - 1;
  for (int b = next_count - 1; b >= 0; --b) {
    const int target = next[b];
    for (; a >= 0 && list[a] >= target; --a) {
      const std::size_t s = static_cast<std::size_t>(list[a]) * kLanes;
      for (int u = 0; u < U; ++u) {
        vi xi;
        vd r;
        std::memcpy(&xi, z + s + u * W, sizeof(vi));
        std::memcpy(&r, sent + s + u * W, sizeof(vd));
        const vd x = __builtin_convertvector(xi, vd);
        cur[u] = x > zero ? r : cur[u];
      }
    }
    for (int u = 0; u < U; ++u)
      std::memcpy(fill + static_cast<std::size_t>(target) * kLanes + u * W, &cur[u], sizeof(vd));
  }
}

template <int W, bool kArrival, bool kSend>
PIPETRAIN_INLINE void row_for(const Job& job, int tile, int dir, int j, const double* e0, double* finish) {
  const std::size_t row =
      (static_cast<std::size_t>(tile) * 2 + static_cast<std::size_t>(dir)) * static_cast<std::size_t>(job.p) +
      static_cast<std::size_t>(j);
  run_row<W, kArrival, kSend>(job.sizes + row * static_cast<std::size_t>(job.n) * kLanes,
                              job.active + row * static_cast<std::size_t>(job.n), job.active_count[row],
                              job.table(dir == 0 ? 0 : 1, j), job.table(dir == 0 ? 2 : 3, j), e0, job.fill, job.sent,
                              finish);
}

template <int W>
PIPETRAIN_INLINE void carry_for(const Job& job, int tile, int dir, int j, int next_j) {
  auto row = [&](int jj) {
    return (static_cast<std::size_t>(tile) * 2 + static_cast<std::size_t>(dir)) * static_cast<std::size_t>(job.p) +
           static_cast<std::size_t>(jj);
  };
  carry_back<W>(job.sizes + row(j) * static_cast<std::size_t>(job.n) * kLanes,
                job.active + row(j) * static_cast<std::size_t>(job.n), job.active_count[row(j)],
                job.active + row(next_j) * static_cast<std::size_t>(job.n), job.active_count[row(next_j)], job.sent,
                job.fill);
}

// All tiles: forward rows j = 0..p-1, then backward rows j = p-1..0; T = max_j EB(j, r_j).
template <int W>
PIPETRAIN_INLINE void run_tiles(const Job& job) {
  const int p = job.p;
  const double zero[kLanes] = {};
  double finish[kLanes];
  for (int tile = 0; tile < job.tiles; ++tile) {
    for (int j = 0; j < p; ++j) {
      double* fin = job.forward_finish + static_cast<std::size_t>(j) * kLanes;
      const bool arrival = j > 0, send = j + 1 < p;
      if (arrival && send)
        row_for<W, true, true>(job, tile, 0, j, zero, fin);
      else if (arrival)
        row_for<W, true, false>(job, tile, 0, j, zero, fin);
      else if (send)
        row_for<W, false, true>(job, tile, 0, j, zero, fin);
      else
        row_for<W, false, false>(job, tile, 0, j, zero, fin);
      if (send) carry_for<W>(job, tile, 0, j, j + 1);
    }
    double* out = job.out + static_cast<std::size_t>(tile) * kLanes;
    for (int l = 0; l < kLanes; ++l) out[l] = 0;
    for (int j = p - 1; j >= 0; --j) {
      const double* e0 = job.forward_finish + static_cast<std::size_t>(j) * kLanes;
      const bool arrival = j + 1 < p, send = j > 0;
      if (arrival && send)
        row_for<W, true, true>(job, tile, 1, j, e0, finish);
      else if (arrival)
        row_for<W, true, false>(job, tile, 1, j, e0, finish);
      else if (send)
        row_for<W, false, true>(job, tile, 1, j, e0, finish);
      else
        row_for<W, false, false>(job, tile, 1, j, e0, finish);
      for (int l = 0; l < kLanes; ++l) out[l] = out[l] > finish[l] ? out[l] : finish[l];
      if (send) carry_for<W>(job, tile, 1, j, j - 1);
    }
  }
}

#undef PIPETRAIN_INLINE

}  // namespace
}  // namespace umpipe_detail
}  // namespace pipetrain
#endif  // PIPETRAIN_UMPIPE_KERNEL_BODY

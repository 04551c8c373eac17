// TiDGAP's vectorised evaluation (docs/ALGORITHMS.md §7.3) for plan/umpipe.h: a whole population at once.
//
// Level 1 (across individuals): individuals sit in tiles of 8 lanes, structure of arrays, and every
// operation below works on a vector of lanes (GCC/Clang vector extensions: 8 doubles with AVX-512, 4
// with AVX2, 2 with SSE2 or NEON; the x86 width is picked at run time).
// Level 2 (across micro-batches): each row E_k = max(E_{k-1}, A_k) + t_k, E_0 = e0 is computed in its
// max-plus prefix form
//     S_k = sum_{l<=k} t_l,   E_k = S_k + max(e0, max_{l<=k} (A_l - S_{l-1}))
// as one running sum and one running maximum, and the link row R_k = max(R_{k-1}, E_k) + c_k the same
// way with e0 = 0. With lanes, the scan runs over samples rather than micro-batches: slot s holds the
// size of the micro-batch that ends at sample s, or 0 where none ends (size 0, cost 0: the padding of
// §7.3, spread between the micro-batches instead of after them). A padded slot leaves S, the maximum and
// E unchanged, so the result is the recurrence's; slots where no lane of the tile ends a micro-batch are
// skipped altogether.
// Gathers (§7.3's idx): the upstream micro-batch that completes the samples of a downstream micro-batch
// ending at s is the first upstream one ending at or after s. A reverse scan over both rows' slots
// carries the upstream R back to every downstream end, so no index search is needed.
// Costs are read from the evaluator's tables (a gather per lane), so every lane and every instruction
// set computes with the same values and the same operations: results do not depend on the width.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "pipetrain/core/error.h"
#include "pipetrain/plan/umpipe.h"
#include "umpipe_kernel.h"

namespace pipetrain {

// --- population --------------------------------------------------------------------------------------

UmpipePopulation::UmpipePopulation(int stages, int samples, int size) : p_(stages), n_(samples) {
  if (stages < 1 || samples < 1)
    throw UsageError(fmt::format("UmpipePopulation: needs >= 1 stage and >= 1 sample, got {} and {}", stages, samples));
  resize(size);
}

std::size_t UmpipePopulation::row_offset(int tile, int dir, int stage) const {
  return ((static_cast<std::size_t>(tile) * 2 + static_cast<std::size_t>(dir)) * static_cast<std::size_t>(p_) +
          static_cast<std::size_t>(stage)) *
         static_cast<std::size_t>(n_) * kLanes;
}

void UmpipePopulation::write_row(int index, int dir, int stage, const int* sizes, int count) {
  const int tile = index / kLanes, lane = index % kLanes;
  int32_t* z = sizes_.data() + row_offset(tile, dir, stage) + lane;
  for (int s = 0; s < n_; ++s) z[static_cast<std::size_t>(s) * kLanes] = 0;
  int end = 0;
  for (int k = 0; k < count; ++k) {
    end += sizes[k];
    z[static_cast<std::size_t>(end - 1) * kLanes] = sizes[k];
  }
  dirty_[static_cast<std::size_t>(tile)] = 1;
}

void UmpipePopulation::resize(int size) {
  if (size < 0) throw UsageError(fmt::format("UmpipePopulation: size must be >= 0, got {}", size));
  const int old = size_;
  const int tiles = (size + kLanes - 1) / kLanes;
  const auto rows = static_cast<std::size_t>(tiles) * 2 * static_cast<std::size_t>(p_);
  sizes_.resize(rows * static_cast<std::size_t>(n_) * kLanes, 0);
  active_.resize(rows * static_cast<std::size_t>(n_), 0);
  active_count_.resize(rows, 0);
  dirty_.resize(static_cast<std::size_t>(tiles), 1);
  size_ = size;
  // Every lane from the old size on (also the spare lanes of a partial tile) becomes one micro-batch of
  // N, so the evaluator never meets an empty row.
  for (int i = std::min(old, size); i < tiles * kLanes; ++i)
    for (int dir = 0; dir < 2; ++dir)
      for (int j = 0; j < p_; ++j) write_row(i, dir, j, &n_, 1);
}

void UmpipePopulation::set_row(int index, bool backward, int stage, const int* sizes, int count) {
  if (index < 0 || index >= size_ || stage < 0 || stage >= p_)
    throw UsageError(
        fmt::format("UmpipePopulation::set_row: individual {} stage {} out of range ({} individuals, {} stages)", index,
                    stage, size_, p_));
  long long sum = 0;
  for (int k = 0; k < count; ++k) {
    if (sizes[k] < 1)
      throw UsageError(
          fmt::format("UmpipePopulation::set_row: micro-batch {} has {} samples; every one needs >= 1", k, sizes[k]));
    sum += sizes[k];
  }
  if (sum != n_) throw UsageError(fmt::format("UmpipePopulation::set_row: the sizes sum to {}, not N = {}", sum, n_));
  write_row(index, backward ? 1 : 0, stage, sizes, count);
}

void UmpipePopulation::set(int index, const UmpipePlan& plan) {
  check_umpipe_plan(plan, p_, n_);
  for (int j = 0; j < p_; ++j) {
    const auto& x = plan.forward[static_cast<std::size_t>(j)];
    const auto& y = plan.backward[static_cast<std::size_t>(j)];
    set_row(index, false, j, x.data(), static_cast<int>(x.size()));
    set_row(index, true, j, y.data(), static_cast<int>(y.size()));
  }
}

void UmpipePopulation::refresh() const {
  for (std::size_t tile = 0; tile < dirty_.size(); ++tile) {
    if (!dirty_[tile]) continue;
    for (int dir = 0; dir < 2; ++dir)
      for (int j = 0; j < p_; ++j) {
        const std::size_t row =
            (tile * 2 + static_cast<std::size_t>(dir)) * static_cast<std::size_t>(p_) + static_cast<std::size_t>(j);
        const int32_t* z = sizes_.data() + row_offset(static_cast<int>(tile), dir, j);
        int32_t* list = active_.data() + row * static_cast<std::size_t>(n_);
        int count = 0;
        for (int s = 0; s < n_; ++s) {
          const int32_t* lanes = z + static_cast<std::size_t>(s) * kLanes;
          bool any = false;
          for (int l = 0; l < kLanes; ++l) any = any || lanes[l] > 0;
          if (any) list[count++] = s;
        }
        active_count_[row] = count;
      }
    dirty_[tile] = 0;
  }
}

}  // namespace pipetrain

// --- the 128-bit kernel (SSE2 on x86-64, NEON on AArch64; umpipe_kernel.h) -------------------------

#if defined(__GNUC__)
namespace pipetrain::umpipe_detail {
namespace {
struct Gather {
  template <class vd, class vi>
  static inline __attribute__((always_inline)) vd load(const double* table, const vi& index) {
    vd v;
    for (int l = 0; l < static_cast<int>(sizeof(vd) / sizeof(double)); ++l) v[l] = table[index[l]];
    return v;
  }
};
}  // namespace
}  // namespace pipetrain::umpipe_detail
#define PIPETRAIN_UMPIPE_KERNEL_BODY
#include "umpipe_kernel.h"
namespace pipetrain::umpipe_detail {
void run_vector_128(const Job& job) { run_tiles<2>(job); }
}  // namespace pipetrain::umpipe_detail
#else
namespace pipetrain::umpipe_detail {
void run_vector_128(const Job&) {}  // never called: detect() says scalar without vector extensions
}  // namespace pipetrain::umpipe_detail
#endif

namespace pipetrain {
namespace {

enum class Isa { scalar, v128, avx2, avx512 };

Isa detect() {
#if defined(__GNUC__)
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return Isa::avx512;
  if (__builtin_cpu_supports("avx2")) return Isa::avx2;
#endif
  return Isa::v128;
#else
  return Isa::scalar;
#endif
}

std::atomic<int>& chosen() {
  static std::atomic<int> isa{static_cast<int>(detect())};
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    case Isa::v128:
      return "vector-128";
    case Isa::scalar:
      break;
  }
  return "scalar";
}

}  // namespace

const char* UmpipeEvaluator::vector_isa() { return isa_name(static_cast<Isa>(chosen().load())); }

void UmpipeEvaluator::force_vector_isa(const std::string& name) {
  const Isa best = detect();
  Isa want;
  if (name == "scalar")
    want = Isa::scalar;
  else if (name == "vector-128")
    want = Isa::v128;
  else if (name == "avx2")
    want = Isa::avx2;
  else if (name == "avx512")
    want = Isa::avx512;
  else if (name == "best")
    want = best;
  else
    throw UsageError("UmpipeEvaluator::force_vector_isa: unknown \"" + name +
                     "\"; use best, avx512, avx2, vector-128 or scalar");
  if (static_cast<int>(want) > static_cast<int>(best))
    throw UsageError(
        fmt::format("UmpipeEvaluator::force_vector_isa: {} is not available here (best: {})", name, isa_name(best)));
  chosen().store(static_cast<int>(want));
}

std::vector<std::string> UmpipeEvaluator::available_vector_isas() {
  std::vector<std::string> out{"scalar"};
  const Isa best = detect();
  for (Isa isa : {Isa::v128, Isa::avx2, Isa::avx512})
    if (static_cast<int>(isa) <= static_cast<int>(best)) out.emplace_back(isa_name(isa));
  return out;
}

void UmpipeEvaluator::evaluate(const UmpipePopulation& pop, std::vector<double>& step_ms) const {
  if (pop.stages() != p_ || pop.samples() != n_)
    throw UsageError(
        fmt::format("UmpipeEvaluator::evaluate: the population has {} stages and N = {}, the model {} and {}",
                    pop.stages(), pop.samples(), p_, n_));
  step_ms.resize(static_cast<std::size_t>(pop.size()));
  if (pop.size() == 0) return;
  const auto isa = static_cast<Isa>(chosen().load());
  if (isa == Isa::scalar) {
    // No vector extensions (or forced): the scalar recurrence per individual, from the same rows.
    UmpipePlan plan;
    plan.forward.resize(static_cast<std::size_t>(p_));
    plan.backward.resize(static_cast<std::size_t>(p_));
    for (int i = 0; i < pop.size(); ++i) {
      const int tile = i / UmpipePopulation::kLanes, lane = i % UmpipePopulation::kLanes;
      for (int dir = 0; dir < 2; ++dir)
        for (int j = 0; j < p_; ++j) {
          auto& row = (dir == 0 ? plan.forward : plan.backward)[static_cast<std::size_t>(j)];
          row.clear();
          const int32_t* z = pop.sizes_.data() + pop.row_offset(tile, dir, j) + lane;
          for (int s = 0; s < n_; ++s) {
            const int32_t x = z[static_cast<std::size_t>(s) * UmpipePopulation::kLanes];
            if (x > 0) row.push_back(x);
          }
        }
      step_ms[static_cast<std::size_t>(i)] = this->step_ms(plan);
    }
    return;
  }
  pop.refresh();
  constexpr int kLanes = UmpipePopulation::kLanes;
  const int tiles = (pop.size() + kLanes - 1) / kLanes;
  thread_local std::vector<double> sent, fill, out, forward_finish;
  forward_finish.resize(static_cast<std::size_t>(p_) * kLanes);
  sent.resize(static_cast<std::size_t>(n_) * kLanes);
  fill.resize(static_cast<std::size_t>(n_) * kLanes);
  out.resize(static_cast<std::size_t>(tiles) * kLanes);
  umpipe_detail::Job job;
  job.p = p_;
  job.n = n_;
  job.tiles = tiles;
  job.sizes = pop.sizes_.data();
  job.active = pop.active_.data();
  job.active_count = pop.active_count_.data();
  job.tables = tables_.data();
  job.out = out.data();
  job.sent = sent.data();
  job.fill = fill.data();
  job.forward_finish = forward_finish.data();
  switch (isa) {
    case Isa::avx512:
      umpipe_detail::run_avx512(job);
      break;
    case Isa::avx2:
      umpipe_detail::run_avx2(job);
      break;
    default:
      umpipe_detail::run_vector_128(job);
      break;
  }
  std::copy(out.begin(), out.begin() + pop.size(), step_ms.begin());
}

}  // namespace pipetrain

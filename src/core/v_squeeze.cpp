// The squeeze of the controllable-memory schedules (Qi, Wan, Amar, Lin, arXiv 2405.15362; the procedure of
// the authors' release, docs/ALGORITHMS.md §4.6.2), in slots of one chunk pass each.
#include "v_squeeze.h"

#include <algorithm>

namespace pipetrain::detail {
namespace {

std::size_t z(int i) { return static_cast<std::size_t>(i); }

std::vector<int> b_slots(const std::array<std::vector<int>, 5>& rank) {
  std::vector<int> bs(rank[2]);
  bs.insert(bs.end(), rank[3].begin(), rank[3].end());
  std::sort(bs.begin(), bs.end());
  return bs;
}

// Puts each W in the first free slot after its B (one W per B, in slot order).
void place_w(VPlan& plan) {
  for (auto& rank : plan) {
    std::vector<int> taken;
    for (int k = 0; k < 4; ++k) taken.insert(taken.end(), rank[z(k)].begin(), rank[z(k)].end());
    std::sort(taken.begin(), taken.end());
    const std::vector<int> bs = b_slots(rank);
    rank[4].clear();
    std::size_t next_b = 0, next_taken = 0;
    int pending = 0;
    for (int slot = 0; rank[4].size() < bs.size(); ++slot) {
      if (next_taken < taken.size() && taken[next_taken] == slot) {
        ++next_taken;
        for (; next_b < bs.size() && bs[next_b] == slot; ++next_b) ++pending;
      } else if (pending > 0) {
        rank[4].push_back(slot);
        --pending;
      }
    }
  }
}

// Peak activation count of one rank in slot order (a chunk's F adds 1, a W frees 1). With `explicit_w`
// false the plan has no W passes and each free slot runs one pending W.
int peak_of(const std::array<std::vector<int>, 5>& rank, bool explicit_w) {
  std::vector<std::pair<int, int>> events;  // (slot, kind)
  for (int k = 0; k < (explicit_w ? 5 : 4); ++k)
    for (int slot : rank[z(k)]) events.push_back({slot, k});
  std::sort(events.begin(), events.end());
  int cur = 0, peak = 0, pending = 0, last = -1;
  for (const auto& [slot, kind] : events) {
    if (!explicit_w) {
      const int idle = std::min(slot - last - 1, pending);
      cur -= idle;
      pending -= idle;
    }
    last = slot;
    if (kind <= 1) ++cur;
    if (kind == 4) --cur;
    if (kind == 2 || kind == 3) ++pending;
    peak = std::max(peak, cur);
  }
  return peak;
}

// The latest slot that a pass must follow: its input from the neighbouring rank (F chunk 0 and B chunk 1
// come from rank r-1, F chunk 1 and B chunk 0 from rank r+1), the micro-batch's previous pass on this
// rank, the same kind's previous micro-batch, and for the k-th W the k-th B.
int ready_after(const VPlan& plan, int r, int kind, int i) {
  const int p = static_cast<int>(plan.size());
  auto slot = [&](int rr, int k, int ii) { return plan[z(rr)][z(k)][z(ii)]; };
  int after = -1;
  if ((kind == 0 || kind == 2) && r > 0) after = std::max(after, slot(r - 1, kind, i));
  if ((kind == 1 || kind == 3) && r < p - 1) after = std::max(after, slot(r + 1, kind, i));
  if (kind >= 1 && kind <= 3) after = std::max(after, slot(r, kind - 1, i));
  if (kind == 4) after = std::max(after, b_slots(plan[z(r)])[z(i)]);
  if (i > 0) after = std::max(after, slot(r, kind, i - 1));
  return after;
}

// Renumbers the slots to the plan's order run at unit time per pass with free transfers: each pass as
// early as its rank and its input allow, which closes the holes the moves left.
void compress(VPlan& plan) {
  const int p = static_cast<int>(plan.size());
  VPlan out = plan;
  std::vector<int> rank_free(z(p), 0);
  for (const VItem& it : v_items(plan)) {
    const int r = it.rank;
    int start = rank_free[z(r)];
    if ((it.kind == 0 || it.kind == 2) && r > 0) start = std::max(start, out[z(r - 1)][z(it.kind)][z(it.index)] + 1);
    if ((it.kind == 1 || it.kind == 3) && r < p - 1)
      start = std::max(start, out[z(r + 1)][z(it.kind)][z(it.index)] + 1);
    out[z(r)][z(it.kind)][z(it.index)] = start;
    rank_free[z(r)] = start + 1;
  }
  plan = std::move(out);
}

// One sweep: walking all passes in slot order, a pass of the warm-up (before rank 0's first B of chunk 0;
// only when `move_warmup`) or of the cool-down (after the first rank's last forward of chunk 0) moves to
// the earliest free slot after what it must follow where its rank's peak memory stays within the plan's
// peak before the sweep; the steady state between stays in place.
void sweep(VPlan& plan, bool explicit_w, bool move_warmup) {
  const int p = static_cast<int>(plan.size());
  const int m = static_cast<int>(plan[0][0].size());
  int peak = 0;
  for (const auto& rank : plan) peak = std::max(peak, peak_of(rank, explicit_w));
  const std::vector<VItem> items = v_items(plan);
  std::vector<std::vector<char>> taken(z(p), std::vector<char>(z(items.back().slot + 1), 0));
  int phase = 0;  // 0 warm-up, 1 steady state, 2 cool-down
  for (const VItem& it : items) {
    if (phase == 0 && it.kind == 3 && it.rank == 0) phase = 1;
    const bool movable = phase == 2 || (phase == 0 && move_warmup);
    if (phase == 1 && it.kind == 0 && it.index == m - 1) phase = 2;
    auto& row = taken[z(it.rank)];
    int& slot = plan[z(it.rank)][z(it.kind)][z(it.index)];
    if (movable) {
      const int original = slot;
      bool moved = false;
      for (int s = ready_after(plan, it.rank, it.kind, it.index) + 1; s < original && !moved; ++s) {
        if (row[z(s)]) continue;
        slot = s;
        moved = peak_of(plan[z(it.rank)], explicit_w) <= peak;
      }
      if (!moved) slot = original;
    }
    row[z(slot)] = 1;
  }
}

}  // namespace

std::vector<VItem> v_items(const VPlan& plan) {
  std::vector<VItem> out;
  for (int r = 0; r < static_cast<int>(plan.size()); ++r)
    for (int k = 0; k < 5; ++k)
      for (int i = 0; i < static_cast<int>(plan[z(r)][z(k)].size()); ++i) out.push_back({plan[z(r)][z(k)][z(i)], r, k, i});
  std::sort(out.begin(), out.end());
  return out;
}

// First with the W passes placed and both ends free to move, then once more without them and only the
// cool-down, each sweep followed by a compaction.
void v_squeeze(VPlan& plan) {
  place_w(plan);
  sweep(plan, true, true);
  compress(plan);
  for (auto& rank : plan) rank[4].clear();
  sweep(plan, false, false);
  place_w(plan);
  compress(plan);
  for (auto& rank : plan) rank[4].clear();
}

}  // namespace pipetrain::detail

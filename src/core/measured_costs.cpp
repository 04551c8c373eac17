// measured_costs and measured_runtime (timeline.h): cost models from a measured timeline.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "pipetrain/core/timeline.h"

namespace pipetrain {

CostModel measured_costs(const Timeline& t, int stages) {
  std::map<std::pair<int, ActionKind>, std::pair<double, int>> sum;  // (stage, kind) -> (total, count)
  for (const TimedAction& e : t.events)
    if (is_compute(e.action.kind)) {
      auto& s = sum[{e.action.stage, e.action.kind}];
      s.first += e.end - e.start;
      ++s.second;
    }
  auto mean = [&](int s, ActionKind k) {
    auto it = sum.find({s, k});
    return it == sum.end() ? 0.0 : it->second.first / it->second.second;
  };
  CostModel c;
  for (int s = 0; s < stages; ++s) {
    StageCost sc;
    sc.f = mean(s, ActionKind::F);
    if (sum.count({s, ActionKind::BW})) {
      sc.b = mean(s, ActionKind::BW);
      sc.w = 0;
    } else {
      sc.b = mean(s, ActionKind::B);
      sc.w = mean(s, ActionKind::W);
    }
    c.stage.push_back(sc);
  }
  return c;
}

MeasuredRuntime measured_runtime(const Timeline& t) {
  // Where each activation (forward output of a stage) and gradient (backward output) was made: the
  // producer's rank and end, keyed by (stage, forward?, micro-batch).
  std::map<std::tuple<int, bool, int>, const TimedAction*> made;
  for (const TimedAction& e : t.events) {
    const ActionKind k = e.action.kind;
    if (k == ActionKind::F || k == ActionKind::B || k == ActionKind::BW)
      made[{e.action.stage, k == ActionKind::F, e.action.index}] = &e;
  }
  std::vector<double> waiting, any;
  std::map<int, double> span_start, span_end, unmodelled;
  std::map<int, int> compute;
  double step = std::numeric_limits<double>::infinity();
  for (const TimedAction& e : t.events) {
    const ActionKind k = e.action.kind;
    auto [lo, fresh] = span_start.emplace(e.rank, e.start);
    if (!fresh) lo->second = std::min(lo->second, e.start);
    auto [hi, fresh_end] = span_end.emplace(e.rank, e.end);
    if (!fresh_end) hi->second = std::max(hi->second, e.end);
    const double d = e.end - e.start;
    if (is_compute(k)) {
      ++compute[e.rank];
      unmodelled[e.rank] -= d;
    } else if (k == ActionKind::Step) {
      step = std::min(step, d);
      unmodelled[e.rank] -= d;
    } else if (k == ActionKind::RecvAct || k == ActionKind::RecvGrad) {
      unmodelled[e.rank] -= d;
      const bool act = k == ActionKind::RecvAct;
      // A skip receive's data was made by its peer stage (the stashing F, or the popping stage's
      // backward); a boundary receive's by the neighbour.
      const int maker = e.action.peer >= 0 ? e.action.peer : act ? e.action.stage - 1 : e.action.stage + 1;
      auto it = made.find({maker, act, e.action.index});
      if (it == made.end() || it->second->rank == e.rank) continue;
      const double gap = e.end - it->second->end;
      if (gap < 0) continue;  // clocks that disagree; not a transfer time
      any.push_back(gap);
      if (e.start <= it->second->end) waiting.push_back(gap);
    }
  }
  MeasuredRuntime m;
  m.transfer_samples = static_cast<int>(waiting.size());
  if (!waiting.empty()) {
    std::sort(waiting.begin(), waiting.end());
    const std::size_t n = waiting.size();
    m.transfer = n % 2 ? waiting[n / 2] : 0.5 * (waiting[n / 2 - 1] + waiting[n / 2]);
  } else if (!any.empty()) {
    m.transfer = *std::min_element(any.begin(), any.end());
  }
  double total = 0;
  int actions = 0;
  for (const auto& [r, lo] : span_start) total += span_end[r] - lo + unmodelled[r];
  for (const auto& [r, n] : compute) actions += n;
  m.overhead = actions > 0 ? std::max(0.0, total / actions) : 0.0;
  m.step = std::isinf(step) ? 0.0 : step;
  return m;
}

CostModel measured_costs_with_runtime(const Timeline& t, int stages) {
  CostModel c = measured_costs(t, stages);
  const MeasuredRuntime m = measured_runtime(t);
  c.comm = m.transfer;
  c.overhead = m.overhead;
  c.step = m.step;
  return c;
}

}  // namespace pipetrain

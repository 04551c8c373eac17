// measured_costs (timeline.h): a cost model from a measured timeline.
#include <map>
#include <utility>

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

}  // namespace pipetrain

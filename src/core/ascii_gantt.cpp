#include <algorithm>
#include <cmath>
#include <string>

#include "pipetrain/core/timeline.h"

namespace pipetrain {

std::string ascii_gantt(const Timeline& t, double chars_per_unit) {
  double t0 = 0, t1 = 0;
  bool any = false;
  for (const TimedAction& e : t.events) {
    t0 = any ? std::min(t0, e.start) : e.start;
    t1 = any ? std::max(t1, e.end) : e.end;
    any = true;
  }
  const auto col = [&](double x) { return static_cast<std::size_t>(std::llround((x - t0) * chars_per_unit)); };
  const std::size_t width = any ? col(t1) : 0;
  std::vector<std::string> rows(static_cast<std::size_t>(t.ranks), std::string(width, '.'));
  for (const TimedAction& e : t.events) {
    if (!is_compute(e.action.kind) && e.action.kind != ActionKind::Step) continue;
    const std::size_t a = col(e.start), b = std::max(col(e.end), a + 1);
    char letter = 'f';
    switch (e.action.kind) {
      case ActionKind::B: letter = 'b'; break;
      case ActionKind::W: letter = 'w'; break;
      case ActionKind::BW: letter = 'B'; break;
      case ActionKind::Step: letter = 'S'; break;
      default: break;
    }
    std::string box = std::string(1, letter) + (e.action.kind == ActionKind::Step ? "" : std::to_string(e.action.index));
    auto& row = rows.at(static_cast<std::size_t>(e.rank));
    if (row.size() < b) row.resize(b, '.');
    for (std::size_t c = a; c < b; ++c) row[c] = c - a < box.size() ? box[c - a] : '-';
  }
  std::string out;
  for (int r = 0; r < t.ranks; ++r) out += "rank " + std::to_string(r) + "  " + rows[static_cast<std::size_t>(r)] + "\n";
  return out;
}

}  // namespace pipetrain

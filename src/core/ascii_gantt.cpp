#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "pipetrain/core/error.h"
#include "pipetrain/core/timeline.h"

namespace pipetrain {

namespace {
std::string short_number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}
}  // namespace

// Rows are held whole (a byte per column per rank); each rank's boxes are drawn in the order its events
// were made, a later one over an earlier one where they overlap.
// The default scale fits the longest label (its letter and micro-batch number) in the shortest compute
// box: at 2 characters f10 and f11 both read "f1", as micro-batch 1 does.
double ascii_chars_per_unit(const TimelineEvents& events) {
  double shortest = 0;
  int largest = 0;
  events.in_order([&](const TimedAction& e) {
    const double d = e.end - e.start;
    if (!is_compute(e.action.kind)) return;
    largest = std::max(largest, e.action.index);
    if (d > 0 && (shortest == 0 || d < shortest)) shortest = d;
  });
  const double label = std::max(2.0, 1.0 + static_cast<double>(std::to_string(largest).size()));
  return shortest > 0 ? label / shortest : label;
}

void write_ascii_gantt(const TimelineEvents& events, TextSink& out, double chars_per_unit) {
  if (!(chars_per_unit > 0) || !std::isfinite(chars_per_unit))
    throw UsageError("a text timeline's characters per time unit must be a finite number > 0, got " +
                     short_number(chars_per_unit));
  const Timeline& t = events.header();
  double t0 = 0, t1 = 0;
  bool any = false;
  events.in_order([&](const TimedAction& e) {
    t0 = any ? std::min(t0, e.start) : e.start;
    t1 = any ? std::max(t1, e.end) : e.end;
    any = true;
  });
  // Costs in small units (us, ns) at 2 characters per unit made rows of gigabytes: beyond the cap, the
  // scale that fits it.
  if (any && (t1 - t0) * chars_per_unit > kMaxAsciiColumns) {
    chars_per_unit = kMaxAsciiColumns / (t1 - t0);
    out.write("(drawn " + std::to_string(static_cast<long long>(kMaxAsciiColumns)) + " characters wide: " +
              short_number(chars_per_unit) + " per time unit)\n");
  }
  const auto col = [&](double x) { return static_cast<std::size_t>(std::llround((x - t0) * chars_per_unit)); };
  const std::size_t width = any ? col(t1) : 0;
  std::vector<std::string> rows(static_cast<std::size_t>(t.ranks), std::string(width, '.'));
  std::string box;
  events.in_order([&](const TimedAction& e) {
    if (!is_compute(e.action.kind) && e.action.kind != ActionKind::Step) return;
    const std::size_t a = col(e.start), b = std::max(col(e.end), a + 1);
    char letter = 'f';
    switch (e.action.kind) {
      case ActionKind::B: letter = 'b'; break;
      case ActionKind::W: letter = 'w'; break;
      case ActionKind::BW: letter = 'B'; break;
      case ActionKind::Step: letter = 'S'; break;
      default: break;
    }
    box.assign(1, letter);
    if (e.action.kind != ActionKind::Step) box += std::to_string(e.action.index);
    auto& row = rows.at(static_cast<std::size_t>(e.rank));
    if (row.size() < b) row.resize(b, '.');
    for (std::size_t c = a; c < b; ++c) row[c] = c - a < box.size() ? box[c - a] : '-';
  });
  for (int r = 0; r < t.ranks; ++r) {
    std::string& row = rows[static_cast<std::size_t>(r)];
    out.write("rank " + std::to_string(r) + "  ");
    row += '\n';
    out.write(row);
    std::string().swap(row);  // written: its memory goes back
  }
}

std::string ascii_gantt(const Timeline& t, double chars_per_unit) {
  StringSink out;
  write_ascii_gantt(TimelineView(t), out, chars_per_unit);
  return std::move(out.text);
}

}  // namespace pipetrain

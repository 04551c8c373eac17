// Tests for pipetrain/core/timeline.h:
//   - compute_metrics: makespan, per-rank busy/span/bubble, bubble fraction and max bubble on hand-built
//     timelines whose numbers are derived by hand below; communication and Step are not busy time; peak
//     in-flight counting with fused BW, with split B/W, with B and no W, with virtual stages, and the
//     start/end tie rule; empty timelines, ranks with no events, and bad events (rank out of range,
//     end < start) rejected with UsageError.
//   - chrome_trace_json: parses back, metadata per rank, one "X" event per action, ts/dur in microseconds
//     for every unit, args (micro vs step), otherData, unknown unit rejected.
//   - gantt_svg: one box rect per action, one legend entry per kind present, row labels, title text,
//     XML escaping of the schedule name, tooltips on every box, labels omitted on narrow boxes, and a
//     minimal well-formedness check (balanced tags).
//   - write_file_atomic: writes, overwrites, leaves no temporary file, and throws (leaving nothing) for a
//     missing directory or a path that cannot be replaced.
#include "pipetrain/core/timeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/simulate.h"

namespace pipetrain {
namespace {

TimedAction ev(int rank, const char* action, double start, double end) {
  return TimedAction{rank, parse_action(action), start, end};
}

// 2 ranks, 2 micro-batches, 1F1B with F = 1 and BW = 2 (no communication time):
//
//   time   0   1   2   3   4   5   6   7   8   9
//   rank 0 [F0][F1]        [ BW0  ]    [ BW1  ]
//   rank 1     [F0][ BW0  ][F1][ BW1  ]
//
// rank 0: busy = 1+1+2+2 = 6, span = 9-0 = 9, bubble = 3
// rank 1: busy = 1+2+1+2 = 6, span = 7-1 = 6, bubble = 0
// makespan = 9; bubble_fraction = 1 - 12/(2*9) = 1/3; max_bubble = 3
// in flight: rank 0 F0 F1 -> 2, then BW0 BW1 -> 0: peak 2; rank 1 alternates F/BW: peak 1.
Timeline one_f_one_b() {
  Timeline t;
  t.schedule = "1f1b";
  t.ranks = 2;
  t.microbatches = 2;
  t.unit = "ms";
  // Deliberately not in time order.
  t.events = {ev(1, "1BW1", 5, 7), ev(0, "0F0", 0, 1), ev(0, "0F1", 1, 2), ev(0, "0BW0", 4, 6),
              ev(0, "0BW1", 7, 9), ev(1, "1F0", 1, 2), ev(1, "1BW0", 2, 4), ev(1, "1F1", 4, 5)};
  return t;
}

TEST(ComputeMetrics, OneFOneBByHand) {
  const Metrics m = compute_metrics(one_f_one_b());
  EXPECT_DOUBLE_EQ(m.makespan, 9.0);
  ASSERT_EQ(m.per_rank.size(), 2u);
  EXPECT_EQ(m.per_rank[0].rank, 0);
  EXPECT_DOUBLE_EQ(m.per_rank[0].busy, 6.0);
  EXPECT_DOUBLE_EQ(m.per_rank[0].span, 9.0);
  EXPECT_DOUBLE_EQ(m.per_rank[0].bubble, 3.0);
  EXPECT_EQ(m.per_rank[0].peak_inflight, 2);
  EXPECT_EQ(m.per_rank[1].rank, 1);
  EXPECT_DOUBLE_EQ(m.per_rank[1].busy, 6.0);
  EXPECT_DOUBLE_EQ(m.per_rank[1].span, 6.0);
  EXPECT_DOUBLE_EQ(m.per_rank[1].bubble, 0.0);
  EXPECT_EQ(m.per_rank[1].peak_inflight, 1);
  EXPECT_DOUBLE_EQ(m.bubble_fraction, 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(m.max_bubble(), 3.0);
  EXPECT_DOUBLE_EQ(m.per_rank[0].peak_memory, 0.0);
}

// Communication and Step count towards the makespan but not towards busy time or span:
//   rank 0: 0F0 [0,2], 0SF0 [2,3]
//   rank 1: 1RF0 [2,3], 1F0 [3,5], 1S0 [5,6]
// makespan = 6 - 0 = 6; rank 0 busy 2 span 2 bubble 0; rank 1 busy 2 span 5-3 = 2 bubble 0;
// bubble_fraction = 1 - 4/(2*6) = 2/3.
TEST(ComputeMetrics, CommAndStepAreNotBusy) {
  Timeline t;
  t.ranks = 2;
  t.events = {ev(0, "0F0", 0, 2), ev(0, "0SF0", 2, 3), ev(1, "1RF0", 2, 3), ev(1, "1F0", 3, 5), ev(1, "1S0", 5, 6)};
  const Metrics m = compute_metrics(t);
  EXPECT_DOUBLE_EQ(m.makespan, 6.0);
  EXPECT_DOUBLE_EQ(m.per_rank[0].busy, 2.0);
  EXPECT_DOUBLE_EQ(m.per_rank[0].span, 2.0);
  EXPECT_DOUBLE_EQ(m.per_rank[0].bubble, 0.0);
  EXPECT_DOUBLE_EQ(m.per_rank[1].busy, 2.0);
  EXPECT_DOUBLE_EQ(m.per_rank[1].span, 2.0);
  EXPECT_DOUBLE_EQ(m.per_rank[1].bubble, 0.0);
  EXPECT_DOUBLE_EQ(m.bubble_fraction, 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(m.max_bubble(), 0.0);
}

// Makespan runs from the earliest start, not from 0: events on [10, 14] give makespan 4.
TEST(ComputeMetrics, MakespanFromFirstStart) {
  Timeline t;
  t.ranks = 1;
  t.events = {ev(0, "0F0", 10, 12), ev(0, "0BW0", 13, 14)};
  const Metrics m = compute_metrics(t);
  EXPECT_DOUBLE_EQ(m.makespan, 4.0);
  EXPECT_DOUBLE_EQ(m.per_rank[0].span, 4.0);
  EXPECT_DOUBLE_EQ(m.per_rank[0].bubble, 1.0);
  EXPECT_DOUBLE_EQ(m.bubble_fraction, 1.0 - 3.0 / 4.0);
}

// One rank, unit-time actions back to back, zero-bubble style B/W split:
//   F0 F1 B0 F2 W0 B1 W1 B2 W2
//   in flight after each: 1 2 2 3 2 2 1 1 0 -> peak 3 (B does not end a micro-batch when its W follows).
TEST(ComputeMetrics, PeakInflightSplitBackwardLeavesOnW) {
  Timeline t;
  t.ranks = 1;
  const char* order[] = {"0F0", "0F1", "0B0", "0F2", "0W0", "0B1", "0W1", "0B2", "0W2"};
  for (int i = 0; i < 9; ++i) t.events.push_back(ev(0, order[i], i, i + 1));
  EXPECT_EQ(compute_metrics(t).per_rank[0].peak_inflight, 3);
}

// B with no W for the pair ends it: F0 B0 F1 F2 B1 B2 -> 1 0 1 2 1 0, peak 2 (3 if B were ignored).
TEST(ComputeMetrics, PeakInflightBWithoutWLeavesOnB) {
  Timeline t;
  t.ranks = 1;
  const char* order[] = {"0F0", "0B0", "0F1", "0F2", "0B1", "0B2"};
  for (int i = 0; i < 6; ++i) t.events.push_back(ev(0, order[i], i, i + 1));
  EXPECT_EQ(compute_metrics(t).per_rank[0].peak_inflight, 2);
}

// Fused BW: F0 F1 F2 BW0 F3 BW1 BW2 BW3 -> 1 2 3 2 3 2 1 0, peak 3.
TEST(ComputeMetrics, PeakInflightFusedBackward) {
  Timeline t;
  t.ranks = 1;
  const char* order[] = {"0F0", "0F1", "0F2", "0BW0", "0F3", "0BW1", "0BW2", "0BW3"};
  for (int i = 0; i < 8; ++i) t.events.push_back(ev(0, order[i], i, i + 1));
  EXPECT_EQ(compute_metrics(t).per_rank[0].peak_inflight, 3);
}

// Virtual stages: rank 0 holds stages 0 and 2; (0,0) and (2,0) are different pairs.
// 0F0 2F0 2BW0 0BW0 -> 1 2 1 0, peak 2.
TEST(ComputeMetrics, PeakInflightCountsPairsPerVirtualStage) {
  Timeline t;
  t.ranks = 2;
  t.virtual_stages = 2;
  t.events = {ev(0, "0F0", 0, 1), ev(0, "2F0", 2, 3), ev(0, "2BW0", 4, 5), ev(0, "0BW0", 6, 7)};
  const Metrics m = compute_metrics(t);
  EXPECT_EQ(m.per_rank[0].peak_inflight, 2);
  EXPECT_EQ(m.per_rank[1].peak_inflight, 0);
}

// Ties in start are broken by end: a zero-length BW0 at t=2 ends before F1 [2,3] does, so BW0 is processed
// first even though F1 comes first in the input, and only one micro-batch is ever in flight.
TEST(ComputeMetrics, PeakInflightTiesBrokenByEnd) {
  Timeline t;
  t.ranks = 1;
  t.events = {ev(0, "0F1", 2, 3), ev(0, "0F0", 0, 1), ev(0, "0BW0", 2, 2), ev(0, "0BW1", 3, 4)};
  EXPECT_EQ(compute_metrics(t).per_rank[0].peak_inflight, 1);
}

TEST(ComputeMetrics, EmptyTimeline) {
  Timeline t;
  t.ranks = 2;
  const Metrics m = compute_metrics(t);
  EXPECT_DOUBLE_EQ(m.makespan, 0.0);
  EXPECT_DOUBLE_EQ(m.bubble_fraction, 0.0);
  EXPECT_DOUBLE_EQ(m.max_bubble(), 0.0);
  ASSERT_EQ(m.per_rank.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(m.per_rank[r].rank, r);
    EXPECT_DOUBLE_EQ(m.per_rank[r].busy, 0.0);
    EXPECT_DOUBLE_EQ(m.per_rank[r].span, 0.0);
    EXPECT_DOUBLE_EQ(m.per_rank[r].bubble, 0.0);
    EXPECT_EQ(m.per_rank[r].peak_inflight, 0);
  }
  Timeline none;  // zero ranks
  EXPECT_TRUE(compute_metrics(none).per_rank.empty());
  EXPECT_DOUBLE_EQ(Metrics{}.max_bubble(), 0.0);
}

// 3 ranks, rank 2 idle: rank 0 F [0,2], rank 1 F [1,3].
// makespan 3; busy 2+2+0 = 4; bubble_fraction = 1 - 4/(3*3) = 5/9; rank 2 all zero.
TEST(ComputeMetrics, RankWithNoEvents) {
  Timeline t;
  t.ranks = 3;
  t.events = {ev(0, "0F0", 0, 2), ev(1, "1F0", 1, 3)};
  const Metrics m = compute_metrics(t);
  ASSERT_EQ(m.per_rank.size(), 3u);
  EXPECT_DOUBLE_EQ(m.makespan, 3.0);
  EXPECT_DOUBLE_EQ(m.bubble_fraction, 5.0 / 9.0);
  EXPECT_EQ(m.per_rank[2].rank, 2);
  EXPECT_DOUBLE_EQ(m.per_rank[2].busy, 0.0);
  EXPECT_DOUBLE_EQ(m.per_rank[2].span, 0.0);
  EXPECT_DOUBLE_EQ(m.per_rank[2].bubble, 0.0);
}

TEST(ComputeMetrics, RankOutOfRangeIsUsageError) {
  Timeline t;
  t.ranks = 2;
  t.events = {ev(2, "2F0", 0, 1)};
  EXPECT_THROW(compute_metrics(t), UsageError);
  t.events = {ev(-1, "0F0", 0, 1)};
  EXPECT_THROW(compute_metrics(t), UsageError);
}

TEST(ComputeMetrics, EndBeforeStartIsUsageError) {
  Timeline t;
  t.ranks = 1;
  t.events = {ev(0, "0F0", 2, 1)};
  EXPECT_THROW(compute_metrics(t), UsageError);
}

// ---------------------------------------------------------------------------------------------------
// Chrome trace JSON

std::vector<nlohmann::json> of_phase(const nlohmann::json& doc, const std::string& ph) {
  std::vector<nlohmann::json> out;
  for (const auto& e : doc.at("traceEvents"))
    if (e.at("ph") == ph) out.push_back(e);
  return out;
}

TEST(ChromeTrace, ParsesWithOneSlicePerAction) {
  const Timeline t = one_f_one_b();
  const auto doc = nlohmann::json::parse(chrome_trace_json(t));
  EXPECT_EQ(doc.at("displayTimeUnit"), "ms");
  const auto& other = doc.at("otherData");
  EXPECT_EQ(other.at("schedule"), "1f1b");
  EXPECT_EQ(other.at("ranks"), 2);
  EXPECT_EQ(other.at("microbatches"), 2);
  EXPECT_EQ(other.at("virtual_stages"), 1);
  EXPECT_EQ(other.at("unit"), "ms");

  const auto slices = of_phase(doc, "X");
  ASSERT_EQ(slices.size(), t.events.size());
  std::multiset<std::string> names;
  for (const auto& s : slices) names.insert(s.at("name").get<std::string>());
  for (const auto& e : t.events) EXPECT_EQ(names.count(to_string(e.action)), 1u) << to_string(e.action);

  // 1BW1 on rank 1 at [5, 7] ms -> ts 5000 us, dur 2000 us.
  bool found = false;
  for (const auto& s : slices) {
    if (s.at("name") != "1BW1") continue;
    found = true;
    EXPECT_EQ(s.at("cat"), "BW");
    EXPECT_EQ(s.at("pid"), 0);
    EXPECT_EQ(s.at("tid"), 1);
    EXPECT_DOUBLE_EQ(s.at("ts").get<double>(), 5000.0);
    EXPECT_DOUBLE_EQ(s.at("dur").get<double>(), 2000.0);
    EXPECT_EQ(s.at("args").at("stage"), 1);
    EXPECT_EQ(s.at("args").at("micro"), 1);
    EXPECT_EQ(s.at("args").at("kind"), "BW");
  }
  EXPECT_TRUE(found);

  const auto meta = of_phase(doc, "M");
  int process = 0, threads = 0, sorts = 0;
  std::set<int> thread_tids;
  for (const auto& e : meta) {
    if (e.at("name") == "process_name") {
      ++process;
      EXPECT_EQ(e.at("args").at("name"), "pipetrain: 1f1b");
    } else if (e.at("name") == "thread_name") {
      ++threads;
      const int tid = e.at("tid").get<int>();
      thread_tids.insert(tid);
      EXPECT_EQ(e.at("args").at("name"), "rank " + std::to_string(tid));
    } else if (e.at("name") == "thread_sort_index") {
      ++sorts;
      EXPECT_EQ(e.at("args").at("sort_index"), e.at("tid"));
    }
  }
  EXPECT_EQ(process, 1);
  EXPECT_EQ(threads, 2);
  EXPECT_EQ(sorts, 2);
  EXPECT_EQ(thread_tids, (std::set<int>{0, 1}));
}

TEST(ChromeTrace, ConvertsEveryUnitToMicroseconds) {
  const std::pair<const char*, double> units[] = {{"ms", 1e3}, {"s", 1e6}, {"us", 1.0}, {"units", 1e3}};
  for (const auto& [unit, scale] : units) {
    Timeline t;
    t.ranks = 1;
    t.unit = unit;
    t.events = {ev(0, "0F3", 0.5, 1.75)};
    const auto slices = of_phase(nlohmann::json::parse(chrome_trace_json(t)), "X");
    ASSERT_EQ(slices.size(), 1u) << unit;
    EXPECT_DOUBLE_EQ(slices[0].at("ts").get<double>(), 0.5 * scale) << unit;
    EXPECT_DOUBLE_EQ(slices[0].at("dur").get<double>(), 1.25 * scale) << unit;
  }
}

TEST(ChromeTrace, StepHasStepArgNotMicro) {
  Timeline t;
  t.ranks = 1;
  t.events = {ev(0, "0S4", 0, 1)};
  const auto slices = of_phase(nlohmann::json::parse(chrome_trace_json(t)), "X");
  ASSERT_EQ(slices.size(), 1u);
  EXPECT_EQ(slices[0].at("name"), "0S4");
  EXPECT_EQ(slices[0].at("cat"), "S");
  EXPECT_EQ(slices[0].at("args").at("step"), 4);
  EXPECT_FALSE(slices[0].at("args").contains("micro"));
}

TEST(ChromeTrace, EmptyTimelineIsValid) {
  Timeline t;
  t.ranks = 2;
  const auto doc = nlohmann::json::parse(chrome_trace_json(t));
  EXPECT_TRUE(of_phase(doc, "X").empty());
  EXPECT_EQ(of_phase(doc, "M").size(), 5u);  // process_name + 2 x (thread_name, thread_sort_index)
}

TEST(ChromeTrace, UnknownUnitIsUsageError) {
  Timeline t;
  t.ranks = 1;
  t.unit = "fortnights";
  t.events = {ev(0, "0F0", 0, 1)};
  EXPECT_THROW(chrome_trace_json(t), UsageError);
}

// ---------------------------------------------------------------------------------------------------
// SVG

std::size_t count(const std::string& haystack, const std::string& needle) {
  std::size_t n = 0;
  for (std::size_t pos = haystack.find(needle); pos != std::string::npos; pos = haystack.find(needle, pos + 1)) ++n;
  return n;
}

// Minimal XML well-formedness: tags balance and nest, the root is <svg>, and every '&' starts an entity.
// Returns an empty string when fine, else what is wrong.
std::string xml_problem(const std::string& s) {
  std::vector<std::string> stack;
  bool seen_root = false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '&') {
      const std::size_t semi = s.find(';', i);
      const std::string ent = semi == std::string::npos ? "" : s.substr(i, semi - i + 1);
      if (ent != "&amp;" && ent != "&lt;" && ent != "&gt;" && ent != "&quot;" && ent != "&apos;")
        return "bad entity at " + std::to_string(i);
      continue;
    }
    if (s[i] == '>' && stack.empty() && seen_root) return "stray '>' at " + std::to_string(i);
    if (s[i] != '<') continue;
    const std::size_t close = s.find('>', i);
    if (close == std::string::npos) return "unterminated tag at " + std::to_string(i);
    std::string tag = s.substr(i + 1, close - i - 1);
    if (tag.find('<') != std::string::npos) return "'<' inside a tag at " + std::to_string(i);
    i = close;
    if (tag.empty()) return "empty tag";
    if (tag[0] == '?' || tag[0] == '!') continue;
    if (tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (stack.empty() || stack.back() != name) return "unbalanced </" + name + ">";
      stack.pop_back();
      continue;
    }
    const bool self_closing = tag.back() == '/';
    const std::string name = tag.substr(0, tag.find_first_of(" \t\n/"));
    if (!seen_root) {
      if (name != "svg") return "root is <" + name + ">";
      seen_root = true;
    } else if (stack.empty()) {
      return "second root <" + name + ">";
    }
    if (!self_closing) stack.push_back(name);
  }
  if (!seen_root) return "no root";
  if (!stack.empty()) return "unclosed <" + stack.back() + ">";
  return "";
}

TEST(GanttSvg, BoxesLegendTitleAndRows) {
  Timeline t = one_f_one_b();
  t.events.push_back(ev(0, "0SF1", 2, 2.5));  // a comm kind and a Step: 4 kinds in all
  t.events.push_back(ev(1, "1S0", 9, 9.5));
  const Metrics m = compute_metrics(t);
  const std::string svg = gantt_svg(t, m);

  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_EQ(count(svg, "<svg"), 1u);
  EXPECT_EQ(count(svg, "</svg>"), 1u);
  EXPECT_EQ(count(svg, "class=\"box\""), t.events.size());
  EXPECT_EQ(count(svg, "<title>"), t.events.size());  // every box is inspectable
  EXPECT_EQ(count(svg, "class=\"legend\""), 4u);      // F, BW, SF, S: only the kinds present
  EXPECT_EQ(count(svg, "class=\"row\""), 2u);
  // background + one row rect per rank + one per action + one legend swatch per kind
  EXPECT_EQ(count(svg, "<rect"), 1u + 2u + t.events.size() + 4u);
  EXPECT_NE(svg.find("F forward"), std::string::npos);
  EXPECT_NE(svg.find("BW backward"), std::string::npos);
  EXPECT_NE(svg.find("SF send activation"), std::string::npos);
  EXPECT_NE(svg.find("S optimizer step"), std::string::npos);
  EXPECT_EQ(svg.find("W weight grad"), std::string::npos);
  EXPECT_EQ(svg.find("B input grad"), std::string::npos);
  EXPECT_NE(svg.find(">rank 0<"), std::string::npos);
  EXPECT_NE(svg.find(">rank 1<"), std::string::npos);
  EXPECT_NE(svg.find("1f1b  p=2  m=2  v=1  bubble fraction=0.368  makespan=9.5 ms"), std::string::npos) << svg;
  EXPECT_NE(svg.find("<title>1BW1 rank 1 [5, 7] ms</title>"), std::string::npos);
  EXPECT_NE(svg.find("time (ms)"), std::string::npos);
}

TEST(GanttSvg, TitleUsesMetricsOfHandBuiltTimeline) {
  const Timeline t = one_f_one_b();
  const std::string svg = gantt_svg(t, compute_metrics(t));
  EXPECT_NE(svg.find("1f1b  p=2  m=2  v=1  bubble fraction=0.333  makespan=9 ms"), std::string::npos);
  EXPECT_EQ(count(svg, "class=\"legend\""), 2u);  // F and BW
}

TEST(GanttSvg, EscapesScheduleName) {
  Timeline t = one_f_one_b();
  t.schedule = "a<b&c>\"d'";
  const std::string svg = gantt_svg(t, compute_metrics(t));
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_NE(svg.find("a&lt;b&amp;c&gt;&quot;d&apos;"), std::string::npos);
  EXPECT_EQ(svg.find("a<b"), std::string::npos);
  EXPECT_EQ(svg.find("b&c"), std::string::npos);
}

// A box far too narrow for its number keeps its rect and tooltip but loses the label.
TEST(GanttSvg, NarrowBoxesHaveNoLabelButKeepTooltip) {
  Timeline t;
  t.ranks = 1;
  t.events = {ev(0, "0F0", 0, 1000), ev(0, "0F1", 1000, 1000.001)};
  const std::string svg = gantt_svg(t, compute_metrics(t));
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_EQ(count(svg, "class=\"box\""), 2u);
  EXPECT_EQ(count(svg, "<title>"), 2u);
  EXPECT_EQ(count(svg, "class=\"micro\""), 1u);
  EXPECT_NE(svg.find("width=\"1.00\""), std::string::npos);  // minimum box width 1 px
}

TEST(GanttSvg, EmptyTimelineIsWellFormed) {
  Timeline t;
  t.schedule = "empty";
  t.ranks = 2;
  const std::string svg = gantt_svg(t, compute_metrics(t));
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_EQ(count(svg, "class=\"box\""), 0u);
  EXPECT_EQ(count(svg, "class=\"legend\""), 0u);
  EXPECT_EQ(count(svg, "class=\"row\""), 2u);
}

// Larger random-ish timeline: structure stays valid for many ranks, kinds and tiny durations.
TEST(GanttSvg, ManyEventsStayWellFormed) {
  Timeline t;
  t.schedule = "stress";
  t.ranks = 8;
  t.unit = "s";
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> dur(0.0, 0.05);
  const char* kinds[] = {"F", "B", "W", "BW", "SF", "RF", "SB", "RB", "S"};
  for (int r = 0; r < 8; ++r) {
    double now = 0.0;
    for (int i = 0; i < 60; ++i) {
      const double d = dur(rng);
      t.events.push_back(ev(r, (std::to_string(r) + kinds[i % 9] + std::to_string(i)).c_str(), now, now + d));
      now += d;
    }
  }
  const std::string svg = gantt_svg(t, compute_metrics(t));
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_EQ(count(svg, "class=\"box\""), t.events.size());
  EXPECT_EQ(count(svg, "class=\"legend\""), 9u);
  EXPECT_NE(svg.find("time (s)"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------------
// write_file_atomic

namespace fs = std::filesystem;

class WriteFileAtomic : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("pipetrain_test_timeline_" + std::to_string(std::random_device{}()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string read(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    return out;
  }

  fs::path dir_;
};

TEST_F(WriteFileAtomic, WritesAndOverwrites) {
  const std::string path = (dir_ / "out.json").string();
  write_file_atomic(path, "hello\n");
  EXPECT_EQ(read(path), "hello\n");
  write_file_atomic(path, std::string("second, longer\0binary", 21));
  EXPECT_EQ(read(path), std::string("second, longer\0binary", 21));
  write_file_atomic(path, "");
  EXPECT_EQ(read(path), "");
  EXPECT_EQ(entries(), std::vector<std::string>{"out.json"});  // no temporary file left
}

TEST_F(WriteFileAtomic, MissingDirectoryThrowsAndLeavesNothing) {
  const std::string path = (dir_ / "missing" / "out.svg").string();
  try {
    write_file_atomic(path, "x");
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir_ / "missing"));
  EXPECT_TRUE(entries().empty());
}

// A symbolic link stays a link (a rename over it had put a regular file in its place and left its target
// stale), relative and dangling ones included; a file replaced keeps its permissions.
TEST_F(WriteFileAtomic, LinksStayLinksAndFilesKeepTheirMode) {
  fs::create_directories(dir_ / "real");
  const fs::path file = dir_ / "real" / "log.jsonl";
  write_file_atomic(file.string(), "old\n");
  fs::create_symlink("real/log.jsonl", dir_ / "link.jsonl");  // relative to the link's folder
  write_file_atomic((dir_ / "link.jsonl").string(), "new\n");
  EXPECT_TRUE(fs::is_symlink(dir_ / "link.jsonl"));
  EXPECT_EQ(read(file), "new\n");
  fs::create_symlink(dir_ / "real" / "later.svg", dir_ / "dangling.svg");  // absolute, to a file not yet there
  write_file_atomic((dir_ / "dangling.svg").string(), "<svg/>");
  EXPECT_TRUE(fs::is_symlink(dir_ / "dangling.svg"));
  EXPECT_EQ(read(dir_ / "real" / "later.svg"), "<svg/>");
  fs::permissions(file, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);  // 0640
  write_file_atomic(file.string(), "again\n");
  EXPECT_EQ(fs::status(file).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  std::vector<std::string> real;
  for (const auto& e : fs::directory_iterator(dir_ / "real")) real.push_back(e.path().filename().string());
  std::sort(real.begin(), real.end());
  EXPECT_EQ(real, (std::vector<std::string>{"later.svg", "log.jsonl"}));  // no temporary file left
}

// A folder as the target is a usage error naming the path and the fix (issue 23; it was a failed rename
// after the temporary file was written): no temporary file is left and the folder is untouched.
TEST_F(WriteFileAtomic, FolderTargetIsRefusedAndLeftUntouched) {
  const fs::path target = dir_ / "is_a_dir";
  fs::create_directories(target / "child");
  try {
    write_file_atomic(target.string(), "x");
    ADD_FAILURE() << "a folder was accepted as the target";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(target.string() + "': it is a folder; give the path of a file"),
              std::string::npos) << e.what();
  }
  EXPECT_EQ(entries(), std::vector<std::string>{"is_a_dir"});
  EXPECT_TRUE(fs::is_directory(target / "child"));
}

}  // namespace
}  // namespace pipetrain

namespace pipetrain {
namespace {

// Costs in ns drew 2 characters per ns: rows of gigabytes (simulate --ascii with --cost 1e9:1e9:1e9 never
// finished). simulate's scale gives the shortest action 2 characters; any row is at most kMaxAsciiColumns.
TEST(AsciiGantt, TheScaleFollowsTheCostUnitAndRowsAreBounded) {
  Timeline t = one_f_one_b();
  EXPECT_DOUBLE_EQ(ascii_chars_per_unit(TimelineView(t)), 2.0);  // F = 1: as before
  EXPECT_EQ(ascii_gantt(t, ascii_chars_per_unit(TimelineView(t))), ascii_gantt(t));
  for (TimedAction& e : t.events) {
    e.start *= 1e9;
    e.end *= 1e9;
  }
  const double scale = ascii_chars_per_unit(TimelineView(t));
  EXPECT_DOUBLE_EQ(scale, 2e-9);
  Timeline unit = one_f_one_b();
  EXPECT_EQ(ascii_gantt(t, scale), ascii_gantt(unit));  // the same drawing at the unit's scale
  // At 2 characters per ns: capped, and said.
  const std::string capped = ascii_gantt(t, 2.0);
  EXPECT_EQ(capped.rfind("(drawn 100000 characters wide", 0), 0u) << capped.substr(0, 80);
  EXPECT_LT(capped.size(), 3 * 100100u);
  for (double bad : {0.0, -1.0, std::nan("")}) EXPECT_THROW(ascii_gantt(t, bad), UsageError);
}

// With 10 or more micro-batches, 2 characters cut f10 and f11 to "f1", micro-batch 1's label: the scale
// now fits the longest label in the shortest compute box.
TEST(AsciiGantt, EveryLabelFitsItsBox) {
  const Schedule s = pipetrain::one_f_one_b(2, 12);
  const SimResult r = simulate(s, CostModel::uniform(2, StageCost{}));
  const double scale = ascii_chars_per_unit(TimelineView(r.timeline));
  EXPECT_DOUBLE_EQ(scale, 3.0);
  const std::string drawn = ascii_gantt(r.timeline, scale);
  for (const std::string label : {"f10", "f11", "B10", "B11", "f1-", "f9-"})
    EXPECT_NE(drawn.find(label), std::string::npos) << label << "\n" << drawn;
}

}  // namespace
}  // namespace pipetrain

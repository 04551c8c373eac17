// Tests for the streamed writers (timeline.h: write_chrome_trace, write_gantt_svg, write_ascii_gantt,
// write_file_atomic with a producer), the simulator's compact timeline (simulate.h: SimTimeline) and
// predict_heap's walk without lowering (heap.h), all made for `simulate` at p = 512, m = 2048 (issue 28):
//   - the Chrome trace, written piece by piece, is the text the previous writer made with a nlohmann::json
//     document (kept below as the reference), byte for byte, on random timelines with ties, zero-length
//     events, steps, transfers and a schedule name that needs escaping;
//   - simulate_compact's timeline draws the same trace, SVG and ASCII chart as simulate()'s Timeline,
//     with the same metrics, for schedules with ties across ranks (equal costs and comm), virtual stages,
//     split backwards, skips, replication and several steps; by_start visits the events in the stable
//     start order of the simulator's run;
//   - a producer that throws, or a write that fails, leaves no file and no temporary file, and an
//     existing file keeps its old contents;
//   - predict_heap equals the largest sample of heap_walk (which always lowers) with and without bytes
//     on the transfers.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/heap.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/timeline.h"

namespace pipetrain {
namespace {

// The Chrome trace writer as it was before the writers streamed (a nlohmann::json document, dumped).
std::string reference_chrome_trace(const Timeline& t) {
  const double scale = t.unit == "s" ? 1e6 : t.unit == "us" ? 1.0 : 1e3;
  using nlohmann::json;
  json events = json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", "pipetrain: " + t.schedule}}}});
  for (int r = 0; r < t.ranks; ++r) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", r},
                      {"args", {{"name", "rank " + std::to_string(r)}}}});
    events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", 0}, {"tid", r}, {"args", {{"sort_index", r}}}});
  }
  std::vector<std::size_t> order(t.events.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const TimedAction &x = t.events[a], &y = t.events[b];
    if (x.rank != y.rank) return x.rank < y.rank;
    if (x.start != y.start) return x.start < y.start;
    return x.end < y.end;
  });
  for (std::size_t i : order) {
    const TimedAction& e = t.events[i];
    const std::string kind(kind_name(e.action.kind));
    json args = {{"stage", e.action.stage}, {"kind", kind}};
    args[e.action.kind == ActionKind::Step ? "step" : "micro"] = e.action.index;
    events.push_back({{"name", to_string(e.action)}, {"cat", kind}, {"ph", "X"}, {"pid", 0}, {"tid", e.rank},
                      {"ts", e.start * scale}, {"dur", (e.end - e.start) * scale}, {"args", std::move(args)}});
  }
  json doc = {{"traceEvents", std::move(events)},
              {"displayTimeUnit", "ms"},
              {"otherData",
               {{"schedule", t.schedule}, {"ranks", t.ranks}, {"microbatches", t.microbatches},
                {"virtual_stages", t.virtual_stages}, {"unit", t.unit}}}};
  return doc.dump() + "\n";
}

// Random events on `ranks` ranks: times on a coarse grid (so starts and ends tie across and within
// ranks), some of zero length, every kind, awkward magnitudes.
Timeline random_timeline(std::mt19937& rng, int ranks, int events, const std::string& unit) {
  Timeline t;
  t.schedule = "rand \"q\" <&> \xc3\xa9\\";
  t.ranks = ranks;
  t.microbatches = 3;
  t.virtual_stages = 2;
  t.unit = unit;
  std::uniform_int_distribution<int> rank(0, ranks - 1), grid(0, 12), len(0, 3), kind(0, 8), micro(0, 40);
  const double scales[] = {1.0, 0.1, 1e-7, 12345.678, 1.0 / 3.0};
  for (int i = 0; i < events; ++i) {
    const double s = scales[static_cast<std::size_t>(i) % 5];
    const double start = grid(rng) * s;
    Action a;
    a.kind = static_cast<ActionKind>(kind(rng));
    a.stage = rank(rng);
    a.index = micro(rng);
    t.events.push_back(TimedAction{rank(rng), a, start, start + len(rng) * s});
  }
  return t;
}

TEST(StreamedTrace, EqualsTheDocumentWritersTextOnRandomTimelines) {
  std::mt19937 rng(28);
  for (const char* unit : {"ms", "s", "us", "units"})
    for (int round = 0; round < 10; ++round) {
      const Timeline t = random_timeline(rng, 1 + round % 4, 5 * round, unit);
      ASSERT_EQ(chrome_trace_json(t), reference_chrome_trace(t)) << unit << " round " << round;
    }
  Timeline empty;
  empty.ranks = 2;
  EXPECT_EQ(chrome_trace_json(empty), reference_chrome_trace(empty));
}

// The pieces the sink receives concatenate to the string form, and none exceeds the writer's buffer
// by more than one formatted event.
TEST(StreamedTrace, ComesInBoundedPieces) {
  std::mt19937 rng(7);
  const Timeline t = random_timeline(rng, 4, 6000, "ms");
  struct Pieces : TextSink {
    void write(std::string_view bytes) override {
      text.append(bytes);
      largest = std::max(largest, bytes.size());
      ++count;
    }
    std::string text;
    std::size_t largest = 0, count = 0;
  } pieces;
  write_chrome_trace(TimelineView(t), pieces);
  EXPECT_EQ(pieces.text, chrome_trace_json(t));
  EXPECT_GT(pieces.count, 2u);
  EXPECT_LT(pieces.largest, 64u * 1024 + 1024);
}

struct Case {
  const char* what;
  Schedule schedule;
  CostModel costs;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  const auto with = [](const Schedule& s, double comm, StageCost c = {}) {
    return CostModel::uniform(s.stages, c, s.virtual_stages_per_rank(), comm);
  };
  Schedule s = one_f_one_b(4, 8);
  out.push_back({"1f1b, unit costs, no comm (ties across ranks)", s, with(s, 0.0)});
  s = zb_h1(5, 10);
  out.push_back({"zb-h1, comm 0.25", s, with(s, 0.25)});
  s = interleaved(4, 8, 2);
  out.push_back({"interleaved v=2, comm 0.5", s, with(s, 0.5, StageCost{2, 2, 2})});
  s = gpipe(3, 5, 2);
  CostModel steps = with(s, 0.1, StageCost{1, 2, 0});
  steps.step = 0.75;
  out.push_back({"gpipe, two steps, step time", s, steps});
  s = zb_v(4, 8);
  out.push_back({"zb-v", s, with(s, 0.0)});
  s = round_robin("1f1b", {2, 1}, 6);
  out.push_back({"1f1b with stage 0 replicated", s, with(s, 0.3)});
  s = one_f_one_b(4, 8);
  s.skips.push_back(SkipEdge{0, 3, 0.5});
  CostModel skip = with(s, 0.1);
  skip.bandwidth = 0.25;
  out.push_back({"1f1b with a skip 0 -> 3", s, skip});
  return out;
}

TEST(CompactTimeline, DrawsWhatTheFullTimelineDraws) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.what);
    const SimResult full = simulate(c.schedule, c.costs);
    const CompactSimResult compact = simulate_compact(c.schedule, c.costs);
    ASSERT_EQ(compact.metrics.per_rank.size(), full.metrics.per_rank.size());
    EXPECT_EQ(compact.metrics.makespan, full.metrics.makespan);
    EXPECT_EQ(compact.metrics.bubble_fraction, full.metrics.bubble_fraction);
    for (std::size_t r = 0; r < full.metrics.per_rank.size(); ++r) {
      EXPECT_EQ(compact.metrics.per_rank[r].busy, full.metrics.per_rank[r].busy);
      EXPECT_EQ(compact.metrics.per_rank[r].peak_inflight, full.metrics.per_rank[r].peak_inflight);
      EXPECT_EQ(compact.metrics.per_rank[r].peak_memory, full.metrics.per_rank[r].peak_memory);
    }
    StringSink trace, svg, ascii;
    write_chrome_trace(compact.timeline, trace);
    write_gantt_svg(compact.timeline, compact.metrics, svg);
    write_ascii_gantt(compact.timeline, ascii);
    EXPECT_EQ(trace.text, reference_chrome_trace(full.timeline));
    EXPECT_EQ(svg.text, gantt_svg(full.timeline, full.metrics));
    EXPECT_EQ(ascii.text, ascii_gantt(full.timeline));
  }
}

TEST(CompactTimeline, ByStartIsTheStableStartOrderOfTheRun) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.what);
    const SimResult full = simulate(c.schedule, c.costs);
    std::vector<TimedAction> expected = full.timeline.events;  // in the order the simulator ran them
    std::stable_sort(expected.begin(), expected.end(), [](const TimedAction& a, const TimedAction& b) {
      return a.start != b.start ? a.start < b.start : a.end < b.end;
    });
    const CompactSimResult compact = simulate_compact(c.schedule, c.costs);
    std::vector<TimedAction> got;
    compact.timeline.by_start([&](const TimedAction& e) { got.push_back(e); });
    ASSERT_EQ(got.size(), expected.size());
    std::size_t ties = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].rank, expected[i].rank) << i;
      EXPECT_EQ(got[i].action, expected[i].action) << i;
      EXPECT_EQ(got[i].start, expected[i].start) << i;
      EXPECT_EQ(got[i].end, expected[i].end) << i;
      if (i > 0 && got[i].start == got[i - 1].start && got[i].end == got[i - 1].end) ++ties;
    }
    if (std::string(c.what).rfind("1f1b, unit", 0) == 0) {
      EXPECT_GT(ties, 0u);  // the order of ties is tested
    }
  }
}

namespace fs = std::filesystem;

class StreamedFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("pipetrain_test_streamed_" + std::to_string(std::random_device{}()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    return out;
  }
  static std::string read(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  fs::path dir_;
};

TEST_F(StreamedFile, WritesWhatTheProducerWrites) {
  const std::string path = (dir_ / "trace.json").string();
  const Schedule s = one_f_one_b(3, 6);
  const SimResult r = simulate(s, CostModel::uniform(s.stages, StageCost{}));
  write_file_atomic(path, [&](TextSink& out) { write_chrome_trace(TimelineView(r.timeline), out); });
  EXPECT_EQ(read(path), chrome_trace_json(r.timeline));
  EXPECT_EQ(entries(), std::vector<std::string>{"trace.json"});
}

// A producer that fails after writing (a bad event, a full disk) leaves neither a new file nor a
// temporary one, and a file already there keeps what it had.
TEST_F(StreamedFile, AFailedProducerLeavesNothingHalfWritten) {
  const std::string fresh = (dir_ / "new.svg").string();
  EXPECT_THROW(write_file_atomic(fresh,
                                 [](TextSink& out) {
                                   out.write(std::string(200000, 'x'));
                                   throw std::runtime_error("producer failed");
                                 }),
               std::runtime_error);
  EXPECT_TRUE(entries().empty());

  const std::string kept = (dir_ / "old.json").string();
  write_file_atomic(kept, "old contents\n");
  Timeline bad;
  bad.ranks = 1;
  bad.events = {TimedAction{0, parse_action("0F0"), 0, 1}, TimedAction{3, parse_action("0F1"), 1, 2}};
  EXPECT_THROW(write_file_atomic(kept, [&](TextSink& out) { write_chrome_trace(TimelineView(bad), out); }),
               UsageError);
  EXPECT_EQ(read(kept), "old contents\n");
  EXPECT_EQ(entries(), std::vector<std::string>{"old.json"});
}

TEST_F(StreamedFile, AFailedWriteToADeviceNamesIt) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  try {
    write_file_atomic("/dev/full", [](TextSink& out) { out.write(std::string(100000, 'x')); });
    FAIL() << "writing /dev/full succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write '/dev/full': writing failed: No space left on device"),
              std::string::npos) << e.what();
  }
}

// predict_heap walks the schedule itself when no transfer carries bytes and it has no skips; the result
// is heap_walk's (which lowers) largest sample, at the same action.
TEST(PredictHeap, EqualsTheLoweredWalksPeak) {
  // w_held 2 (more than the activation, as autograd's split keeps) exercises the heap model's own B/W rule.
  for (const double message : {0.0, 0.5})
  for (const double w_held : {-1.0, 2.0}) {
    for (const Schedule& s : {one_f_one_b(4, 8), zb_h1(4, 8), interleaved(2, 4, 2), gpipe(3, 4)}) {
      SCOPED_TRACE(s.name + " message " + std::to_string(message) + " w_held " + std::to_string(w_held));
      CostModel c = CostModel::uniform(s.stages, StageCost{1, 1, 1, 1.5, 0.25, 0.5, message}, s.virtual_stages_per_rank());
      for (StageCost& sc : c.stage) sc.w_held = w_held;
      for (const HeapOptions& o : {HeapOptions{}, HeapOptions::reference(), HeapOptions{1, 2}}) {
        const HeapWalk walk = heap_walk(s, c, o);
        const std::vector<HeapPeak> peaks = predict_heap(s, c, o);
        ASSERT_EQ(peaks.size(), walk.samples.size());
        for (std::size_t r = 0; r < peaks.size(); ++r) {
          double best = 0;
          std::string after = "-";
          HeapParts parts;
          for (std::size_t k = 0; k < walk.samples[r].size(); ++k)
            if (walk.samples[r][k].total() > best) {
              best = walk.samples[r][k].total();
              parts = walk.samples[r][k];
              after = to_string(walk.lowered.actions[r][k]);
            }
          EXPECT_GT(best, 0.0);
          EXPECT_EQ(peaks[r].total(), best) << "rank " << r;
          EXPECT_EQ(peaks[r].activations, parts.activations) << "rank " << r;
          EXPECT_EQ(peaks[r].gradients, parts.gradients) << "rank " << r;
          EXPECT_EQ(peaks[r].transfers, parts.transfers) << "rank " << r;
          EXPECT_EQ(peaks[r].position < 0 ? std::string("-") : to_string(peaks[r].after), after) << "rank " << r;
        }
      }
    }
  }
}

}  // namespace
}  // namespace pipetrain

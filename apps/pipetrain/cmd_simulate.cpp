// `pipetrain simulate`: predict a schedule's timeline, bubble and memory from per-stage costs.
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>

#include "cli_common.h"
#include "exact_option.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/core/heap.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/simulate_json.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/core/torch_csv.h"
#include "pipetrain/core/validate.h"

namespace pipetrain::cli {

// With a profile the costs are milliseconds and bytes, and the table says so (memory in MiB);
// hand-given costs are the cost model's plain units.
void print_metrics_table(std::ostream& out, const Schedule& s, const SimResult& r, bool profile) {
  const char* ms = profile ? " ms" : "";
  const double memory_unit = profile ? 1048576.0 : 1.0;
  out << fmt::format("schedule {}  p={}  m={}  v={}  steps={}\n", s.name, s.ranks, s.microbatches_per_step,
                     s.virtual_stages_per_rank(), s.steps());
  out << fmt::format("makespan {:.3f}{}   bubble fraction {:.4f}   max per-stage bubble {:.3f}{}\n",
                     r.metrics.makespan, ms, r.metrics.bubble_fraction, r.metrics.max_bubble(), ms);
  for (const SkipEdge& k : s.skips)
    out << fmt::format("skip stage {} -> stage {}, size {} per micro-batch (held by rank {} until its backward)\n",
                       k.from_stage, k.to_stage, k.size, s.rank_of(k.to_stage));
  out << fmt::format("{:>5}  {:>10}  {:>10}  {:>10}  {:>14}  {:>12}\n", "stage", profile ? "busy ms" : "busy",
                     profile ? "span ms" : "span", profile ? "bubble ms" : "bubble", "peak in-flight",
                     profile ? "peak MiB" : "peak memory");
  for (const RankMetrics& m : r.metrics.per_rank)
    out << fmt::format("{:>5}  {:>10.3f}  {:>10.3f}  {:>10.3f}  {:>14}  {:>12.3f}\n", m.rank, m.busy, m.span,
                       m.bubble, m.peak_inflight, m.peak_memory / memory_unit);
}

// A timeline drawn in another unit than the simulator's "units" (milliseconds, for a profile's costs).
class TimelineInUnit : public TimelineEvents {
 public:
  TimelineInUnit(const TimelineEvents& t, const std::string& unit) : t_(t), header_(t.header()) {
    header_.unit = unit;
  }
  const Timeline& header() const override { return header_; }
  void by_rank(const Visit& visit) const override { t_.by_rank(visit); }
  void by_start(const Visit& visit) const override { t_.by_start(visit); }
  void in_order(const Visit& visit) const override { t_.in_order(visit); }

 private:
  const TimelineEvents& t_;
  Timeline header_;
};

// The heap model's prediction per rank (core/heap.h), in MiB for a profile's bytes.
void print_heap_table(std::ostream& out, const std::vector<HeapPeak>& heap, const HeapOptions& policy, bool bytes) {
  const double unit = bytes ? 1048576.0 : 1.0;
  out << fmt::format("predicted heap growth in a step{} ({} receives posted ahead, {} sends in flight):\n",
                     bytes ? ", MiB" : "", policy.receives_ahead, policy.sends_in_flight);
  out << fmt::format("{:>5}  {:>10}  {:>11}  {:>10}  {:>10}  {}\n", "rank", "total", "activations", "gradients",
                     "transfers", "peak after");
  for (std::size_t r = 0; r < heap.size(); ++r) {
    const HeapPeak& h = heap[r];
    out << fmt::format("{:>5}  {:>10.3f}  {:>11.3f}  {:>10.3f}  {:>10.3f}  {}\n", r, h.total() / unit,
                       h.activations / unit, h.gradients / unit, h.transfers / unit,
                       h.position < 0 ? std::string("-") : to_string(h.after));
  }
}

void add_simulate_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<ScheduleFlags>();
  auto json = std::make_shared<bool>(false);
  auto ascii = std::make_shared<bool>(false);
  auto trace = std::make_shared<std::string>();
  auto svg = std::make_shared<std::string>();
  auto format = std::make_shared<std::string>("csv");
  auto letters = std::make_shared<std::string>("detect");
  auto stage_rank = std::make_shared<std::vector<int>>();
  auto exact = std::make_shared<ExactFlags>();
  auto reference = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand("simulate", "predict a schedule's timeline, bubble and memory");
  flags->add_to(*cmd);
  exact->add_to(*cmd);
  cmd->add_option("--format", *format,
                  "format of the --load file: csv (pipetrain's, default) or torch (PyTorch's _dump_csv output)")
      ->check(CLI::IsMember({"csv", "torch"}));
  cmd->add_option("--letters", *letters,
                  "with --format torch: detect (default), current (I input gradient, B full backward) or legacy "
                  "(B input gradient, BW full backward)")
      ->check(CLI::IsMember({"detect", "current", "legacy"}));
  cmd->add_option("--stage-rank", *stage_rank,
                  "with --format torch: the rank of every stage, e.g. 0,1,1,0 (default: the row that names it)")
      ->delimiter(',');
  cmd->add_flag("--reference", *reference,
                "predict the heap of the blocking reference executor (train --reference): no receives posted "
                "ahead, sends complete in place; default: the fast path (4 receives ahead, 4 sends in flight)");
  cmd->add_flag("--json", *json, "print one JSON object instead of the table");
  cmd->add_flag("--ascii", *ascii, "also print a text timeline (one line per stage)");
  cmd->add_option("--trace", *trace, "write a Chrome trace (open in Perfetto or chrome://tracing)");
  cmd->add_option("--svg", *svg, "write an SVG Gantt chart");
  cmd->footer(
      "Stage entries are per rank (a rank holds v virtual stages in interleaved schedules). Bubble per stage "
      "is span - busy; bubble fraction is 1 - sum(busy) / (p * makespan). With --profile it also predicts what a "
      "step adds to each rank's heap: activations, weight gradients and the runtime's transfer buffers "
      "(see docs/ALGORITHMS.md §1.5.1; --json: per_stage[].heap).\n"
      "Examples:\n"
      "  pipetrain simulate --schedule 1f1b --stages 4 --microbatches 8\n"
      "  pipetrain simulate --schedule zb-h1 --stages 4 --microbatches 8 --cost 1:1:1 --json\n"
      "  pipetrain simulate --schedule interleaved -p 4 -m 8 -v 2 --cost 2:2:2 --svg il.svg --trace il.json\n"
      "  pipetrain simulate --schedule zb-auto -p 4 -m 12 --cost 1:1.5:1,1:1:1,1:1:1,2:2:1 --memory-limit 5\n"
      "  pipetrain simulate --schedule zb-auto -p 4 -m 6 --memory-limit 3 --exact   (optimum and the greedy's gap)\n"
      "  pipetrain simulate --load zb1p.csv --format torch --ascii   (a schedule PyTorch dumped with _dump_csv)\n"
      "  pipetrain simulate -s 1f1b -p 4 -m 8 --skip 0:3:0.5 --skip-bandwidth 0.25   (a skip from stage 0 to 3)");
  cmd->callback([=, &exit_code] {
    exit_code = guarded("simulate", [&] {
      refuse_empty_names(cmd, {"--trace", "--svg", "--load", "--profile"});
      check_outputs_apart({{"--trace", *trace}, {"--svg", *svg}}, {{"--load", flags->load}, {"--profile", flags->profile}});
      if (*json && *ascii)
        throw UsageError("--ascii prints a text timeline, which --json leaves out: drop one (--svg or --trace draw "
                         "the timeline beside --json)");
      check_output_path(*trace, "--trace");  // before any work: a bad path is known now
      check_output_path(*svg, "--svg");
      if (*format != "torch" && (*letters != "detect" || !stage_rank->empty()))
        throw UsageError("--letters and --stage-rank apply to --format torch");
      std::vector<std::string> notes;
      Schedule s = *format == "torch" ? flags->load_torch(*letters, *stage_rank, notes) : flags->build();
      ZbExactResult found;
      const bool searched = exact->apply(*flags, s, found);
      if (searched && s.skips.empty()) flags->add_skips(s);  // the searched schedule, with the routes
      const CostModel costs = flags->costs(s);
      // The timeline is kept only for what draws it; the table and --json need the metrics alone, which
      // take a fraction of the memory at large p x m.
      // What draws it gets the compact timeline (8 bytes per action) and writes as it reads it.
      const bool timeline = !trace->empty() || !svg->empty() || *ascii;
      std::optional<CompactSimResult> drawn;
      SimResult r;
      if (timeline) {
        drawn.emplace(simulate_compact(s, costs));
        r.metrics = drawn->metrics;
      } else {
        r.metrics = simulate_metrics(s, costs);
      }
      const HeapOptions policy = *reference ? HeapOptions::reference() : HeapOptions{};
      // With a profile (or byte amounts) the heap model has gradients and messages to add; the table shows
      // it only then, --json always. (It walks the lowered schedule: skipped when nothing shows it.)
      bool heap_inputs = false;
      for (const StageCost& c : costs.stage) heap_inputs |= c.gradient_b + c.gradient_w + c.message > 0;
      const std::vector<HeapPeak> heap =
          *json || heap_inputs ? predict_heap(s, costs, policy) : std::vector<HeapPeak>{};
      const bool profile = !flags->profile.empty();
      std::optional<TimelineInUnit> in_ms;
      if (drawn) in_ms.emplace(drawn->timeline, profile ? "ms" : drawn->timeline.header().unit);
      if (!trace->empty()) write_file_atomic(*trace, [&](TextSink& out) { write_chrome_trace(*in_ms, out); });
      if (!svg->empty()) write_file_atomic(*svg, [&](TextSink& out) { write_gantt_svg(*in_ms, r.metrics, out); });
      if (*json) {
        nlohmann::json j = simulation_json(s, r, heap, policy);
        if (*format == "torch") j["notes"] = notes;
        if (searched)
          j["exact"] = {{"greedy_makespan", found.greedy_makespan}, {"makespan", found.makespan},
                        {"gap_percent", found.gap_percent()}, {"proven", found.proven},
                        {"lower_bound", found.lower_bound}, {"nodes", found.nodes}};
        std::cout << j.dump(2) << "\n";
      } else {
        for (const std::string& n : notes) std::cout << "note: " << escape_controls(n) << "\n";  // may quote the file
        if (searched) std::cout << found.summary() << " (one step)\n";
        print_metrics_table(std::cout, s, r, profile);
        if (heap_inputs) print_heap_table(std::cout, heap, policy, profile);
        if (*ascii) {
          OstreamSink out(std::cout);
          write_ascii_gantt(*in_ms, out, ascii_chars_per_unit(*in_ms));
        }
        if (!trace->empty()) std::cout << "trace written to " << *trace << "\n";
        if (!svg->empty()) std::cout << "timeline written to " << *svg << "\n";
      }
      return kExitOk;
    });
  });
}

}  // namespace pipetrain::cli

// `pipetrain simulate`: predict a schedule's timeline, bubble and memory from per-stage costs.
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli_common.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/timeline.h"

namespace pipetrain::cli {

namespace {

nlohmann::json metrics_json(const Schedule& s, const SimResult& r) {
  nlohmann::json j;
  j["schedule"] = s.name;
  j["stages"] = s.ranks;
  j["virtual_stages"] = s.virtual_stages_per_rank();
  j["microbatches"] = s.microbatches_per_step;
  j["steps"] = s.steps();
  j["makespan"] = r.metrics.makespan;
  j["bubble_fraction"] = r.metrics.bubble_fraction;
  j["max_bubble"] = r.metrics.max_bubble();
  j["per_stage"] = nlohmann::json::array();
  for (const RankMetrics& m : r.metrics.per_rank)
    j["per_stage"].push_back({{"stage", m.rank},
                              {"busy", m.busy},
                              {"span", m.span},
                              {"bubble", m.bubble},
                              {"peak_inflight", m.peak_inflight},
                              {"peak_memory", m.peak_memory}});
  return j;
}

}  // namespace

void print_metrics_table(std::ostream& out, const Schedule& s, const SimResult& r) {
  out << fmt::format("schedule {}  p={}  m={}  v={}  steps={}\n", s.name, s.ranks, s.microbatches_per_step,
                     s.virtual_stages_per_rank(), s.steps());
  out << fmt::format("makespan {:.3f}   bubble fraction {:.4f}   max per-stage bubble {:.3f}\n",
                     r.metrics.makespan, r.metrics.bubble_fraction, r.metrics.max_bubble());
  out << fmt::format("{:>5}  {:>10}  {:>10}  {:>10}  {:>14}  {:>12}\n", "stage", "busy", "span", "bubble",
                     "peak in-flight", "peak memory");
  for (const RankMetrics& m : r.metrics.per_rank)
    out << fmt::format("{:>5}  {:>10.3f}  {:>10.3f}  {:>10.3f}  {:>14}  {:>12.3f}\n", m.rank, m.busy, m.span,
                       m.bubble, m.peak_inflight, m.peak_memory);
}

void add_simulate_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<ScheduleFlags>();
  auto json = std::make_shared<bool>(false);
  auto ascii = std::make_shared<bool>(false);
  auto trace = std::make_shared<std::string>();
  auto svg = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("simulate", "predict a schedule's timeline, bubble and memory");
  flags->add_to(*cmd);
  cmd->add_flag("--json", *json, "print one JSON object instead of the table");
  cmd->add_flag("--ascii", *ascii, "also print a text timeline (one line per stage)");
  cmd->add_option("--trace", *trace, "write a Chrome trace (open in Perfetto or chrome://tracing)");
  cmd->add_option("--svg", *svg, "write an SVG Gantt chart");
  cmd->footer(
      "Stage entries are per rank (a rank holds v virtual stages in interleaved schedules). Bubble per stage "
      "is span - busy; bubble fraction is 1 - sum(busy) / (p * makespan).\n"
      "Examples:\n"
      "  pipetrain simulate --schedule 1f1b --stages 4 --microbatches 8\n"
      "  pipetrain simulate --schedule zb-h1 --stages 4 --microbatches 8 --cost 1:1:1 --json\n"
      "  pipetrain simulate --schedule interleaved -p 4 -m 8 -v 2 --cost 2:2:2 --svg il.svg --trace il.json\n"
      "  pipetrain simulate --schedule zb-auto -p 4 -m 12 --cost 1:1.5:1,1:1:1,1:1:1,2:2:1 --memory-limit 5");
  cmd->callback([=, &exit_code] {
    exit_code = guarded("simulate", [&] {
      const Schedule s = flags->build();
      const SimResult r = simulate(s, flags->costs(s));
      if (!trace->empty()) write_file_atomic(*trace, chrome_trace_json(r.timeline));
      if (!svg->empty()) write_file_atomic(*svg, gantt_svg(r.timeline, r.metrics));
      if (*json) {
        std::cout << metrics_json(s, r).dump(2) << "\n";
      } else {
        print_metrics_table(std::cout, s, r);
        if (*ascii) std::cout << ascii_gantt(r.timeline);
        if (!trace->empty()) std::cout << "trace written to " << *trace << "\n";
        if (!svg->empty()) std::cout << "timeline written to " << *svg << "\n";
      }
      return kExitOk;
    });
  });
}

}  // namespace pipetrain::cli

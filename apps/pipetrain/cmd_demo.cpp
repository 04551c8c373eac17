// `pipetrain demo`: the main job for now. Simulates every schedule on one pipeline, prints a comparison
// table and writes an SVG timeline (and a Chrome trace) per schedule.
#include <fmt/format.h>

#include <filesystem>
#include <iostream>
#include <memory>

#include "cli_common.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/core/validate.h"

namespace pipetrain::cli {

void add_demo_command(CLI::App& app, int& exit_code) {
  struct Flags {
    int stages = 4;
    int microbatches = 8;
    int steps = 2;
    std::string cost = "1:1:1";
    double comm = 0.0;
    std::string out = "pipetrain-demo";
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand("demo", "simulate every schedule side by side and draw their timelines");
  cmd->add_option("--stages,-p", f->stages, "pipeline stages, default 4");
  cmd->add_option("--microbatches,-m", f->microbatches, "micro-batches per step, default 8");
  cmd->add_option("--steps", f->steps, "optimizer steps, default 2 (shows what a flush costs)");
  cmd->add_option("--cost", f->cost, "F:B:W per stage, default 1:1:1");
  cmd->add_option("--comm", f->comm, "transfer time between ranks, default 0");
  cmd->add_option("--out", f->out, "folder for the SVG and trace files, default ./pipetrain-demo");
  cmd->footer("Example:\n  pipetrain demo --stages 4 --microbatches 8 --cost 1:2:1 --out build/demo");
  cmd->callback([f, &exit_code] {
    exit_code = guarded("demo", [&] {
      // Sizes that leave nothing to simulate: every row was "skipped" and the files claimed were never written.
      const std::pair<const char*, std::pair<int, int>> sizes[] = {
          {"--stages", {f->stages, 4}}, {"--microbatches", {f->microbatches, 8}}, {"--steps", {f->steps, 2}}};
      for (const auto& [flag, value] : sizes)
        if (value.first < 1)
          throw UsageError(fmt::format("{} {} leaves nothing to simulate: give {} 1 or more (default {})", flag,
                                       value.first, flag, value.second));
      const auto flags_for = [&](const std::string& name) {
        ScheduleFlags sf;
        sf.schedule = name;
        sf.stages = f->stages;
        sf.microbatches = f->microbatches;
        sf.steps = f->steps;
        sf.cost = f->cost;
        sf.comm = f->comm;
        if (schedule_traits(name).virtual_stages) sf.virtual_stages = 2;
        return sf;
      };
      {  // gpipe takes any sizes: what it refuses (a --cost, a --comm) no schedule takes; said before --out is made
        const ScheduleFlags g = flags_for("gpipe");
        const Schedule s = g.build();
        (void)g.costs(s);
      }
      std::error_code ec;
      if (std::filesystem::exists(f->out, ec) && !std::filesystem::is_directory(f->out, ec))
        throw UsageError("--out " + f->out + " is not a folder: give a folder for the SVG and trace files, e.g. --out " +
                         f->out + "-demo");
      std::filesystem::create_directories(f->out, ec);
      if (ec)
        throw UsageError("--out " + f->out + ": cannot create the folder (" + ec.message() +
                         "): choose a folder you can write");
      check_output_path((std::filesystem::path(f->out) / "gpipe.svg").string(), "--out");
      std::cout << fmt::format("Simulated pipeline: p={} stages, m={} micro-batches per step, {} steps, "
                               "cost F:B:W={}, comm={}\n\n",
                               f->stages, f->microbatches, f->steps, f->cost, f->comm);
      std::cout << fmt::format("{:<19} {:>9} {:>9} {:>10} {:>11} {:>9} {:>9}\n", "schedule", "makespan",
                               "bubble", "max stage", "peak in", "peak mem", "speed-up");
      std::cout << fmt::format("{:<19} {:>9} {:>9} {:>10} {:>11} {:>9} {:>9}\n", "", "", "fraction",
                               "bubble", "flight (s0)", "(s0)", "vs gpipe");
      double gpipe_makespan = 0;
      int written = 0;
      std::string first_skip;  // why the first schedule skipped could not run
      for (const std::string& name : schedule_names()) {
        const ScheduleFlags sf = flags_for(name);
        Schedule s;
        try {
          s = sf.build();
        } catch (const std::exception& e) {
          std::cout << fmt::format("{:<19} skipped: {}\n", name, e.what());
          if (first_skip.empty()) first_skip = name + ": " + e.what();
          continue;
        }
        const SimResult r = simulate(s, sf.costs(s));
        if (name == "gpipe") gpipe_makespan = r.metrics.makespan;
        const RankMetrics& s0 = r.metrics.per_rank.front();
        std::cout << fmt::format("{:<19} {:>9.2f} {:>9.4f} {:>10.2f} {:>11} {:>9.2f} {:>8.2f}x\n",
                                 name + (schedule_traits(name).v_shape            ? " V"
                                         : s.virtual_stages_per_rank() > 1 ? " v=2"
                                                                           : "") +
                                     (s.microbatches_per_step != f->microbatches
                                          ? fmt::format(" m={}*", s.microbatches_per_step)
                                          : ""),
                                 r.metrics.makespan,
                                 r.metrics.bubble_fraction, r.metrics.max_bubble(), s0.peak_inflight,
                                 s0.peak_memory, gpipe_makespan > 0 ? gpipe_makespan / r.metrics.makespan : 1.0);
        const std::string base = (std::filesystem::path(f->out) / name).string();
        write_file_atomic(base + ".svg", gantt_svg(r.timeline, r.metrics));
        write_file_atomic(base + ".trace.json", chrome_trace_json(r.timeline));
        ++written;
      }
      // Nothing simulated (e.g. a --cost or --comm no schedule takes): an error, not a table of skips.
      if (written == 0)
        throw UsageError("no schedule could be simulated with these flags, so no files were written (" + first_skip +
                         ")");
      // The closed forms hold for equal stages and free transfers only (with --comm 0.5 gpipe and 1f1b
      // even differ): elsewhere the note says the table is the simulation's.
      const bool closed_forms = f->cost.find(',') == std::string::npos && f->comm == 0;
      std::cout << fmt::format(
          "\n{}; pipedream and 2bw skip the flush between steps.\n",
          closed_forms ? "For gpipe and 1f1b the makespan is steps*(m+p-1)*(F+B+W) and the bubble fraction (p-1)/(m+p-1)"
                       : "With per-stage --cost or a --comm the closed forms of equal stages (gpipe and 1f1b: "
                         "steps*(m+p-1)*(F+B+W), bubble (p-1)/(m+p-1)) do not hold: the table is the simulation's");
      std::cout << fmt::format(
          "* m=1: pipedream and spectrain step after every micro-batch: their m x steps micro-batches are as many "
          "steps of one (their timelines' titles give both counts).\n"
          "Timelines (SVG) and Chrome traces of the {} schedules simulated written to {}/<schedule>.svg and "
          ".trace.json\n",
          written, f->out);
      return kExitOk;
    });
  });
}

}  // namespace pipetrain::cli

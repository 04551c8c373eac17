// `pipetrain schedule`: print (or save) a schedule's per-rank action lists.
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli_common.h"
#include "exact_option.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/core/torch_csv.h"

namespace pipetrain::cli {

void add_schedule_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<ScheduleFlags>();
  auto lower = std::make_shared<bool>(false);
  auto format = std::make_shared<std::string>("text");
  auto out = std::make_shared<std::string>();
  auto letters = std::make_shared<std::string>("current");
  auto exact = std::make_shared<ExactFlags>();
  auto load_format = std::make_shared<std::string>("csv");
  auto stage_rank = std::make_shared<std::vector<int>>();
  CLI::App* cmd = app.add_subcommand("schedule", "print a schedule: one line per rank with its actions");
  flags->add_to(*cmd);
  exact->add_to(*cmd);
  cmd->add_flag("--lower", *lower, "insert the send and receive actions (deadlock-free on blocking transports)");
  cmd->add_option("--format", *format,
                  "text (one line per rank), csv (loadable with --load) or torch (PyTorch's schedule CSV, which its "
                  "_load_csv reads: compute only, or with communication after --lower)")
      ->check(CLI::IsMember({"text", "csv", "torch"}));
  cmd->add_option("--letters", *letters,
                  "with --format torch: current (I input gradient, B full backward; default) or legacy (B input "
                  "gradient, BW full backward: PyTorch before the I letter)")
      ->check(CLI::IsMember({"current", "legacy"}));
  cmd->add_option("--load-format", *load_format,
                  "format of the --load file: csv (pipetrain's, default) or torch (PyTorch's _dump_csv output, "
                  "its letters detected); with --format csv or torch this converts between the two")
      ->check(CLI::IsMember({"csv", "torch"}));
  cmd->add_option("--stage-rank", *stage_rank,
                  "with --load-format torch: the rank of every stage, e.g. 0,1,1,0 (default: the row that names it)")
      ->delimiter(',');
  cmd->add_option("--out", *out, "write the CSV form (PyTorch's with --format torch) to this file as well");
  cmd->footer(
      "Actions read <stage><KIND><micro-batch>: F forward, B input gradient, W weight gradient, BW fused "
      "backward, SF/RF send/receive activation, SB/RB send/receive gradient, S optimizer step; a transfer "
      "ending @<stage> is a skip transfer to or from that stage (--skip).\n"
      "Examples:\n"
      "  pipetrain schedule --schedule 1f1b --stages 4 --microbatches 8\n"
      "  pipetrain schedule --schedule interleaved --stages 2 --microbatches 4 --virtual 2 --lower\n"
      "  pipetrain schedule --schedule zb-h1 -p 4 -m 8 --format csv > zb.csv\n"
      "  pipetrain schedule --load zb.csv\n"
      "  pipetrain schedule -s zb-auto -p 4 -m 6 --memory-limit 3 --exact   (the optimum; the gap on stderr)\n"
      "  pipetrain schedule -s interleaved -p 2 -m 4 -v 2 --format torch > il.csv   (for PyTorch's _load_csv)\n"
      "  pipetrain schedule --load il.csv --load-format torch --format csv   (PyTorch's CSV as pipetrain's)\n"
      "  pipetrain schedule -s 1f1b -p 4 -m 4 --skip 0:3 --lower   (skip transfers 0SF0@3 ... 0RB0@3)");
  cmd->callback([=, &exit_code] {
    exit_code = guarded("schedule", [&] {
      refuse_empty_names(cmd, {"--out", "--load", "--profile"});
      check_outputs_apart({{"--out", *out}}, {{"--load", flags->load}, {"--profile", flags->profile}});
      check_output_path(*out, "--out");
      if (*load_format != "torch" && !stage_rank->empty())
        throw UsageError("--stage-rank applies to --load-format torch");
      if (*load_format == "torch" && flags->load.empty())
        throw UsageError("--load-format torch reads the file given by --load: add --load FILE.csv");
      std::vector<std::string> notes;
      Schedule s = *load_format == "torch" ? flags->load_torch("detect", *stage_rank, notes) : flags->build();
      for (const std::string& n : notes) std::cerr << "note: " << n << "\n";  // stdout stays the schedule
      ZbExactResult found;
      if (exact->apply(*flags, s, found)) {
        std::cerr << found.summary() << "\n";  // stdout stays the schedule
        if (s.skips.empty()) flags->add_skips(s);
      }
      if (*lower) s = insert_communication(s, flags->costs(s));
      if (*format != "torch" && *letters != "current") throw UsageError("--letters applies to --format torch");
      std::string torch_text;
      if (*format == "torch") {
        TorchCsvWriteOptions w;
        w.letters = parse_torch_letters(*letters);
        torch_text = to_torch_csv(s, w);
      }
      if (!out->empty()) write_file_atomic(*out, *format == "torch" ? torch_text : to_csv(s));
      if (*format == "torch") {
        std::cout << torch_text;
      } else if (*format == "csv") {
        std::cout << to_csv(s);
      } else {
        for (const SkipEdge& k : s.skips)
          std::cout << "skip " << k.from_stage << " -> " << k.to_stage << " size " << k.size << "\n";
        for (int r = 0; r < s.ranks; ++r) std::cout << "rank " << r << ": " << rank_line(s, r) << "\n";
      }
      return kExitOk;
    });
  });
}

}  // namespace pipetrain::cli

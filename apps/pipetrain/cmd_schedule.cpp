// `pipetrain schedule`: print (or save) a schedule's per-rank action lists.
#include <iostream>
#include <memory>

#include "cli_common.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/timeline.h"

namespace pipetrain::cli {

void add_schedule_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<ScheduleFlags>();
  auto lower = std::make_shared<bool>(false);
  auto format = std::make_shared<std::string>("text");
  auto out = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("schedule", "print a schedule: one line per rank with its actions");
  flags->add_to(*cmd);
  cmd->add_flag("--lower", *lower, "insert the send and receive actions (deadlock-free on blocking transports)");
  cmd->add_option("--format", *format, "text (one line per rank) or csv (loadable with --load)")
      ->check(CLI::IsMember({"text", "csv"}));
  cmd->add_option("--out", *out, "write the CSV form to this file as well");
  cmd->footer(
      "Actions read <stage><KIND><micro-batch>: F forward, B input gradient, W weight gradient, BW fused "
      "backward, SF/RF send/receive activation, SB/RB send/receive gradient, S optimizer step.\n"
      "Examples:\n"
      "  pipetrain schedule --schedule 1f1b --stages 4 --microbatches 8\n"
      "  pipetrain schedule --schedule interleaved --stages 2 --microbatches 4 --virtual 2 --lower\n"
      "  pipetrain schedule --schedule zb-h1 -p 4 -m 8 --format csv > zb.csv\n"
      "  pipetrain schedule --load zb.csv");
  cmd->callback([=, &exit_code] {
    exit_code = guarded("schedule", [&] {
      Schedule s = flags->build();
      if (*lower) s = insert_communication(s, flags->costs(s));
      if (!out->empty()) write_file_atomic(*out, to_csv(s));
      if (*format == "csv") {
        std::cout << to_csv(s);
      } else {
        for (int r = 0; r < s.ranks; ++r) std::cout << "rank " << r << ": " << rank_line(s, r) << "\n";
      }
      return kExitOk;
    });
  });
}

}  // namespace pipetrain::cli

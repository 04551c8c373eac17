// pipetrain: plan, simulate and train pipeline-parallel models. One file per subcommand.
//
// Built twice (CMakeLists.txt): as `pipetrain-torch`, every command; and with PIPETRAIN_FRONT as
// `pipetrain`, the torch-free front: it runs schedule, simulate, plan and demo itself, without paying
// LibTorch's start-up, and execs `pipetrain-torch` (next to its own executable) for any other command
// line, with the same arguments, so train, profile, --help, ... behave exactly as before.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "cli_common.h"
#include "pipetrain/core/config.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"

#ifdef PIPETRAIN_FRONT
namespace {

// The commands the front runs itself.
bool front_command(const char* name) {
  for (const char* c : {"schedule", "simulate", "plan", "demo"})
    if (std::strcmp(name, c) == 0) return true;
  return false;
}

// Execs pipetrain-torch next to this executable with argv; returns only when there is none (a build
// without LibTorch, or a pipetrain copied without it), after saying which when the command needs it.
void exec_torch(char** argv, bool needed) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::filesystem::path torch = (ec ? std::filesystem::path(argv[0]) : self).parent_path() / "pipetrain-torch";
  if (::access(torch.c_str(), X_OK) == 0) {
    ::execv(torch.c_str(), argv);
    std::cerr << "pipetrain: error: cannot run " << torch.string() << ": " << std::strerror(errno) << "\n";
    std::exit(pipetrain::cli::kExitFailure);
  }
  if (needed) {
    const std::string command = pipetrain::excerpt(argv[1]);
#ifdef PIPETRAIN_FRONT_CORE_ONLY
    std::cerr << "pipetrain: error: '" << command
              << "' needs LibTorch, and this build has only the torch-free commands (schedule, simulate, plan, "
                 "demo): build pipetrain with LibTorch (configure without -DPIPETRAIN_CORE_ONLY=ON), which adds "
                 "pipetrain-torch next to "
              << (ec ? std::string("pipetrain") : self.string()) << "\n";
#else
    // A build with LibTorch makes both programs side by side: this pipetrain was copied without its
    // pipetrain-torch, or that one is being relinked or was deleted.
    std::error_code exists_ec;
    const bool present = std::filesystem::exists(torch, exists_ec);
    std::cerr << "pipetrain: error: '" << command << "' runs in pipetrain-torch, the program with LibTorch that "
              << "this pipetrain execs, expected next to it at " << torch.string() << ", which "
              << (present ? "is not executable" : "does not exist")
              << ": keep pipetrain and pipetrain-torch in one folder (copy both, or install them with cmake "
                 "--install BUILD --prefix DIR, which puts both in DIR/bin)"
              << (present ? ", or make it executable (chmod +x)"
                          : ", or, in the build folder, build it (cmake --build BUILD --target pipetrain)")
              << "\n";
#endif
    std::exit(pipetrain::cli::kExitUsage);
  }
}

}  // namespace
#endif

namespace {

// Exit status 0 only if what the command printed reached its standard output: `schedule --format csv >
// zb.csv` on a full disk left a cut file and exit 0. A closed pipe (`| head`) is not an error.
int stdout_written() {
  std::cout.flush();
  const bool stream_ok = static_cast<bool>(std::cout);
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0 && !std::ferror(stdout);
  const int err = errno;
  if ((stream_ok && flushed) || err == EPIPE) return pipetrain::cli::kExitOk;
  std::cerr << "pipetrain: error: writing the standard output failed"
            << (err ? std::string(" (") + std::strerror(err) + ")" : std::string())
            << ": what was printed is incomplete; is the disk full?\n";
  return pipetrain::cli::kExitFailure;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace pipetrain::cli;
  // Under a file-size limit (ulimit -f, a batch system's) a write past it killed the process with SIGXFSZ,
  // without a word, in the middle of a save or a log line; ignored (and so for the ranks this process
  // starts), such a write fails with EFBIG, which every writer reports with the file and the reason.
  ::signal(SIGXFSZ, SIG_IGN);
#ifdef PIPETRAIN_FRONT
  if (argc < 2 || !front_command(argv[1])) {
    static const char* torch_commands[] = {"info", "launch", "train", "selftest", "profile"};
    const bool needed = argc >= 2 && std::any_of(std::begin(torch_commands), std::end(torch_commands),
                                                 [&](const char* c) { return std::strcmp(argv[1], c) == 0; });
    exec_torch(argv, needed);  // returns only without pipetrain-torch: then the front's own help and errors
  }
#endif
  CLI::App app{"pipetrain: pipeline-parallel training, planning and simulation on LibTorch"};
  app.require_subcommand(1);
  // A flag given twice takes its last value, so a command line can be extended with overrides.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.footer(
      "Examples:\n"
      "  pipetrain schedule --schedule 1f1b --stages 4 --microbatches 8\n"
      "  pipetrain simulate --schedule zb-h1 --stages 4 --microbatches 8 --cost 1:1:1 --svg zb.svg\n"
      "  pipetrain demo\n"
      "  pipetrain train --stages 2 --schedule zb-h1 --steps 20 --svg run.svg\n"
      "Run 'pipetrain COMMAND --help' for a command's flags.");
  int exit_code = kExitOk;
  add_schedule_command(app, exit_code);
  add_simulate_command(app, exit_code);
  add_demo_command(app, exit_code);
#ifndef PIPETRAIN_FRONT
  add_info_command(app, exit_code);
  add_launch_command(app, exit_code);
  add_train_command(app, exit_code);
  add_selftest_command(app, exit_code);
  add_profile_command(app, exit_code);
#endif
  add_plan_command(app, exit_code);
  for (const char* name : {"simulate", "plan", "schedule", "demo"}) refuse_non_finite(*app.get_subcommand(name));
  for (CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) check_values(*sub);
  set_command_line(argc, argv);
  // An unknown command: said first, as such ("zoo" got CLI11's "A subcommand is required", and `zoo --help`
  // printed the general help with exit 0).
  if (argc > 1 && argv[1][0] != '-') {
    const std::vector<std::string> commands = subcommand_names(app);
    if (std::find(commands.begin(), commands.end(), argv[1]) == commands.end()) {
      const std::string near = pipetrain::nearest_name(argv[1], commands);
      std::cerr << "pipetrain: error: '" << pipetrain::excerpt(argv[1]) << "' is not a command"
                << (near.empty() ? "" : "; did you mean '" + near + "'?") << "\n"
                << "Commands are schedule, simulate, demo, info, launch, train, selftest, profile and plan; run "
                   "'pipetrain --help' for usage.\n";
      return kExitUsage;
    }
  }
  // Flags from a --config file go in ahead of the command line's own.
  std::vector<std::string> args(argv, argv + argc);
  try {
    args = expand_config(args, &app);
  } catch (const pipetrain::UsageError& e) {
    std::cerr << "pipetrain: error: " << pipetrain::escape_controls(e.what()) << "\n";
    return kExitUsage;
  }
  std::vector<char*> expanded;
  for (auto& a : args) expanded.push_back(a.data());
  try {
    app.parse(static_cast<int>(expanded.size()), expanded.data());
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    const std::vector<std::string> original(argv, argv + argc);
    // CLI11's message, as app.exit(e) prints it, but escaped and cut short: it quotes the bad value,
    // which may be a --config file's (a 300 KB string, a terminal escape sequence).
    const std::string message = e.what();
    std::cerr << (message.size() > 400 ? pipetrain::excerpt(message, 400) : pipetrain::escape_controls(message)) << "\n";
    if (original.size() > 1)
      for (CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; }))
        if (s->get_name() == original[1]) {
          const std::string hint = integer_range_hint(*s, message);
          if (!hint.empty()) std::cerr << pipetrain::escape_controls(hint) << "\n";
        }
    std::cerr << "Run with --help for more information.\n";
    // The nearest names for a mistyped subcommand or flag, and where a bad value came from.
    const std::vector<std::string> commands = subcommand_names(app);
    const CLI::App* sub = nullptr;
    if (original.size() > 1) {
      for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; }))
        if (s->get_name() == original[1]) sub = s;
      if (!sub && original[1].rfind("-", 0) != 0) {
        const std::string near = pipetrain::nearest_name(original[1], commands);
        if (!near.empty()) std::cerr << "'" << pipetrain::excerpt(original[1]) << "' is not a command; did you mean '" << near << "'?\n";
      }
    }
    if (sub) {
      const std::vector<std::string> flags = long_flag_names(*sub);
      for (std::size_t i = 2; i < original.size(); ++i) {
        if (original[i] == "--") break;
        if (original[i].rfind("--", 0) != 0) continue;
        const std::string name = original[i].substr(0, original[i].find('='));
        if (std::find(flags.begin(), flags.end(), name) != flags.end()) continue;
        const std::string near = pipetrain::nearest_name(name, flags);
        std::cerr << "pipetrain " << original[1] << " has no flag " << pipetrain::excerpt(name)
                  << (near.empty() ? "" : "; did you mean " + near + "?") << "\n";
      }
      const std::string what = e.what();
      for (std::size_t i = 2; i + 1 < args.size() && args.size() != original.size(); ++i)
        if (args[i].rfind("--", 0) == 0 && args[i] != "--config" &&
            what.find(args[i]) != std::string::npos && std::find(original.begin(), original.end(), args[i]) == original.end()) {
          std::cerr << "the value of " << args[i] << " comes from key '" << args[i].substr(2)
                    << "' of the --config file: fix it there\n";
          break;
        }
    }
    std::cerr << "Commands are schedule, simulate, demo, info, launch, train, selftest, profile and plan; run 'pipetrain --help' for usage.\n";
    return kExitUsage;
  } catch (const pipetrain::UsageError& e) {  // from a flag's own check at parse time (e.g. a --plan file's)
    std::cerr << "pipetrain: error: " << pipetrain::escape_controls(e.what()) << "\n";
    return kExitUsage;
  } catch (const std::exception& e) {
    std::cerr << "pipetrain: error: " << pipetrain::escape_controls(e.what()) << "\n";
    return 1;
  }
  return exit_code == 0 ? stdout_written() : exit_code;
}

// `pipetrain info`: what the linked LibTorch provides (version, threads, BLAS, CUDA).
#include <iostream>
#include <memory>

#include "cli_common.h"
#include "pipetrain/runtime/info.h"

namespace pipetrain::cli {

void add_info_command(CLI::App& app, int& exit_code) {
  auto full = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand("info", "show the LibTorch build, threads, BLAS and CUDA devices");
  cmd->add_flag("--config", *full, "also print LibTorch's full build configuration");
  cmd->footer("Example:\n  pipetrain info --config");
  cmd->callback([=, &exit_code] {
    exit_code = guarded("info", [&] {
      const RuntimeInfo info = runtime_info();
      std::cout << describe(info);
      if (*full) std::cout << info.build_config << "\n";
      return kExitOk;
    });
  });
}

}  // namespace pipetrain::cli

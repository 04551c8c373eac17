// `pipetrain selftest`: the transparency check on live ranks over a real transport. For every
// synchronous schedule and several micro-batch counts, one pipelined step must give the loss and the
// gradients of plain LibTorch gradient accumulation (runtime/verify.h). Exit 0 when all agree.
#include <fmt/format.h>

#include <iostream>
#include <memory>

#include "cli_common.h"
#include "pipetrain/core/error.h"
#include "pipetrain/runtime/verify.h"
#include "run_common.h"

namespace pipetrain::cli {

void add_selftest_command(CLI::App& app, int& exit_code) {
  struct Flags {
    ModelFlags model;
    PipelineFlags pipe;
    std::vector<std::string> schedules{"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-auto"};
    std::vector<int> microbatches{1, 3, 8};
    int64_t batch_size = 12;
    double tolerance = 1e-5;
  };
  auto f = std::make_shared<Flags>();
  f->model.model = "mlp";
  f->model.data = "synthetic";
  f->model.mlp.hidden = 16;
  f->model.gpt.d_model = 16;
  f->model.gpt.heads = 2;
  f->model.gpt.seq_len = 8;
  f->model.gpt.vocab = 11;

  CLI::App* cmd = app.add_subcommand(
      "selftest", "check that pipelined steps give the gradients of plain training, on live ranks");
  f->model.add_to(*cmd);
  f->pipe.add_to(*cmd);
  cmd->add_option("--schedules", f->schedules, "schedules to check; default all synchronous ones");
  cmd->add_option("--microbatch-counts", f->microbatches, "micro-batch counts to check; default 1 3 8");
  cmd->add_option("--batch-size", f->batch_size, "samples per step, default 12");
  cmd->add_option("--tolerance", f->tolerance, "largest relative gradient error accepted, default 1e-5 (fp32)");
  cmd->footer(
      "Examples:\n"
      "  pipetrain selftest --stages 2                      # two local processes over shared memory\n"
      "  pipetrain selftest --stages 4 --transport local    # threads\n"
      "  mpirun -n 2 pipetrain selftest --stages 2 --transport mpi");
  cmd->callback([f, &exit_code] {
    exit_code = guarded("selftest", [&] {
      // Enough layers for 2 virtual stages per rank unless --layers says otherwise.
      if (f->model.layers == 0) f->model.layers = std::max(2, 2 * f->pipe.stages - (f->model.model == "gpt" ? 2 : 0));
      f->model.prepare();
      return run_ranks(f->pipe, cli_argc(), cli_argv(), [&](std::shared_ptr<Transport> t) {
        const bool leader = t->rank() == 0;
        auto data = f->model.dataset();
        const zoo::Batch batch = data->batch(0, f->batch_size);
        int failures = 0, checked = 0;
        for (const std::string& schedule : f->schedules)
          for (int m : f->microbatches) {
            PipelineOptions o = f->pipe.options(f->model.seed);
            o.schedule = schedule;
            o.microbatches = m;
            o.virtual_stages = schedule_traits(schedule).virtual_stages ? 2 : 1;
            if ((schedule == "interleaved" || schedule == "interleaved-zb") && m % f->pipe.stages != 0) continue;
            const VerifyResult r = verify_transparency(f->model.factory(), f->model.loss(), t, o, batch.input, batch.target);
            const bool ok = r.ok(f->tolerance);
            failures += !ok;
            ++checked;
            if (leader)
              std::cout << fmt::format("{:<12} p={} m={}  loss {:.6f} (plain {:.6f})  max gradient error {:.2e}  {}\n",
                                       schedule, f->pipe.stages, m, r.pipeline_loss, r.reference_loss,
                                       r.max_grad_error, ok ? "ok" : "MISMATCH")
                        << std::flush;
          }
        if (leader)
          std::cout << fmt::format("selftest over {}: {} passed, {} failed\n", t->name(), checked - failures, failures);
        return failures == 0 ? 0 : 1;
      });
    });
  });
}

}  // namespace pipetrain::cli

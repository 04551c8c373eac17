// `pipetrain selftest`: the transparency check on live ranks over a real transport. For every
// synchronous schedule and several micro-batch counts, one pipelined step must give the loss and the
// gradients of plain LibTorch gradient accumulation (runtime/verify.h). Exit 0 when all agree.
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>

#include <algorithm>
#include <iostream>
#include <memory>

#include "cli_common.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/runtime/launch.h"
#include "pipetrain/runtime/verify.h"
#include "run_common.h"

namespace pipetrain::cli {

namespace {

// The schedules selftest checks unless told: every synchronous one the runtime runs.
std::vector<std::string> synchronous_schedules() {
  std::vector<std::string> out;
  for (const std::string& name : schedule_names())
    if (schedule_traits(name).synchronous) out.push_back(name);
  return out;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  return out;
}

// One combination to check, or why it is skipped (a micro-batch count or layer count the schedule cannot
// take): the same on every rank, so that every rank runs the same checks.
struct Check {
  std::string schedule;
  int microbatches = 1;
  int virtual_stages = 1;
  std::string skipped;
};

}  // namespace

void add_selftest_command(CLI::App& app, int& exit_code) {
  struct Flags {
    ModelFlags model;
    PipelineFlags pipe;
    std::vector<std::string> schedules;  // empty: every synchronous one
    std::vector<int> microbatches{1, 3, 8};
    int64_t batch_size = 0;  // 0: 12 per copy of the pipeline
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
  // selftest's own defaults (small models, quick to check), not train's, which the shared flags state.
  const auto describe = [cmd](const char* name, const std::string& text) { cmd->get_option(name)->description(text); };
  describe("--model", "gpt (character language model), mlp, cnn (VGG-16 style), resnet or unet; default mlp");
  describe("--data", "synthetic (generated samples), kjv (King James Bible), text (with --text FILE) or fashion-mnist; "
                     "default synthetic");
  describe("--layers",
           "gpt: transformer blocks (the model has layers+2 pipeline layers); mlp: Linear layers; default: enough for "
           "the most stages per rank of the schedules checked (2, or --virtual), at least 2");
  describe("--d-model", "gpt width, default 16");
  describe("--heads", "gpt attention heads, default 2");
  describe("--vocab", "gpt vocabulary with synthetic data (text data sets it), default 11");
  describe("--seq-len", "gpt context length, default 8");
  describe("--hidden", "mlp width and the cnn's fully connected width; default 16 (mlp), 128 (cnn)");
  describe("--schedule", "one schedule to check (as --schedules NAME); default: every synchronous one");
  describe("--microbatches", "one micro-batch count to check (as --microbatch-counts M); default 1, 3 and 8");
  describe("--virtual",
           "virtual stages per rank of interleaved, interleaved-zb and looped-bfs (the V shapes hold 2); default 2");
  describe("--replicas",
           "data parallelism across pipelines: R copies of the pipeline (R x stages ranks), copy k on the k-th 1/R of "
           "--batch-size, gradients averaged per stage, checked against plain training on the whole batch; default 1");
  cmd->add_option("--schedules", f->schedules,
                  "schedules to check; default every synchronous one: " + joined(synchronous_schedules()));
  cmd->add_option("--microbatch-counts", f->microbatches, "micro-batch counts to check; default 1 3 8");
  cmd->add_option("--batch-size", f->batch_size, "samples per step (all copies together); default a --plan's, else 12 per copy");
  cmd->add_option("--tolerance", f->tolerance, "largest relative gradient error accepted, default 1e-5 (fp32)");
  cmd->footer(
      "A schedule that cannot take a micro-batch count (interleaved: a multiple of --stages; the V shapes: enough to\n"
      "fill the V) or the model's layer count is skipped with a line saying why.\n"
      "Examples:\n"
      "  pipetrain selftest --stages 2                      # two local processes over shared memory\n"
      "  pipetrain selftest --stages 4 --transport local    # threads\n"
      "  pipetrain selftest --stages 2 -s zb-v -m 8         # one schedule, one micro-batch count\n"
      "  pipetrain selftest --stages 2 --replicas 2 --transport local   # 2 copies of a 2-stage pipeline\n"
      "  mpirun -n 2 pipetrain selftest --stages 2 --transport mpi");
  cmd->callback([f, cmd, &exit_code] {
    exit_code = guarded("selftest", [&] {
      const auto given = [cmd](const char* name) { return cmd->get_option(name)->count() > 0; };
      PipelineFlags& pipe = f->pipe;
      // nan or a negative tolerance declared exact gradients a MISMATCH (exit 1: a pipeline bug reported for a typo).
      if (!(f->tolerance >= 0) || !std::isfinite(f->tolerance))
        throw UsageError(fmt::format("--tolerance must be a finite number >= 0 (the largest relative gradient error "
                                     "accepted; default 1e-5), got {}", f->tolerance));
      // -s/-m name one value each; --schedules/--microbatch-counts several. A --plan's schedule and
      // micro-batch count stand for -s and -m.
      if (given("--schedule") && given("--schedules"))
        throw UsageError("--schedule " + pipe.schedule + " and --schedules both name the schedules to check: give "
                         "one of them (--schedules A B for several)");
      if (given("--microbatches") && given("--microbatch-counts"))
        throw UsageError("--microbatches " + std::to_string(pipe.microbatches) + " and --microbatch-counts both "
                         "name the micro-batch counts to check: give one of them (--microbatch-counts 2 4 for several)");
      const bool from_plan = given("--plan");
      std::vector<std::string> schedules = f->schedules;
      if (given("--schedule") || (from_plan && !given("--schedules"))) schedules = {pipe.schedule};
      if (schedules.empty()) schedules = synchronous_schedules();
      std::vector<int> counts = f->microbatches;
      if (given("--microbatches") || (from_plan && !given("--microbatch-counts"))) counts = {pipe.microbatches};
      const char* count_flag = given("--microbatches") ? "--microbatches" : "--microbatch-counts";
      for (int m : counts)
        if (m < 1) throw UsageError(std::string(count_flag) + " must be >= 1, got " + std::to_string(m));
      for (const std::string& s : schedules) (void)schedule_traits(s);  // an unknown name: its own error
      // --virtual (or a plan's) counts for the schedules with virtual stages; the V shapes hold 2 whatever.
      const bool virtual_given = given("--virtual") || (from_plan && pipe.virtual_stages > 1);
      if (virtual_given && pipe.virtual_stages < 1)
        throw UsageError("--virtual must be >= 1, got " + std::to_string(pipe.virtual_stages));
      const auto virtual_of = [&](const std::string& s) {
        return schedule_traits(s).virtual_stages ? (virtual_given ? pipe.virtual_stages : 2) : 1;
      };
      if (virtual_given && std::none_of(schedules.begin(), schedules.end(),
                                        [](const std::string& s) { return schedule_traits(s).virtual_stages; }))
        (void)stages_per_rank(schedules.front(), pipe.virtual_stages);  // names the schedules it is for
      // Copies of the pipeline (--replicas): each checks its share of the batch.
      if (pipe.replicas < 1) throw UsageError("--replicas must be >= 1, got " + std::to_string(pipe.replicas));
      if (pipe.replicas > 1 && !pipe.replication.empty())
        throw UsageError("--replication " + pipe.replication + " (replicated stages) and --replicas " +
                         std::to_string(pipe.replicas) + " (copies of the whole pipeline) do not combine: use one or the other");
      const int copies = pipe.replicas;
      if (given("--batch-size") && f->batch_size < 1)
        throw UsageError("--batch-size must be >= 1, got " + std::to_string(f->batch_size));
      const int64_t batch_size = given("--batch-size")       ? f->batch_size
                                 : pipe.plan_batch_size > 0 ? pipe.plan_batch_size  // a --plan's mini-batch
                                                            : 12 * static_cast<int64_t>(copies);
      if (batch_size % copies != 0)
        throw UsageError(fmt::format("--batch-size {} does not split into --replicas {} equal shares: give a multiple "
                                     "of {}, e.g. --batch-size {}",
                                     batch_size, copies, copies, (batch_size / copies + 1) * copies));
      const int64_t share = batch_size / copies;
      (void)pipe.options(f->model.seed);  // --device, --threads: said once, not as every check's skip
      // Enough layers for the most stages per rank checked (2 at least) unless --layers says otherwise.
      if (f->model.layers == 0 && !given("--layers")) {  // (--layers 0 is refused by prepare() below)
        int per_rank = 2;
        for (const std::string& s : schedules) {
          try {
            per_rank = std::max(per_rank, stages_per_rank(s, virtual_of(s)));
          } catch (const UsageError&) {  // skipped below, with the reason
          }
        }
        f->model.layers = std::max(2, pipe.stages * per_rank - (f->model.model == "gpt" ? 2 : 0));
      }
      f->model.prepare();
      // What each rank checks, and what is skipped with the reason.
      const int pipeline_ranks = pipe.world_size() / copies;
      // As train: a model or batch past this host's memory is refused before anything is built (it ended
      // in LibTorch's allocator error, with a stack trace). The check counts the pipeline's model once;
      // the plain reference is another copy, which this lower bound leaves out.
      {
        const bool launched = std::getenv("RANK") || std::getenv("OMPI_COMM_WORLD_RANK");
        // Each copy's share of the batch, cut into the most micro-batches any check uses (a lower bound).
        const int most = counts.empty() ? std::max(1, pipe.microbatches) : *std::max_element(counts.begin(), counts.end());
        f->model.check_fits(share, std::max(1, most),
                            launched ? 1 : std::min(pipe.world_size(), kMaxLocalRanks), pipeline_ranks, 0);
      }
      std::vector<Check> checks;
      for (const std::string& schedule : schedules)
        for (int m : counts) {
          Check c{schedule, m, virtual_of(schedule), ""};
          try {
            PipelineFlags q = pipe;
            q.schedule = schedule;
            q.microbatches = m;
            q.virtual_stages = c.virtual_stages;
            check_balance_flags(q, f->model);
            if (copies > 1 && !schedule_traits(schedule).synchronous)
              throw UsageError("schedule '" + schedule + "' is asynchronous; data parallelism across pipelines "
                               "(replicas) runs with the synchronous schedules");
            check_pipeline_options(q.options(f->model.seed), pipeline_ranks);
            (void)split_equal(share, m);
          } catch (const UsageError& e) {
            c.skipped = e.what();
          }
          checks.push_back(std::move(c));
        }
      if (std::all_of(checks.begin(), checks.end(), [](const Check& c) { return !c.skipped.empty(); })) {
        std::string why;
        for (const Check& c : checks) why += fmt::format("\n  {} m={}: {}", c.schedule, c.microbatches, c.skipped);
        throw UsageError("nothing to check: every schedule and micro-batch count asked for is skipped here:" + why);
      }
      const auto label = [&](const Check& c) {
        std::string where = fmt::format("p={}", pipe.stages);
        if (schedule_traits(c.schedule).virtual_stages) where += fmt::format(" v={}", c.virtual_stages);
        if (copies > 1) where += fmt::format(" replicas={}", copies);
        if (!pipe.replication.empty()) where += " replication=" + pipe.replication;
        return fmt::format("{:<14} {} m={}", c.schedule, where, c.microbatches);
      };
      // What every rank must agree on: ranks started by hand with other flags waited in different
      // collectives (a hang), or reported a pipeline "MISMATCH" that was only their own difference.
      nlohmann::json settings = {{"--model and its flags", f->model.model_json()},
                                 {"--data", [&] {  // a text by its content, not its path
                                    nlohmann::json d = f->model.data_json();
                                    d.erase("file");
                                    d.erase("dir");
                                    return d;
                                  }()},
                                 {"--seed", f->model.seed},
                                 {"--batch-size", batch_size},
                                 {"--tolerance", f->tolerance},
                                 {"--stages", pipe.stages},
                                 {"--replicas", pipe.replicas},
                                 {"--replication", pipe.replication},
                                 {"--balance", pipe.balance},
                                 {"--balance-solver", pipe.balance_solver},
                                 {"--checkpoint", pipe.checkpoint},
                                 {"--precision", pipe.precision},
                                 {"--backward-split", pipe.backward_split},
                                 {"--placement", pipe.placement}};
      nlohmann::json& list = settings["the checks (--schedules, --microbatch-counts, -s, -m, -v)"];
      list = nlohmann::json::array();
      for (const Check& c : checks) list.push_back({c.schedule, c.microbatches, c.virtual_stages, c.skipped});
      return run_ranks(pipe, cli_argc(), cli_argv(), [&](std::shared_ptr<Transport> t) {
        check_same_on_every_rank(settings, *t);
        // With --replicas R: R pipelines (`pipeline`), and each stage's copies (`replicas`) average their
        // gradients, as in train.
        const std::shared_ptr<Transport> world = pipe.placed_world(t);
        const std::shared_ptr<Transport> pipeline = pipe.pipeline_group(world);
        const std::shared_ptr<Transport> replicas = pipe.replica_group(world);
        const bool leader = world->rank() == 0;
        auto data = f->model.dataset();
        const zoo::Batch batch = data->batch(0, batch_size);
        int failures = 0, checked = 0, skipped = 0;
        for (const Check& c : checks) {
          if (!c.skipped.empty()) {
            ++skipped;
            if (leader) std::cout << label(c) << "  skipped: " << c.skipped << "\n" << std::flush;
            continue;
          }
          PipelineFlags q = pipe;
          q.schedule = c.schedule;
          q.microbatches = c.microbatches;
          q.virtual_stages = c.virtual_stages;
          PipelineOptions o = q.options(f->model.seed, device_rank(pipe.transport, world->rank()));
          o.data_parallel = replicas;
          // --balance time/memory and --balance-solver: the cut every rank uses (rank 0 measures).
          o.layers_per_stage = resolve_balance(q, f->model, std::max<int64_t>(1, share / c.microbatches), *world);
          const VerifyResult r =
              verify_transparency(f->model.factory(), f->model.loss(), pipeline, o, batch.input, batch.target);
          const bool ok = r.ok(f->tolerance);
          failures += !ok;
          ++checked;
          if (leader)
            std::cout << fmt::format("{}  loss {:.6f} (plain {:.6f})  max gradient error {:.2e}  {}\n", label(c),
                                     r.pipeline_loss, r.reference_loss, r.max_grad_error, ok ? "ok" : "MISMATCH")
                      << std::flush;
        }
        if (leader)
          std::cout << fmt::format("selftest over {}: {} passed, {} failed{}\n", t->name(), checked - failures,
                                   failures, skipped ? fmt::format(", {} skipped", skipped) : "");
        return failures == 0 ? 0 : 1;
      });
    });
  });
}

}  // namespace pipetrain::cli

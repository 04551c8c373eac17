// A plan file and UMPIPE partitions on the command line (PipelineFlags::apply_plan, prepare_umpipe;
// run_common.h): the stages, balance, schedule and micro-batches `pipetrain plan` chose.
#include "run_common.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include <torch/cuda.h>

#include "pipetrain/core/read_file.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/planner.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/plan/search.h"
#include "pipetrain/runtime/launch.h"
#include "pipetrain/runtime/profiler.h"

namespace pipetrain::cli {

namespace {

struct PlanReplication {
  bool unequal = false;  // stages replicated unequally (PipeDream's plans, e.g. 3,1)
  int workers = 0;       // ranks over all replicas
  int lcm = 1;           // least common multiple of the replica counts
};

// A plan's replication on the command line: unequal runs as 1F1B-RR over each stage's replicas
// (--replication); equal replication R > 1 as R copies of the pipeline (--replicas). Refuses flags
// that contradict the file.
PlanReplication apply_plan_replication(PipelineFlags& flags, const Plan& plan, const std::string& path,
                                       const std::function<bool(const char*)>& given) {
  PlanReplication out;
  out.unequal = std::any_of(plan.replication.begin(), plan.replication.end(),
                            [&](int r) { return r != plan.replication.front(); });
  std::string counts;
  for (int r : plan.replication) {
    counts += (counts.empty() ? "" : ",") + std::to_string(r);
    out.workers += r;
    out.lcm = std::lcm(out.lcm, r);
  }
  if (out.unequal) {
    if (given("--replication") && flags.replication_counts() != plan.replication)
      throw CLI::ValidationError("--plan", path + " replicates its stages " + counts + " but --replication is " +
                                                 flags.replication + ": drop --replication");
    if (given("--replicas") && flags.replicas != 1)
      throw CLI::ValidationError("--plan", path + " replicates its stages unequally (" + counts +
                                                 "), which does not combine with --replicas: drop --replicas");
    flags.replication = counts;
  } else {
    if (given("--replication"))
      throw CLI::ValidationError("--plan", path + " does not replicate its stages unequally, but --replication " +
                                                 flags.replication + " does: drop --replication (or --plan)");
    if (!plan.replication.empty() && plan.replication.front() > 1) {
      if (given("--replicas") && flags.replicas != plan.replication.front())
        throw CLI::ValidationError("--plan", path + " replicates every stage " +
                                                   std::to_string(plan.replication.front()) + " times but --replicas is " +
                                                   std::to_string(flags.replicas));
      flags.replicas = plan.replication.front();
    }
  }
  return out;
}

}  // namespace

void PipelineFlags::apply_plan(const std::string& path, const CLI::App& app) {
  plan_file = path;
  auto given = [&](const char* name) { return app.get_option(name)->count() > 0; };
  // This runs while the command line is parsed, when --plan's value is read: flags defined after --plan hold
  // their defaults still (`--plan dp.json --replicas 2` was told "--replicas is 1"). Their given values are
  // read here for the comparisons below.
  if (given("--replicas")) replicas = app.get_option("--replicas")->as<int>();
  if (given("--replication")) replication = app.get_option("--replication")->as<std::string>();
  if (given("--stages")) stages = app.get_option("--stages")->as<int>();
  if (given("--virtual")) virtual_stages = app.get_option("--virtual")->as<int>();
  // The part of the file that runs: its top level (the chosen plan), or the PipeDream planner's section.
  PlanFile file;
  Plan plan;
  std::string file_schedule;
  int file_microbatches = 0;
  try {
    if (plan_use != "pipeline" && plan_use != "pipedream")
      throw UsageError("--plan-use " + plan_use + " is not a part of a plan: use pipeline (the default) or pipedream");
    file = read_plan_file(path);  // checks the file, its plan and its sections
    plan = file.plan;
    file_schedule = file.schedule;
    file_microbatches = file.microbatches;
    if (plan_use == "pipedream") {
      if (!file.pipedream)
        throw UsageError(path + " holds no PipeDream plan (no \"pipedream\" section): make it with pipetrain plan, "
                         "which writes one when the PipeDream planner finds a feasible plan, or drop --plan-use");
      plan = *file.pipedream;
      file_schedule = file.pipedream_schedule;
      file_microbatches = file.pipedream_microbatches;
    }
  } catch (const std::exception& e) {  // parse time: report as a usage error (exit 2)
    throw CLI::ValidationError("--plan", e.what());
  }
  // What follows checks the plan against the flags (CLI::ValidationError) and its schedule's traits
  // (UsageError, e.g. a hand-edited schedule name): both exit 2 with the message, never an abort.
  try {
  const PlanReplication rep = apply_plan_replication(*this, plan, path, given);
  const bool unequal = rep.unequal;
  // A plan with v stages per rank (interleaved's chunks, the V shapes' two) lists every stage in its
  // balance: p ranks hold balance.size() / v of them each.
  const int v = plan_use == "pipedream" ? 1 : std::max(1, file.virtual_stages);
  const int p = static_cast<int>(plan.balance.size()) / v;
  if (v > 1 && !given("--virtual") && !file_schedule.empty() && !schedule_traits(file_schedule).v_shape)
    virtual_stages = v;
  if (given("--stages") && stages != p)
    throw CLI::ValidationError("--plan", path + " has " + std::to_string(p) + " stages but --stages is " +
                                             std::to_string(stages) + ": drop --stages or plan for " +
                                             std::to_string(stages) + " ranks");
  stages = p;
  if (!given("--balance")) {
    balance.clear();
    for (int n : plan.balance) balance += (balance.empty() ? "" : ",") + std::to_string(n);
  }
  // The schedule and micro-batches the file records (pipetrain plan writes them for both parts). A
  // replicated plan without them runs 1F1B-RR with a multiple of every replica count (equal shares)
  // that is at least twice the ranks, so the pipeline fills.
  if (!given("--schedule")) {
    if (!file_schedule.empty()) {
      // A hand-edited or foreign file's schedule: named as the file's, not as a --schedule nobody typed.
      try {
        (void)schedule_traits(file_schedule);
      } catch (const UsageError& e) {
        throw CLI::ValidationError("--plan", path + ": its \"schedule\": " + e.what() + " (or give --schedule)");
      }
      schedule = file_schedule;
    }
    else if (unequal)
      schedule = "1f1b";
  }
  if (!given("--microbatches")) {
    if (file_microbatches > 0)
      microbatches = file_microbatches;
    else if (unequal)
      microbatches = (2 * rep.workers + rep.lcm - 1) / rep.lcm * rep.lcm;
  }
  // UMPIPE partitions, if the chosen plan has them (not the PipeDream section: the partitions belong to
  // the top-level balance); prepare_umpipe decides whether they run (--umpipe).
  umpipe_section = nlohmann::json();
  plan_balance = plan.balance;
  // The mini-batch the plan was made for (train uses it unless --batch-size is given): its prediction is
  // for that many samples per step, split evenly over its replicas.
  plan_batch_size = file.batch_size;
  plan_model = plan.model;
  plan_fits_memory = !file.fits_memory_limit || *file.fits_memory_limit;
  plan_peak_bytes = file.predicted_peak_bytes;
  if (plan_use != "pipedream") {
    umpipe_section = file.umpipe;
    // Where the copies' ranks go (with --level the plan chose it); pipeline-inner when not recorded.
    if (!file.placement.empty() && !given("--placement")) placement = file.placement;
  }
  // The profile's intra-op threads per rank: the times the plan predicts from were measured with them
  // (the default, cores / ranks, may differ and with it every layer's time).
  if (file.threads > 0 && !given("--threads")) {
    threads = file.threads;
    threads_from = "the plan " + path;
  }
  } catch (const UsageError& e) {
    throw CLI::ValidationError("--plan", path + ": " + e.what());
  }
}

void PipelineFlags::add_umpipe_to(CLI::App& app) {
  app.add_option("--umpipe", umpipe,
                 "with a plan from pipetrain plan --planner umpipe: whose unequal micro-batches per stage to run, dgap, "
                 "equal, local-greedy or global-dp; off runs the plan as a normal pipeline; default: the fastest "
                 "of these the file records");
}

void PipelineFlags::prepare_umpipe(const CLI::App& app, int64_t batch_size) {
  umpipe_chosen.reset();
  static const std::vector<std::string> planners{"dgap", "equal", "local-greedy", "global-dp"};
  if (umpipe != "auto" && umpipe != "off" && std::find(planners.begin(), planners.end(), umpipe) == planners.end())
    throw UsageError("unknown --umpipe '" + umpipe + "': use dgap, equal, local-greedy, global-dp or off");
  if (umpipe == "off") return;
  if (umpipe_section.is_null()) {
    if (umpipe == "auto") return;
    if (plan_file.empty())
      throw UsageError("--umpipe " + umpipe + " runs the partitions of a plan: pass --plan FILE from pipetrain plan "
                       "--planner umpipe");
    throw UsageError("--plan " + plan_file + " has no UMPIPE partitions: make it with pipetrain plan --planner umpipe, "
                     "or drop --umpipe");
  }
  // By default the fastest the file offers (pipetrain plan records it; files from before: dgap's), which
  // may be the straight pipeline ("off").
  const std::string name = umpipe != "auto" ? umpipe : umpipe_section.value("fastest", std::string("dgap"));
  if (name == "off") return;
  nlohmann::json chosen;
  const nlohmann::json& all = umpipe_section.contains("planners") ? umpipe_section["planners"] : nlohmann::json();
  if (all.is_object() && all.contains(name))
    chosen = all[name];
  else if (umpipe_section.value("planner", std::string()) == name)
    chosen = umpipe_section;
  if (chosen.is_null()) {
    std::string have;
    if (all.is_object())
      for (const auto& item : all.items()) have += (have.empty() ? "" : ", ") + item.key();
    if (have.empty()) have = umpipe_section.value("planner", std::string("?"));
    throw UsageError("--plan " + plan_file + " holds no '" + name + "' UMPIPE partitions (it has " + have +
                     "): pick one of those with --umpipe, or plan again with pipetrain plan --planner umpipe");
  }
  auto result = std::make_shared<UmpipeResult>(umpipe_result_from_json(chosen, plan_file + ": umpipe " + name));
  if (!umpipe_section.value("rematerialise", false))
    throw UsageError("--plan " + plan_file + ": its UMPIPE partitions were planned without re-materialisation (the "
                     "backward times leave out the recompute), but the runtime always re-materialises: plan again "
                     "without --no-rematerialise, or pass --umpipe off");
  int64_t samples = 0;
  for (int b : result->plan.forward.front()) samples += b;
  if (static_cast<int>(result->plan.forward.size()) != stages)
    throw UsageError(fmt::format("--plan {}: its UMPIPE partitions are for {} stages but the run has {}: drop --stages "
                                 "or plan for {} ranks",
                                 plan_file, result->plan.forward.size(), stages, stages));
  if (samples != batch_size)
    throw UsageError(fmt::format("--plan {} cuts mini-batches of {} samples (its UMPIPE partitions) but --batch-size is "
                                 "{}: pass --batch-size {}, plan with --batch-size {}, or pass --umpipe off",
                                 plan_file, samples, batch_size, samples, batch_size));
  if (replicas != 1)
    throw UsageError("UMPIPE partitions run on one pipeline, but --replicas is " + std::to_string(replicas) +
                     ": drop --replicas or pass --umpipe off");
  if (virtual_stages != 1)
    throw UsageError("UMPIPE partitions run one stage per rank, but --virtual is " + std::to_string(virtual_stages) +
                     ": drop --virtual or pass --umpipe off");
  if (app.get_option("--schedule")->count() > 0 && schedule != "gpipe")
    throw UsageError("UMPIPE partitions run in GPipe order (all forwards, then all backwards), not --schedule " +
                     schedule + ": drop --schedule or pass --umpipe off");
  schedule = "gpipe";
  std::string planned;
  for (int n : plan_balance) planned += (planned.empty() ? "" : ",") + std::to_string(n);
  if (balance != planned)
    throw UsageError("--plan " + plan_file + "'s UMPIPE partitions were planned for balance " + planned +
                     ", not --balance " + balance + ": drop --balance or pass --umpipe off");
  umpipe_chosen = result;
}

}  // namespace pipetrain::cli

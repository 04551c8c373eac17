#include "exact_option.h"

#include "pipetrain/core/error.h"
#include "pipetrain/core/validate.h"

namespace pipetrain::cli {

void ExactFlags::add_to(CLI::App& app) {
  app.add_flag("--exact", exact,
               "with --schedule zb-auto: search for the shortest schedule under the memory limit (branch and "
               "bound, small p*m only) and report how far the greedy one is from it");
  nodes_option = app.add_option("--exact-nodes", nodes,
                                "with --exact: search nodes before giving up the proof (default 5000000, at most 50000000; the best "
                                "schedule found and a bound are reported then)");
}

bool ExactFlags::apply(const ScheduleFlags& flags, Schedule& s, ZbExactResult& result) const {
  if (!exact) {
    if (nodes_option && nodes_option->count() > 0) throw UsageError("--exact-nodes applies with --exact: add --exact");
    return false;
  }
  if (!flags.load.empty() || flags.schedule != "zb-auto")
    throw UsageError("--exact searches zb-auto's schedules: use --schedule zb-auto (not " +
                     (flags.load.empty() ? "--schedule " + flags.schedule : "--load " + flags.load) + ")");
  if (!flags.replication.empty()) throw UsageError("--exact plans one rank per stage: drop --replication");
  // The search's memory accounting and bounds know F, B and W only: a skip's memory held on its consumer
  // (and a slow skip's delay) would make its optimum a wrong answer, so it refuses rather than drop them.
  if (!flags.skips.empty())
    throw UsageError("--exact searches schedules without skip routes (its memory limit and bounds leave out the "
                     "skips' memory and transfers), but --skip " + flags.skips.front() +
                     " was given: drop --skip to search, or drop --exact to simulate zb-auto's greedy schedule "
                     "with the skips");
  ZbExactOptions o;
  o.memory_limit = flags.memory_limit;
  o.node_budget = nodes;
  o.steps = flags.steps;
  result = zb_exact(s.ranks, s.microbatches_per_step, flags.costs(s), o);
  ValidateOptions vo;
  if (flags.memory_limit > 0) vo.memory_limit = flags.memory_limit;
  validate(result.schedule, vo);
  s = result.schedule;
  return true;
}

}  // namespace pipetrain::cli

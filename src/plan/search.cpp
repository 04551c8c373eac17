// The plan search and the plan file (plan/search.h).
#include "pipetrain/plan/search.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/read_file.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/costs.h"

namespace pipetrain {

bool better_candidate(const PlanCandidate& a, const PlanCandidate& b) {
  if (a.fits != b.fits) return a.fits;
  return a.makespan < b.makespan - 1e-9 || (std::abs(a.makespan - b.makespan) <= 1e-9 && a.m < b.m);
}

PlanCandidate simulate_candidate(const Profile& profile, const std::vector<int>& balance, const std::string& schedule,
                                 int m, double micro_batch, double bandwidth_bytes_per_ms, double latency_ms,
                                 double memory_limit_bytes, const std::vector<int>& replication) {
  PlanCandidate c;
  c.schedule = schedule;
  c.m = m;
  c.balance = balance;
  c.replication = replication;
  StageCostOptions so;
  so.micro_batch = micro_batch;
  so.bandwidth_bytes_per_ms = bandwidth_bytes_per_ms;
  so.latency_ms = latency_ms;
  CostModel costs = stage_costs(profile, balance, so);
  const std::vector<double> static_bytes = stage_static_bytes(profile, balance);
  Schedule sch;
  if (replication.empty()) {
    GeneratorOptions g;
    g.ranks = static_cast<int>(balance.size());
    g.microbatches = m;
    g.costs = costs;
    sch = generate(schedule, g);
  } else {
    sch = round_robin(schedule, replication, m);
    costs.stage_step = replica_allreduce_ms(profile, balance, replication, bandwidth_bytes_per_ms, latency_ms);
  }
  const SimResult r = simulate(sch, costs);
  c.makespan = r.metrics.makespan;
  c.bubble = r.metrics.bubble_fraction;
  for (int rank = 0; rank < sch.ranks; ++rank) {
    const int stage = sch.first_stage_of(rank);
    const double bytes =
        static_bytes[static_cast<std::size_t>(stage)] + r.metrics.per_rank[static_cast<std::size_t>(rank)].peak_memory;
    c.peak_bytes = std::max(c.peak_bytes, bytes);
  }
  c.fits = memory_limit_bytes <= 0 || c.peak_bytes <= memory_limit_bytes;
  return c;
}

namespace {

void check_search_options(const Profile& profile, const PlanSearchOptions& o) {
  if (o.ranks < 1) throw UsageError(fmt::format("ranks must be >= 1, got {}", o.ranks));
  if (!(o.bandwidth_bytes_per_ms > 0))  // infinite: the bytes cost nothing (a latency-only profile)
    throw UsageError(fmt::format("the bandwidth must be > 0, got {} bytes/ms", o.bandwidth_bytes_per_ms));
  if (!(o.latency_ms >= 0)) throw UsageError(fmt::format("the latency must be >= 0, got {} ms", o.latency_ms));
  if (!(o.memory_limit_bytes >= 0)) throw UsageError(fmt::format("the memory limit must be >= 0, got {}", o.memory_limit_bytes));
  for (int m : o.microbatch_counts)
    if (m < 1) throw UsageError(fmt::format("micro-batch counts must be >= 1, got {}", m));
  const int layers = static_cast<int>(profile.layers.size());
  if (o.ranks > layers)
    throw UsageError(fmt::format("{} ranks but the profile has {} layers: a straight pipeline needs --ranks <= {}",
                                 o.ranks, layers, layers));
}

}  // namespace

PlanSearchResult search_plans(const Profile& prof, const PlanSearchOptions& o) {
  check_search_options(prof, o);
  // Every plan is compared by time, and the report divides by it: a profile without compute time made
  // every candidate 0 ms and the speed-ups "infx".
  double total_ms = 0;
  for (const LayerProfile& l : prof.layers) total_ms += l.forward_ms + l.backward_ms;
  if (!(total_ms > 0))
    throw UsageError("the profile of " + excerpt(prof.model) + " has no compute time (every layer's forward_ms and "
                     "backward_ms is 0), so every plan would take 0 ms: measure the model with pipetrain profile, or "
                     "give the layers their times");
  PlanSearchResult res;
  const int64_t batch = o.batch_size > 0 ? o.batch_size : 8LL * prof.micro_batch_size;
  res.batch_size = batch;
  const double bw = o.bandwidth_bytes_per_ms, limit = o.memory_limit_bytes;

  // Straight pipelines.
  for (const std::string& kind : o.balance_kinds)
    for (const std::string solver : {"min-max", "block-partition"}) {
      if (kind == "uniform" && solver != std::string("min-max")) continue;
      std::vector<int> balance;
      try {
        balance = plan_balance(prof, o.ranks, kind, parse_balance_solver(solver));
      } catch (const UsageError&) {
        if (solver == std::string("block-partition")) continue;  // torchgpipe's heuristic may find none
        throw;
      }
      for (const std::string& schedule : o.schedules)
        for (int m : o.microbatch_counts) {
          if (m > batch) continue;
          PlanCandidate c =
              simulate_candidate(prof, balance, schedule, m, static_cast<double>(batch) / m, bw, o.latency_ms, limit);
          c.kind = kind;
          c.solver = solver;
          res.candidates.push_back(c);
        }
    }
  if (res.candidates.empty())
    throw UsageError("no candidate: check --schedules, --microbatch-counts and --batch-size");
  res.best_straight = *std::min_element(res.candidates.begin(), res.candidates.end(), better_candidate);
  for (const PlanCandidate& c : res.candidates)
    if (c.kind == "uniform" && c.schedule == "1f1b" && (!res.uniform_1f1b || better_candidate(c, *res.uniform_1f1b)))
      res.uniform_1f1b = c;

  // Data parallelism on the same ranks: every rank runs the whole model on batch / ranks samples
  // (serially in one pass), then a ring all-reduce of the gradients: 2 (R-1)/R x parameter bytes.
  double compute = 0, params = 0, dp_static = 0, dp_act = 0;
  const double share = static_cast<double>(batch) / o.ranks;
  for (const LayerProfile& l : prof.layers) {
    compute += layer_time_at(l, prof.micro_batch_size, share, true) + layer_time_at(l, prof.micro_batch_size, share, false);
    params += l.parameter_bytes;
    dp_static += 2 * l.parameter_bytes + l.optimizer_bytes;
    dp_act += l.held_bytes() * share / prof.micro_batch_size;
  }
  res.data_parallel_ms = compute + ring_allreduce_ms(params, o.ranks, bw, 0.0);
  res.data_parallel_bytes = dp_static + dp_act;
  res.data_parallel_fits = limit <= 0 || res.data_parallel_bytes <= limit;

  // PipeDream's planner (replication), on the same devices.
  PlannerOptions po = o.pipedream;
  if (po.levels.empty()) po.levels.push_back(NetworkLevel{o.ranks, bw * 1e3});
  if (planner_devices(po.levels) != o.ranks) {
    std::string product;
    for (const NetworkLevel& l : po.levels) product += (product.empty() ? "" : " x ") + std::to_string(l.machines);
    // The levels describe the devices PipeDream's planner places stages on; they must be the ranks the
    // straight pipelines are planned for, or the table would compare plans for different machines.
    throw UsageError(fmt::format("--level describes {} = {} devices but --ranks is {}: give --ranks {} (the product "
                                 "of the levels' MACHINES) or levels whose MACHINES multiply to {}",
                                 product, planner_devices(po.levels), o.ranks, planner_devices(po.levels), o.ranks));
  }
  if (limit > 0) po.memory_limit_bytes = limit;
  po.allow_fewer_machines = true;
  res.pipedream_options = po;
  try {
    res.pipedream = plan_pipedream(prof, po);
  } catch (const UsageError& e) {
    res.pipedream_error = e.what();
  }

  // PipeDream's plan run synchronously as 1F1B-RR (stage replication in the runtime), simulated like
  // the straight pipelines; micro-batch counts that every replica count divides.
  const auto& pd = res.pipedream;
  if (pd && std::any_of(pd->replication.begin(), pd->replication.end(), [](int r) { return r > 1; }) &&
      pd->balance.size() > 1) {
    int lcm = 1;
    for (int r : pd->replication) lcm = std::lcm(lcm, r);
    for (int m : o.microbatch_counts) {
      const int mm = (m + lcm - 1) / lcm * lcm;
      if (mm > batch) continue;
      PlanCandidate c = simulate_candidate(prof, pd->balance, "1f1b", mm, static_cast<double>(batch) / mm, bw,
                                           o.latency_ms, limit, pd->replication);
      c.kind = "pipedream";
      c.solver = "planner";
      if (!res.replicated || better_candidate(c, *res.replicated)) res.replicated = c;
    }
  }
  // The replicated plan is chosen when it is faster and fits.
  res.chose_replicated = res.replicated && o.replicated_may_win && better_candidate(*res.replicated, res.best_straight);
  return res;
}

PlanFile plan_file_for(const Profile& prof, const PlanSearchResult& res) {
  const PlanCandidate& top = res.chosen();
  PlanFile f;
  Plan& chosen = f.plan;
  chosen.model = prof.model;
  chosen.layers = static_cast<int>(prof.layers.size());
  chosen.options = res.pipedream_options;
  chosen.balance = top.balance;
  chosen.replication = top.replication.empty() ? std::vector<int>(top.balance.size(), 1) : top.replication;
  chosen.time_ms = top.makespan;
  chosen.data_parallel_time_ms = res.data_parallel_ms;
  chosen.speedup = top.makespan > 0 ? res.data_parallel_ms / top.makespan : 0;
  chosen.data_parallel_fits = res.data_parallel_fits;
  // Per stage: compute per micro-batch (F + B + W from the simulator's costs) and static bytes.
  StageCostOptions so;
  so.micro_batch = static_cast<double>(res.batch_size) / top.m;
  for (const StageCost& c : stage_costs(prof, top.balance, so).stage) chosen.stage_time_ms.push_back(c.f + c.b + c.w);
  chosen.stage_memory_bytes = stage_static_bytes(prof, top.balance);
  chosen.stage_in_flight.assign(top.balance.size(), 1);
  f.schedule = top.schedule;
  f.microbatches = top.m;
  f.batch_size = res.batch_size;
  f.balance_kind = top.kind;
  f.balance_solver = top.solver;
  f.predicted_bubble_fraction = top.bubble;
  f.pipedream = res.pipedream;
  if (res.replicated) {  // how train --plan-use pipedream runs it: synchronous 1F1B-RR with this m
    f.pipedream_schedule = "1f1b";
    f.pipedream_microbatches = res.replicated->m;
    f.pipedream_simulated_ms = res.replicated->makespan;
  }
  return f;
}

nlohmann::json plan_file_to_json(const PlanFile& f) {
  nlohmann::json j = plan_to_json(f.plan);
  if (!f.schedule.empty()) j["schedule"] = f.schedule;
  if (f.microbatches > 0) j["microbatches"] = f.microbatches;
  if (f.batch_size > 0) j["batch_size"] = f.batch_size;
  if (!f.balance_kind.empty()) j["balance_kind"] = f.balance_kind;
  if (!f.balance_solver.empty()) j["balance_solver"] = f.balance_solver;
  if (!f.schedule.empty()) j["predicted_bubble_fraction"] = f.predicted_bubble_fraction;
  if (f.pipedream) {
    j["pipedream"] = plan_to_json(*f.pipedream);
    if (!f.pipedream_schedule.empty()) {
      j["pipedream"]["schedule"] = f.pipedream_schedule;
      j["pipedream"]["microbatches"] = f.pipedream_microbatches;
      j["pipedream"]["simulated_time_ms"] = f.pipedream_simulated_ms;
    }
  }
  if (!f.umpipe.is_null()) j["umpipe"] = f.umpipe;
  return j;
}

namespace {

[[noreturn]] void file_fail(const std::string& origin, const std::string& field, const nlohmann::json& value,
                            const std::string& fix) {
  throw UsageError(fmt::format("{}: \"{}\" is {}: {}", origin, field, json_excerpt(value), fix));
}

// The optional run fields of a plan (or of its "pipedream" section).
void read_run_fields(const nlohmann::json& j, const std::string& origin, const std::string& prefix,
                     std::string& schedule, int& microbatches) {
  if (j.contains("schedule")) {
    if (!j["schedule"].is_string()) file_fail(origin, prefix + "schedule", j["schedule"], "write a schedule name");
    schedule = j["schedule"].get<std::string>();
  }
  if (j.contains("microbatches")) {
    const auto& m = j["microbatches"];
    if (!m.is_number_integer() || m.get<long long>() < 1 || m.get<long long>() > (1 << 20))
      file_fail(origin, prefix + "microbatches", m, "write a micro-batch count, an integer in 1..1048576");
    microbatches = m.get<int>();
  }
}

}  // namespace

PlanFile plan_file_from_json(const nlohmann::json& j, const std::string& origin) {
  PlanFile f;
  f.plan = plan_from_json(j, origin);  // checks the object, format, version and the plan's own fields
  read_run_fields(j, origin, "", f.schedule, f.microbatches);
  if (j.contains("batch_size")) {
    const auto& b = j["batch_size"];
    if (!b.is_number_integer() || b.get<long long>() < 1)
      file_fail(origin, "batch_size", b, "write the mini-batch size, an integer >= 1");
    f.batch_size = b.get<int64_t>();
  }
  for (const char* key : {"balance_kind", "balance_solver"})
    if (j.contains(key)) {
      if (!j[key].is_string()) file_fail(origin, key, j[key], "write a string");
      (std::string(key) == "balance_kind" ? f.balance_kind : f.balance_solver) = j[key].get<std::string>();
    }
  if (j.contains("predicted_bubble_fraction") && j["predicted_bubble_fraction"].is_number())
    f.predicted_bubble_fraction = j["predicted_bubble_fraction"].get<double>();
  if (j.contains("pipedream")) {
    const nlohmann::json& pd = j["pipedream"];
    f.pipedream = plan_from_json(pd, origin + " (pipedream)");
    read_run_fields(pd, origin, "pipedream.", f.pipedream_schedule, f.pipedream_microbatches);
    if (pd.contains("simulated_time_ms") && pd["simulated_time_ms"].is_number())
      f.pipedream_simulated_ms = pd["simulated_time_ms"].get<double>();
  }
  if (j.contains("umpipe")) {
    if (!j["umpipe"].is_object()) file_fail(origin, "umpipe", j["umpipe"], "write UMPIPE's partitions as an object");
    f.umpipe = j["umpipe"];
  }
  return f;
}

void write_plan_file(const std::string& path, const PlanFile& file) {
  write_file_atomic(path, plan_file_to_json(file).dump(2) + "\n");
}

PlanFile read_plan_file(const std::string& path) {
  const std::string text = read_file_capped(path, "plan", kMaxPlanFileBytes);
  return plan_file_from_json(parse_json_text(text, path), path);
}

}  // namespace pipetrain

// `pipetrain plan`: from a per-layer profile (pipetrain profile's JSON, or PipeDream's graph text),
// the number of ranks, their bandwidth and memory, chooses how to run the model:
//  - a straight pipeline for `pipetrain train`: balance kind x solver x schedule x micro-batch count,
//    each candidate timed by the simulator with per-stage costs summed from the profile (scaled to the
//    micro-batch size) and transfers at the bandwidth, checked against the memory per rank;
//  - PipeDream's planner with stage replication (plan/planner.h), for comparison and for hybrid runs.
// Prints the chosen plan next to the plain alternatives (uniform balance with 1f1b, data parallelism)
// and writes a plan JSON that `pipetrain train --plan FILE` runs.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <memory>
#include <numeric>
#include <nlohmann/json.hpp>

#include "cli_common.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/costs.h"
#include "pipetrain/plan/planner.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/plan/umpipe.h"

namespace pipetrain::cli {
namespace {

struct PlanFlags {
  std::string profile;
  int ranks = 2;
  double bandwidth_gbps = 10;  // GB/s between ranks
  double latency_us = 50;      // per transfer (gloo on one host: about 60 us one-way)
  int pipedream_batch = 0;     // the batch size a PipeDream graph file was profiled at
  std::vector<std::string> levels;
  double memory_gib = 0;       // per rank; 0 = unlimited
  int64_t batch_size = 0;      // 0: 8 x the profile's micro-batch size
  std::vector<std::string> schedules{"gpipe", "1f1b", "zb-h1"};
  std::vector<int> microbatch_counts{1, 2, 4, 8, 16, 32};
  std::vector<std::string> kinds{"uniform", "parameters", "time", "memory"};
  std::string cost_form = "paper";
  std::string planner = "pipeline";  // pipeline | umpipe
  uint64_t seed = 1;
  int generations = 800;
  double overhead_ms = 0.05;
  bool no_rematerialise = false;  // umpipe: plan without re-materialisation (a planning study; train refuses it)
  std::string fit = "table";      // umpipe: per-layer time curves, table (piecewise linear) or affine
  std::string out;
};

struct Candidate {
  std::string kind, solver, schedule;
  int m = 0;
  std::vector<int> balance;
  std::vector<int> replication;  // empty: a straight pipeline
  double makespan = 0, bubble = 0, peak_bytes = 0;
  bool fits = true;
};

// Simulates one candidate. With `replication` (one count per stage) the schedule is 1F1B-RR over the
// replicas (round_robin) and each replicated stage's step carries a ring all-reduce of its parameters.
Candidate evaluate(const Profile& prof, const std::vector<int>& balance, const std::string& schedule, int m,
                   double micro, double bandwidth_bytes_per_ms, double latency_ms, double memory_limit,
                   const std::vector<int>& replication = {}) {
  Candidate c;
  c.schedule = schedule;
  c.m = m;
  c.balance = balance;
  c.replication = replication;
  const int p = static_cast<int>(balance.size());
  StageCostOptions so;
  so.micro_batch = micro;
  so.bandwidth_bytes_per_ms = bandwidth_bytes_per_ms;
  so.latency_ms = latency_ms;
  CostModel costs = stage_costs(prof, balance, so);
  const std::vector<double> static_bytes = stage_static_bytes(prof, balance);
  Schedule sch;
  if (replication.empty()) {
    GeneratorOptions g;
    g.ranks = p;
    g.microbatches = m;
    g.costs = costs;
    sch = generate(schedule, g);
  } else {
    sch = round_robin(schedule, replication, m);
    costs.stage_step = replica_allreduce_ms(prof, balance, replication, bandwidth_bytes_per_ms, latency_ms);
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
  c.fits = memory_limit <= 0 || c.peak_bytes <= memory_limit;
  return c;
}

std::string list(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

}  // namespace

void add_plan_command(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<PlanFlags>();
  CLI::App* cmd = app.add_subcommand("plan", "choose balance, schedule and micro-batches (and PipeDream's replication) "
                                             "from a profile");
  cmd->add_option("--profile", f->profile, "profile: pipetrain profile's JSON, or PipeDream's graph text")->required();
  cmd->add_option("--ranks,-p", f->ranks, "ranks (devices) to plan for, default 2");
  cmd->add_option("--bandwidth", f->bandwidth_gbps, "GB/s between ranks, default 10");
  cmd->add_option("--latency", f->latency_us, "microseconds per transfer between ranks, default 50");
  cmd->add_option("--pipedream-batch", f->pipedream_batch,
                  "the batch size a PipeDream graph file was profiled at (its format does not record it; VGG-16's: 128)");
  cmd->add_option("--level", f->levels,
                  "hierarchical network for PipeDream's planner, innermost first: MACHINES:GB/s, e.g. --level 4:100 "
                  "--level 2:3.125 (the product of MACHINES is the device count)");
  cmd->add_option("--memory", f->memory_gib, "GiB per rank (weights, gradients, optimizer state, activations); 0 = no limit");
  cmd->add_option("--batch-size", f->batch_size, "samples per mini-batch; default 8 x the profile's micro-batch size");
  cmd->add_option("--schedules", f->schedules, "schedules to consider, default gpipe 1f1b zb-h1");
  cmd->add_option("--microbatch-counts", f->microbatch_counts, "micro-batch counts to consider, default 1 2 4 8 16 32");
  cmd->add_option("--balances", f->kinds, "balance kinds to consider, default uniform parameters time memory");
  cmd->add_option("--cost-form", f->cost_form, "PipeDream planner's cost form: paper (default) or reference");
  cmd->add_option("--planner", f->planner,
                  "pipeline (default: balance, schedule and micro-batches), or umpipe: also unequal micro-batches "
                  "per stage (docs/UMPIPE.md), GPipe order, with the equal, local-greedy and global-DP baselines")
      ->check(CLI::IsMember({"pipeline", "umpipe"}));
  cmd->add_option("--seed", f->seed, "umpipe: the genetic algorithm's seed, default 1");
  cmd->add_option("--generations", f->generations, "umpipe: generations at most (it stops on stall), default 800");
  cmd->add_option("--overhead", f->overhead_ms,
                  "umpipe: fixed ms per layer and pass for layers measured at one size only, default 0.05");
  cmd->add_option("--fit", f->fit,
                  "umpipe: per-layer time as a function of the micro-batch size, table (piecewise linear through the "
                  "profile's sizes, default) or affine (least-squares line)")
      ->check(CLI::IsMember({"table", "affine"}));
  cmd->add_flag("--no-rematerialise", f->no_rematerialise,
               "umpipe: plan as if the backward kept the forward's activations (a planning study: train --plan refuses "
               "such partitions, since the runtime re-materialises every backward chunk)");
  cmd->add_option("--out", f->out, "write the plan JSON here (pipetrain train --plan FILE runs it)");
  cmd->footer(
      "Examples:\n"
      "  pipetrain profile --model gpt --microbatch-size 8 --out gpt.json\n"
      "  pipetrain plan --profile gpt.json --ranks 4 --batch-size 64 --out plan.json\n"
      "  pipetrain train --plan plan.json --batch-size 64\n"
      "  pipetrain plan --profile vgg16.txt --ranks 8 --bandwidth 1.25 --memory 16   # PipeDream's profile");
  cmd->callback([f, cmd, &exit_code] {
    exit_code = guarded("plan", [&] {
      if (f->ranks < 1) throw UsageError("--ranks must be >= 1, got " + std::to_string(f->ranks));
      if (!(f->bandwidth_gbps > 0)) throw UsageError("--bandwidth must be > 0 GB/s, got " + fmt::format("{}", f->bandwidth_gbps));
      if (f->memory_gib < 0) throw UsageError("--memory must be >= 0 GiB, got " + fmt::format("{}", f->memory_gib));
      for (int m : f->microbatch_counts)
        if (m < 1) throw UsageError("--microbatch-counts must be >= 1, got " + std::to_string(m));
      if (f->latency_us < 0) throw UsageError("--latency must be >= 0 us, got " + fmt::format("{}", f->latency_us));
      if (cmd->get_option("--pipedream-batch")->count() > 0 && f->pipedream_batch < 1)
        throw UsageError("--pipedream-batch must be >= 1 (the batch size the PipeDream graph was profiled at, e.g. "
                         "128), got " + std::to_string(f->pipedream_batch));
      if (!std::isfinite(f->bandwidth_gbps))
        throw UsageError("--bandwidth must be a finite number of GB/s, got " + fmt::format("{}", f->bandwidth_gbps));
      Profile prof = load_profile(f->profile);
      if (f->pipedream_batch > 0) {
        if (prof.source.rfind("pipedream graph", 0) != 0)
          throw UsageError("--pipedream-batch is for PipeDream graph files; " + f->profile +
                           " is a JSON profile, which records its micro-batch size: drop --pipedream-batch");
        PipeDreamOptions po;
        po.micro_batch_size = f->pipedream_batch;
        prof = load_pipedream_graph(f->profile, po);
      }
      const int layers = static_cast<int>(prof.layers.size());
      if (f->ranks > layers)
        throw UsageError(std::to_string(f->ranks) + " ranks but the profile has " + std::to_string(layers) +
                         " layers: a straight pipeline needs --ranks <= " + std::to_string(layers));
      const int64_t batch = f->batch_size > 0 ? f->batch_size : 8LL * prof.micro_batch_size;
      const double bw = f->bandwidth_gbps * 1e9 / 1e3;  // bytes per ms
      const double limit = f->memory_gib * 1073741824.0;

      // Straight pipelines.
      std::vector<Candidate> all;
      for (const std::string& kind : f->kinds)
        for (const std::string solver : {"min-max", "block-partition"}) {
          if (kind == "uniform" && solver != std::string("min-max")) continue;
          std::vector<int> balance;
          try {
            balance = plan_balance(prof, f->ranks, kind, parse_balance_solver(solver));
          } catch (const UsageError&) {
            if (solver == std::string("block-partition")) continue;  // torchgpipe's heuristic may find none
            throw;
          }
          for (const std::string& schedule : f->schedules)
            for (int m : f->microbatch_counts) {
              if (m > batch) continue;
              Candidate c = evaluate(prof, balance, schedule, m, static_cast<double>(batch) / m, bw, f->latency_us / 1e3, limit);
              c.kind = kind;
              c.solver = solver;
              all.push_back(c);
            }
        }
      auto better = [](const Candidate& a, const Candidate& b) {
        if (a.fits != b.fits) return a.fits;
        return a.makespan < b.makespan - 1e-9 || (std::abs(a.makespan - b.makespan) <= 1e-9 && a.m < b.m);
      };
      if (all.empty()) throw UsageError("no candidate: check --schedules, --microbatch-counts and --batch-size");
      const Candidate best = *std::min_element(all.begin(), all.end(), better);
      const Candidate* uniform_1f1b = nullptr;
      for (const Candidate& c : all)
        if (c.kind == "uniform" && c.schedule == "1f1b" && (!uniform_1f1b || better(c, *uniform_1f1b))) uniform_1f1b = &c;

      // Data parallelism on the same ranks: every rank runs the whole model on batch / ranks samples
      // (serially in one pass), then a ring all-reduce of the gradients: 2 (R-1)/R x parameter bytes.
      double compute = 0, params = 0, dp_static = 0, dp_act = 0;
      for (const LayerProfile& l : prof.layers) {
        const double share = static_cast<double>(batch) / f->ranks;
        compute += layer_time_at(l, prof.micro_batch_size, share, true) +
                   layer_time_at(l, prof.micro_batch_size, share, false);
        params += l.parameter_bytes;
        dp_static += 2 * l.parameter_bytes + l.optimizer_bytes;
        dp_act += l.activation_bytes * share / prof.micro_batch_size;
      }
      const double dp_time = compute + ring_allreduce_ms(params, f->ranks, bw, 0.0);
      const bool dp_fits = limit <= 0 || dp_static + dp_act <= limit;

      // PipeDream's planner (replication), on the same devices.
      PlannerOptions po;
      if (f->levels.empty()) {
        po.levels.push_back(NetworkLevel{f->ranks, f->bandwidth_gbps * 1e9});
      } else {
        for (const std::string& lv : f->levels) {
          const auto colon = lv.find(':');
          try {
            if (colon == std::string::npos) throw std::invalid_argument(lv);
            po.levels.push_back(NetworkLevel{std::stoi(lv.substr(0, colon)), std::stod(lv.substr(colon + 1)) * 1e9});
          } catch (const std::exception&) {
            throw UsageError("--level " + lv + " must read MACHINES:GB/s, e.g. 4:100");
          }
          if (po.levels.back().machines < 1 || !(po.levels.back().bandwidth > 0) ||
              !std::isfinite(po.levels.back().bandwidth))
            throw UsageError("--level " + lv + " needs MACHINES >= 1 and a finite GB/s > 0, e.g. 4:100");
        }
        // The levels describe the devices PipeDream's planner places stages on; they must be the --ranks
        // the straight pipelines are planned for, or the table would compare plans for different machines.
        long devices = 1;
        std::string product;
        for (const NetworkLevel& l : po.levels) {
          devices *= l.machines;
          product += (product.empty() ? "" : " x ") + std::to_string(l.machines);
          if (devices > 1 << 20) break;
        }
        if (devices != f->ranks)
          throw UsageError("--level describes " + product + " = " + std::to_string(devices) + " devices but --ranks is " +
                           std::to_string(f->ranks) + ": give --ranks " + std::to_string(devices) +
                           " (the product of the levels' MACHINES) or levels whose MACHINES multiply to " +
                           std::to_string(f->ranks));
      }
      po.cost_form = parse_planner_cost_form(f->cost_form);
      if (limit > 0) po.memory_limit_bytes = limit;
      po.allow_fewer_machines = true;
      std::unique_ptr<Plan> pd;
      std::string pd_error;
      try {
        pd = std::make_unique<Plan>(plan_pipedream(prof, po));
      } catch (const UsageError& e) {
        pd_error = e.what();
      }

      // PipeDream's plan run synchronously as 1F1B-RR (stage replication in the runtime), simulated like
      // the straight pipelines; micro-batch counts that every replica count divides.
      std::unique_ptr<Candidate> rr;
      if (pd && std::any_of(pd->replication.begin(), pd->replication.end(), [](int r) { return r > 1; }) &&
          pd->balance.size() > 1) {
        int lcm = 1;
        for (int r : pd->replication) lcm = std::lcm(lcm, r);
        for (int m : f->microbatch_counts) {
          const int mm = (m + lcm - 1) / lcm * lcm;
          if (mm > batch) continue;
          Candidate c = evaluate(prof, pd->balance, "1f1b", mm, static_cast<double>(batch) / mm, bw, f->latency_us / 1e3,
                                 limit, pd->replication);
          c.kind = "pipedream";
          c.solver = "planner";
          if (!rr || better(c, *rr)) rr = std::make_unique<Candidate>(c);
        }
      }
      // The replicated plan is chosen when it is faster and fits (not for UMPIPE, which cuts one pipeline).
      const bool choose_rr = rr && f->planner != "umpipe" && better(*rr, best);
      std::cout << fmt::format("plan for {} ({} layers, profiled at micro-batch {}), {} ranks, {} GB/s, {}, mini-batch {}\n",
                               prof.model, layers, prof.micro_batch_size, f->ranks, f->bandwidth_gbps,
                               limit > 0 ? fmt::format("{} GiB per rank", f->memory_gib) : "no memory limit", batch);
      std::cout << fmt::format("  {:<34} {:>14} {:>8} {:>12}  {}\n", "", "ms/mini-batch", "bubble", "peak GiB", "balance");
      auto row = [&](const std::string& name, const Candidate& c) {
        std::cout << fmt::format("  {:<34} {:>14.2f} {:>8.3f} {:>12.3f}  {}{}\n", name, c.makespan, c.bubble,
                                 c.peak_bytes / 1073741824.0, list(c.balance), c.fits ? "" : "  (over the memory limit)");
      };
      row(fmt::format("{}: {} m={}, {} ({})", choose_rr ? "best straight" : "chosen", best.schedule, best.m, best.kind,
                      best.solver),
          best);
      if (uniform_1f1b) row(fmt::format("uniform balance, 1f1b m={}", uniform_1f1b->m), *uniform_1f1b);
      std::cout << fmt::format("  {:<34} {:>14.2f} {:>8} {:>12.3f}  {}\n", "data parallelism", dp_time, "-",
                               (dp_static + dp_act) / 1073741824.0, dp_fits ? "all layers on every rank" : "over the memory limit");
      if (pd) {
        const double per_batch = pd->time_ms * static_cast<double>(batch) / prof.micro_batch_size;
        std::cout << fmt::format("  {:<34} {:>14.2f} {:>8} {:>12.3f}  {} x replication {} ({} cost form, {:.2f}x over its "
                                 "data parallelism)\n",
                                 "PipeDream planner (asynchronous)", per_batch, "-",
                                 *std::max_element(pd->stage_memory_bytes.begin(), pd->stage_memory_bytes.end()) / 1073741824.0,
                                 list(pd->balance), list(pd->replication), f->cost_form, pd->speedup);
      } else {
        std::cout << "  PipeDream planner: no feasible plan: " << pd_error << "\n";
      }
      if (rr)
        std::cout << fmt::format("  {:<34} {:>14.2f} {:>8.3f} {:>12.3f}  {} x replication {}{}\n",
                                 fmt::format("{}its plan as 1F1B-RR m={}", choose_rr ? "chosen: " : "", rr->m), rr->makespan,
                                 rr->bubble, rr->peak_bytes / 1073741824.0, list(rr->balance), list(rr->replication),
                                 rr->fits ? " (synchronous, simulated)" : "  (over the memory limit)");
      const Candidate& top = choose_rr ? *rr : best;
      if (uniform_1f1b && top.makespan > 0)
        std::cout << fmt::format("  the chosen plan is {:.2f}x the throughput of uniform 1f1b and {:.2f}x data parallelism\n",
                                 uniform_1f1b->makespan / top.makespan, dp_time / top.makespan);
      // UMPIPE: unequal micro-batches per stage on the chosen balance (GPipe order).
      nlohmann::json umpipe;
      if (f->planner == "umpipe") {
        if (f->generations < 1) throw UsageError("--generations must be >= 1, got " + std::to_string(f->generations));
        UmpipeProfileOptions uo;
        uo.samples = static_cast<int>(batch);
        uo.bandwidth_bytes_per_s = f->bandwidth_gbps * 1e9;
        uo.latency_ms = f->latency_us / 1e3;
        if (limit > 0) uo.memory_limit_bytes = limit;
        uo.single_size_overhead_ms = f->overhead_ms;
        // The runtime (src/runtime/umpipe_pass.h) runs the forward without a graph and recomputes it in
        // every backward chunk, so g_j includes f_j. The last stage's forward outputs would only feed its
        // own backward, which recomputes them: the runtime skips them, and its forward row costs nothing
        // (the stage only waits there for its input, as GPipe's order wants before the first backward).
        uo.rematerialise = !f->no_rematerialise;
        // Measured CPU times are not affine in the micro-batch size (the largest sizes fall out of cache
        // and grow faster than linearly), and a least-squares line through them can have a negative
        // intercept, making small micro-batches look free; the table keeps every measured point.
        uo.fit = f->fit == "affine" ? UmpipeFit::affine : UmpipeFit::table;
        UmpipeModel um = umpipe_model_from_profile(prof, best.balance, uo);
        if (uo.rematerialise) um.stages.back().forward = TimeCurve::constant(0);
        DgapOptions dg;
        dg.seed = f->seed;
        dg.generations = f->generations;
        int shown = 0;
        const auto results = plan_umpipe_all(um, dg, [&](const DgapProgress& g) {
          if (g.generation % 50 == 0 || g.stall == dg.stall_generations)
            std::cout << fmt::format("  dgap generation {:>4}: best {:.3f} ms, mean {:.3f} ms, {} without gain\n",
                                     g.generation, g.best_ms, g.mean_ms, g.stall)
                      << std::flush, ++shown;
        });
        std::cout << fmt::format("umpipe on balance {} (GPipe order, mini-batch {}):\n", list(best.balance), batch);
        const double equal = results.front().step_ms;
        for (const UmpipeResult& r : results)
          std::cout << fmt::format("  {:<14} {:>12.3f} ms/mini-batch  {:>+7.2f}% vs equal{}\n", r.planner, r.step_ms,
                                   100.0 * (equal / r.step_ms - 1.0),
                                   r.planner == "equal" ? fmt::format(" (m={})", r.microbatches) : "");
        const UmpipeResult& dgap = results.back();
        // The plan file's "umpipe": DGAP's result at the top (what train --plan runs by default), every
        // planner's under "planners" (train --umpipe NAME), and how the times were modelled.
        umpipe = umpipe_result_to_json(dgap);
        umpipe["rematerialise"] = uo.rematerialise;
        umpipe["fit"] = f->fit;
        umpipe["balance"] = best.balance;
        umpipe["planners"] = nlohmann::json::object();
        for (const UmpipeResult& r : results) umpipe["planners"][r.planner] = umpipe_result_to_json(r);
        for (std::size_t s = 0; s < dgap.plan.forward.size(); ++s)
          std::cout << fmt::format("  stage {} forward {} | backward {}{}\n", s, list(dgap.plan.forward[s]),
                                   list(dgap.plan.backward[s]),
                                   uo.rematerialise && s + 1 == dgap.plan.forward.size()
                                       ? " (the last stage's forward is folded into its backward)"
                                       : "");
        if (uo.rematerialise)
          std::cout << "  re-materialised: every backward chunk recomputes its forward (the runtime's way); train "
                       "--plan FILE runs the dgap partitions, --umpipe equal|local-greedy|global-dp another planner's, "
                       "--umpipe off the straight pipeline above\n";
        else
          std::cout << "  planned without re-materialisation (--no-rematerialise): a planning study only; the runtime "
                       "re-materialises, so train --plan refuses these partitions (run it with --umpipe off)\n";
      }
      if (!f->out.empty()) {
        Plan chosen;
        chosen.model = prof.model;
        chosen.layers = layers;
        chosen.options = po;
        chosen.balance = top.balance;
        chosen.replication = top.replication.empty() ? std::vector<int>(top.balance.size(), 1) : top.replication;
        chosen.time_ms = top.makespan;
        chosen.data_parallel_time_ms = dp_time;
        chosen.speedup = top.makespan > 0 ? dp_time / top.makespan : 0;
        chosen.data_parallel_fits = dp_fits;
        // Per stage: compute per micro-batch (F + B + W from the simulator's costs) and static bytes.
        StageCostOptions so;
        so.micro_batch = static_cast<double>(batch) / top.m;
        for (const StageCost& c : stage_costs(prof, top.balance, so).stage) chosen.stage_time_ms.push_back(c.f + c.b + c.w);
        chosen.stage_memory_bytes = stage_static_bytes(prof, top.balance);
        chosen.stage_in_flight.assign(top.balance.size(), 1);
        nlohmann::json j = plan_to_json(chosen);
        j["schedule"] = top.schedule;
        j["microbatches"] = top.m;
        j["batch_size"] = batch;
        j["balance_kind"] = top.kind;
        j["balance_solver"] = top.solver;
        j["predicted_bubble_fraction"] = top.bubble;
        if (pd) j["pipedream"] = plan_to_json(*pd);
        if (rr) {  // how train --plan-use pipedream runs it: synchronous 1F1B-RR with this m
          j["pipedream"]["schedule"] = "1f1b";
          j["pipedream"]["microbatches"] = rr->m;
          j["pipedream"]["simulated_time_ms"] = rr->makespan;
        }
        if (!umpipe.is_null()) j["umpipe"] = umpipe;
        write_file_atomic(f->out, j.dump(2) + "\n");
        std::cout << "plan written to " << f->out << " (run it with pipetrain train --plan " << f->out << ")\n";
      }
      return 0;
    });
  });
}

}  // namespace pipetrain::cli

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
#include "pipetrain/core/json_limits.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/costs.h"
#include "pipetrain/plan/planner.h"
#include "pipetrain/plan/search.h"
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
  bool pipedream_states = false;  // read a PipeDream graph one layer per node, as PipeDream's planner does
  double activation_compression = 0;  // PipeDream's --activation_compression_ratio; 0: not given
  std::vector<std::string> levels;
  double memory_gib = 0;       // per rank; 0 = unlimited
  int64_t batch_size = 0;      // 0: 8 x the profile's micro-batch size
  std::vector<std::string> schedules{"gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved", "zb-v", "v-half", "v-min"};
  std::vector<int> virtual_counts{2};
  std::vector<int> microbatch_counts{1, 2, 4, 8, 16, 32};
  bool no_hybrid = false;  // only straight pipelines over all ranks (the search before replicas)
  bool exhaustive = false; // simulate every candidate (no pruning)
  bool allreduce_measured = false;  // price replicas with the profile's measured all-reduce (read_plan_profile)
  int top = 8;             // runners-up shown
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

std::string list(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

// --level MACHINES:GB/s, innermost first, as PipeDream's planner's network levels (bytes per second).
// Each field whole: an integer MACHINES >= 1 and a finite GB/s > 0 (no "4.5:100", "4:100abc", "4:100:3"),
// and the product of the MACHINES at most the most ranks a plan takes.
std::vector<NetworkLevel> parse_levels(const std::vector<std::string>& levels) {
  std::vector<NetworkLevel> out;
  long long devices = 1;
  std::string product;
  for (const std::string& lv : levels) {
    const std::string shown = excerpt(lv);
    const auto colon = lv.find(':');
    const std::string machines_text = colon == std::string::npos ? lv : lv.substr(0, colon);
    const std::string gbps_text = colon == std::string::npos ? "" : lv.substr(colon + 1);
    auto bad = [&](const std::string& what) {
      return UsageError(fmt::format("--level {}: {}; write MACHINES:GB/s, an integer MACHINES >= 1 and a finite GB/s > "
                                    "0, e.g. --level 4:100", shown, what));
    };
    if (colon == std::string::npos) throw bad("no ':' between MACHINES and GB/s");
    long long machines = 0;
    double gbps = 0;
    std::size_t used = 0;
    try {
      machines = std::stoll(machines_text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (machines_text.empty() || used != machines_text.size() || !std::isdigit(static_cast<unsigned char>(machines_text[0])))
      throw bad("MACHINES '" + excerpt(machines_text) + "' is not a whole number of machines (at most " +
                std::to_string(kMaxPlanRanks) + ")");
    if (machines < 1) throw bad(fmt::format("MACHINES is {}", machines));
    try {
      gbps = std::stod(gbps_text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (gbps_text.empty() || used != gbps_text.size() || std::isspace(static_cast<unsigned char>(gbps_text[0])))
      throw bad("GB/s '" + excerpt(gbps_text) + "' is not a number");
    if (!(gbps > 0) || !std::isfinite(gbps) || !std::isfinite(gbps * 1e9))
      throw bad(fmt::format("GB/s is {}{}", gbps, std::isfinite(gbps) && gbps > 0 ? " (too large)" : ""));
    product += (product.empty() ? "" : " x ") + std::to_string(machines);
    devices = machines > kMaxPlanRanks ? kMaxPlanRanks + 1LL : devices * machines;
    if (devices > kMaxPlanRanks)
      throw UsageError(fmt::format("--level: the levels' MACHINES multiply to {} = more than {} devices, the most a "
                                   "plan takes: give levels whose MACHINES multiply to --ranks",
                                   product, kMaxPlanRanks));
    out.push_back(NetworkLevel{static_cast<int>(machines), gbps * 1e9});
  }
  return out;
}

void add_plan_flags(CLI::App* cmd, const std::shared_ptr<PlanFlags>& f) {
  cmd->add_option("--profile", f->profile, "profile: pipetrain profile's JSON, or PipeDream's graph text")->required();
  cmd->add_option("--ranks,-p", f->ranks, "ranks (devices) to plan for, default 2");
  cmd->add_option("--bandwidth", f->bandwidth_gbps,
                  "GB/s between ranks; default: the profile's measured bandwidth (pipetrain profile --transport), "
                  "else 10");
  cmd->add_option("--latency", f->latency_us,
                  "microseconds per transfer between ranks; default: the profile's measured latency, else 50");
  cmd->add_flag("--pipedream-states", f->pipedream_states,
                "read a PipeDream graph file one layer per node, each carrying what crosses the cut after it, as "
                "PipeDream's planner does (VGG-16: its 40 states; default: chains folded, 39 layers)");
  cmd->add_option("--activation-compression", f->activation_compression,
                  "PipeDream's planner: its --activation_compression_ratio (activations and gradients shrink by this "
                  "ratio in transit, and each stage's cost counts its transfers as PipeDream's code does); default: "
                  "not given");
  cmd->add_option("--pipedream-batch", f->pipedream_batch,
                  "the batch size a PipeDream graph file was profiled at (its format does not record it; VGG-16's: 128)");
  cmd->add_option("--level", f->levels,
                  "hierarchical network for PipeDream's planner, innermost first: MACHINES:GB/s, e.g. --level 4:100 "
                  "--level 2:3.125 (the product of MACHINES is the device count)");
  cmd->add_option("--memory", f->memory_gib, "GiB per rank (weights, gradients, optimizer state, activations); 0 = no limit");
  cmd->add_option("--batch-size", f->batch_size,
                  "samples per mini-batch; default max(8, ranks) x the profile's micro-batch size");
  cmd->add_option("--schedules", f->schedules,
                  "schedules to consider (synchronous ones: the asynchronous pipedream, 2bw and spectrain are not searched; "
                  "PipeDream's planner runs for every plan), default gpipe 1f1b zb-h1 zb-h2 interleaved zb-v v-half v-min "
                  "(v-half and v-min keep about 1/2 and 1/3 of 1f1b's activations: the ones that fit a tight --memory)");
  cmd->add_option("--virtual-counts", f->virtual_counts,
                  "stages per rank to try for the looped schedules (interleaved, interleaved-zb, looped-bfs), default 2");
  cmd->add_flag("--no-hybrid", f->no_hybrid,
                "only straight pipelines over all the ranks (no data-parallel replicas, no shorter pipelines)");
  cmd->add_flag("--exhaustive", f->exhaustive,
                "simulate every candidate instead of pruning those whose lower bound cannot win (same choice, slower)");
  cmd->add_option("--top", f->top, "runners-up to show (the best plan of each other shape), default 8");
  cmd->add_option("--microbatch-counts", f->microbatch_counts, "micro-batch counts to consider, default 1 2 4 8 16 32");
  cmd->add_option("--balances", f->kinds,
                  "balance kinds to consider, default uniform parameters time memory; a list such as 5,7,7,20 is "
                  "a balance for the plans of that many stages");
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
  cmd->add_option("--out", f->out,
                  "write the plan JSON here (pipetrain train --plan FILE runs it); when no candidate fits --memory, "
                  "the fastest is written all the same, with \"fits_memory_limit\": false and a warning, for inspection");
}

void check_plan_flags(const PlanFlags* f, const CLI::App* cmd) {
  if (f->ranks < 1 || f->ranks > kMaxPlanRanks)
    throw UsageError(fmt::format("--ranks must be in 1..{} (the devices to plan for), got {}", kMaxPlanRanks, f->ranks));
  if (f->top < 0) throw UsageError("--top must be >= 0, got " + std::to_string(f->top));
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
  if (!std::isfinite(f->latency_us) || f->latency_us > 1e9)
    throw UsageError(fmt::format("--latency must be at most 1e9 us (1000 s per transfer), got {:g}", f->latency_us));
  if (cmd->get_option("--batch-size")->count() > 0 && f->batch_size < 1)
    throw UsageError(fmt::format("--batch-size must be >= 1 (samples per mini-batch), got {}; leave it out for the "
                                 "default, max(8, ranks) x the profile's micro-batch size", f->batch_size));
  if (!(f->activation_compression >= 0) || !std::isfinite(f->activation_compression))
    throw UsageError(fmt::format("--activation-compression must be a finite ratio > 0 (PipeDream's "
                                 "--activation_compression_ratio), or 0 for none; got {:g}", f->activation_compression));
  // The genetic algorithm's flags do nothing for the pipeline planner (they ran without a word).
  if (f->planner != "umpipe")
    for (const char* flag : {"--seed", "--generations", "--overhead", "--fit", "--no-rematerialise"})
      if (cmd->get_option(flag)->count() > 0)
        throw UsageError(std::string(flag) + " applies with --planner umpipe (unequal micro-batches per stage): add "
                         "--planner umpipe, or drop " + flag);
  if (!(f->overhead_ms >= 0) || !std::isfinite(f->overhead_ms) || f->overhead_ms > 1e9)
    throw UsageError(fmt::format("--overhead must be a finite number of ms >= 0 (per layer and pass, for layers "
                                 "measured at one size only), got {:g}", f->overhead_ms));
}

// A measured profile whose fit found no bandwidth term (latency only) gives an infinite bandwidth:
// the bytes cost nothing (it used to give the largest double, printed as 1.8e+302 GB/s, and the
// search then refused the bandwidth it overflowed to).
std::string bandwidth_text(double gbps) {
  return std::isinf(gbps) ? "no bandwidth limit (latency only)" : fmt::format("{:.3g} GB/s", gbps);
}

// The asynchronous schedules in --schedules are not searched (core/plan search): a note names them, unless
// nothing else is given, which the search refuses in its own words.
void note_asynchronous_schedules(const std::vector<std::string>& schedules) {
  std::string given_async;
  bool any_sync = false;
  for (const std::string& name : schedules) {
    const bool sync = schedule_traits(name).synchronous;  // an unknown name: UsageError listing the names
    any_sync |= sync;
    if (!sync) given_async += (given_async.empty() ? "" : " ") + name;
  }
  if (given_async.empty() || !any_sync) return;
  std::string async_names;
  for (const std::string& name : schedule_names())
    if (!schedule_traits(name).synchronous) async_names += (async_names.empty() ? "" : ", ") + name;
  std::cerr << "pipetrain plan: note: --schedules " << given_async << ": the asynchronous schedules (" << async_names
            << ") are not searched (they never flush, so no step time compares with the others'); PipeDream's own "
            << "planner is run for every plan (its section, \"PipeDream planner's own estimate\", and its plan as "
            << "1F1B-RR)\n";
}

// The profile, read as the flags say (a PipeDream graph one state per node, at its batch size); a measured
// transport in it sets each of the transfers' terms (bandwidth, latency) that --bandwidth/--latency do not.
Profile read_plan_profile(PlanFlags* f, const CLI::App* cmd) {
  Profile prof = load_profile(f->profile);
  // A PipeDream graph file does not record the batch size it was profiled at: read at 1, its activations
  // and throughput are that many times off (VGG-16's file: 128x).
  if (prof.source.rfind("pipedream graph", 0) == 0 && f->pipedream_batch == 0)
    std::cerr << "pipetrain plan: warning: " << f->profile << " is a PipeDream graph file, read as profiled at batch "
              << "size 1 (its format does not record one): give --pipedream-batch N, the batch size it was profiled "
              << "at (VGG-16's: 128), or its memory and throughput are N times off\n";
  if (f->pipedream_batch > 0 || f->pipedream_states) {
    const std::string flag = f->pipedream_batch > 0 ? "--pipedream-batch" : "--pipedream-states";
    if (prof.source.rfind("pipedream graph", 0) != 0)
      throw UsageError(flag + " is for PipeDream graph files; " + f->profile + " is a JSON profile: drop " + flag);
    PipeDreamOptions po;
    if (f->pipedream_batch > 0) po.micro_batch_size = f->pipedream_batch;
    po.planner_states = f->pipedream_states;
    prof = load_pipedream_graph(f->profile, po);
  }
  // A profile with measured runtime costs gives the transfers (each term --bandwidth/--latency does not)
  // and the per-action overhead (stage_costs reads it) to every candidate's simulation.
  // Each of --bandwidth and --latency not given is the profile's measured one.
  const bool bandwidth_given = cmd->get_option("--bandwidth")->count() > 0;
  const bool latency_given = cmd->get_option("--latency")->count() > 0;
  const bool transfers_given = bandwidth_given || latency_given;
  if (const auto t = profile_transfers(prof)) {
    if (!bandwidth_given) f->bandwidth_gbps = t->bandwidth_bytes_per_ms / 1e6;
    if (!latency_given) f->latency_us = t->latency_ms * 1e3;
    std::cout << fmt::format("transfers and overhead as measured over {}: {:.2f} us{} + bytes at {}{}, {:.2f} us "
                             "per compute action\n",
                             excerpt(prof.runtime->transport), f->latency_us, latency_given ? " (--latency)" : "",
                             bandwidth_text(f->bandwidth_gbps), bandwidth_given ? " (--bandwidth)" : "",
                             prof.runtime->overhead_ms * 1e3);
  }
  // And its measured all-reduce prices the replicas' gradients on one host (not across --level links).
  if (prof.runtime && !prof.runtime->allreduce.empty() && !transfers_given && f->levels.empty()) {
    f->allreduce_measured = true;
    std::cout << fmt::format("replicas' all-reduce as measured over {} ({} ranks, {} sizes up to {:.0f} KiB)\n",
                             excerpt(prof.runtime->transport), prof.runtime->allreduce_ranks,
                             prof.runtime->allreduce.size(),
                             std::max_element(prof.runtime->allreduce.begin(), prof.runtime->allreduce.end(),
                                              [](const TransferSample& a, const TransferSample& b) { return a.bytes < b.bytes; })
                                     ->bytes / 1024);
  }
  return prof;
}


// 1F1B-RR's m: the whole schedule's; with every stage replicated u times, train --plan runs u copies of
// m / u each (the plan file's count), which the text says.
std::string rr_microbatches(const PlanCandidate& c) {
  const int u = c.replication.front();
  const bool equal = u > 1 && std::all_of(c.replication.begin(), c.replication.end(), [&](int r) { return r == u; });
  return equal ? fmt::format("m={} ({} per copy)", c.m, c.m / u) : fmt::format("m={}", c.m);
}

// A long partition as runs ("3x340,2x2"); short ones as they are.
std::string partition_text(const std::vector<int>& v) {
  if (v.size() <= 16) return list(v);
  std::string s;
  for (std::size_t i = 0; i < v.size();) {
    std::size_t j = i;
    while (j < v.size() && v[j] == v[i]) ++j;
    s += (s.empty() ? "" : ",") + std::to_string(v[i]) + (j - i > 1 ? "x" + std::to_string(j - i) : "");
    i = j;
  }
  return s;
}

// One plan's shape in words: "4 stages x 8 replicas, 1f1b v=1 m=16 (time, min-max)".
std::string shape_text(const PlanCandidate& c) {
  if (!c.replication.empty() && c.copies > 1)
    return fmt::format("PipeDream's plan for {} ranks x {} copies: {} stages replicated {} (1F1B-RR), {}",
                       c.ranks_used / c.copies, c.copies, c.balance.size(), list(c.replication), rr_microbatches(c));
  if (!c.replication.empty())
    return fmt::format("{} stages replicated {} (1F1B-RR), {}", c.balance.size(), list(c.replication),
                       rr_microbatches(c));
  std::string s = c.stages == 1 ? fmt::format("1 stage x {} replicas", c.replicas)
                                : fmt::format("{} stages x {} replica{}", c.stages, c.replicas, c.replicas == 1 ? "" : "s");
  s += fmt::format(", {}", c.schedule);
  if (c.virtual_stages > 1) s += fmt::format(" v={}", c.virtual_stages);
  s += fmt::format(" m={}", c.m);
  if (!c.placement.empty()) s += ", " + c.placement;
  return s;
}

// The search's table: the chosen plan, why it won, the runners-up of other shapes, and the baselines
// (uniform 1f1b, data parallelism, PipeDream's plan). Every row's time is the same simulation's, so the
// chosen plan is never slower than a row below it (within the memory limit).
void print_plans(const PlanFlags* f, const Profile& prof, const PlanSearchResult& res, double limit) {
  const int layers = static_cast<int>(prof.layers.size());
  const int64_t batch = res.batch_size;
  const PlanCandidate& top = res.chosen();
  std::cout << fmt::format("plan for {} ({} layers, profiled at micro-batch {}), {} ranks, {}, {}, mini-batch {}\n",
                           excerpt(prof.model), layers, prof.micro_batch_size, f->ranks,
                           f->levels.empty() ? bandwidth_text(f->bandwidth_gbps)
                                             : fmt::format("{} level{}", f->levels.size(), f->levels.size() > 1 ? "s" : ""),
                           limit > 0 ? fmt::format("{} GiB per rank", f->memory_gib) : "no memory limit", batch);
  if (f->exhaustive || static_cast<int64_t>(res.candidates.size()) >= res.considered)
    std::cout << fmt::format("  searched {} candidates, simulated every one{}\n", res.considered,
                             f->exhaustive ? " (--exhaustive)" : "");
  else
    std::cout << fmt::format("  searched {} candidates, simulated {} (the others' lower bound could not beat the best)\n",
                             res.considered, res.candidates.size());
  std::cout << fmt::format("  {:<48} {:>6} {:>14} {:>12} {:>8} {:>10}  {}\n", "", "ranks", "ms/mini-batch", "samples/s",
                           "bubble", "peak GiB", "balance");
  // Rows the options do not let be chosen (--no-hybrid, UMPIPE, 1F1B-RR without 1f1b) are references,
  // marked as such; the chosen plan is the best of the others.
  auto row = [&](const std::string& name, const PlanCandidate& c) {
    const std::string why_not = res.ineligible(c);
    std::cout << fmt::format("  {:<48} {:>6} {:>14.2f} {:>12.1f} {:>8.3f} {:>10.3f}  {}{}{}\n", name, c.ranks_used,
                             c.makespan, c.makespan > 0 ? 1e3 * static_cast<double>(batch) / c.makespan : 0.0, c.bubble,
                             c.peak_bytes / 1073741824.0, list(c.balance), c.fits ? "" : "  (over the memory limit)",
                             why_not.empty() ? "" : "  (not eligible: " + why_not + ")");
  };
  row("chosen: " + shape_text(top), top);
  const bool straight_row = res.best_straight.makespan != top.makespan || res.best_straight.balance != top.balance;
  if (straight_row) row("best straight: " + shape_text(res.best_straight), res.best_straight);
  auto same_shape = [](const PlanCandidate& a, const PlanCandidate& b) {
    return a.stages == b.stages && a.replicas == b.replicas && a.schedule == b.schedule &&
           a.virtual_stages == b.virtual_stages && a.replication == b.replication;
  };
  // Runners-up: the best simulated plan of each other (stages, replicas, schedule) shape.
  std::vector<const PlanCandidate*> others;
  for (const PlanCandidate& c : res.candidates) {
    if (same_shape(c, top) || (straight_row && same_shape(c, res.best_straight))) continue;  // shown above
    auto same = std::find_if(others.begin(), others.end(), [&](const PlanCandidate* o) {
      return o->stages == c.stages && o->replicas == c.replicas && o->schedule == c.schedule &&
             o->virtual_stages == c.virtual_stages && o->replication == c.replication;
    });
    if (same == others.end()) others.push_back(&c);
    else if (better_candidate(c, **same)) *same = &c;
  }
  std::sort(others.begin(), others.end(), [](const PlanCandidate* a, const PlanCandidate* b) { return better_candidate(*a, *b); });
  for (int i = 0; i < f->top && i < static_cast<int>(others.size()); ++i)
    row("  runner-up: " + shape_text(*others[static_cast<std::size_t>(i)]), *others[static_cast<std::size_t>(i)]);
  if (res.uniform_1f1b)
    row(fmt::format("uniform balance, 1f1b, {} stages m={}", res.uniform_1f1b->stages, res.uniform_1f1b->m),
        *res.uniform_1f1b);
  if (res.data_parallel)
    row(fmt::format("data parallelism ({} replicas, all layers)", res.data_parallel->replicas), *res.data_parallel);
  if (const auto& rr = res.replicated)
    row(fmt::format("PipeDream's plan{} as 1F1B-RR {}", res.replicated_unlimited ? " (without --memory)" : "",
                    rr_microbatches(*rr)),
        *rr);
  // PipeDream's plan for fewer ranks x data-parallel copies of it: the best of the copy counts tried.
  const PlanCandidate* copies = nullptr;
  for (const PlanCandidate& c : res.pipedream_copies)
    if (!copies || better_candidate(c, *copies)) copies = &c;
  if (copies)
    row(fmt::format("PipeDream's plan for {} ranks x {} copies, 1F1B-RR {}", copies->ranks_used / copies->copies,
                    copies->copies, rr_microbatches(*copies)),
        *copies);
  if (const auto& pd = res.pipedream) {
    const double per_batch = pd->time_ms * static_cast<double>(batch) / prof.micro_batch_size;
    std::cout << fmt::format("  PipeDream planner's own estimate (asynchronous, no flush; its cost model, not the rows'): "
                             "{:.2f} ms/mini-batch, peak {:.3f} GiB, {} x replication {} ({} cost form)\n",
                             per_batch,
                             *std::max_element(pd->stage_memory_bytes.begin(), pd->stage_memory_bytes.end()) / 1073741824.0,
                             list(pd->balance), list(pd->replication), f->cost_form);
  } else {
    std::cout << "  PipeDream planner: no plan: " << res.pipedream_error << "\n";
  }
  // Why it won.
  std::string why =
      !top.fits ? fmt::format("  why: none of the {} simulated fits {} GiB per rank (raise --memory, give more --ranks "
                              "or a smaller --batch-size); the fastest of them ({:.2f} ms, {:.1f} samples/s",
                              res.candidates.size(), f->memory_gib, top.makespan,
                              1e3 * static_cast<double>(batch) / top.makespan)
                : fmt::format("  why: fastest{} of the {} simulated{} ({:.2f} ms, {:.1f} samples/s",
                              limit > 0 ? fmt::format(" within {} GiB per rank", f->memory_gib) : "",
                              res.candidates.size(),
                              !res.hybrid || !res.replicated_may_win
                                  ? fmt::format(" that {} allows", res.replicated_may_win ? "--no-hybrid" : "UMPIPE")
                                  : "",
                              top.makespan, 1e3 * static_cast<double>(batch) / top.makespan);
  why += fmt::format(", bubble {:.3f}, peak {:.3f} GiB per rank", top.bubble, top.peak_bytes / 1073741824.0);
  if (top.replicas > 1) why += fmt::format(", all-reduce {:.2f} ms", top.allreduce_ms);
  why += ")";
  auto ratio = [&](const char* name, const std::optional<PlanCandidate>& c) {
    if (c && top.makespan > 0) why += fmt::format("; {:.2f}x {}", c->makespan / top.makespan, name);
  };
  ratio("uniform 1f1b", res.uniform_1f1b);
  ratio("data parallelism", res.data_parallel);
  ratio("PipeDream's plan", res.replicated);
  if (copies && top.makespan > 0)
    why += fmt::format("; {:.2f}x PipeDream's plan x {} copies", copies->makespan / top.makespan, copies->copies);
  std::cout << why << "\n";
}

// UMPIPE: unequal micro-batches per stage on the chosen balance (GPipe order); the plan file's "umpipe".
nlohmann::json plan_umpipe(const PlanFlags* f, const Profile& prof, const PlanSearchResult& res, double limit) {
  const int64_t batch = res.batch_size;
  const PlanCandidate& best = res.best_straight;
  nlohmann::json umpipe;
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
    std::cout << fmt::format("  stage {} forward {} | backward {}{}\n", s, partition_text(dgap.plan.forward[s]),
                             partition_text(dgap.plan.backward[s]),
                             uo.rematerialise && s + 1 == dgap.plan.forward.size()
                                 ? " (the last stage's forward is folded into its backward)"
                                 : "");
  // What the file offers: the straight pipeline chosen above (train --plan FILE --umpipe off) and each
  // planner's partitions (--umpipe NAME); train runs the fastest of them unless told otherwise (before:
  // dgap's always, even where the straight pipeline was faster).
  const UmpipeResult* quickest = &results.front();
  for (const UmpipeResult& r : results)
    if (r.step_ms < quickest->step_ms) quickest = &r;
  // One time model for the comparison: UMPIPE's (its --overhead, its fit) and the search's scale layer
  // times differently, so a GPipe straight pipeline is priced again under UMPIPE's, as the equal
  // partitions into its m (P-U1): the same plan got 24.00 ms from the search and 23.30 ms as "equal",
  // and train then ran the partitions for a difference that was only the model. Ties go to the straight
  // pipeline.
  double straight_ms = best.makespan;
  if (best.schedule == "gpipe" && best.m >= 1 && best.m <= um.samples &&
      static_cast<int>(best.balance.size()) == um.stage_count())
    straight_ms = UmpipeEvaluator(um).step_ms(equal_plan(um.stage_count(), um.samples, best.m));
  const bool straight_wins = uo.rematerialise && straight_ms <= quickest->step_ms * (1 + 1e-9);
  const std::string fastest = !uo.rematerialise || straight_wins ? "off" : quickest->planner;
  const double fastest_ms = fastest == "off" ? best.makespan : quickest->step_ms;
  const std::string fastest_text = fastest == "off" ? "the straight pipeline chosen above" : fastest + "'s partitions";
  umpipe["runs_by_default"] = fastest;
  umpipe["fastest"] = fastest;
  umpipe["fastest_ms"] = fastest_ms;
  umpipe["straight_pipeline_ms"] = best.makespan;
  umpipe["note"] = fmt::format("train --plan runs {} by default ({:.3f} ms predicted), the fastest this file offers; "
                               "--umpipe NAME runs another planner's partitions, --umpipe off the straight pipeline",
                               fastest_text, fastest_ms);
  if (uo.rematerialise) {
    std::cout << "  re-materialised: every backward chunk recomputes its forward (the runtime's way); train "
                 "--plan FILE runs the fastest of what follows, --umpipe dgap|equal|local-greedy|global-dp a "
                 "planner's partitions, --umpipe off the straight pipeline chosen above\n";
    std::cout << fmt::format("  runs by default: {} ({:.3f} ms predicted), the fastest the file offers (dgap: {:.3f} ms, "
                             "the straight pipeline: {:.2f} ms{})\n", fastest_text, fastest_ms, dgap.step_ms, best.makespan,
                             straight_ms != best.makespan
                                 ? fmt::format(", {:.3f} ms in UMPIPE's time model, which the partitions are compared in",
                                               straight_ms)
                                 : std::string());
  }
  else
    std::cout << "  planned without re-materialisation (--no-rematerialise): a planning study only; the runtime "
                 "re-materialises, so train --plan refuses these partitions (run it with --umpipe off)\n";
  return umpipe;
}

}  // namespace

void add_plan_command(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<PlanFlags>();
  CLI::App* cmd = app.add_subcommand("plan", "choose balance, schedule and micro-batches (and PipeDream's replication) "
                                             "from a profile");
  add_plan_flags(cmd, f);
  cmd->footer(
      "Examples:\n"
      "  pipetrain profile --model gpt --microbatch-size 8 --out gpt.json\n"
      "  pipetrain plan --profile gpt.json --ranks 4 --batch-size 64 --out plan.json\n"
      "  pipetrain train --plan plan.json --batch-size 64\n"
      "  pipetrain plan --profile data/pipedream/vgg16-graph.txt --pipedream-batch 128 --ranks 8 --bandwidth 1.25 "
      "--memory 16\n"
      "      # PipeDream's graph file: --pipedream-batch gives the batch size it was profiled at (VGG-16's: 128)");
  cmd->callback([f, cmd, &exit_code] {
    exit_code = guarded("plan", [&] {
      check_plan_flags(f.get(), cmd);
      refuse_empty_names(cmd, {"--out", "--profile"});
      check_outputs_apart({{"--out", f->out}}, {{"--profile", f->profile}});
      check_output_path(f->out, "--out");
      note_asynchronous_schedules(f->schedules);
      const Profile prof = read_plan_profile(f.get(), cmd);
      const double limit = f->memory_gib * 1073741824.0;
      PlanSearchOptions so;
      so.ranks = f->ranks;
      so.bandwidth_bytes_per_ms = f->bandwidth_gbps * 1e9 / 1e3;
      so.latency_ms = f->latency_us / 1e3;
      so.memory_limit_bytes = limit;
      so.batch_size = f->batch_size;
      so.schedules = f->schedules;
      so.virtual_counts = f->virtual_counts;
      so.hybrid = !f->no_hybrid;
      so.exhaustive = f->exhaustive;
      so.microbatch_counts = f->microbatch_counts;
      if (f->allreduce_measured) {
        so.allreduce = prof.runtime->allreduce;
        so.allreduce_ranks = prof.runtime->allreduce_ranks;
      }
      so.balance_kinds = f->kinds;
      so.pipedream.levels = parse_levels(f->levels);
      so.pipedream.cost_form = parse_planner_cost_form(f->cost_form);
      so.pipedream.activation_compression = f->activation_compression;
      so.replicated_may_win = f->planner != "umpipe";  // UMPIPE cuts one straight pipeline
      const PlanSearchResult res = search_plans(prof, so);
      print_plans(f.get(), prof, res, limit);
      const nlohmann::json umpipe = f->planner == "umpipe" ? plan_umpipe(f.get(), prof, res, limit) : nlohmann::json();
      if (!f->out.empty()) {
        PlanFile file = plan_file_for(prof, res);
        file.umpipe = umpipe;
        write_plan_file(f->out, file);
        const PlanCandidate& top = res.chosen();
        const std::string fastest = umpipe.is_object() ? umpipe.value("fastest", std::string("dgap")) : "dgap";
        if (top.fits)
          std::cout << "plan written to " << f->out << " (run it with pipetrain train --plan " << f->out
                    << (fastest == "dgap" ? std::string() : " --umpipe " + fastest) << ")\n";
        else  // written for inspection; its "fits_memory_limit" says false
          std::cout << fmt::format("plan written to {}, but it does NOT fit {} GiB per rank (its peak: {:.3f} GiB per "
                                   "rank), and a run of it would need that much: raise --memory, give more --ranks or "
                                   "a smaller --batch-size, and plan again\n",
                                   f->out, f->memory_gib, top.peak_bytes / 1073741824.0);
      }
      return 0;
    });
  });
}

}  // namespace pipetrain::cli

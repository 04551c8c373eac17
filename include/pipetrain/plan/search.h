// Choosing how to run a model from its profile (what `pipetrain plan` prints). For R ranks the search
// covers every hybrid plan: d data-parallel copies (replicas) of a p-stage pipeline with d x p <= R, for
// every schedule asked for (with its virtual stages: interleaved's v chunks per rank, the V shapes' two),
// micro-batch count m, balance kind x solver, and, across a --level hierarchy, both placements (a
// replica's stages on neighbouring ranks, or a stage's replicas on neighbouring ranks), each simulated
// with per-stage costs summed from the profile at the micro-batch size, a transfer time per stage
// boundary from the bytes that cross it and the link it crosses, and the runtime's group all-reduce
// (costs.h group_allreduce_ms) of every stage's gradients over its replicas at the end of the step, and
// checked against the memory per rank. p = 1 is
// data parallelism (with gradient accumulation when m > 1). PipeDream's planner with per-stage
// replication (planner.h) runs too, and its plan, run synchronously as 1F1B-RR, is a candidate like the
// others; so are d data-parallel copies of its plan for R/d ranks (stage s replicated r_s times in the
// plan for R/d ranks runs on d x r_s ranks: micro-batch i goes to the stage's replica i mod (d r_s), so
// i mod d picks one copy at every stage, and each stage's gradients are all-reduced over its d r_s
// replicas; that is one 1F1B-RR schedule with the replication times d, which the runtime runs as it
// is). Torch-free.
//
// Exact pruning: every candidate gets a lower bound on its time (the busiest rank's work after its first
// input can arrive, plus its step; and one micro-batch's path through every stage and back), and
// candidates are simulated in order of that bound until the bound passes the best time found; so the
// result is the one an exhaustive search gives (PlanSearchOptions::exhaustive checks that). Replica
// counts d are those that divide the mini-batch (every copy trains on the same N / d samples, which is
// what the runtime runs: `train --replicas` refuses a batch it does not split).
//
// And the plan file: one type (PlanFile) with one writer and one reader, which `pipetrain plan --out`
// writes and `pipetrain train --plan` runs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pipetrain/plan/costs.h"
#include "pipetrain/plan/planner.h"
#include "pipetrain/plan/profile.h"

namespace pipetrain {

// The largest rank count the search takes (and the message that refuses more names it).
inline constexpr int kMaxPlanRanks = kMaxLevelDevices;

struct PlanSearchOptions {
  int ranks = 2;
  double bandwidth_bytes_per_ms = 1e7;  // between ranks (10 GB/s); with pipedream.levels, theirs instead
  double latency_ms = 0.05;             // per transfer, and per all-reduce message
  double memory_limit_bytes = 0;        // per rank; 0: no limit
  // Samples per mini-batch; 0: max(8, ranks) x the profile's micro-batch size (so every rank can get one
  // profiled micro-batch).
  int64_t batch_size = 0;
  std::vector<std::string> schedules{"gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved", "zb-v", "v-half", "v-min"};
  std::vector<int> virtual_counts{2};   // v for the looped schedules (interleaved, interleaved-zb, looped-bfs)
  std::vector<int> microbatch_counts{1, 2, 4, 8, 16, 32};
  std::vector<std::string> balance_kinds{"uniform", "parameters", "time", "memory"};
  // The network: levels innermost first (planner.h); empty: one level of `ranks` devices at the
  // bandwidth. Every candidate's transfers and all-reduces cross the links these levels give; PipeDream's
  // planner gets them too, with its memory limit and allow_fewer_machines set from the options above.
  PlannerOptions pipedream;
  // The group all-reduce between replicas on the innermost level (one host), as a measured profile timed it
  // (RuntimeCosts::allreduce over allreduce_ranks; costs.h measured_allreduce_ms): `pipetrain plan` sets them
  // unless --bandwidth, --latency or --level is given. Empty: the links' bandwidth and `latency_ms`.
  std::vector<TransferSample> allreduce;
  int allreduce_ranks = 0;
  // false (UMPIPE): only one straight pipeline over min(ranks, layers) ranks, one stage each, may be
  // chosen; the other rows are still simulated and shown, as references (PlanSearchResult::ineligible).
  bool replicated_may_win = true;
  // false (--no-hybrid): only pipelines over min(ranks, layers) ranks are searched (with virtual stages
  // where the schedule has them); PipeDream's plan and data parallelism are references, never chosen.
  bool hybrid = true;
  bool exhaustive = false;         // simulate every candidate (no pruning): the reference the tests compare with
  // PipeDream's planner is O(L^2 R^2) on one level; above this many ranks (and without levels given) it
  // runs on two levels of the same links, groups of g ranks with g the divisor of R nearest sqrt(R)
  // (each level costs about L^3 x its units squared), which restricts its replication to whole groups at
  // the outer level; not at all for a prime R.
  int pipedream_max_ranks = 256;
  // PipeDream's plan x d copies: its planner runs for k = R/d ranks, k a divisor of R in
  // 2..min(pipedream_max_ranks, R/2) (so each run is at most one flat run at the cap); when there are more
  // such k than this, this many spread evenly over them, the smallest and the largest included. 0: none;
  // none either without hybrid or replicated_may_win.
  int pipedream_copy_plans = 8;
};

// One way to run the model, simulated.
struct PlanCandidate {
  std::string kind, solver, schedule;  // balance kind and solver ("pipedream" / "planner" for 1F1B-RR)
  int m = 0;                           // micro-batches per replica and step
  std::vector<int> balance;            // layers per (virtual) stage
  std::vector<int> replication;  // per stage (PipeDream's 1F1B-RR); empty: `replicas` copies of one pipeline
  int copies = 1;  // with replication: data-parallel copies of PipeDream's plan for ranks_used / copies
                   // ranks (`replication` is that plan's times copies)
  double makespan = 0, bubble = 0, peak_bytes = 0;  // ms per mini-batch, bubble fraction, bytes per rank
  bool fits = true;                                  // within the memory limit
  int stages = 0;          // p: ranks per pipeline
  int virtual_stages = 1;  // stages per rank (interleaved's v; 2 for the V shapes)
  int replicas = 1;        // d: data-parallel copies of the pipeline (each gets `samples` of the mini-batch)
  int ranks_used = 0;      // p x d (the sum of `replication` for 1F1B-RR)
  double samples = 0;      // samples per replica and step (the slowest replica's share)
  double allreduce_ms = 0; // the largest per-rank gradient all-reduce over the replicas
  std::string placement;   // with levels: "pipeline-inner" or "replicas-inner"; else empty
  // Per (virtual) stage: the simulated peak bytes of the rank holding it (static + activations; for a
  // replicated stage, the most of its replicas): the plan file's stage_memory_bytes.
  std::vector<double> stage_peak_bytes;
};

// Faster first; candidates within the memory limit before those over it; ties: fewer micro-batches.
bool better_candidate(const PlanCandidate& a, const PlanCandidate& b);

struct PlanSearchResult {
  int64_t batch_size = 0;                    // the mini-batch planned for
  std::vector<PlanCandidate> candidates;     // every candidate simulated (the pruned ones are not)
  int64_t considered = 0;                    // candidates in the search space (simulated + pruned)
  PlanCandidate best;  // the chosen plan: never worse than any eligible candidate or baseline here
  PlanCandidate best_straight;  // the best single pipeline over min(R, L) ranks, one stage each (what UMPIPE cuts)
  std::optional<PlanCandidate> uniform_1f1b;  // the baseline: uniform balance, 1f1b, min(R, L) stages, its best m
  // Data parallelism: p = 1 on min(ranks, batch) replicas, one micro-batch, as simulated (the whole
  // model's compute on each replica's share, then the group all-reduce of the gradients and the loss).
  std::optional<PlanCandidate> data_parallel;
  double data_parallel_ms = 0, data_parallel_bytes = 0;
  bool data_parallel_fits = true;
  PlannerOptions pipedream_options;          // what PipeDream's planner was given (levels filled in)
  std::optional<Plan> pipedream;             // PipeDream's planner (asynchronous), if it found a plan
  std::string pipedream_error;               // why not, otherwise
  std::optional<PlanCandidate> replicated;   // its plan as synchronous 1F1B-RR, if it replicates a stage
  // With a memory limit, PipeDream's planner prices memory by its asynchronous model (whole mini-batches
  // and weight versions stashed), which has nothing to do with the synchronous 1F1B-RR that runs: its
  // plan without the limit is tried too, and `replicated` comes from whichever of the two is better once
  // simulated (fits first). `replicated_plan` is the plan `replicated` runs (train --plan-use pipedream);
  // `replicated_unlimited` says it is the one planned without the limit.
  std::optional<Plan> replicated_plan;
  bool replicated_unlimited = false;
  // PipeDream's plan for R/d ranks x d copies (PlanCandidate::copies = d), as 1F1B-RR: the best m of
  // each d tried (PlanSearchOptions::pipedream_copy_plans), by d; the planner's plans in `pipedream_copy_plans`.
  std::vector<PlanCandidate> pipedream_copies;
  std::vector<Plan> pipedream_copy_plans;
  bool chose_replicated = false;             // `best` is PipeDream's plan as 1F1B-RR (best.copies: how many)
  const PlanCandidate& chosen() const { return best; }

  // What the options let be chosen (every other row is a reference): replicas, shorter pipelines and
  // 1F1B-RR only with `hybrid` and `replicated_may_win`; 1F1B-RR only with 1f1b among the schedules;
  // without `replicated_may_win` (UMPIPE) one stage per rank over `straight_stages` ranks.
  bool hybrid = true, replicated_may_win = true, rr_schedule = true;
  int straight_stages = 0;  // min(ranks, layers)
  double memory_limit_bytes = 0;  // per rank; 0: none
  // Empty when `c` may be chosen; else why not, in words ("--no-hybrid: ...").
  std::string ineligible(const PlanCandidate& c) const;
  bool eligible(const PlanCandidate& c) const { return ineligible(c).empty(); }
};

// Throws UsageError for impossible options (no candidate, ranks < 1 or > kMaxPlanRanks, a profile without
// layers or compute time, levels for another device count), naming the value and the fix.
PlanSearchResult search_plans(const Profile& profile, const PlanSearchOptions& options);

// Simulates one candidate: a straight pipeline, or with `replication` (one count per stage) 1F1B-RR
// over the replicas, each replicated stage's step carrying the group all-reduce of its parameters' gradients
// (from `measured` where given, the all-reduce `pipetrain profile --transport` measured; else the link's).
PlanCandidate simulate_candidate(const Profile& profile, const std::vector<int>& balance, const std::string& schedule,
                                 int m, double micro_batch, double bandwidth_bytes_per_ms, double latency_ms,
                                 double memory_limit_bytes, const std::vector<int>& replication = {},
                                 const MeasuredAllReduce* measured = nullptr);

// A plan file: the chosen plan (Plan's fields) with what `train --plan` runs (schedule, micro-batches,
// batch size), how it was chosen, and optionally PipeDream's plan and UMPIPE's partitions.
struct PlanFile {
  Plan plan;
  std::string schedule;            // empty: not recorded
  int microbatches = 0;            // 0: not recorded
  int virtual_stages = 1;          // stages per rank: the balance has stages x virtual_stages entries
  int64_t batch_size = 0;          // 0: not recorded
  std::string placement;           // with levels and replicas: pipeline-inner or replicas-inner; empty: not recorded
  int threads = 0;                 // intra-op threads per rank the profile measured with; 0: not recorded
  std::string balance_kind, balance_solver;
  double predicted_bubble_fraction = 0;
  // The chosen plan's simulated peak bytes per rank, and whether it fits the memory limit the plan was
  // made for (written as "fits_memory_limit" only with a limit; absent: no limit or not recorded).
  double predicted_peak_bytes = 0;
  std::optional<bool> fits_memory_limit;
  std::optional<Plan> pipedream;   // the PipeDream planner's plan
  std::string pipedream_schedule;  // how train --plan-use pipedream runs it (synchronous 1F1B-RR)
  int pipedream_microbatches = 0;
  double pipedream_simulated_ms = 0;
  nlohmann::json umpipe;           // UMPIPE's partitions (plan/umpipe.h's JSON); null: none
};

// The plan file `pipetrain plan` writes for a search's chosen plan.
PlanFile plan_file_for(const Profile& profile, const PlanSearchResult& result);

nlohmann::json plan_file_to_json(const PlanFile& file);
// Checks every field it reads; throws UsageError naming `origin` and the field.
PlanFile plan_file_from_json(const nlohmann::json& j, const std::string& origin);
void write_plan_file(const std::string& path, const PlanFile& file);  // atomic
PlanFile read_plan_file(const std::string& path);                     // capped read, one parse

}  // namespace pipetrain

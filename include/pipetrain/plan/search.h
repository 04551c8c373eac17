// Choosing how to run a model from its profile (what `pipetrain plan` prints): every straight pipeline
// of balance kind x solver x schedule x micro-batch count, each timed by the simulator with per-stage
// costs summed from the profile (scaled to the micro-batch size) and transfers at the bandwidth, and
// checked against the memory per rank; data parallelism on the same ranks; PipeDream's planner with
// stage replication (planner.h), and its plan run synchronously as 1F1B-RR. Torch-free.
//
// And the plan file: one type (PlanFile) with one writer and one reader, which `pipetrain plan --out`
// writes and `pipetrain train --plan` runs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pipetrain/plan/planner.h"
#include "pipetrain/plan/profile.h"

namespace pipetrain {

struct PlanSearchOptions {
  int ranks = 2;
  double bandwidth_bytes_per_ms = 1e7;  // between ranks (10 GB/s)
  double latency_ms = 0.05;             // per transfer
  double memory_limit_bytes = 0;        // per rank; 0: no limit
  int64_t batch_size = 0;               // samples per mini-batch; 0: 8 x the profile's micro-batch size
  std::vector<std::string> schedules{"gpipe", "1f1b", "zb-h1"};
  std::vector<int> microbatch_counts{1, 2, 4, 8, 16, 32};
  std::vector<std::string> balance_kinds{"uniform", "parameters", "time", "memory"};
  // PipeDream's planner; empty levels: one level of `ranks` devices at the bandwidth. Its memory limit
  // and allow_fewer_machines are set from the options above.
  PlannerOptions pipedream;
  bool replicated_may_win = true;  // false: the straight pipeline is chosen even when 1F1B-RR is faster
};

// One way to run the model, simulated.
struct PlanCandidate {
  std::string kind, solver, schedule;  // balance kind and solver ("pipedream" / "planner" for 1F1B-RR)
  int m = 0;
  std::vector<int> balance;
  std::vector<int> replication;  // empty: a straight pipeline
  double makespan = 0, bubble = 0, peak_bytes = 0;  // ms per mini-batch, bubble fraction, bytes per rank
  bool fits = true;                                  // within the memory limit
};

// Faster first; candidates within the memory limit before those over it; ties: fewer micro-batches.
bool better_candidate(const PlanCandidate& a, const PlanCandidate& b);

struct PlanSearchResult {
  int64_t batch_size = 0;                    // the mini-batch planned for
  std::vector<PlanCandidate> candidates;     // every straight pipeline simulated
  PlanCandidate best_straight;               // the best of them
  std::optional<PlanCandidate> uniform_1f1b;  // the baseline: uniform balance, 1f1b, its best m
  // Data parallelism: every rank runs the whole model on batch / ranks samples, then a ring all-reduce
  // of the gradients.
  double data_parallel_ms = 0, data_parallel_bytes = 0;
  bool data_parallel_fits = true;
  PlannerOptions pipedream_options;          // what PipeDream's planner was given (levels filled in)
  std::optional<Plan> pipedream;             // PipeDream's planner (asynchronous), if it found a plan
  std::string pipedream_error;               // why not, otherwise
  std::optional<PlanCandidate> replicated;   // its plan as synchronous 1F1B-RR, if it replicates a stage
  bool chose_replicated = false;
  const PlanCandidate& chosen() const { return chose_replicated ? *replicated : best_straight; }
};

// Throws UsageError for impossible options (no candidate, more ranks than layers, ...).
PlanSearchResult search_plans(const Profile& profile, const PlanSearchOptions& options);

// Simulates one candidate: a straight pipeline, or with `replication` (one count per stage) 1F1B-RR
// over the replicas, each replicated stage's step carrying a ring all-reduce of its parameters.
PlanCandidate simulate_candidate(const Profile& profile, const std::vector<int>& balance, const std::string& schedule,
                                 int m, double micro_batch, double bandwidth_bytes_per_ms, double latency_ms,
                                 double memory_limit_bytes, const std::vector<int>& replication = {});

// A plan file: the chosen plan (Plan's fields) with what `train --plan` runs (schedule, micro-batches,
// batch size), how it was chosen, and optionally PipeDream's plan and UMPIPE's partitions.
struct PlanFile {
  Plan plan;
  std::string schedule;            // empty: not recorded
  int microbatches = 0;            // 0: not recorded
  int64_t batch_size = 0;          // 0: not recorded
  std::string balance_kind, balance_solver;
  double predicted_bubble_fraction = 0;
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

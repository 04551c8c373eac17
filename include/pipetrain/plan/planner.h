// PipeDream's planner (docs/ALGORITHMS.md §3.4): split a profiled model into contiguous stages and give each
// stage a replication factor (data parallelism inside the stage, mini-batches dealt round robin to the
// replicas, 1F1B-RR), minimising the predicted time per mini-batch at the bottleneck. Torch-free.
//
// Model (times in ms per mini-batch = per profiled batch of Profile::micro_batch_size samples; bytes;
// bandwidths in bytes per second). For a range of layers i..j: T = sum of forward_ms + backward_ms,
// W = parameter bytes, A = activation bytes, a_j = output bytes of layer j. On one network level with
// bandwidth Bw, a stage on r replicas costs
//   paper form      (1/r) * max(T, AR)      AR = 4 (r-1) W / (r Bw)       (ring all-reduce)
//   reference form  (1/r) * (T + AR)
// and the bottleneck time of a plan is the largest of its stage costs and its transfer terms:
//   paper form      2 a_j / Bw at every split j (activation forward, gradient back);
//   reference form  only with activation_compression > 0: each stage but the first pays
//                   2 a_{i-1} / (Bw r c) for its input and, unless it ends the model, 2 a_j / (Bw r c)
//                   for its output (PipeDream's optimizer_graph_hierarchical.py does exactly this).
// Both forms divide transfers by activation_compression c when it is > 0.
//
// The paper form is the default: it is the model the paper states (a replica's all-reduce overlaps its
// compute, so the slower of the two bounds it) and, unlike the reference code without a compression
// ratio, it never ignores the cost of sending activations between stages (VGG-16's first layers output
// 1.6 GB per batch; a planner blind to that splits there for free). The reference form exists to
// compare results with PipeDream's published planner: same cost terms and memory estimate, same quirks.
//
// Hierarchy (docs/ALGORITHMS.md §3.4, reference detail 5): `levels` lists the network innermost first, e.g.
// {{8, 300e9}, {4, 25e9}} is 4 servers of 8 GPUs. Level 0's units are devices; a unit of level k > 0 is
// a whole group of level k-1 (G_k devices, G_k = M_0 ... M_{k-1}). A range placed on level-k units runs,
// inside each unit, the best level-(k-1) plan of that range; its time takes the place of T above, and
// the level-k all-reduce is divided by G_k (each device reduces its own share of W in parallel; the
// reference form divides by M_{k-1} instead, and only for the first stage of a range, as the code does).
// Inner groups always use all their units; only the outermost level may use fewer (allow_fewer_machines).
// The flattened plan has one stage per innermost stage, replicated by the product of the factors of all
// the stages that enclose it.
//
// Memory per device (memory_limit_bytes; a stage over it is infeasible):
//   paper form      2 W + O + n A  (+ (n - 1) W with weight_stashing): weights, gradients, optimizer
//                   state, and one activation set per mini-batch in flight. n = ceil(D_s / R_s) where
//                   R_s is the stage's replication in the flattened plan and D_s the devices of it and of
//                   every later stage: the 1F1B warm-up plus one, (p - s) in a straight pipeline
//                   (docs/ALGORITHMS.md §3.4, "warm-up forwards on stage s"). Exact across levels.
//   reference form  ceil((m - r) / r) (A + W) at every level, with m the units at and after the stage in
//                   its own level's group: the reference code's stash estimate.
//
// One deliberate difference from the reference code (docs/PROFILE.md, "Conformance"): with
// allow_fewer_machines and a memory limit, PipeDream counts m against the machine budget even for
// machines left idle; pipetrain counts the machines used, so it can find a plan on fewer devices that
// PipeDream rejects.
#pragma once

#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace pipetrain {

struct Profile;

enum class PlannerCostForm { paper, reference };
PlannerCostForm parse_planner_cost_form(const std::string& name);  // "paper" or "reference"
const char* to_string(PlannerCostForm form);

struct NetworkLevel {
  int machines = 1;  // units at this level (devices at level 0, groups of the level below above it)
  double bandwidth = std::numeric_limits<double>::infinity();  // bytes per second between them
};

struct PlannerOptions {
  std::vector<NetworkLevel> levels;  // innermost first; the devices are the product of the machines
  PlannerCostForm cost_form = PlannerCostForm::paper;
  double memory_limit_bytes = std::numeric_limits<double>::infinity();  // per device
  bool straight_pipeline = false;     // every replication factor 1 (PipeDream's --straight_pipeline)
  bool allow_fewer_machines = false;  // the outermost level may leave units idle (--use_fewer_machines)
  double activation_compression = 0;  // > 0: activations and gradients shrink by this ratio in transit
  bool weight_stashing = false;       // paper-form memory: PipeDream's one weight version per mini-batch
};

// Throws UsageError naming the field and the fix: no levels, machines < 1, bandwidth <= 0 or NaN,
// memory limit <= 0, compression < 0 or not finite.
void check_planner_options(const PlannerOptions& options);

// The most devices network levels may describe (search.h's kMaxPlanRanks is the same bound).
inline constexpr int kMaxLevelDevices = 1 << 20;
// The number of devices the levels describe (the product of their machines). Throws UsageError for a
// level with machines < 1 or a product beyond kMaxLevelDevices (naming the product).
int planner_devices(const std::vector<NetworkLevel>& levels);

struct Plan {
  std::string model;
  int layers = 0;
  PlannerOptions options;
  std::vector<int> balance;                // layers per stage, model order
  std::vector<int> replication;            // devices per stage; the sum is the devices used
  std::vector<double> stage_time_ms;       // the stage's cost term at level 0 over the outer replications
  std::vector<double> stage_memory_bytes;  // per device, by the paper form's memory model (either form)
  std::vector<int> stage_in_flight;        // n above: mini-batches a replica holds at once (optional in a file)
  double time_ms = 0;                      // predicted time per mini-batch: the bottleneck term
  double data_parallel_time_ms = 0;        // one stage on every device, same cost form, memory not checked
  double speedup = 0;                      // data_parallel_time_ms / time_ms
  bool data_parallel_fits = true;          // whether data parallelism meets the memory limit

  int devices_used() const;  // sum of replication
};

// Runs the planner. Throws UsageError when the profile or options are invalid or no plan is feasible
// (memory limit too small, or a straight pipeline with more devices than layers), saying which.
// Complexity O(L^2 M^2) for one level, O(L^3 M^2) per inner level (and per memory context when a
// paper-form memory limit is set across several levels).
Plan plan_pipedream(const Profile& profile, const PlannerOptions& options);

// The data-parallel time alone: T_stage(all layers, M) at every level.
double data_parallel_time_ms(const Profile& profile, const PlannerOptions& options);

// JSON form (docs/PROFILE.md, "Plan files"). The reader checks format, version, the types of the
// fields it knows and their consistency (one entry per stage everywhere, balance sums to `layers`,
// replication >= 1), and ignores top-level keys it does not know, which other tools may add (e.g. a
// chosen schedule). Errors are UsageError naming `origin` and the field.
inline constexpr const char* kPlanFormat = "pipetrain-plan";
inline constexpr int kPlanVersion = 1;
nlohmann::json plan_to_json(const Plan& plan);
Plan plan_from_json(const nlohmann::json& j, const std::string& origin = "plan");
std::string plan_to_json_text(const Plan& plan);
Plan plan_from_json_text(const std::string& text, const std::string& origin = "plan");
void save_plan(const std::string& path, const Plan& plan);
Plan load_plan(const std::string& path);

}  // namespace pipetrain

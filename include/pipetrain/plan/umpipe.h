// UMPIPE planning (docs/ALGORITHMS.md §7): every stage cuts the mini-batch of N samples into its own
// micro-batches, separately for the forward and the backward pass, and a dual-chromosome genetic
// algorithm (DGAP) chooses the cuts. Torch-free.
//
// Provenance: only the paper's abstract is public (Zhou, Tian, Buyya, Wu, IEEE TPDS 2024). The model,
// the time recurrence, the vectorised evaluation, DGAP's operators and the two greedy baselines below
// are pipetrain's own definitions, taken from the reconstruction in docs/ALGORITHMS.md §7 ([RECON] there);
// docs/UMPIPE.md explains the choices.
//
// Model (§7.1). Stages j = 0..p-1, a mini-batch of N samples in a fixed order. Per stage, functions of
// the micro-batch size b (samples), in ms: forward f_j(b), backward g_j(b) (including the recompute
// when re-materialised), link times cF_j(b) for activations j -> j+1 and cB_j(b) for gradients j -> j-1.
// A plan (one "individual") gives every stage a forward partition X_j and a backward partition Y_j:
// compositions of N (positive parts summing to N), in stream order.
//
// Time recurrence (§7.2), with X̄ the cumulative boundaries and idxF(j,k) = min{u : X̄_{j-1,u} >= X̄_{j,k}}
// (the upstream micro-batch that completes the samples stage j's micro-batch k needs):
//   EF(j,k) = max(EF(j,k-1), RF(j-1, idxF(j,k))) + f_j(x_{j,k})     EF(j,0) = 0, RF(-1,.) = 0
//   RF(j,k) = max(RF(j,k-1), EF(j,k)) + cF_j(x_{j,k})              RF(j,0) = 0 (the link is serial)
//   EB(j,k) = max(EB(j,k-1), RB(j+1, idxB(j,k))) + g_j(y_{j,k})     EB(j,0) = EF(j,n_j) (GPipe order)
//   RB(j,k) = max(RB(j,k-1), EB(j,k)) + cB_j(y_{j,k})              RB(j,0) = 0, RB(p,.) = 0
//   T = max_j EB(j, r_j)
// (no optimizer or all-reduce time: it is the same for every plan).
//
// Memory (§7.2, "Memory model"; GPipe order keeps every sample's stash until its backward):
//   peak_j = static_j + N stash_j + max(max_k x_{j,k} forward_j, max_k y_{j,k} backward_j)
// with stash_j the bytes per sample held from forward to backward (the stage's activations a_full, or
// only its input a_in when re-materialised) and forward_j / backward_j the transient bytes per sample
// while one micro-batch runs (the workspace; with re-materialisation the backward also rebuilds a_full
// for its micro-batch). A memory limit thus becomes a largest micro-batch per stage and direction
// (umpipe_caps), which DGAP's repair and the baselines' candidate sets respect.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace pipetrain {

struct Profile;

// A time in ms as a function of the micro-batch size b (samples). Affine, max(0, alpha + beta b), when
// `sizes` is empty; otherwise a table: piecewise linear through (sizes[i], ms[i]), continued along the
// first and last segment outside [sizes.front(), sizes.back()], never below 0; a one-point table scales
// proportionally (ms[0] b / sizes[0]). Sizes strictly increasing and >= 1; all values finite, ms >= 0.
struct TimeCurve {
  double alpha = 0;
  double beta = 0;
  std::vector<double> sizes;
  std::vector<double> ms;

  static TimeCurve affine(double alpha, double beta);
  static TimeCurve constant(double ms) { return affine(ms, 0.0); }
  static TimeCurve table(std::vector<double> sizes, std::vector<double> ms);
  bool is_table() const { return !sizes.empty(); }
  double operator()(double b) const;
};

// Least-squares line through (sizes[i], ms[i]) as an affine TimeCurve; at least two distinct sizes.
TimeCurve fit_affine(const std::vector<double>& sizes, const std::vector<double>& ms);

// Bytes of one stage (see the memory model above). limit_bytes = infinity: no limit.
struct StageMemory {
  double static_bytes = 0;               // weights, their gradients, optimizer state
  double stash_bytes_per_sample = 0;     // held from a sample's forward until its backward
  double forward_bytes_per_sample = 0;   // transient while a forward micro-batch runs
  double backward_bytes_per_sample = 0;  // transient while a backward micro-batch runs
  double limit_bytes = std::numeric_limits<double>::infinity();
};

struct UmpipeStage {
  TimeCurve forward;        // f_j
  TimeCurve backward;       // g_j: the whole backward (plus the recompute when re-materialised)
  TimeCurve send_forward;   // cF_j: activations of b samples j -> j+1; not used on the last stage
  TimeCurve send_backward;  // cB_j: their gradients j -> j-1; not used on stage 0
  StageMemory memory;
  int max_forward = 0;   // explicit largest forward micro-batch in samples; 0 = only the memory model
  int max_backward = 0;  // the same for backward micro-batches
};

struct UmpipeModel {
  int samples = 0;  // N, the mini-batch
  std::vector<UmpipeStage> stages;
  int stage_count() const { return static_cast<int>(stages.size()); }
};

// Throws UsageError naming the stage and field: no stages, N < 1, a negative or non-finite number, a
// malformed table, negative caps.
void validate_umpipe_model(const UmpipeModel& model);

// Largest micro-batch per stage and direction: min(N, the explicit cap, the memory model's), where the
// memory model allows b while static + N stash + b transient <= limit. Throws UsageError naming the
// stage, its bytes and the limit when not even one sample per micro-batch fits.
struct UmpipeCaps {
  std::vector<int> forward;
  std::vector<int> backward;
};
UmpipeCaps umpipe_caps(const UmpipeModel& model);

// A plan: X_j and Y_j for every stage (sample counts per micro-batch, in stream order).
struct UmpipePlan {
  std::vector<std::vector<int>> forward;
  std::vector<std::vector<int>> backward;
};
bool operator==(const UmpipePlan& a, const UmpipePlan& b);
inline bool operator!=(const UmpipePlan& a, const UmpipePlan& b) { return !(a == b); }

// N split into `parts` sizes differing by at most one, the larger ones first (N = 10, 4 parts: 3,3,2,2).
std::vector<int> equal_partition(int samples, int parts);
// Every stage and direction with equal_partition(N, parts): EDP / GPipe with m = parts.
UmpipePlan equal_plan(int stages, int samples, int parts);
// Throws UsageError unless `plan` has `stages` rows per direction, each a composition of `samples`.
void check_umpipe_plan(const UmpipePlan& plan, int stages, int samples);
bool within_caps(const UmpipePlan& plan, const UmpipeCaps& caps);
// peak_j of the memory model for every stage.
std::vector<double> umpipe_peak_bytes(const UmpipeModel& model, const UmpipePlan& plan);

// Building a model from a profile (plan/profile.h) and a balance (plan/balance.h).
enum class UmpipeFit {
  affine,  // per layer a least-squares line through its sizes (the profile's own and by_micro_batch)
  table,   // per layer piecewise linear through its sizes; a stage's table is the sum on their union
};
struct UmpipeProfileOptions {
  int samples = 0;                                                         // N; required
  double bandwidth_bytes_per_s = std::numeric_limits<double>::infinity();  // between neighbouring stages
  double latency_ms = 0;                                                   // per transfer
  double memory_limit_bytes = std::numeric_limits<double>::infinity();     // per stage
  bool rematerialise = false;  // stash only stage inputs; the backward recomputes the forward
  UmpipeFit fit = UmpipeFit::affine;
  // A layer measured at one size only (PipeDream's profiles) gets this fixed part per micro-batch and
  // pass: t(b) = a + (t0 - a) b / b0 with a = min(this, t0), so t(b0) = t0 still. 0: proportional.
  double single_size_overhead_ms = 0;
  // Transient bytes per sample while a micro-batch runs = this x the stage's largest layer output per
  // sample (an output and its gradient live at once). No profiler measures it; 2 is an estimate.
  double workspace_activations = 2.0;
};
// Per stage j (layers in balance order):
//   f_j, g_j   sum of the layers' forward_ms / backward_ms curves (affine: the sum of the per-layer
//              fits, which is the least-squares fit of the summed times when the layers share sizes);
//              with rematerialise g_j also includes f_j;
//   cF_j, cB_{j+1}  latency_ms + a_j b / (b0 bandwidth), a_j = activation_bytes of stage j's last layer
//              at the profile's micro_batch_size b0 (the gradient has the activation's shape);
//   memory     static = sum(2 parameter_bytes + optimizer_bytes); a_full = sum(activation_bytes) / b0;
//              a_in = the previous stage's last activation / b0 (0 for stage 0: the input is not
//              profiled); ws = workspace_activations x max(activation_bytes) / b0;
//              stash = a_full, forward = backward = ws; re-materialised: stash = a_in, forward = ws,
//              backward = a_full + ws.
// Throws UsageError on a bad balance, N < 1, bandwidth <= 0 or negative numbers.
UmpipeModel umpipe_model_from_profile(const Profile& profile, const std::vector<int>& balance,
                                      const UmpipeProfileOptions& options);

// One stage's row of the recurrence: what the baselines build plans from.
struct UmpipeRow {
  std::vector<int> ends;     // cumulative boundaries X̄ (or Ȳ) of this row
  std::vector<double> done;  // EF(j,k) or EB(j,k)
  std::vector<double> sent;  // RF(j,k) or RB(j,k)
  double finish() const { return done.empty() ? 0.0 : done.back(); }
};

// Every EF, RF, EB, RB of a plan, indexed [stage][micro-batch] from 0.
struct UmpipeTrace {
  std::vector<UmpipeRow> forward;
  std::vector<UmpipeRow> backward;
  double step_ms = 0;
};

class UmpipePopulation;

// Evaluates plans under one model. Costs are tabulated at b = 0..N once (b = 0, padding, costs 0), so
// every evaluator reads identical cost values. Not thread-safe for concurrent calls on one object.
class UmpipeEvaluator {
 public:
  explicit UmpipeEvaluator(const UmpipeModel& model);  // validates the model
  int stages() const { return p_; }
  int samples() const { return n_; }

  // T of §7.2 by the scalar recurrence (two-pointer look-ups). The plan is not checked: rows must be
  // compositions of N (check_umpipe_plan).
  double step_ms(const UmpipePlan& plan) const;
  UmpipeTrace trace(const UmpipePlan& plan) const;

  // Rows of the recurrence: stage j's forward given its upstream forward row (nullptr for stage 0),
  // and its backward given its downstream backward row (nullptr for the last stage) and EF(j, n_j).
  UmpipeRow forward_row(int stage, const std::vector<int>& sizes, const UmpipeRow* upstream) const;
  UmpipeRow backward_row(int stage, const std::vector<int>& sizes, const UmpipeRow* downstream,
                         double forward_finish) const;

  // T for every individual of `population` at once (§7.3): structure of arrays, individuals in tiles
  // of 8 lanes, the max-plus prefix form per row (one running sum and one running maximum), SIMD across
  // the tile's individuals. Agrees with step_ms to ~1e-15 relative (the closed form reassociates sums).
  void evaluate(const UmpipePopulation& population, std::vector<double>& step_ms) const;
  // The instruction set evaluate() uses: "avx512", "avx2", "vector-128" (SSE2 or NEON) or "scalar" (no
  // GCC/Clang vector extensions: step_ms per individual). The best this CPU has unless forced; forcing
  // (process-wide; "best" restores it) lets tests and benchmarks run every width. UsageError when the
  // CPU lacks it.
  static const char* vector_isa();
  static void force_vector_isa(const std::string& name);
  static std::vector<std::string> available_vector_isas();

  double cost(int kind, int stage, int size) const;  // kind 0..3: f, g, cF, cB; size 0..N

 private:
  int p_ = 0, n_ = 0;
  std::vector<double> tables_;  // [kind][stage][b], kind: 0 f, 1 g, 2 cF, 3 cB
  const double* table(int kind, int stage) const {
    return tables_.data() + (static_cast<std::size_t>(kind) * p_ + stage) * (n_ + 1);
  }
};

// A population in the vectorised evaluator's layout: per tile of 8 individuals, per direction, stage
// and sample s, the size of the micro-batch that ends at sample s, or 0 (§7.3's padding: size 0, cost 0,
// here at the samples where no micro-batch ends; docs/ALGORITHMS.md pads at the end instead, which is the
// same recurrence). Which samples end a micro-batch in any lane of a tile is cached, so the evaluator
// skips the rest.
class UmpipePopulation {
 public:
  static constexpr int kLanes = 8;
  UmpipePopulation(int stages, int samples, int size = 0);
  int size() const { return size_; }
  int stages() const { return p_; }
  int samples() const { return n_; }
  void resize(int size);                        // new individuals have one micro-batch of N everywhere
  void set(int index, const UmpipePlan& plan);  // checks the plan (check_umpipe_plan)
  // One row, unchecked except that the sizes must be positive and sum to N (else UsageError).
  void set_row(int index, bool backward, int stage, const int* sizes, int count);

 private:
  friend class UmpipeEvaluator;
  int p_, n_, size_ = 0;
  std::vector<int32_t> sizes_;                 // [tile][dir][stage][s][lane]
  mutable std::vector<int32_t> active_;        // per row (tile, dir, stage): N slots, the first count used
  mutable std::vector<int32_t> active_count_;  // per row
  mutable std::vector<uint8_t> dirty_;         // per tile
  std::size_t row_offset(int tile, int dir, int stage) const;
  void write_row(int index, int dir, int stage, const int* sizes, int count);
  void refresh() const;
};

// --- planners -------------------------------------------------------------------------------------

struct UmpipeResult {
  std::string planner;  // "equal", "local-greedy", "global-dp" or "dgap"
  UmpipePlan plan;
  double step_ms = 0;
  int microbatches = 0;       // equal: the best m
  int generations = 0;        // dgap
  long long evaluations = 0;  // plans evaluated
};

// EDP (§7.5): m over 1..N with ceil(N/m) within every cap, each stage and direction split equally into
// m; the fastest, fewer micro-batches on ties.
UmpipeResult plan_umpipe_equal(const UmpipeModel& model);

// Local greedy (§7.5). Candidates per stage and direction: equal_partition(N, n) for n = 1..N within
// the cap. Forward: for j = 0..p-1, the candidate that minimises EF(j, n_j) given stages 0..j-1;
// backward: for j = p-1..0, the one that minimises EB(j, r_j) given stages j+1..p-1 and the forward.
// Ties: fewer micro-batches.
UmpipeResult plan_umpipe_local_greedy(const UmpipeModel& model);

// Global-greedy DP (§7.5), Viterbi-style over the same candidates. Forward: DP[j][c] keeps, for stage j
// under candidate c, the predecessor state c' of stage j-1 that minimises EF(j, n_j) (the greedy step:
// the whole row is collapsed to that scalar); the best final state gives the forward plan. Backward, in
// reverse with EB(j, r_j) as the score, under that forward plan; then every final backward state's
// plan is evaluated exactly and the fastest is returned. Ties: fewer micro-batches, then the lower c'.
// Exact for its objective when p <= 2; a heuristic otherwise. O(p |C|^2) row evaluations.
UmpipeResult plan_umpipe_global_dp(const UmpipeModel& model);

// DGAP (§7.4).
struct DgapOptions {
  int population = 128;         // P
  int generations = 800;        // G, at most
  int stall_generations = 150;  // stop after this many generations without improving the best
  // Per cut bit; < 0: 1 / (p (N - 1)), two flips per child on average over its 2p rows. Flips split or
  // merge micro-batches, so a few per child already change a plan a lot: on docs/ALGORITHMS.md §7.4's
  // sanity model, 0.02 (about ten flips) ended 7% above what 0.005 reached with the same budget.
  double mutation_rate = -1;
  double shift_rate = 0.2;  // per chromosome row: move one cut by one sample
  // Per chromosome: a random run of neighbouring stages becomes equal splits into a common count near
  // the first row's (one fewer, as many or one more).
  double resplit_rate = 0.3;
  double row_crossover_rate = 0.9;    // per pair; otherwise the children copy the parents
  double inner_crossover_rate = 0.3;  // per chromosome: one-point crossover inside one random row
  int elite = 4;                      // best individuals copied unchanged
  int equal_seeds = 8;                // EDP plans in the first population (the best m always among them)
  double stagewise_seeds = 0.25;      // share of the first population: every row an equal split, own count
  bool seed_baselines = false;        // also put the local-greedy and DP plans in the first population
  int min_micro_batch = 1;            // repair also removes cuts that leave micro-batches below this
  uint64_t seed = 1;
};
struct DgapProgress {
  int generation = 0;  // 0 = the first population
  double best_ms = 0;
  double mean_ms = 0;
  int stall = 0;  // generations since the best improved
  long long evaluations = 0;
};
// Deterministic for a seed (own generator, no std distributions; fitness values are bitwise the same on
// every vector width). With min_micro_batch = 1 never worse than the best equal plan, which is a seed and
// stays by elitism (the final choice between the two uses step_ms). Every returned row is within its cap.
// Throws UsageError on bad options (elite must leave room for children, rates in [0, 1]).
UmpipeResult plan_umpipe_dgap(const UmpipeModel& model, const DgapOptions& options = {},
                              const std::function<void(const DgapProgress&)>& progress = {});

// The four planners on one model, in the order equal, local-greedy, global-dp, dgap.
std::vector<UmpipeResult> plan_umpipe_all(const UmpipeModel& model, const DgapOptions& options = {},
                                          const std::function<void(const DgapProgress&)>& progress = {});

// DGAP's genotype: for one row, cuts[t] = 1 means a micro-batch boundary after sample t (t = 0..N-2).
std::vector<int> cuts_to_partition(const std::vector<uint8_t>& cuts);
std::vector<uint8_t> partition_to_cuts(const std::vector<int>& sizes);
// Repair (§7.4): inserts a cut wherever a micro-batch would exceed `cap`, then, when min_size > 1,
// removes cuts that leave a micro-batch below min_size if the merged one stays within `cap`.
void repair_cuts(std::vector<uint8_t>& cuts, int cap, int min_size = 1);

// JSON for a plan file: {"planner": ..., "forward": [[...] per stage], "backward": [[...]],
// "step_ms": ..., "samples": N, "stages": p}. The reader checks the shape and the compositions.
nlohmann::json umpipe_result_to_json(const UmpipeResult& result);
UmpipeResult umpipe_result_from_json(const nlohmann::json& j, const std::string& origin = "umpipe plan");

}  // namespace pipetrain

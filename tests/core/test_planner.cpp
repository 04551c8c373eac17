// Checks the PipeDream planner (plan/planner.h, docs/ALGORITHMS.md §3.4).
//  - Brute force: every contiguous split with every replication vector (and, for two network levels,
//    every nested inner plan) is evaluated by the formulas of planner.h, written out again here from
//    the flattened plan (memory from each stage's position in it, not from the planner's contexts);
//    the planner's time must equal the best, its plan must achieve it, and infeasible cases must throw.
//  - §3.4's properties: with infinite bandwidth and no replication the straight pipeline is the
//    min-max partition of §3.3; the plan is never worse than data parallelism or the straight pipeline;
//    the time never grows with more machines when fewer may be used; replication appears where one
//    stage dominates; the memory limit holds.
//  - Hand-derived numbers for the two cost forms, the transfer terms and the memory model.
//  - The real VGG-16 profile on 4 and 8 devices, flat and with two network levels.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "pipetrain/core/error.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/planner.h"
#include "pipetrain/plan/profile.h"
#include "shared_data.h"

using namespace pipetrain;

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

using pipetrain::testing::vgg16_path;

struct Layer {
  double ms, params, act, opt;
};

Profile make_profile(const std::vector<Layer>& layers) {
  Profile p;
  p.model = "test";
  for (const Layer& x : layers) {
    LayerProfile l;
    l.name = "l" + std::to_string(p.layers.size());
    l.type = "Linear";
    l.forward_ms = x.ms / 2;
    l.backward_ms = x.ms / 2;
    l.input_grad_ms = x.ms / 2;
    l.parameter_bytes = x.params;
    l.activation_bytes = x.act;
    l.optimizer_bytes = x.opt;
    p.layers.push_back(l);
  }
  return p;
}

PlannerOptions flat(int machines, double bandwidth, PlannerCostForm form = PlannerCostForm::paper) {
  PlannerOptions o;
  o.levels = {{machines, bandwidth}};
  o.cost_form = form;
  return o;
}

// --- an independent evaluator of planner.h's formulas ----------------------------------------------
struct Sums {
  double t = 0, w = 0, a = 0, o = 0;
};
Sums sums(const Profile& p, int first, int last) {
  Sums s;
  for (int l = first; l <= last; ++l) {
    const LayerProfile& x = p.layers[static_cast<std::size_t>(l)];
    s.t += x.forward_ms + x.backward_ms;
    s.w += x.parameter_bytes;
    s.a += x.activation_bytes;
    s.o += x.optimizer_bytes;
  }
  return s;
}
double out_bytes(const Profile& p, int layer) { return p.layers[static_cast<std::size_t>(layer)].activation_bytes; }
double allreduce_ms(double w, int r, double bw) { return r > 1 ? 1000.0 * 4.0 * (r - 1) * w / (r * bw) : 0.0; }
double transfer_ms(double bytes, double bw, double replicas, double compression) {
  return 1000.0 * 2.0 * bytes / (bw * replicas * (compression > 0 ? compression : 1.0));
}

// A stage of a nested plan: inner is empty at level 0.
struct St {
  int first, last, r;
  std::vector<St> inner;
};

// Devices of the flattened plan, in order, with their replication.
void flatten(const std::vector<St>& stages, long outer, std::vector<std::pair<St, long>>& out) {
  for (const St& s : stages) {
    if (s.inner.empty())
      out.emplace_back(s, outer * s.r);
    else
      flatten(s.inner, outer * s.r, out);
  }
}

// Paper-form memory of every flattened stage, or an empty vector when one is over the limit.
std::vector<double> paper_memories(const Profile& p, const PlannerOptions& o, const std::vector<St>& plan) {
  std::vector<std::pair<St, long>> f;
  flatten(plan, 1, f);
  long after = 0;
  for (const auto& x : f) after += x.second;
  std::vector<double> mem;
  for (const auto& [s, R] : f) {
    const long n = (after + R - 1) / R;
    const Sums z = sums(p, s.first, s.last);
    const double m =
        2 * z.w + z.o + static_cast<double>(n) * z.a + (o.weight_stashing ? static_cast<double>(n - 1) * z.w : 0.0);
    if (m > o.memory_limit_bytes) return {};
    mem.push_back(m);
    after -= R;
  }
  return mem;
}

// The time of one level's stages; `level` indexes o.levels. Returns infinity when the reference
// form's stash estimate is over the limit.
double level_time(const Profile& p, const PlannerOptions& o, const std::vector<St>& stages, std::size_t level) {
  const bool paper = o.cost_form == PlannerCostForm::paper;
  const double bw = o.levels[level].bandwidth, c = o.activation_compression;
  const int L = static_cast<int>(p.layers.size());
  long devices_in_unit = 1;
  for (std::size_t k = 0; k < level; ++k) devices_in_unit *= o.levels[k].machines;
  double worst = 0;
  for (std::size_t g = 0; g < stages.size(); ++g) {
    const St& s = stages[g];
    const Sums z = sums(p, s.first, s.last);
    if (!paper) {
      int at_and_after = 0;
      for (std::size_t h = g; h < stages.size(); ++h) at_and_after += stages[h].r;
      const double stash = static_cast<double>((at_and_after - s.r + s.r - 1) / s.r) * (z.a + z.w);
      if (stash > o.memory_limit_bytes) return kInf;
    }
    const double compute = level == 0 ? z.t : level_time(p, o, s.inner, level - 1);
    double ar = allreduce_ms(z.w, s.r, bw);
    double cost;
    if (paper) {
      cost = std::max(compute, ar / static_cast<double>(devices_in_unit)) / s.r;
      if (g + 1 < stages.size()) cost = std::max(cost, transfer_ms(out_bytes(p, s.last), bw, 1, c));
    } else {
      if (level >= 1 && g == 0) ar /= o.levels[level - 1].machines;
      cost = (compute + ar) / s.r;
      if (c > 0 && g > 0) {
        cost = std::max(cost, transfer_ms(out_bytes(p, s.first - 1), bw, s.r, c));
        if (s.last < L - 1) cost = std::max(cost, transfer_ms(out_bytes(p, s.last), bw, s.r, c));
      }
    }
    worst = std::max(worst, cost);
  }
  return worst;
}

double evaluate(const Profile& p, const PlannerOptions& o, const std::vector<St>& plan) {
  if (o.cost_form == PlannerCostForm::paper && paper_memories(p, o, plan).empty()) return kInf;
  return level_time(p, o, plan, o.levels.size() - 1);
}

std::vector<St> flat_plan(const std::vector<int>& balance, const std::vector<int>& replication) {
  std::vector<St> out;
  int at = 0;
  for (std::size_t s = 0; s < balance.size(); ++s) {
    out.push_back({at, at + balance[s] - 1, replication[s], {}});
    at += balance[s];
  }
  return out;
}

// Calls f with every composition of n into exactly k positive parts.
void compositions(int n, int k, std::vector<int>& cur, const std::function<void(const std::vector<int>&)>& f) {
  if (k == 0) {
    if (n == 0) f(cur);
    return;
  }
  for (int first = 1; first <= n - (k - 1); ++first) {
    cur.push_back(first);
    compositions(n - first, k - 1, cur, f);
    cur.pop_back();
  }
}

// Every plan of layers [first, last] on `units` units of `level` (exactly, or at most when `fewer`),
// with every nested inner plan.
void all_plans(const Profile& p, const PlannerOptions& o, std::size_t level, int first, int last, int units, bool fewer,
               const std::function<void(const std::vector<St>&)>& f) {
  const int n = last - first + 1;
  for (int k = 1; k <= n; ++k) {
    std::vector<int> balance;
    compositions(n, k, balance, [&](const std::vector<int>& b) {
      for (int total = fewer ? 1 : units; total <= units; ++total) {
        if (total < k) continue;
        std::vector<int> reps;
        compositions(total, k, reps, [&](const std::vector<int>& r) {
          if (o.straight_pipeline && *std::max_element(r.begin(), r.end()) > 1) return;
          std::vector<St> stages;
          int at = first;
          for (int s = 0; s < k; ++s) {
            stages.push_back({at, at + b[static_cast<std::size_t>(s)] - 1, r[static_cast<std::size_t>(s)], {}});
            at += b[static_cast<std::size_t>(s)];
          }
          if (level == 0) {
            f(stages);
            return;
          }
          // Choose every inner plan of every stage, one stage at a time.
          std::function<void(std::size_t)> choose = [&](std::size_t s) {
            if (s == stages.size()) {
              f(stages);
              return;
            }
            all_plans(p, o, level - 1, stages[s].first, stages[s].last, o.levels[level - 1].machines, false,
                      [&](const std::vector<St>& inner) {
                        stages[s].inner = inner;
                        choose(s + 1);
                      });
          };
          choose(0);
        });
      }
    });
  }
}

double brute_force(const Profile& p, const PlannerOptions& o) {
  double best = kInf;
  const int L = static_cast<int>(p.layers.size());
  all_plans(p, o, o.levels.size() - 1, 0, L - 1, o.levels.back().machines, o.allow_fewer_machines,
            [&](const std::vector<St>& plan) { best = std::min(best, evaluate(p, o, plan)); });
  return best;
}

// Times of 0.5 to 20 ms; byte counts spread over six orders of magnitude (1 kB to 2 GB), so that
// all-reduces and transfers range from negligible to dominant; some layers without weights.
Profile random_profile(std::mt19937& rng, int layers) {
  std::uniform_real_distribution<double> ms(0.5, 20), exponent(3, 9.3);
  auto bytes = [&]() { return std::pow(10.0, exponent(rng)); };
  std::vector<Layer> l;
  for (int i = 0; i < layers; ++i)
    l.push_back({ms(rng), rng() % 3 == 0 ? 0.0 : bytes(), bytes(), rng() % 2 ? 0.0 : bytes()});
  return make_profile(l);
}

void randomise_options(std::mt19937& rng, PlannerOptions& o) {
  const double bandwidths[] = {1e9, 1e10, kInf};
  for (NetworkLevel& l : o.levels) l.bandwidth = bandwidths[rng() % 3];
  o.cost_form = rng() % 2 ? PlannerCostForm::paper : PlannerCostForm::reference;
  o.memory_limit_bytes = rng() % 3 == 0 ? kInf : std::uniform_real_distribution<double>(1e9, 8e9)(rng);
  o.activation_compression = rng() % 3 == 0 ? 2.0 : 0.0;
  o.weight_stashing = rng() % 2;
  o.allow_fewer_machines = rng() % 2;
  o.straight_pipeline = rng() % 4 == 0;
}

// Sets a memory limit below what the unconstrained plan uses, so that the limit changes the answer
// often rather than by chance.
void bind_memory(std::mt19937& rng, const Profile& p, PlannerOptions& o) {
  PlannerOptions free = o;
  free.memory_limit_bytes = kInf;
  double most = 0;
  try {
    const Plan plan = plan_pipedream(p, free);
    if (o.cost_form == PlannerCostForm::paper)
      for (double m : plan.stage_memory_bytes) most = std::max(most, m);
    else
      most = sums(p, 0, static_cast<int>(p.layers.size()) - 1).a + sums(p, 0, static_cast<int>(p.layers.size()) - 1).w;
  } catch (const UsageError&) {
    return;
  }
  if (most > 0) o.memory_limit_bytes = most * std::uniform_real_distribution<double>(0.4, 1.0)(rng);
}

bool near(double a, double b) { return std::abs(a - b) <= 1e-9 * std::max(1.0, std::abs(b)); }
}  // namespace

TEST(Planner, FlatMatchesBruteForce) {
  std::mt19937 rng(17);
  int feasible = 0;
  for (int trial = 0; trial < 1000; ++trial) {
    const Profile p = random_profile(rng, 1 + static_cast<int>(rng() % 6));
    PlannerOptions o = flat(1 + static_cast<int>(rng() % 5), 1e9);
    randomise_options(rng, o);
    if (rng() % 2) bind_memory(rng, p, o);
    const double best = brute_force(p, o);
    if (best == kInf) {
      EXPECT_THROW(plan_pipedream(p, o), UsageError) << "trial " << trial;
      continue;
    }
    ++feasible;
    const Plan plan = plan_pipedream(p, o);
    ASSERT_TRUE(near(plan.time_ms, best)) << "trial " << trial << ": " << plan.time_ms << " vs " << best;
    // The plan it returns achieves that time, fits, and uses the machines it may.
    ASSERT_NO_THROW(check_balance(plan.balance, static_cast<int>(p.layers.size())));
    const std::vector<St> chosen = flat_plan(plan.balance, plan.replication);
    EXPECT_TRUE(near(evaluate(p, o, chosen), plan.time_ms)) << "trial " << trial;
    if (o.allow_fewer_machines)
      EXPECT_LE(plan.devices_used(), o.levels[0].machines);
    else
      EXPECT_EQ(plan.devices_used(), o.levels[0].machines);
    PlannerOptions unlimited = o;  // the memory numbers themselves, whatever the limit
    unlimited.memory_limit_bytes = kInf;
    const std::vector<double> mem = paper_memories(p, unlimited, chosen);
    ASSERT_EQ(mem.size(), plan.stage_memory_bytes.size());
    for (std::size_t s = 0; s < mem.size(); ++s) {
      EXPECT_NEAR(plan.stage_memory_bytes[s], mem[s], 1e-9 * mem[s] + 1e-6);
      if (o.cost_form == PlannerCostForm::paper) {
        EXPECT_LE(plan.stage_memory_bytes[s], o.memory_limit_bytes);
      }
    }
  }
  EXPECT_GT(feasible, 500);
}

TEST(Planner, TwoLevelsMatchBruteForce) {
  std::mt19937 rng(29);
  int feasible = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    const Profile p = random_profile(rng, 2 + static_cast<int>(rng() % 5));
    PlannerOptions o;
    o.levels = {{1 + static_cast<int>(rng() % 3), 1e10}, {2 + static_cast<int>(rng() % 3), 1e9}};
    randomise_options(rng, o);
    if (rng() % 2) bind_memory(rng, p, o);
    const double best = brute_force(p, o);
    if (best == kInf) {
      EXPECT_THROW(plan_pipedream(p, o), UsageError) << "trial " << trial;
      continue;
    }
    ++feasible;
    const Plan plan = plan_pipedream(p, o);
    ASSERT_TRUE(near(plan.time_ms, best)) << "trial " << trial << ": " << plan.time_ms << " vs " << best;
    ASSERT_NO_THROW(check_balance(plan.balance, static_cast<int>(p.layers.size())));
    const int devices = planner_devices(o.levels);
    if (o.allow_fewer_machines)
      EXPECT_LE(plan.devices_used(), devices);
    else
      EXPECT_EQ(plan.devices_used(), devices);
    for (int r : plan.replication) {
      EXPECT_GE(r, 1);
      EXPECT_LE(r, devices);
    }
    if (o.cost_form == PlannerCostForm::paper) {
      for (double m : plan.stage_memory_bytes) EXPECT_LE(m, o.memory_limit_bytes);
    }
  }
  EXPECT_GT(feasible, 600);
}

TEST(Planner, ThreeLevelsMatchBruteForce) {
  // Three levels make the enclosing replication R of the memory context differ from 1 two levels down.
  std::mt19937 rng(31);
  int feasible = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const Profile p = random_profile(rng, 2 + static_cast<int>(rng() % 4));
    PlannerOptions o;
    o.levels = {{1 + static_cast<int>(rng() % 2), 1e11}, {2, 1e10}, {2 + static_cast<int>(rng() % 2), 1e9}};
    randomise_options(rng, o);
    if (rng() % 2) bind_memory(rng, p, o);
    const double best = brute_force(p, o);
    if (best == kInf) {
      EXPECT_THROW(plan_pipedream(p, o), UsageError) << "trial " << trial;
      continue;
    }
    ++feasible;
    const Plan plan = plan_pipedream(p, o);
    ASSERT_TRUE(near(plan.time_ms, best)) << "trial " << trial << ": " << plan.time_ms << " vs " << best;
    if (o.cost_form == PlannerCostForm::paper) {
      for (double m : plan.stage_memory_bytes) EXPECT_LE(m, o.memory_limit_bytes);
    }
  }
  EXPECT_GT(feasible, 100);
}

TEST(Planner, InfiniteBandwidthStraightPipelineIsTheMinMaxPartition) {
  // docs/ALGORITHMS.md §3.4: with Bw -> infinity and no all-reduce, the straight pipeline on M devices is
  // §3.3's min-max partition of forward + backward into M parts, in either cost form.
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const int L = 2 + static_cast<int>(rng() % 29);
    const int M = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(L, 10)));
    const Profile p = random_profile(rng, L);
    for (PlannerCostForm form : {PlannerCostForm::paper, PlannerCostForm::reference}) {
      PlannerOptions o = flat(M, kInf, form);
      o.straight_pipeline = true;
      const Plan plan = plan_pipedream(p, o);
      const std::vector<double> t = forward_plus_backward_ms(p);
      EXPECT_TRUE(near(plan.time_ms, bottleneck(t, balance_min_max(t, M)))) << trial;
      EXPECT_EQ(plan.balance.size(), static_cast<std::size_t>(M));
      EXPECT_EQ(plan.replication, std::vector<int>(static_cast<std::size_t>(M), 1));
    }
  }
}

TEST(Planner, NeverWorseThanDataParallelOrStraightPipeline) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 120; ++trial) {
    const int L = 1 + static_cast<int>(rng() % 25);
    const Profile p = random_profile(rng, L);
    PlannerOptions o = flat(1 + static_cast<int>(rng() % 8), rng() % 2 ? 1e9 : 1.25e10,
                            rng() % 2 ? PlannerCostForm::paper : PlannerCostForm::reference);
    o.activation_compression = rng() % 2 ? 0.0 : 3.0;
    const Plan plan = plan_pipedream(p, o);
    EXPECT_LE(plan.time_ms, plan.data_parallel_time_ms * (1 + 1e-12));
    EXPECT_GE(plan.speedup, 1 - 1e-12);
    EXPECT_TRUE(near(plan.data_parallel_time_ms, data_parallel_time_ms(p, o)));
    PlannerOptions straight = o;
    straight.straight_pipeline = true;
    straight.allow_fewer_machines = true;  // so that a straight pipeline exists when M > L
    const Plan s = plan_pipedream(p, straight);
    for (int r : s.replication) EXPECT_EQ(r, 1);
    PlannerOptions fewer = o;
    fewer.allow_fewer_machines = true;
    EXPECT_LE(plan_pipedream(p, fewer).time_ms, s.time_ms * (1 + 1e-12));
    EXPECT_LE(plan_pipedream(p, fewer).time_ms, plan.time_ms * (1 + 1e-12));
    // Data parallelism by the formula: (1/M) max(T, 4 (M-1) W / (M Bw)) or (1/M)(T + ...).
    const Sums z = sums(p, 0, L - 1);
    const int M = o.levels[0].machines;
    const double ar = allreduce_ms(z.w, M, o.levels[0].bandwidth);
    const double dp = o.cost_form == PlannerCostForm::paper ? std::max(z.t, ar) / M : (z.t + ar) / M;
    EXPECT_TRUE(near(plan.data_parallel_time_ms, dp));
  }
}

TEST(Planner, MoreMachinesNeverHurtWhenFewerMayBeUsed) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 40; ++trial) {
    const Profile p = random_profile(rng, 1 + static_cast<int>(rng() % 15));
    double previous = kInf;
    for (int M = 1; M <= 8; ++M) {
      PlannerOptions o = flat(M, 1e9, trial % 2 ? PlannerCostForm::paper : PlannerCostForm::reference);
      o.allow_fewer_machines = true;
      const double t = plan_pipedream(p, o).time_ms;
      EXPECT_LE(t, previous * (1 + 1e-12)) << "trial " << trial << " M " << M;
      previous = t;
    }
  }
}

TEST(Planner, ReplicatesTheStageThatDominates) {
  // Layer 0: 10 ms and 1 GB of weights; layer 1: 30 ms, no weights; layer 0 outputs 1 MB. 4 devices at
  // 1 GB/s. Data parallel: all-reduce 4*3*1e9/(4*1e9) s = 3000 ms, so max(40, 3000)/4 = 750 ms
  // (reference form (40 + 3000)/4 = 760). Layer 0 alone, layer 1 on 3 replicas: 10 ms and 30/3 = 10 ms,
  // the transfer 2*1e6/1e9 s = 2 ms. Replicating layer 0 costs at least 4*1*1e9/(2*1e9) s / 2 = 1000 ms;
  // one replica of layer 1 costs 30. So 1 | 1 with replication 1, 3 at 10 ms is optimal.
  const Profile p = make_profile({{10, 1e9, 1e6, 0}, {30, 0, 1e6, 0}});
  for (PlannerCostForm form : {PlannerCostForm::paper, PlannerCostForm::reference}) {
    const Plan plan = plan_pipedream(p, flat(4, 1e9, form));
    EXPECT_EQ(plan.balance, (std::vector<int>{1, 1}));
    EXPECT_EQ(plan.replication, (std::vector<int>{1, 3}));
    EXPECT_DOUBLE_EQ(plan.time_ms, 10.0);
    const double dp = form == PlannerCostForm::paper ? 750.0 : 760.0;
    EXPECT_DOUBLE_EQ(plan.data_parallel_time_ms, dp);
    EXPECT_DOUBLE_EQ(plan.speedup, dp / 10.0);
    EXPECT_DOUBLE_EQ(plan.stage_time_ms[0], 10.0);
    EXPECT_DOUBLE_EQ(plan.stage_time_ms[1], 10.0);
    // In flight: stage 0 sees all 4 devices downstream of it, stage 1 3 devices over 3 replicas.
    EXPECT_EQ(plan.stage_in_flight, (std::vector<int>{4, 1}));
  }
}

TEST(Planner, CostFormsDifferAsSpecified) {
  // One layer of 10 ms with 3 MB of weights on 2 devices at 1 GB/s: all-reduce 4*1*3e6/(2*1e9) s = 6 ms.
  // Paper: max(10, 6)/2 = 5. Reference: (10 + 6)/2 = 8.
  const Profile p = make_profile({{10, 3e6, 0, 0}});
  EXPECT_DOUBLE_EQ(plan_pipedream(p, flat(2, 1e9, PlannerCostForm::paper)).time_ms, 5.0);
  EXPECT_DOUBLE_EQ(plan_pipedream(p, flat(2, 1e9, PlannerCostForm::reference)).time_ms, 8.0);
  EXPECT_EQ(parse_planner_cost_form("reference"), PlannerCostForm::reference);
  EXPECT_THROW(parse_planner_cost_form("max"), UsageError);
}

TEST(Planner, TransfersArePaidPerForm) {
  // Two 10 ms layers without weights; layer 0 outputs 100 MB; 2 devices at 1 GB/s, straight.
  // Paper: the split costs 2*1e8/1e9 s = 200 ms. Reference: nothing without a compression ratio; with
  // ratio 4 the second stage pays 2*1e8/(1e9*1*4) s = 50 ms for its input (it ends the model, so no
  // output term). Paper with ratio 4: 50 ms too.
  const Profile p = make_profile({{10, 0, 1e8, 0}, {10, 0, 1e3, 0}});
  PlannerOptions o = flat(2, 1e9, PlannerCostForm::paper);
  o.straight_pipeline = true;
  EXPECT_DOUBLE_EQ(plan_pipedream(p, o).time_ms, 200.0);
  o.activation_compression = 4;
  EXPECT_DOUBLE_EQ(plan_pipedream(p, o).time_ms, 50.0);
  o.cost_form = PlannerCostForm::reference;
  EXPECT_DOUBLE_EQ(plan_pipedream(p, o).time_ms, 50.0);
  o.activation_compression = 0;
  EXPECT_DOUBLE_EQ(plan_pipedream(p, o).time_ms, 10.0);
  // Without the straight constraint the paper form avoids the 200 ms split: data parallel 20/2 = 10.
  PlannerOptions free = flat(2, 1e9, PlannerCostForm::paper);
  const Plan plan = plan_pipedream(p, free);
  EXPECT_DOUBLE_EQ(plan.time_ms, 10.0);
  EXPECT_EQ(plan.replication, (std::vector<int>{2}));
}

TEST(Planner, MemoryLimitIsRespected) {
  // Three 10 ms layers; layer 0 has 3 GB of weights; outputs of 1 MB; 3 devices at 1 GB/s; weight
  // stashing. Replicating layer 0 costs >= 4*1*3e9/(2*1e9) s / 2 = 3000 ms, so unconstrained the best is
  // 10 ms with layer 0 on one device (e.g. straight 1|1|1; transfers 2 ms). Layer 0's stage then has
  // n = ceil(3/1) = 3 mini-batches in flight: 2W + 2 stashed W + 3 MB = 12.003 GB.
  const Profile p = make_profile({{10, 3e9, 1e6, 0}, {10, 0, 1e6, 0}, {10, 0, 1e6, 0}});
  PlannerOptions o = flat(3, 1e9);
  o.weight_stashing = true;
  const Plan free = plan_pipedream(p, o);
  EXPECT_DOUBLE_EQ(free.time_ms, 10.0);
  EXPECT_DOUBLE_EQ(free.stage_memory_bytes[0], 2 * 3e9 + 2 * 3e9 + 3 * 1e6 * free.balance[0]);
  // With 9 GB per device layer 0's stage needs (n + 1) 3 GB + n MB <= 9 GB, so n = 1: its stage holds
  // every device used, i.e. data parallelism: 3 devices: max(30, 4*2*3e9/(3*1e9) s)/3 = 8000/3 ms;
  // allowed to use fewer, 1 device: 30 ms (6.003 GB).
  o.memory_limit_bytes = 9e9;
  const Plan tight = plan_pipedream(p, o);
  EXPECT_EQ(tight.balance, (std::vector<int>{3}));
  EXPECT_NEAR(tight.time_ms, 8000.0 / 3, 1e-9);
  for (double m : tight.stage_memory_bytes) EXPECT_LE(m, 9e9);
  EXPECT_TRUE(tight.data_parallel_fits);
  o.allow_fewer_machines = true;
  const Plan fewer = plan_pipedream(p, o);
  EXPECT_DOUBLE_EQ(fewer.time_ms, 30.0);
  EXPECT_EQ(fewer.replication, (std::vector<int>{1}));
  EXPECT_DOUBLE_EQ(fewer.stage_memory_bytes[0], 2 * 3e9 + 3e6);
  // Without stashing 2W + n A fits 9 GB for any n: the unconstrained plan again.
  o.weight_stashing = false;
  EXPECT_DOUBLE_EQ(plan_pipedream(p, o).time_ms, 10.0);
  // Below 2W nothing fits.
  o.memory_limit_bytes = 5e9;
  try {
    plan_pipedream(p, o);
    ADD_FAILURE() << "accepted a limit below the weights";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("no split fits in 5 GB per device"), std::string::npos) << e.what();
  }
}

TEST(Planner, OptionsAreChecked) {
  const Profile p = make_profile({{1, 0, 0, 0}, {1, 0, 0, 0}});
  auto error = [&](const PlannerOptions& o) {
    try {
      plan_pipedream(p, o);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(error(PlannerOptions{}).find("at least one network level"), std::string::npos);
  EXPECT_NE(error(flat(0, 1e9)).find("has 0 machines"), std::string::npos);
  EXPECT_NE(error(flat(2, 0)).find("bandwidth 0"), std::string::npos);
  PlannerOptions o = flat(2, 1e9);
  o.memory_limit_bytes = 0;
  EXPECT_NE(error(o).find("memory limit"), std::string::npos);
  o = flat(2, 1e9);
  o.activation_compression = -1;
  EXPECT_NE(error(o).find("activation compression"), std::string::npos);
  o = flat(3, 1e9);
  o.straight_pipeline = true;
  EXPECT_NE(error(o).find("straight pipeline on 3 devices needs at least 3 layers"), std::string::npos);
  o.allow_fewer_machines = true;
  EXPECT_EQ(error(o), "accepted");
}

TEST(Planner, PlanJsonRoundTripsAndIsChecked) {
  const Profile p = make_profile({{10, 1e9, 1e6, 0}, {30, 0, 1e6, 0}});
  PlannerOptions o = flat(4, 1e9);
  o.memory_limit_bytes = 1e12;
  o.activation_compression = 2;
  const Plan plan = plan_pipedream(p, o);
  const std::string text = plan_to_json_text(plan);
  const Plan back = plan_from_json_text(text, "plan.json");
  EXPECT_EQ(back.model, plan.model);
  EXPECT_EQ(back.layers, 2);
  EXPECT_EQ(back.balance, plan.balance);
  EXPECT_EQ(back.replication, plan.replication);
  EXPECT_EQ(back.stage_time_ms, plan.stage_time_ms);
  EXPECT_EQ(back.stage_memory_bytes, plan.stage_memory_bytes);
  EXPECT_EQ(back.stage_in_flight, plan.stage_in_flight);
  EXPECT_EQ(back.time_ms, plan.time_ms);
  EXPECT_EQ(back.data_parallel_time_ms, plan.data_parallel_time_ms);
  EXPECT_EQ(back.speedup, plan.speedup);
  EXPECT_EQ(back.options.levels[0].machines, 4);
  EXPECT_EQ(back.options.levels[0].bandwidth, 1e9);
  EXPECT_EQ(back.options.memory_limit_bytes, 1e12);
  EXPECT_EQ(back.options.activation_compression, 2);
  // No limit and unlimited bandwidth are null in JSON and infinity again when read.
  Plan unlimited = plan;
  unlimited.options.memory_limit_bytes = kInf;
  unlimited.options.levels[0].bandwidth = kInf;
  const nlohmann::json j = plan_to_json(unlimited);
  EXPECT_TRUE(j["options"]["memory_limit_bytes"].is_null());
  EXPECT_EQ(plan_from_json(j).options.levels[0].bandwidth, kInf);
  // Other tools may add keys.
  nlohmann::json extended = j;
  extended["schedule"] = "1f1b";
  EXPECT_NO_THROW(plan_from_json(extended));
  auto error = [&](const std::function<void(nlohmann::json&)>& mutate) {
    nlohmann::json k = plan_to_json(plan);
    mutate(k);
    try {
      plan_from_json(k, "plan.json");
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(error([](nlohmann::json& k) { k["format"] = "pipetrain-profile"; }).find("\"pipetrain-plan\""),
            std::string::npos);
  EXPECT_NE(error([](nlohmann::json& k) { k["replication"] = {1}; }).find("replication: has 1 entries for 2 stages"),
            std::string::npos);
  EXPECT_NE(error([](nlohmann::json& k) {
              k["replication"] = {0, 4};
            }).find("replication[0]: is 0"),
            std::string::npos);
  EXPECT_NE(error([](nlohmann::json& k) {
              k["replication"] = {4, 4};
            }).find("uses 8 devices but the levels have 4"),
            std::string::npos);
  EXPECT_NE(error([](nlohmann::json& k) { k["layers"] = 3; }).find("sums to 2 but the model has 3"), std::string::npos);
  EXPECT_NE(error([](nlohmann::json& k) { k.erase("time_ms"); }).find("\"time_ms\" is missing"), std::string::npos);
  EXPECT_NE(error([](nlohmann::json& k) { k["options"]["cost_form"] = "max"; }).find("options.cost_form"),
            std::string::npos);
  EXPECT_NE(error([](nlohmann::json& k) { k["version"] = 7; }).find("plan versions 1..1"), std::string::npos);
  EXPECT_EQ(error([](nlohmann::json&) {}), "accepted");
  const std::string path = ::testing::TempDir() + "/pipetrain_plan_test.json";
  save_plan(path, plan);
  EXPECT_EQ(load_plan(path).replication, plan.replication);
  std::remove(path.c_str());
}

TEST(Planner, Vgg16OnFourAndEightDevices) {
  const std::string path = vgg16_path();
  ASSERT_TRUE(std::ifstream(path).good()) << path << " is missing; it is part of the repository (data/pipedream/)";
  PipeDreamOptions po;
  po.model = "vgg16";
  po.micro_batch_size = 128;
  po.optimizer_bytes_per_parameter_byte = 1;  // SGD with momentum
  const Profile p = load_pipedream_graph(path, po);
  const int L = static_cast<int>(p.layers.size());
  const double total = sums(p, 0, L - 1).t;
  // 10 Gbit/s between devices (1.25 GB/s), flat; and servers of 4 devices at 100 GB/s joined at 25 Gbit/s.
  std::vector<PlannerOptions> setups;
  for (int M : {4, 8})
    for (PlannerCostForm form : {PlannerCostForm::paper, PlannerCostForm::reference}) {
      setups.push_back(flat(M, 1.25e9, form));
      PlannerOptions two;
      two.levels = {{4, 100e9}, {M / 4, 3.125e9}};
      two.cost_form = form;
      setups.push_back(two);
      PlannerOptions limited = flat(M, 1.25e9, form);
      limited.memory_limit_bytes = 16e9;  // a 16 GB device
      setups.push_back(limited);
    }
  for (const PlannerOptions& o : setups) {
    const Plan plan = plan_pipedream(p, o);
    const int M = planner_devices(o.levels);
    SCOPED_TRACE(plan_to_json_text(plan));
    EXPECT_NO_THROW(check_balance(plan.balance, L));
    EXPECT_EQ(plan.devices_used(), M);
    // No plan beats perfect division of the compute over the devices; none is worse than data
    // parallelism where that fits. In the paper form a data-parallel device holds everything once:
    // 2W + O + A, about 16.06 GB here (14.4 GB of activations at batch 128), over a 16 GB limit.
    EXPECT_GE(plan.time_ms, total / M * (1 - 1e-12));
    const Sums z = sums(p, 0, L - 1);
    const bool dp_fits = o.cost_form == PlannerCostForm::reference || 2 * z.w + z.o + z.a <= o.memory_limit_bytes;
    EXPECT_EQ(plan.data_parallel_fits, dp_fits);
    if (dp_fits) {
      EXPECT_LE(plan.time_ms, plan.data_parallel_time_ms * (1 + 1e-12));
      EXPECT_GE(plan.speedup, 1 - 1e-12);
    }
    if (o.levels.size() == 1) {
      EXPECT_TRUE(near(evaluate(p, o, flat_plan(plan.balance, plan.replication)), plan.time_ms));
    }
    if (o.cost_form == PlannerCostForm::paper) {
      for (double m : plan.stage_memory_bytes) EXPECT_LE(m, o.memory_limit_bytes);
    }
  }
  // With 16 GB the paper form cannot run data parallelism; the first stage must stay short (a conv
  // layer's output is 1.6 GB per mini-batch and it holds several in flight).
  PlannerOptions limited = flat(4, 1.25e9);
  limited.memory_limit_bytes = 16e9;
  EXPECT_FALSE(plan_pipedream(p, limited).data_parallel_fits);
  // At 1.25 GB/s the all-reduce of VGG-16's 553 MB of weights over M devices takes
  // 4 (M-1)/M * 0.553 s: data parallelism is communication-bound and the planner must beat it clearly.
  for (int M : {4, 8}) {
    const Plan plan = plan_pipedream(p, flat(M, 1.25e9));
    EXPECT_GT(plan.speedup, 1.5) << M;
    EXPECT_GT(plan.replication.front(), 1) << M;  // the convolutions, few weights, are replicated
  }
}

// PipeDream's own planner (msr-fiddle/pipedream optimizer_graph_hierarchical.py, activation
// compression ratio 1, 1 GB/s) on the vendored VGG-16 profile, as derived in data/pipedream/README.md:
// its 40 states, its time per mini-batch, and every split and replication vector it can print (its
// Python sets iterate in memory order, so on ties it prints one of several equally good plans). The
// reference form over PipeDream's states must give the same time and one of those plans, and each of
// PipeDream's plans must cost exactly that time by planner.h's formulas (the evaluator above).
TEST(Planner, Vgg16ReferenceFormMatchesPipeDreamStateForState) {
  const std::string dir = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/";
  std::ifstream in(dir + "vgg16-planner-expected.json");
  ASSERT_TRUE(in.good()) << "data/pipedream/vgg16-planner-expected.json is missing; it is part of the repository";
  const nlohmann::json expected = nlohmann::json::parse(in);
  PipeDreamOptions po;
  po.model = "vgg16";
  po.micro_batch_size = 128;
  po.planner_states = true;
  const Profile p = load_pipedream_graph(vgg16_path(), po);
  ASSERT_EQ(p.layers.size(), expected.at("states").get<std::size_t>());
  // The state PipeDream adds over the folded profile: the cut between Size and View carries pool5's
  // output and Size's 4 bytes.
  EXPECT_EQ(p.layers[31].name, "node33");
  EXPECT_DOUBLE_EQ(p.layers[31].activation_bytes, 12845056.0 + 4.0);
  EXPECT_DOUBLE_EQ(p.layers[30].activation_bytes, 12845056.0);
  const double bw = expected.at("bandwidth_bytes_per_s").get<double>();
  ASSERT_EQ(expected.at("cases").size(), 4u);
  for (const nlohmann::json& c : expected.at("cases")) {
    SCOPED_TRACE(c.at("arguments").get<std::string>());
    PlannerOptions o = flat(c.at("machines").get<int>(), bw, PlannerCostForm::reference);
    o.activation_compression = expected.at("activation_compression_ratio").get<double>();
    o.straight_pipeline = c.at("straight_pipeline").get<bool>();
    const double want_ms = 1000.0 * c.at("time_per_minibatch_s").get<double>();
    const Plan plan = plan_pipedream(p, o);
    EXPECT_NEAR(plan.time_ms, want_ms, 1e-9 * want_ms);
    bool listed = false;
    for (const nlohmann::json& q : c.at("plans")) {
      const auto balance = q.at("balance").get<std::vector<int>>();
      const auto replication = q.at("replication").get<std::vector<int>>();
      listed |= balance == plan.balance && replication == plan.replication;
      EXPECT_NEAR(evaluate(p, o, flat_plan(balance, replication)), want_ms, 1e-9 * want_ms);
    }
    EXPECT_TRUE(listed) << "the planner's plan is not one PipeDream prints: " << plan_to_json_text(plan);
  }
}

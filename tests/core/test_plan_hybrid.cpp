// The hybrid plan search (plan/search.h, issue 28): the pruned search chooses what an exhaustive one does
// on small cases (random profiles, R <= 8, with and without memory limits and network levels); the chosen
// plan is never worse than any candidate or baseline the result holds; rank counts past the layers give
// replicated plans (VGG-16 at 39 and 256 ranks beats data parallelism or equals it); bad inputs are refused
// naming the value and the fix. And the simulator's pieces the search relies on: the metrics-only
// simulation equals the full one, and per-boundary transfer times.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/costs.h"
#include "pipetrain/plan/search.h"
#include "shared_data.h"

using namespace pipetrain;

namespace {

// PipeDream's VGG-16 graph read at the batch it was profiled at (128), as the tester's cases use it.
Profile vgg16_at_batch_128() {
  PipeDreamOptions po;
  po.micro_batch_size = 128;
  return load_pipedream_graph(pipetrain::testing::vgg16_path(), po);
}

Profile random_profile(std::mt19937& rng, int layers) {
  std::uniform_real_distribution<double> t(0.2, 4.0), bytes(1e4, 4e6), params(1e5, 8e6);
  Profile p;
  p.model = "random";
  p.micro_batch_size = 2;
  for (int i = 0; i < layers; ++i) {
    LayerProfile l;
    l.name = "l" + std::to_string(i);
    l.type = i % 2 ? "Linear" : "Conv";
    l.forward_ms = t(rng);
    l.backward_ms = 2 * l.forward_ms * t(rng) / 2;
    l.activation_bytes = bytes(rng);
    l.parameter_bytes = params(rng);
    l.optimizer_bytes = 2 * l.parameter_bytes;
    l.optimizer_ms = i % 3 ? t(rng) / 4 : 0.0;  // some measured, some not
    p.layers.push_back(l);
  }
  return p;
}

bool same_choice(const PlanCandidate& a, const PlanCandidate& b) {
  return a.fits == b.fits && std::abs(a.makespan - b.makespan) <= 1e-9 * std::max(1.0, b.makespan);
}

// The chosen plan may be chosen, and no row that may be is better (the rows that may not are references).
void expect_never_worse(const PlanSearchResult& r) {
  const PlanCandidate& best = r.chosen();
  EXPECT_TRUE(r.eligible(best)) << r.ineligible(best);
  for (const PlanCandidate& c : r.candidates)
    EXPECT_FALSE(r.eligible(c) && better_candidate(c, best))
        << c.schedule << " p=" << c.stages << " d=" << c.replicas << " m=" << c.m;
  for (const auto* x : {&r.uniform_1f1b, &r.data_parallel, &r.replicated})
    if (*x) {
      EXPECT_FALSE(r.eligible(**x) && better_candidate(**x, best)) << (*x)->schedule;
    }
  for (const PlanCandidate& c : r.pipedream_copies)
    EXPECT_FALSE(r.eligible(c) && better_candidate(c, best)) << "PipeDream's plan x " << c.copies << " copies, m=" << c.m;
}

// PipeDream's plan x d copies as the search holds it: the planner's plan for R/d ranks with every
// replication times d, on d x its devices, with m a multiple of d x every replica count.
void expect_copies_consistent(const PlanSearchResult& r, int ranks, int64_t batch) {
  ASSERT_EQ(r.pipedream_copies.size(), r.pipedream_copy_plans.size());
  for (std::size_t i = 0; i < r.pipedream_copies.size(); ++i) {
    const PlanCandidate& c = r.pipedream_copies[i];
    const Plan& plan = r.pipedream_copy_plans[i];
    ASSERT_GT(c.copies, 1);
    EXPECT_EQ(ranks % c.copies, 0) << c.copies;
    EXPECT_LE(plan.devices_used(), ranks / c.copies);
    EXPECT_EQ(c.balance, plan.balance);
    ASSERT_EQ(c.replication.size(), plan.replication.size());
    int lcm = 1;
    for (std::size_t s = 0; s < plan.replication.size(); ++s) {
      EXPECT_EQ(c.replication[s], plan.replication[s] * c.copies);
      lcm = std::lcm(lcm, plan.replication[s]);
    }
    EXPECT_EQ(c.ranks_used, plan.devices_used() * c.copies);
    EXPECT_LE(c.ranks_used, ranks);
    EXPECT_EQ(c.m % (lcm * c.copies), 0) << c.m;
    EXPECT_LE(c.m, batch);
    if (i > 0) {
      EXPECT_GT(c.copies, r.pipedream_copies[i - 1].copies);  // one per d, ascending
    }
  }
}

}  // namespace

TEST(PlanHybrid, PrunedSearchAgreesWithExhaustiveOnSmallCases) {
  std::mt19937 rng(28);
  int cases = 0, copies = 0;
  for (int ranks = 1; ranks <= 8; ++ranks)
    for (int variant = 0; variant < 3; ++variant) {
      const Profile prof = random_profile(rng, 3 + static_cast<int>(rng() % 6));
      PlanSearchOptions o;
      o.ranks = ranks;
      o.batch_size = 8 << (rng() % 2);
      o.microbatch_counts = {1, 2, 4, 8};
      o.bandwidth_bytes_per_ms = std::uniform_real_distribution<double>(1e3, 1e6)(rng);
      o.latency_ms = 0.01;
      if (variant == 1 && ranks % 2 == 0)  // two levels: pairs on fast links, slow between pairs
        o.pipedream.levels = {NetworkLevel{2, 1e10}, NetworkLevel{ranks / 2, 1e8}};
      if (variant == 2) {  // a memory limit between the leanest and the fattest plan
        PlanSearchOptions free = o;
        free.exhaustive = true;
        const PlanSearchResult all = search_plans(prof, free);
        double lo = 1e300, hi = 0;
        for (const PlanCandidate& c : all.candidates) lo = std::min(lo, c.peak_bytes), hi = std::max(hi, c.peak_bytes);
        o.memory_limit_bytes = (lo + hi) / 2;
      }
      PlanSearchOptions brute = o;
      brute.exhaustive = true;
      const PlanSearchResult pruned = search_plans(prof, o), full = search_plans(prof, brute);
      EXPECT_EQ(pruned.considered, full.considered);
      // Exhaustive: everything simulated (with a limit, what cannot fit by its lower bound is skipped).
      if (o.memory_limit_bytes <= 0) {
        EXPECT_EQ(static_cast<int64_t>(full.candidates.size()), full.considered);
      }
      EXPECT_LE(pruned.candidates.size(), full.candidates.size());
      EXPECT_TRUE(same_choice(pruned.chosen(), full.chosen()))
          << "ranks " << ranks << " variant " << variant << ": pruned " << pruned.chosen().makespan << " ms, exhaustive "
          << full.chosen().makespan << " ms";
      EXPECT_TRUE(same_choice(pruned.best_straight, full.best_straight)) << "ranks " << ranks;
      EXPECT_LE(pruned.chosen().ranks_used, ranks);
      expect_never_worse(pruned);
      expect_never_worse(full);
      expect_copies_consistent(pruned, ranks, pruned.batch_size);
      copies += !pruned.pipedream_copies.empty();
      ++cases;
    }
  EXPECT_EQ(cases, 24);
  EXPECT_GT(copies, 0);  // PipeDream's plan x copies was in the space (R = 4, 6, 8: k = 2, 3, 4)
}

// Six layers (an embedding, four blocks of 4 MB of parameters, a head) with these forward times and
// backwards twice as long: the profiles of the PipeDream-copies tests.
namespace {
Profile six_layers(const std::vector<double>& forward) {
  Profile prof;
  prof.model = "six";
  prof.micro_batch_size = 2;
  for (int i = 0; i < 6; ++i) {
    LayerProfile l;
    l.name = "l" + std::to_string(i);
    l.type = i == 0 ? "Embedding" : i == 5 ? "Head" : "Block";
    l.forward_ms = forward.at(static_cast<std::size_t>(i));
    l.backward_ms = 2 * l.forward_ms;
    l.activation_bytes = 4096;
    l.parameter_bytes = i == 0 ? 256 : i == 5 ? 4096 : 4e6;
    l.optimizer_bytes = 2 * l.parameter_bytes;
    prof.layers.push_back(l);
  }
  return prof;
}
}  // namespace

// PipeDream's plan for fewer ranks x data-parallel copies of it, where it wins: 6 ranks, a slow first
// layer with few parameters and heavy blocks over a 1 GB/s link. PipeDream's planner on all 6 ranks gives
// the first layer 3 replicas and every block its own stage (four stages, 3,1,1,1); its plan for 3 ranks
// (the first two layers on 2 replicas, the rest on one) x 2 copies is 4,2 over the same 6 ranks, fewer
// stages, less bubble. The search finds it, chooses it over everything it shows, and writes the plan that
// train --plan runs: the replication as it is (1F1B-RR), m that every replica count divides.
TEST(PlanHybrid, PipeDreamsPlanTimesCopiesWins) {
  const Profile prof = six_layers({6, 1, 1, 1, 1, 1});
  PlanSearchOptions o;
  o.ranks = 6;
  o.batch_size = 16;
  o.bandwidth_bytes_per_ms = 1e6;  // 1 GB/s
  const PlanSearchResult r = search_plans(prof, o);
  ASSERT_TRUE(r.pipedream.has_value()) << r.pipedream_error;
  EXPECT_EQ(r.pipedream->replication, (std::vector<int>{3, 1, 1, 1}));
  ASSERT_TRUE(r.replicated.has_value());
  const PlanCandidate& c = r.chosen();
  EXPECT_TRUE(r.chose_replicated);
  EXPECT_EQ(c.copies, 2);
  EXPECT_EQ(c.balance, (std::vector<int>{2, 4}));
  EXPECT_EQ(c.replication, (std::vector<int>{4, 2}));
  EXPECT_EQ(c.ranks_used, 6);
  EXPECT_EQ(c.m % 4, 0);
  EXPECT_LT(c.makespan, r.replicated->makespan);
  ASSERT_TRUE(r.data_parallel.has_value());
  EXPECT_LT(c.makespan, r.data_parallel->makespan);
  expect_never_worse(r);
  expect_copies_consistent(r, 6, 16);
  // Its simulation is the 1F1B-RR one of the scaled replication over the whole mini-batch.
  const PlanCandidate again = simulate_candidate(prof, c.balance, "1f1b", c.m, 16.0 / c.m, o.bandwidth_bytes_per_ms,
                                                 o.latency_ms, 0, c.replication);
  EXPECT_DOUBLE_EQ(again.makespan, c.makespan);
  // The plan file: the scaled replication, run as 1F1B-RR with the candidate's m.
  const PlanFile f = plan_file_for(prof, r);
  EXPECT_EQ(f.plan.replication, (std::vector<int>{4, 2}));
  EXPECT_EQ(f.plan.balance, (std::vector<int>{2, 4}));
  EXPECT_EQ(f.schedule, "1f1b");
  EXPECT_EQ(f.microbatches, c.m);
  const PlanFile back = plan_file_from_json(plan_file_to_json(f), "copies.json");
  EXPECT_EQ(back.plan.replication, f.plan.replication);
  EXPECT_EQ(back.microbatches, f.microbatches);
  // Off when only one pipeline may win, or with no copy plans asked for.
  PlanSearchOptions none = o;
  none.pipedream_copy_plans = 0;
  const PlanSearchResult without = search_plans(prof, none);
  EXPECT_TRUE(without.pipedream_copies.empty());
  EXPECT_GT(without.chosen().makespan, c.makespan);
}

// Replicated equally (u times every stage), a plan runs as u copies of the pipeline (train --plan reads it
// as --replicas u), each with its own micro-batches: the file records m / u of them, which is the same
// schedule (RoundRobin.ReplicationTimesDIsDCopiesOfThePipeline). Light first and last layers, heavy
// blocks: PipeDream's plan for 3 ranks is three straight stages, x 2 copies 2,2,2, the fastest row with
// only interleaved asked for; but 1F1B-RR runs 1f1b, which that leaves out, so it is a reference there,
// not chosen, and the writer is checked on a result that chose it.
TEST(PlanHybrid, EquallyReplicatedCopiesAreWrittenAsReplicas) {
  const Profile prof = six_layers({0.05, 1, 1, 1, 1, 0.05});
  PlanSearchOptions o;
  o.ranks = 6;
  o.batch_size = 16;
  o.bandwidth_bytes_per_ms = 1e6;
  o.schedules = {"interleaved"};
  PlanSearchResult r = search_plans(prof, o);
  expect_never_worse(r);
  EXPECT_TRUE(r.chosen().replication.empty());
  EXPECT_FALSE(r.chose_replicated);
  const auto copies = std::min_element(r.pipedream_copies.begin(), r.pipedream_copies.end(), better_candidate);
  ASSERT_NE(copies, r.pipedream_copies.end());
  EXPECT_TRUE(better_candidate(*copies, r.chosen()));  // faster, but not eligible
  EXPECT_NE(r.ineligible(*copies).find("1f1b"), std::string::npos) << r.ineligible(*copies);
  r.best = *copies;
  r.chose_replicated = true;
  const PlanCandidate& c = r.chosen();
  ASSERT_EQ(c.copies, 2);
  EXPECT_EQ(c.replication, (std::vector<int>{2, 2, 2}));
  const PlanFile f = plan_file_for(prof, r);
  EXPECT_EQ(f.plan.replication, (std::vector<int>{2, 2, 2}));
  EXPECT_EQ(f.schedule, "1f1b");
  EXPECT_EQ(f.microbatches * 2, c.m);
  EXPECT_EQ(f.batch_size % f.plan.replication.front(), 0);  // train --plan splits it over the copies
}

// The optimizer's step (the profile's optimizer_ms) is part of every candidate's time, once per rank and
// step, after its compute; the all-reduce column stays the all-reduce alone. Data parallelism on 4
// replicas: its time grows by exactly the whole model's step, and nothing else changes.
TEST(PlanHybrid, TheOptimizerStepCountsInEveryCandidate) {
  std::mt19937 rng(5);
  Profile without = random_profile(rng, 6);
  for (auto& l : without.layers) l.optimizer_ms = 0;
  Profile with = without;
  double total = 0;  // 0.5, 0.75, ..., 1.75
  for (std::size_t i = 0; i < with.layers.size(); ++i) total += with.layers[i].optimizer_ms = 0.5 + 0.25 * i;
  PlanSearchOptions o;
  o.ranks = 4;
  o.batch_size = 16;
  o.bandwidth_bytes_per_ms = 1e5;
  const PlanSearchResult a = search_plans(without, o), b = search_plans(with, o);
  ASSERT_TRUE(a.data_parallel && b.data_parallel);
  EXPECT_NEAR(b.data_parallel->makespan - a.data_parallel->makespan, total, 1e-9);
  EXPECT_DOUBLE_EQ(b.data_parallel->allreduce_ms, a.data_parallel->allreduce_ms);
  EXPECT_GT(b.data_parallel->allreduce_ms, 0.0);
  // A straight pipeline's time grows by at least its busiest stage's step and at most the whole model's.
  const PlanCandidate sa = simulate_candidate(without, {3, 3}, "1f1b", 4, 4, 1e5, 0.05, 0);
  const PlanCandidate sb = simulate_candidate(with, {3, 3}, "1f1b", 4, 4, 1e5, 0.05, 0);
  // Each rank's step is its last action, so nothing else moves: the time grows by at least stage 0's step
  // (rank 0 ends last without them) and at most stage 1's.
  EXPECT_GE(sb.makespan - sa.makespan, 0.5 + 0.75 + 1.0 - 1e-9);
  EXPECT_LE(sb.makespan - sa.makespan, 1.25 + 1.5 + 1.75 + 1e-9);
  expect_never_worse(b);
}

// A measured all-reduce (PlanSearchOptions::allreduce, from a profile's runtime.allreduce) prices the
// replicas' gradients instead of the links: data parallelism's all-reduce column is the group model at the
// measured terms, for the whole model's gradients and the loss; the pruned search still agrees with the
// exhaustive one.
// PipeDream's replicated stages are priced by the measured all-reduce too, where one is given: in 1F1B-RR
// the first stage finishes last, so its step's all-reduce adds to the makespan exactly what the measured
// one costs over the link's.
TEST(PlanHybrid, AMeasuredAllReducePricesPipeDreamsReplicas) {
  const Profile prof = six_layers({6, 1, 1, 1, 1, 1});
  const std::vector<int> balance{2, 4}, replication{3, 1};
  const std::vector<TransferSample> samples{{1e5, 0.5}, {1e6, 4.0}, {1e7, 60.0}};  // far slower than the link
  const MeasuredAllReduce measured(samples, 2);
  const double params = prof.layers[0].parameter_bytes + prof.layers[1].parameter_bytes;
  const PlanCandidate link = simulate_candidate(prof, balance, "1f1b", 6, 2.0, 1e6, 0.05, 0, replication);
  const PlanCandidate with = simulate_candidate(prof, balance, "1f1b", 6, 2.0, 1e6, 0.05, 0, replication, &measured);
  const double by_link = group_allreduce_ms(params, 3, 1e6, 0.05), by_measure = measured.ms(params, 3);
  ASSERT_GT(by_measure, by_link + 1.0);
  EXPECT_NEAR(with.makespan - link.makespan, by_measure - by_link, 1e-6);
  // Unreplicated (one copy of every stage), nothing changes.
  const PlanCandidate plain = simulate_candidate(prof, balance, "1f1b", 6, 2.0, 1e6, 0.05, 0, {1, 1}, &measured);
  EXPECT_DOUBLE_EQ(plain.makespan, simulate_candidate(prof, balance, "1f1b", 6, 2.0, 1e6, 0.05, 0, {1, 1}).makespan);
}

TEST(PlanHybrid, AMeasuredAllReducePricesTheReplicas) {
  std::mt19937 rng(9);
  const Profile prof = random_profile(rng, 6);
  double params = 0;
  for (const auto& l : prof.layers) params += l.parameter_bytes;
  PlanSearchOptions o;
  o.ranks = 4;
  o.batch_size = 16;
  o.microbatch_counts = {1, 2, 4};
  o.bandwidth_bytes_per_ms = 1e7;
  o.allreduce = {{1e5, 0.5}, {1e6, 4.0}, {1e7, 60.0}};  // far slower than the links
  o.allreduce_ranks = 2;
  const PlanSearchResult r = search_plans(prof, o);
  ASSERT_TRUE(r.data_parallel.has_value());
  const int d = r.data_parallel->replicas;
  ASSERT_GT(d, 1);
  EXPECT_NEAR(r.data_parallel->allreduce_ms,
              measured_allreduce_ms(o.allreduce, 2, params, d) + measured_allreduce_ms(o.allreduce, 2, kReplicaLossBytes, d),
              1e-9);
  EXPECT_GT(r.data_parallel->allreduce_ms, group_allreduce_ms(params, d, o.bandwidth_bytes_per_ms, o.latency_ms));
  PlanSearchOptions brute = o;
  brute.exhaustive = true;
  EXPECT_TRUE(same_choice(r.chosen(), search_plans(prof, brute).chosen()));
  expect_never_worse(r);
  o.allreduce_ranks = 1;
  EXPECT_THROW(search_plans(prof, o), UsageError);
  o.allreduce_ranks = 2;
  o.allreduce[1].one_way_ms = -1;
  EXPECT_THROW(search_plans(prof, o), UsageError);
}

TEST(PlanHybrid, MoreRanksThanLayersGiveReplicatedPlansBetterThanTheBaselines) {
  const Profile vgg = vgg16_at_batch_128();
  for (int ranks : {39, 256}) {
    PlanSearchOptions o;
    o.ranks = ranks;
    o.bandwidth_bytes_per_ms = 1.25e6;  // 1.25 GB/s, the case
    const PlanSearchResult r = search_plans(vgg, o);
    const PlanCandidate& c = r.chosen();
    EXPECT_LE(c.ranks_used, ranks);
    EXPECT_GT(c.ranks_used, 1) << "one rank of " << ranks << " used";
    ASSERT_TRUE(r.data_parallel.has_value());
    EXPECT_LE(c.makespan, r.data_parallel->makespan);
    ASSERT_TRUE(r.uniform_1f1b.has_value());
    EXPECT_LT(c.makespan, r.uniform_1f1b->makespan);  // 39 one-layer stages at 1.25 GB/s are far slower
    EXPECT_LT(static_cast<int64_t>(r.candidates.size()), r.considered);  // the bound pruned most of them
    expect_never_worse(r);
  }
}

TEST(PlanHybrid, RefusesBadRankCountsAndEmptyProfilesWithTheFix) {
  std::mt19937 rng(1);
  const Profile prof = random_profile(rng, 4);
  auto message = [&](const Profile& p, int ranks) {
    PlanSearchOptions o;
    o.ranks = ranks;
    try {
      search_plans(p, o);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  for (int ranks : {0, 10000000}) {
    const std::string m = message(prof, ranks);
    EXPECT_NE(m.find("--ranks must be in 1.."), std::string::npos) << m;
    EXPECT_NE(m.find(std::to_string(ranks)), std::string::npos) << m;
  }
  Profile empty = prof;
  empty.layers.clear();
  const std::string m = message(empty, 4);
  EXPECT_NE(m.find("no layers"), std::string::npos) << m;
  EXPECT_NE(m.find("pipetrain profile"), std::string::npos) << m;
  PlanSearchOptions o;
  o.ranks = 8;
  o.hybrid = false;
  EXPECT_THROW(search_plans(prof, o), UsageError);  // a straight pipeline of 8 stages over 4 layers
}

TEST(SimulateMetrics, EqualsTheFullSimulationsMetrics) {
  for (const std::string& name : schedule_names())
    for (auto [p, m] : {std::pair{2, 4}, {4, 8}, {3, 6}}) {
      GeneratorOptions g;
      g.ranks = p;
      g.microbatches = m;
      g.virtual_stages = schedule_traits(name).virtual_stages ? 2 : 1;
      Schedule s;
      try {
        s = generate(name, g);
      } catch (const UsageError&) {
        continue;  // sizes this generator does not take
      }
      CostModel costs = CostModel::uniform(s.stages, StageCost{1.0, 1.5, 0.7, 2.0}, s.virtual_stages_per_rank(), 0.3);
      for (std::size_t k = 0; k < costs.stage.size(); ++k) costs.stage[k].f += 0.1 * static_cast<double>(k);
      const SimResult full = simulate(s, costs);
      const Metrics fast = simulate_metrics(s, costs);
      EXPECT_DOUBLE_EQ(fast.makespan, full.metrics.makespan) << name;
      EXPECT_DOUBLE_EQ(fast.bubble_fraction, full.metrics.bubble_fraction) << name;
      ASSERT_EQ(fast.per_rank.size(), full.metrics.per_rank.size());
      const Metrics again = compute_metrics(full.timeline);  // the timeline's own definitions
      for (std::size_t r = 0; r < fast.per_rank.size(); ++r) {
        EXPECT_DOUBLE_EQ(fast.per_rank[r].busy, again.per_rank[r].busy) << name << " rank " << r;
        EXPECT_DOUBLE_EQ(fast.per_rank[r].span, again.per_rank[r].span) << name << " rank " << r;
        EXPECT_EQ(fast.per_rank[r].peak_inflight, again.per_rank[r].peak_inflight) << name << " rank " << r;
        EXPECT_DOUBLE_EQ(fast.per_rank[r].peak_memory, full.metrics.per_rank[r].peak_memory) << name << " rank " << r;
      }
    }
  // Replicated stages (1F1B-RR).
  const Schedule rr = round_robin("1f1b", {2, 1, 3}, 6);
  CostModel costs = CostModel::uniform(3, StageCost{1, 1, 1, 1}, 1, 0.2);
  costs.stage_step = {0.5, 0.0, 0.7};
  EXPECT_DOUBLE_EQ(simulate_metrics(rr, costs).makespan, simulate(rr, costs).metrics.makespan);
}

TEST(SimulateMetrics, BoundaryTransferTimesApplyPerCut) {
  const Schedule s = gpipe(3, 1);
  CostModel one = CostModel::uniform(3, StageCost{1, 1, 0, 0}, 1, 0.0);
  // One micro-batch: F0 F1 F2 then B2 B1 B0, each cut crossed twice.
  EXPECT_DOUBLE_EQ(simulate_metrics(s, one).makespan, 6.0);
  CostModel cut = one;
  cut.boundary_comm = {0.5, 3.0};
  EXPECT_DOUBLE_EQ(simulate_metrics(s, cut).makespan, 6.0 + 2 * 0.5 + 2 * 3.0);
  EXPECT_DOUBLE_EQ(simulate(s, cut).metrics.makespan, 6.0 + 2 * 0.5 + 2 * 3.0);
  CostModel same = one;
  same.comm = 2.0;
  CostModel listed = one;
  listed.boundary_comm = {2.0, 2.0};
  EXPECT_DOUBLE_EQ(simulate_metrics(s, same).makespan, simulate_metrics(s, listed).makespan);
  CostModel wrong = one;
  wrong.boundary_comm = {1.0};  // 3 stages have 2 cuts
  EXPECT_THROW(simulate_metrics(s, wrong), UsageError);
  wrong.boundary_comm = {1.0, -1.0};
  EXPECT_THROW(simulate_metrics(s, wrong), UsageError);
}

// A chosen plan with two stages per rank (interleaved, the V shapes) lists every stage in its file, and
// records virtual_stages so the reader counts its ranks, not its stages, against the devices.
TEST(PlanHybrid, PlanFilesWithVirtualStagesRoundTrip) {
  std::mt19937 rng(3);
  const Profile prof = random_profile(rng, 6);
  PlanSearchOptions o;
  o.ranks = 2;
  o.batch_size = 16;
  o.schedules = {"interleaved"};
  o.hybrid = false;
  const PlanSearchResult r = search_plans(prof, o);
  ASSERT_EQ(r.chosen().virtual_stages, 2);
  const PlanFile f = plan_file_for(prof, r);
  EXPECT_EQ(f.virtual_stages, 2);
  EXPECT_EQ(f.plan.balance.size(), 4u);
  const nlohmann::json j = plan_file_to_json(f);
  const PlanFile back = plan_file_from_json(j, "v.json");
  EXPECT_EQ(back.virtual_stages, 2);
  EXPECT_EQ(back.plan.balance, f.plan.balance);
  nlohmann::json flat = j;
  flat.erase("virtual_stages");  // four stages of one rank each on two devices: refused
  EXPECT_THROW(plan_file_from_json(flat, "flat.json"), UsageError);
  nlohmann::json odd = j;
  odd["virtual_stages"] = 3;  // does not divide the four stages
  EXPECT_THROW(plan_file_from_json(odd, "odd.json"), UsageError);
}

// The chosen row is the best of the rows the options let be chosen, in every mode: hybrid (all), one
// pipeline over all ranks (--no-hybrid), UMPIPE's one straight pipeline (replicated_may_win false), and
// schedule lists without 1f1b (no 1F1B-RR); and it is of the kind the mode allows. Random profiles on 2
// to 6 ranks; across them some row that may not be chosen is faster (the restriction is real).
TEST(PlanHybrid, ChosenIsTheBestEligibleRowInEveryMode) {
  std::mt19937 rng(11);
  int faster_references = 0;
  for (int trial = 0; trial < 6; ++trial) {
    const Profile prof = random_profile(rng, 4 + trial % 3);
    const int L = static_cast<int>(prof.layers.size());
    for (int ranks : {2, 4, 6}) {
      for (int mode = 0; mode < 4; ++mode) {
        PlanSearchOptions o;
        o.ranks = ranks;
        o.batch_size = 24;
        o.bandwidth_bytes_per_ms = 1e6;
        o.microbatch_counts = {1, 4, 8};
        if (mode == 1) {
          if (ranks > L) continue;
          o.hybrid = false;
        }
        if (mode == 2) o.replicated_may_win = false;
        if (mode == 3) o.schedules = {"gpipe", "interleaved"};
        const PlanSearchResult r = search_plans(prof, o);
        SCOPED_TRACE("trial " + std::to_string(trial) + " ranks " + std::to_string(ranks) + " mode " + std::to_string(mode));
        expect_never_worse(r);
        const PlanCandidate& c = r.chosen();
        const int straight = std::min(ranks, L);
        if (mode == 1 || mode == 2) {
          EXPECT_TRUE(c.replication.empty());
          EXPECT_EQ(c.replicas, 1);
          EXPECT_EQ(c.stages, straight);
        }
        if (mode == 2) {
          EXPECT_EQ(c.virtual_stages, 1);
          EXPECT_TRUE(same_choice(c, r.best_straight));  // what UMPIPE cuts
        }
        if (mode == 3) {
          EXPECT_TRUE(c.replication.empty());  // 1F1B-RR runs 1f1b
        }
        for (const PlanCandidate& x : r.candidates) faster_references += !r.eligible(x) && better_candidate(x, c);
      }
    }
  }
  EXPECT_GT(faster_references, 0);
}

// The tester's case for UMPIPE: a 6-layer profile on 2 ranks, where an interleaved pipeline and data
// parallelism are faster than every straight one. The chosen row is the fastest straight pipeline (what
// UMPIPE cuts, and what train --plan runs from the file), the faster rows are marked, not chosen.
TEST(PlanHybrid, UmpipeChoosesTheBestStraightPipelineAndMarksTheRest) {
  // tests/data/toy-gpt6-profile.json: a 6-layer gpt profile (tests/cli uses it too).
  const Profile prof = load_profile(std::string(PIPETRAIN_SOURCE_DIR) + "/tests/data/toy-gpt6-profile.json");
  PlanSearchOptions o;
  o.ranks = 2;
  o.batch_size = 16;
  o.replicated_may_win = false;
  const PlanSearchResult r = search_plans(prof, o);
  expect_never_worse(r);
  const PlanCandidate& c = r.chosen();
  EXPECT_EQ(c.stages, 2);
  EXPECT_EQ(c.virtual_stages, 1);
  EXPECT_EQ(c.replicas, 1);
  bool looped_faster = false;
  for (const PlanCandidate& x : r.candidates)
    if (x.virtual_stages > 1 && better_candidate(x, c)) {
      looped_faster = true;
      EXPECT_NE(r.ineligible(x).find("UMPIPE"), std::string::npos) << r.ineligible(x);
    }
  EXPECT_TRUE(looped_faster);  // the tester's interleaved v=2 row
  ASSERT_TRUE(r.data_parallel.has_value());  // shown as a reference, not chosen
  EXPECT_FALSE(r.eligible(*r.data_parallel));
  // With replicas allowed the same search may choose what UMPIPE may not.
  o.replicated_may_win = true;
  const PlanSearchResult all = search_plans(prof, o);
  expect_never_worse(all);
  EXPECT_TRUE(better_candidate(all.chosen(), c));
}

// --no-hybrid on VGG-16 x 4 ranks at 1.25 GB/s (the tester's case): PipeDream's plan as 1F1B-RR (2 stages
// replicated 3,1) is the fastest row but a reference; the chosen plan is one pipeline over the 4 ranks,
// and its file says so (straight_pipeline) with data parallelism as simulated (not 0 ms). Without
// --no-hybrid but with only gpipe asked for, 1F1B-RR (which runs 1f1b) is not chosen either.
TEST(PlanHybrid, NoHybridAndSchedulesWithout1f1bNeverChooseReplicatedPlans) {
  const Profile vgg = vgg16_at_batch_128();
  PlanSearchOptions o;
  o.ranks = 4;
  o.bandwidth_bytes_per_ms = 1.25e6;
  o.hybrid = false;
  o.schedules = {"gpipe"};
  const PlanSearchResult r = search_plans(vgg, o);
  expect_never_worse(r);
  const PlanCandidate& c = r.chosen();
  EXPECT_FALSE(r.chose_replicated);
  EXPECT_TRUE(c.replication.empty());
  EXPECT_EQ(c.stages, 4);
  EXPECT_EQ(c.replicas, 1);
  EXPECT_EQ(c.schedule, "gpipe");
  ASSERT_TRUE(r.replicated.has_value());
  EXPECT_TRUE(better_candidate(*r.replicated, c));  // faster, but not eligible
  EXPECT_NE(r.ineligible(*r.replicated).find("--no-hybrid"), std::string::npos);
  ASSERT_TRUE(r.data_parallel.has_value());
  EXPECT_FALSE(r.eligible(*r.data_parallel));
  const PlanFile f = plan_file_for(vgg, r);
  EXPECT_EQ(f.plan.replication, (std::vector<int>{1, 1, 1, 1}));
  EXPECT_EQ(f.schedule, "gpipe");
  EXPECT_TRUE(f.plan.options.straight_pipeline);
  EXPECT_DOUBLE_EQ(f.plan.data_parallel_time_ms, r.data_parallel->makespan);
  EXPECT_GT(f.plan.data_parallel_time_ms, 0.0);
  EXPECT_DOUBLE_EQ(f.plan.speedup, r.data_parallel->makespan / c.makespan);
  EXPECT_EQ(f.plan.data_parallel_fits, r.data_parallel->fits);

  PlanSearchOptions gpipe_only = o;
  gpipe_only.hybrid = true;
  const PlanSearchResult g = search_plans(vgg, gpipe_only);
  expect_never_worse(g);
  EXPECT_TRUE(g.chosen().replication.empty());
  ASSERT_TRUE(g.replicated.has_value());
  EXPECT_NE(g.ineligible(*g.replicated).find("1f1b"), std::string::npos) << g.ineligible(*g.replicated);
  EXPECT_FALSE(plan_file_for(vgg, g).plan.options.straight_pipeline);  // replicas were allowed
}

// The plan's predicted time is what simulating its schedule with stage_costs gives (what simulate
// --profile runs): every cut's transfer carries its own bytes in both. VGG-16 x 4 ranks (5,7,7,20, 1f1b,
// m = 32 at 1.25 GB/s: the tester's 5332.36 ms, which simulate gave as 5754.85 when every transfer cost
// the largest cut), and three layers whose cuts carry 1 KB and 40 MB.
TEST(PlanHybrid, PlanTimeIsSimulatesTimeForTheSamePlan) {
  const Profile vgg = vgg16_at_batch_128();
  Profile skew;
  skew.model = "skew";
  skew.micro_batch_size = 4;
  for (double bytes : {1e3, 4e7, 5e5}) {
    LayerProfile l;
    l.name = "l" + std::to_string(skew.layers.size());
    l.type = "Linear";
    l.forward_ms = 2;
    l.backward_ms = 4;
    l.activation_bytes = bytes;
    l.parameter_bytes = 1e6;
    l.optimizer_bytes = 2e6;
    skew.layers.push_back(l);
  }
  struct Case {
    const Profile* prof;
    std::string balance, schedule;
    int m;
    double latency_ms;
  };
  for (const Case& k : {Case{&vgg, "5,7,7,20", "1f1b", 32, 0.0}, Case{&vgg, "5,7,7,20", "gpipe", 8, 0.05},
                        Case{&skew, "1,1,1", "1f1b", 4, 0.0}, Case{&skew, "1,1,1", "gpipe", 2, 0.05}}) {
    SCOPED_TRACE(k.prof->model + " " + k.schedule);
    const std::vector<int> balance = parse_balance(k.balance);
    const int p = static_cast<int>(balance.size());
    PlanSearchOptions o;
    o.ranks = p;
    o.bandwidth_bytes_per_ms = 1.25e6;
    o.latency_ms = k.latency_ms;
    o.hybrid = false;
    o.schedules = {k.schedule};
    o.balance_kinds = {k.balance};
    o.microbatch_counts = {k.m};
    const PlanSearchResult r = search_plans(*k.prof, o);
    ASSERT_EQ(r.chosen().balance, balance);
    StageCostOptions so;
    so.micro_batch = static_cast<double>(r.batch_size) / k.m;
    so.bandwidth_bytes_per_ms = o.bandwidth_bytes_per_ms;
    so.latency_ms = o.latency_ms;
    const CostModel costs = stage_costs(*k.prof, balance, so);
    ASSERT_EQ(costs.boundary_comm.size(), balance.size() - 1);
    GeneratorOptions g;
    g.ranks = p;
    g.microbatches = k.m;
    const double simulated = simulate(generate(k.schedule, g), costs).metrics.makespan;
    EXPECT_NEAR(r.chosen().makespan, simulated, 1e-9 * simulated);
    // and the one-transfer-time model (every cut at the largest) is really different here
    CostModel flat = costs;
    flat.boundary_comm.clear();
    EXPECT_GT(simulate(generate(k.schedule, g), flat).metrics.makespan, simulated * (1 + 1e-6));
  }
  // stage_costs' per-cut times: latency + that cut's bytes / bandwidth; comm the largest.
  StageCostOptions so;
  so.micro_batch = 8;  // twice the profiled size: twice the bytes
  so.bandwidth_bytes_per_ms = 1e6;
  so.latency_ms = 0.5;
  const CostModel c = stage_costs(skew, {1, 1, 1}, so);
  ASSERT_EQ(c.boundary_comm.size(), 2u);
  EXPECT_DOUBLE_EQ(c.boundary_comm[0], 0.5 + 2e3 / 1e6);
  EXPECT_DOUBLE_EQ(c.boundary_comm[1], 0.5 + 8e7 / 1e6);
  EXPECT_DOUBLE_EQ(c.comm, c.boundary_comm[1]);
  EXPECT_TRUE(stage_costs(skew, {3}, so).boundary_comm.empty());  // nothing crosses
}

// Network levels whose machines multiply past the most ranks a plan takes are refused naming the
// product (the product was cast to int: 3 x 1431655766 planned as 2 devices, 65536 x 65536 as 0).
TEST(PlanHybrid, LevelProductsBeyondTheRankLimitAreRefused) {
  EXPECT_EQ(planner_devices({NetworkLevel{4, 1e9}, NetworkLevel{2, 1e9}}), 8);
  for (const std::vector<NetworkLevel>& levels :
       {std::vector<NetworkLevel>{{3, 1e11}, {1431655766, 1e9}}, std::vector<NetworkLevel>{{2147483647, 1e9}, {2, 1e9}},
        std::vector<NetworkLevel>{{65536, 1e9}, {65536, 1e9}}}) {
    std::string e;
    try {
      planner_devices(levels);
    } catch (const UsageError& x) {
      e = x.what();
    }
    EXPECT_NE(e.find(std::to_string(levels[0].machines) + " x " + std::to_string(levels[1].machines)), std::string::npos) << e;
    EXPECT_NE(e.find(std::to_string(kMaxPlanRanks)), std::string::npos) << e;
    std::mt19937 rng(3);
    PlanSearchOptions o;
    o.ranks = 2;
    o.pipedream.levels = levels;
    EXPECT_THROW(search_plans(random_profile(rng, 4), o), UsageError);
  }
}

// A balance given as a list applies to its own stage count: with replicas allowed the other counts do
// without it (it used to fail on one stage: "lists 4 stages but 1 are needed"); --no-hybrid with another
// count is refused naming the counts it lays out.
TEST(PlanHybrid, BalanceListsApplyToTheirOwnStageCount) {
  std::mt19937 rng(4);
  const Profile prof = random_profile(rng, 8);
  PlanSearchOptions o;
  o.ranks = 4;
  o.balance_kinds = {"2,2,2,2"};
  const PlanSearchResult r = search_plans(prof, o);
  for (const PlanCandidate& c : r.candidates) EXPECT_EQ(c.balance, (std::vector<int>{2, 2, 2, 2}));
  expect_never_worse(r);
  o.hybrid = false;
  o.balance_kinds = {"4,4"};
  try {
    search_plans(prof, o);
    ADD_FAILURE() << "a 2-stage balance for one pipeline over 4 ranks was taken";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--balances 4,4 lists 2 stages"), std::string::npos) << m;
    EXPECT_NE(m.find("drop --no-hybrid"), std::string::npos) << m;
  }
  o.balance_kinds = {"4,4,4"};  // 12 layers for 8: the balance's own check
  EXPECT_THROW(search_plans(prof, o), UsageError);
}

// The plan file's top level: stage_memory_bytes are the simulated peaks of the ranks (the largest is the
// chosen row's peak), no stage_in_flight (the PipeDream section keeps its own), and a plan that fits no
// memory limit says so (fits_memory_limit false, its peak), through a write and a read.
TEST(PlanHybrid, PlanFileRecordsPeaksAndWhetherItFits) {
  const Profile vgg = vgg16_at_batch_128();
  PlanSearchOptions o;
  o.ranks = 4;
  o.bandwidth_bytes_per_ms = 1.25e6;
  const PlanSearchResult r = search_plans(vgg, o);
  const PlanFile f = plan_file_for(vgg, r);
  ASSERT_EQ(f.plan.stage_memory_bytes.size(), f.plan.balance.size());
  EXPECT_DOUBLE_EQ(*std::max_element(f.plan.stage_memory_bytes.begin(), f.plan.stage_memory_bytes.end()),
                   r.chosen().peak_bytes);
  const std::vector<double> statics = stage_static_bytes(vgg, f.plan.balance);
  for (std::size_t s = 0; s < statics.size(); ++s) EXPECT_GT(f.plan.stage_memory_bytes[s], statics[s]);
  const nlohmann::json j = plan_file_to_json(f);
  EXPECT_FALSE(j.contains("stage_in_flight"));
  ASSERT_TRUE(j.contains("pipedream"));
  EXPECT_TRUE(j["pipedream"].contains("stage_in_flight"));
  EXPECT_FALSE(j.contains("fits_memory_limit"));  // no limit
  EXPECT_DOUBLE_EQ(j["predicted_peak_bytes"].get<double>(), r.chosen().peak_bytes);

  o.memory_limit_bytes = 0.5 * 1073741824.0;  // nothing fits half a GiB
  const PlanSearchResult tight = search_plans(vgg, o);
  EXPECT_FALSE(tight.chosen().fits);
  const PlanFile nofit = plan_file_for(vgg, tight);
  const PlanFile back = plan_file_from_json(plan_file_to_json(nofit), "nofit.json");
  ASSERT_TRUE(back.fits_memory_limit.has_value());
  EXPECT_FALSE(*back.fits_memory_limit);
  EXPECT_DOUBLE_EQ(back.predicted_peak_bytes, tight.chosen().peak_bytes);
  EXPECT_TRUE(back.plan.stage_in_flight.empty());
  nlohmann::json bad = plan_file_to_json(nofit);
  bad["fits_memory_limit"] = "no";
  EXPECT_THROW(plan_file_from_json(bad, "bad.json"), UsageError);
}

// Checks every schedule generator: over a table of sizes each one validates and simulates without
// deadlock, and with uniform costs its simulated timeline meets the closed forms of docs/ALGORITHMS.md
// (§1.5, §1.7, §4.1-§4.4, §5). Each test names the formula it checks; the expected numbers come from
// the formulas, never from a previous run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/schedule.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/validate.h"

using namespace pipetrain;

namespace {

SimResult run(const Schedule& s, StageCost c = {}) {
  validate(s);
  return simulate(s, CostModel::uniform(s.stages, c, s.virtual_stages_per_rank()));
}

int max_inflight(const Metrics& m) {
  int out = 0;
  for (const RankMetrics& r : m.per_rank) out = std::max(out, r.peak_inflight);
  return out;
}

const StageCost kCosts[] = {{1, 1, 1, 1}, {1, 2, 1, 1}, {2, 1, 1, 1}, {1, 1, 0.5, 1}, {0.5, 1.5, 1, 1}};

}  // namespace

// Every generator, p up to 16, m up to 64, v in {1, 2, 4}, including m < p, m = 1 and p = 1.
TEST(Generators, TableOfSizesValidatesAndSimulates) {
  int checked = 0;
  for (const std::string& name : schedule_names())
    for (int p : {1, 2, 3, 4, 7, 8, 16})
      for (int m : {1, 2, 3, 4, 7, 8, 16, 64})
        for (int v : {1, 2, 4}) {
          if (v > 1 && !schedule_traits(name).virtual_stages) continue;
          if ((name == "interleaved" || name == "interleaved-zb") && m % p != 0) continue;  // rejected by design
          if (name == "2bw" && m < p) continue;               // rejected by design, tested below
          if (name == "dualpipev" && m < 2 * p) continue;     // rejected by design (test_vschedules.cpp)
          GeneratorOptions o;
          o.ranks = p;
          o.microbatches = m;
          o.virtual_stages = v;
          const Schedule s = generate(name, o);
          ASSERT_NO_THROW(validate(s)) << name << " p=" << p << " m=" << m << " v=" << v;
          const SimResult r = simulate(s, CostModel::uniform(s.stages, StageCost{}, s.virtual_stages_per_rank()));
          // Every compute action ran exactly once; the makespan is at least the busiest rank.
          double busiest = 0;
          for (const RankMetrics& rm : r.metrics.per_rank) busiest = std::max(busiest, rm.busy);
          EXPECT_GE(r.metrics.makespan + 1e-9, busiest);
          EXPECT_NEAR(busiest, 3.0 * m, 1e-9)
              << name << " p=" << p << " m=" << m;
          ++checked;
        }
  EXPECT_GT(checked, 300);
}

// GPipe and 1F1B: makespan (m+p-1)(F+B+W), bubble fraction (p-1)/(m+p-1) (docs/ALGORITHMS.md §1.7, §4.2).
TEST(Generators, GpipeAnd1F1BMakespanAndBubbleFraction) {
  for (const StageCost& c : kCosts)
    for (int p : {1, 2, 4, 8})
      for (int m : {1, 3, 8, 32})
        for (const Schedule& s : {gpipe(p, m), one_f_one_b(p, m)}) {
          const SimResult r = run(s, c);
          EXPECT_NEAR(r.metrics.makespan, (m + p - 1) * (c.f + c.b + c.w), 1e-9) << s.name << " p=" << p;
          EXPECT_NEAR(r.metrics.bubble_fraction, double(p - 1) / (m + p - 1), 1e-12) << s.name;
        }
}

// With K flushed steps the makespan repeats: K (m+p-1)(F+B+W).
TEST(Generators, SynchronousStepsRepeatTheFlush) {
  for (int k : {2, 3}) {
    const SimResult r = run(one_f_one_b(4, 8, k));
    EXPECT_NEAR(r.metrics.makespan, k * (8 + 4 - 1) * 3.0, 1e-9);
  }
}

// Peak in-flight micro-batches: GPipe m on every stage; 1F1B min(p-s, m) on stage s (§1.5).
TEST(Generators, PeakInFlightGpipeAnd1F1B) {
  for (int p : {1, 2, 4, 8})
    for (int m : {1, 2, 4, 9, 16}) {
      const SimResult g = run(gpipe(p, m));
      const SimResult f = run(one_f_one_b(p, m));
      for (int s = 0; s < p; ++s) {
        EXPECT_EQ(g.metrics.per_rank[s].peak_inflight, m);
        EXPECT_EQ(f.metrics.per_rank[s].peak_inflight, std::min(p - s, m)) << "p=" << p << " m=" << m << " s=" << s;
      }
    }
}

// Interleaved 1F1B: Megatron bubble ratio t_bubble / t_ideal = (p-1)/(v m) with t_ideal = m (F+B+W),
// for m % p == 0 (§1.7, §4.3).
TEST(Generators, InterleavedBubbleRatio) {
  for (int p : {2, 3, 4, 8})
    for (int v : {1, 2, 4})
      for (int k : {1, 2, 4}) {
        const int m = k * p;
        const SimResult r = run(interleaved(p, m, v));
        const double ideal = m * 3.0;
        EXPECT_NEAR((r.metrics.makespan - ideal) / ideal, double(p - 1) / (v * m), 1e-9)
            << "p=" << p << " v=" << v << " m=" << m;
      }
}

// Interleaved peak memory on rank r: 2(p-1-r) + (v-1)p + 1 chunk micro-batches when m % p == 0, m > p
// (§1.5), i.e. in full-stage units (2(p-1-r) + (v-1)p + 1)/v.
TEST(Generators, InterleavedPeakMemory) {
  for (int p : {2, 4})
    for (int v : {2, 4}) {
      const int m = 2 * p;
      const SimResult r = run(interleaved(p, m, v));
      for (int rank = 0; rank < p; ++rank) {
        const int chunks = std::min(2 * (p - 1 - rank) + (v - 1) * p + 1, m * v);
        EXPECT_EQ(r.metrics.per_rank[rank].peak_inflight, chunks) << "p=" << p << " v=" << v << " r=" << rank;
        EXPECT_NEAR(r.metrics.per_rank[rank].peak_memory, double(chunks) / v, 1e-9);
      }
    }
}

// ZB-H1: per-stage idle (span - busy) is at most (p-1)(F+B-W), against 1F1B's (p-1)(F+B+W), for
// m >= p and W <= F (§4.4.2; the paper assumes similar F, B and W: when W > F the postponed W passes no
// longer fit the gaps and the idle is larger, though still below 1F1B's); at most p in flight.
TEST(Generators, ZeroBubbleH1IdleAgainst1F1B) {
  for (const StageCost& c : kCosts)
    for (int p : {2, 4, 8})
      for (int m : {p, 2 * p, 3 * p + 1}) {
        const SimResult zb = run(zb_h1(p, m), c);
        const SimResult ref = run(one_f_one_b(p, m), c);
        if (c.w <= c.f) {
          EXPECT_NEAR(zb.metrics.max_bubble(), (p - 1) * (c.f + c.b - c.w), 1e-9) << "p=" << p << " m=" << m;
        }
        EXPECT_LT(zb.metrics.max_bubble(), ref.metrics.max_bubble());
        EXPECT_NEAR(ref.metrics.max_bubble(), (p - 1) * (c.f + c.b + c.w), 1e-9);
        EXPECT_LE(max_inflight(zb.metrics), p);
      }
}

// ZB-H2: no bubble (span = busy on every stage) when F = B = W and m >= 2p-1, with at most 2p-1
// micro-batches in flight; stage s warms up with 2(p-s)-1 forwards (§4.4.3).
TEST(Generators, ZeroBubbleH2HasNoBubble) {
  for (int p : {1, 2, 3, 4, 8, 16})
    for (int m : {2 * p - 1, 2 * p, 3 * p + 1, 64}) {
      const Schedule s = zb_h2(p, m, {});
      const SimResult r = run(s);
      EXPECT_NEAR(r.metrics.max_bubble(), 0.0, 1e-9) << "p=" << p << " m=" << m;
      EXPECT_LE(max_inflight(r.metrics), 2 * p - 1);
      for (int st = 0; st < p; ++st) {
        const auto& row = s.actions[st];
        const auto first_b = std::find_if(row.begin(), row.end(), [](const Action& a) { return a.kind == ActionKind::B; });
        EXPECT_EQ(first_b - row.begin(), std::min(2 * (p - st) - 1, m)) << "p=" << p << " m=" << m << " s=" << st;
      }
    }
}

// zb-auto keeps the memory limit it is given and never has a larger max-span bubble than 1F1B under the
// same limit of p micro-batches.
TEST(Generators, ZeroBubbleAutoRespectsMemoryLimit) {
  const CostModel costs = [] {
    CostModel c;
    c.stage = {{1, 1.5, 1, 1}, {1, 1, 1, 1}, {1.2, 1, 0.8, 1}, {2, 2, 1, 1}};
    return c;
  }();
  for (double limit : {1.0, 2.0, 4.0, 7.0}) {
    const Schedule s = zb_auto(4, 12, costs, limit);
    ValidateOptions vo;
    vo.memory_limit = limit;
    vo.costs = costs;
    EXPECT_NO_THROW(validate(s, vo)) << "limit " << limit;
  }
  const SimResult zb = simulate(zb_auto(4, 12, costs, 4), costs);
  const SimResult ref = simulate(one_f_one_b(4, 12), costs);
  EXPECT_LT(zb.metrics.max_bubble(), ref.metrics.max_bubble());
  EXPECT_THROW(zb_auto(4, 12, costs, 0.4), UsageError);  // below one micro-batch
}

// PipeDream and 2BW have no flush: after the warm-up no rank idles until its cool-down, and K steps take
// (K m + p - 1)(F+B+W) against 1F1B's K (m + p - 1)(F+B+W) (§5.1, §5.2).
TEST(Generators, AsynchronousSchedulesHaveNoSteadyStateBubble) {
  for (const StageCost& c : kCosts)
    for (int p : {2, 4})
      for (int k : {1, 3}) {
        const int m = 2 * p;
        for (const Schedule& s : {pipedream(p, m, k), two_bw(p, m, k)}) {
          const SimResult r = run(s, c);
          EXPECT_NEAR(r.metrics.makespan, (k * m + p - 1) * (c.f + c.b + c.w), 1e-9) << s.name;
          // Steady state: between rank r's first backward and its last forward, no gaps.
          for (int rank = 0; rank < p; ++rank) {
            double first_bw = 1e300, last_f_end = 0, busy = 0;
            std::vector<TimedAction> ev;
            for (const TimedAction& e : r.timeline.events)
              if (e.rank == rank && is_compute(e.action.kind)) ev.push_back(e);
            for (const TimedAction& e : ev) {
              if (e.action.kind == ActionKind::BW) first_bw = std::min(first_bw, e.start);
              if (e.action.kind == ActionKind::F) last_f_end = std::max(last_f_end, e.end);
            }
            for (const TimedAction& e : ev)
              if (e.start >= first_bw - 1e-9 && e.end <= last_f_end + 1e-9) busy += e.end - e.start;
            EXPECT_NEAR(busy, last_f_end - first_bw, 1e-9) << s.name << " rank " << rank;
          }
        }
      }
}

TEST(Generators, AsynchronousStepPlacement) {
  const Schedule pd = pipedream(2, 3);
  EXPECT_EQ(pd.microbatches_per_step, 1);
  EXPECT_FALSE(pd.synchronous);
  EXPECT_EQ(rank_line(pd, 0), "0F0 0F1 0BW0 0S0 0F2 0BW1 0S1 0BW2 0S2");
  const Schedule tb = two_bw(2, 2, 2);
  EXPECT_EQ(rank_line(tb, 0), "0F0 0F1 0BW0 0F2 0BW1 0S0 0F3 0BW2 0BW3 0S1");
}

TEST(Generators, GpipeRunsBackwardInReverse) {
  EXPECT_EQ(rank_line(gpipe(2, 3), 1), "1F0 1F1 1F2 1BW2 1BW1 1BW0 1S0");
}

TEST(Generators, BadSizesAreUsageErrors) {
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] { one_f_one_b(0, 4); }).find("stages must be >= 1, got 0"), std::string::npos);
  EXPECT_NE(message([] { gpipe(2, -1); }).find("micro-batches must be >= 1, got -1"), std::string::npos);
  EXPECT_NE(message([] { interleaved(2, 4, 0); }).find("virtual stages must be >= 1"), std::string::npos);
  EXPECT_NE(message([] { interleaved(4, 6, 2); }).find("use --microbatches 4 or 8"), std::string::npos);
  EXPECT_NE(message([] { two_bw(4, 2); }).find("use --microbatches 4 or more"), std::string::npos);
  EXPECT_NE(message([] { one_f_one_b(100000, 100000); }).find("use fewer"), std::string::npos);
  GeneratorOptions o;
  o.ranks = 2;
  o.microbatches = 2;
  const std::string unknown = message([&] { generate("fifo", o); });
  for (const std::string& n : schedule_names()) EXPECT_NE(unknown.find(n), std::string::npos) << unknown;
  o.virtual_stages = 2;
  EXPECT_NE(message([&] { generate("1f1b", o); }).find("only to --schedule interleaved"), std::string::npos);
}

// ---- stage replication, round robin (1F1B-RR) ------------------------------------------------------

// Without replication the round-robin generator is the plain one: the same action lists.
TEST(RoundRobin, OneReplicaPerStageIsThePlainSchedule) {
  for (const std::string base : {"gpipe", "1f1b"})
    for (int p = 1; p <= 4; ++p)
      for (int m = 1; m <= 6; ++m)
        for (int steps = 1; steps <= 2; ++steps) {
          GeneratorOptions g;
          g.ranks = p;
          g.microbatches = m;
          g.steps = steps;
          const Schedule plain = generate(base, g);
          const Schedule rr = round_robin(base, std::vector<int>(static_cast<std::size_t>(p), 1), m, steps);
          EXPECT_EQ(rr.actions, plain.actions) << base << " p=" << p << " m=" << m;
          EXPECT_EQ(rr.stage_rank, plain.stage_rank);
        }
}

// Random replications: every schedule validates (no deadlock, every action once on the right replica,
// every replica steps), lowers, validates again and simulates; replicas share a stage's micro-batches
// round robin.
TEST(RoundRobin, RandomReplicationsValidateLowerAndSimulate) {
  uint64_t state = 7;
  auto next = [&](int n) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((state >> 33) % static_cast<uint64_t>(n));
  };
  for (int trial = 0; trial < 300; ++trial) {
    const std::string base = trial % 2 ? "1f1b" : "gpipe";
    const int stages = 1 + next(4), m = 1 + next(9), steps = 1 + next(2);
    std::vector<int> rep;
    for (int s = 0; s < stages; ++s) rep.push_back(1 + next(3));
    const Schedule s = round_robin(base, rep, m, steps);
    SCOPED_TRACE(base + " m=" + std::to_string(m) + " ranks=" + std::to_string(s.ranks));
    ASSERT_NO_THROW(validate(s));
    for (int st = 0; st < stages; ++st)
      for (int q = 0; q < rep[static_cast<std::size_t>(st)]; ++q) {
        const int r = s.stage_replicas[static_cast<std::size_t>(st)][static_cast<std::size_t>(q)];
        int forwards = 0, steps_seen = 0;
        for (const Action& a : s.actions[static_cast<std::size_t>(r)]) {
          EXPECT_EQ(a.stage, st);
          if (a.kind == ActionKind::F) {
            EXPECT_EQ(a.index % rep[static_cast<std::size_t>(st)], q);
            EXPECT_EQ(s.rank_of(st, a.index), r);
            ++forwards;
          }
          steps_seen += a.kind == ActionKind::Step;
        }
        int expected = 0;
        for (int i = 0; i < m * steps; ++i) expected += i % rep[static_cast<std::size_t>(st)] == q;
        EXPECT_EQ(forwards, expected);
        EXPECT_EQ(steps_seen, steps);
      }
    const Schedule lowered = insert_communication(s, CostModel{});
    ASSERT_NO_THROW(validate(lowered));
    ASSERT_NO_THROW(simulate(lowered, CostModel::uniform(stages, StageCost{})));
    const Schedule back = from_csv(to_csv(lowered));
    EXPECT_EQ(back.stage_replicas, lowered.stage_replicas);
    EXPECT_EQ(back.actions, lowered.actions);
  }
}

// d copies of a replicated pipeline are the pipeline with every replication times d (what the plan search's
// "PipeDream's plan x d copies" candidates and train --plan run): in round_robin(rep x d, d m), replica
// c + d q of stage s runs exactly what replica q of round_robin(rep, m) runs, with micro-batch j renamed
// c + d j (copy c gets every d-th micro-batch, at every stage), in the same order and with the same
// in-flight count; so the copies never exchange activations, and with all-ones `rep` each copy is the
// plain schedule over m micro-batches (train --plan runs equal replication as --replicas).
TEST(RoundRobin, ReplicationTimesDIsDCopiesOfThePipeline) {
  uint64_t state = 11;
  auto next = [&](int n) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((state >> 33) % static_cast<uint64_t>(n));
  };
  for (int trial = 0; trial < 200; ++trial) {
    const std::string base = trial % 2 ? "1f1b" : "gpipe";
    const int stages = 1 + next(4), m = 1 + next(6), steps = 1 + next(2), d = 2 + next(3);
    std::vector<int> rep, scaled;
    for (int s = 0; s < stages; ++s) {
      rep.push_back(trial % 5 == 0 ? 1 : 1 + next(3));
      scaled.push_back(rep.back() * d);
    }
    const Schedule one = round_robin(base, rep, m, steps), all = round_robin(base, scaled, d * m, steps);
    SCOPED_TRACE(base + " m=" + std::to_string(m) + " d=" + std::to_string(d) + " stages=" + std::to_string(stages));
    for (int st = 0; st < stages; ++st)
      for (int q = 0; q < rep[static_cast<std::size_t>(st)]; ++q)
        for (int c = 0; c < d; ++c) {
          std::vector<Action> renamed = one.actions[static_cast<std::size_t>(
              one.stage_replicas[static_cast<std::size_t>(st)][static_cast<std::size_t>(q)])];
          for (Action& a : renamed)
            if (a.kind != ActionKind::Step) a.index = c + d * a.index;
          const int r = all.stage_replicas[static_cast<std::size_t>(st)][static_cast<std::size_t>(c + d * q)];
          EXPECT_EQ(all.actions[static_cast<std::size_t>(r)], renamed) << "stage " << st << " replica " << q << " copy " << c;
        }
    // Simulated (copies independent until their steps): the same makespan.
    CostModel costs = CostModel::uniform(stages, StageCost{1.0, 1.0, 0.5, 1.0}, 1, 0.25);
    for (std::size_t k = 0; k < costs.stage.size(); ++k) costs.stage[k].f += 0.3 * static_cast<double>(k);
    EXPECT_DOUBLE_EQ(simulate_metrics(all, costs).makespan, simulate_metrics(one, costs).makespan);
  }
}

// Replication is for uneven stages: stage 0 three times as slow as stage 1 and given three replicas
// runs at stage 1's pace. Over m micro-batches the makespan is m x max_s (c_s / r_s) plus a fill and
// drain of at most the summed stage costs twice. PipeDream's in-flight count matters here: with one
// micro-batch in flight per replica of stage 0, the replicas wait for every gradient and the steady
// state is a third slower (4 instead of 3 time units per micro-batch, which this bound rejects for m = 60).
TEST(RoundRobin, ReplicasMatchTheSlowStagesPace) {
  const int m = 60;
  CostModel c;
  c.stage = {StageCost{3, 3, 3, 1}, StageCost{1, 1, 1, 1}};  // BW = b + w: stage 0 9, stage 1 3 per micro-batch
  const Schedule s = round_robin("1f1b", {3, 1}, m);
  validate(s);
  const double makespan = simulate(s, c).metrics.makespan;
  EXPECT_LE(makespan, m * 3.0 + 2 * (9 + 3));
  // The unreplicated pipeline is bound by stage 0: 9 per micro-batch.
  const double plain = simulate(round_robin("1f1b", {1, 1}, m), c).metrics.makespan;
  EXPECT_GE(plain, m * 9.0);
  // In-flight per replica: ceil(W_s / r_s) = ceil(4 / 3) = 2 on stage 0, 1 on stage 1.
  EXPECT_EQ(s.actions[0][0], (Action{ActionKind::F, 0, 0}));
  EXPECT_EQ(s.actions[0][1], (Action{ActionKind::F, 0, 3}));
  EXPECT_EQ(s.actions[0][2], (Action{ActionKind::BW, 0, 0}));
}

TEST(RoundRobin, MalformedCsvReplicasAreRefused) {
  for (const std::string header : {"stage_replicas=0/1::2", "stage_replicas=:0/1", "stage_replicas=0/x:2"})
    try {
      from_csv("# pipetrain schedule " + header + "\n0F0,0BW0\n1F1,1BW1\n2F0,2BW0,2F1,2BW1\n");
      ADD_FAILURE() << header << " was accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("stage_replicas="), std::string::npos) << e.what();
    }
}

TEST(RoundRobin, RefusesBadInput) {
  EXPECT_THROW(round_robin("zb-h1", {2, 1}, 4), UsageError);
  EXPECT_THROW(round_robin("1f1b", {}, 4), UsageError);
  EXPECT_THROW(round_robin("1f1b", {2, 0}, 4), UsageError);
  EXPECT_THROW(round_robin("1f1b", {2, 1}, 0), UsageError);
  try {
    round_robin("1f1b", {2, 0}, 4);
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("stage 1 has replication 0"), std::string::npos) << e.what();
  }
}

// The validator knows replicas: a micro-batch on the wrong replica and a replica without its optimizer
// step are refused with what to change.
TEST(RoundRobin, ValidatorChecksReplicas) {
  Schedule s = round_robin("1f1b", {2, 1}, 4);
  Schedule wrong = s;
  std::swap(wrong.actions[0], wrong.actions[1]);
  try {
    validate(wrong);
    ADD_FAILURE() << "a swapped replica validated";
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find("move it to rank"), std::string::npos) << e.what();
  }
  Schedule no_step = s;
  no_step.actions[1].pop_back();
  try {
    validate(no_step);
    ADD_FAILURE() << "a replica without its step validated";
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find("missing optimizer step 0S0 (rank 1)"), std::string::npos) << e.what();
  }
}

// zb-auto at its default limit (p) was one pass per step longer than ZB-H1 whenever m - p was odd (p=3,
// m=6: 21 against 20), though ZB-H1 fits that limit: ZB-H1 is now one of its candidates.
TEST(Generators, ZeroBubbleAutoIsNeverWorseThanZbH1AtALimitItFits) {
  for (int p = 2; p <= 6; ++p)
    for (int m = p; m <= 2 * p + 1; ++m) {
      const Schedule a = zb_auto(p, m, CostModel{}, 0), h = zb_h1(p, m);
      const CostModel unit = CostModel::uniform(p, StageCost{});
      const SimResult sa = simulate(a, unit), sh = simulate(h, unit);
      EXPECT_LE(sa.metrics.makespan, sh.metrics.makespan + 1e-9) << "p=" << p << " m=" << m;
      EXPECT_LE(sa.metrics.max_bubble(), sh.metrics.max_bubble() + 1e-9) << "p=" << p << " m=" << m;
      ValidateOptions vo;
      vo.memory_limit = p;
      EXPECT_NO_THROW(validate(a, vo)) << "p=" << p << " m=" << m;
      EXPECT_EQ(a.name, "zb-auto");
    }
}

// The limit counts micro-batches per rank in each rank's own activation: in units of the largest stage's,
// a lighter stage held more (a profile's 2,000 and 6,000 bytes: 4 micro-batches under the default limit
// of 2), and an explicit limit gave a schedule the validator refused.
TEST(Generators, ZeroBubbleLimitsCountEachRanksOwnMicroBatches) {
  CostModel costs;
  costs.stage = {{0.81, 1.62, 0.81, 2000}, {0.3, 0.6, 0.3, 6000}};
  for (double limit : {0.0, 2.0, 3.0}) {
    const Schedule s = zb_auto(2, 4, costs, limit);
    ValidateOptions vo;  // as the command validates it: micro-batches per rank
    vo.memory_limit = limit > 0 ? limit : 2;
    EXPECT_NO_THROW(validate(s, vo)) << "limit " << limit;
    for (const RankMetrics& r : simulate(s, costs).metrics.per_rank)  // in each rank's own activations
      EXPECT_LE(r.peak_memory, vo.memory_limit * costs.stage[static_cast<std::size_t>(r.rank)].activation + 1e-9)
          << "limit " << limit << " rank " << r.rank;
  }
  CostModel split = costs;
  split.b_release_fraction = 0;
  for (const RankMetrics& r : simulate(zb_h2(2, 8, costs), split).metrics.per_rank)
    EXPECT_LE(r.peak_inflight, 3) << "rank " << r.rank;  // ZB-H2 holds at most 2p - 1
}

// interleaved with one chunk per rank is 1F1B (Megatron runs its plain schedule then): its warm-up of
// 2(p-1-r) forwards held up to 2p-1 micro-batches for 1F1B's timing.
TEST(Generators, InterleavedWithOneChunkPerRankIsOneFOneB) {
  for (int p : {1, 2, 4})
    for (int m : {p, 2 * p, 3 * p}) {
      const Schedule a = interleaved(p, m, 1), b = one_f_one_b(p, m);
      EXPECT_EQ(a.actions, b.actions) << "p=" << p << " m=" << m;
    }
}

// Skip connections in the schedule the runtime runs and in its timelines (issue 13 item 2, docs/ALGORITHMS.md
// §1.10): a skip that crosses two stage boundaries is a skip edge of every rank's schedule, its transfers
// are actions of the lowered lists, and the measured timeline holds each of them once per micro-batch,
// on the rank of its stage, naming the peer stage, on the fast and the reference paths. The trainer's
// report gathers them across ranks, and its prediction from the measured costs holds the skip on the
// popping rank. (Losses and gradients against plain LibTorch: test_bundles.cpp; over gloo and from the
// command line: tests/cli/test_skip_cli.cpp.)
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>

#include "pipetrain/core/lower.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/split_linear.h"
#include "skip_layers.h"
#include "pipetrain/runtime/trainer.h"

using namespace pipetrain;

namespace {

constexpr int64_t kIn = 6, kHidden = 8, kClasses = 4, kBatch = 12;
constexpr int kMicro = 4;

// Six layers; at three stages of two the skip goes from stage 0 to stage 2, past stage 1.
torch::nn::Sequential skip_model() {
  torch::manual_seed(11);
  torch::nn::Sequential m;
  m->push_back(std::make_shared<pipetrain::testing::StashLayer>(kIn, kHidden));
  m->push_back(torch::nn::Tanh());
  m->push_back(nn::Linear(kHidden, kHidden));
  m->push_back(torch::nn::Tanh());
  m->push_back(nn::Linear(kHidden, kHidden));
  m->push_back(std::make_shared<pipetrain::testing::PopLayer>(kHidden, kClasses));
  return m;
}

torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out, target);
}

std::pair<torch::Tensor, torch::Tensor> samples(int64_t seed, int64_t n) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
  torch::Tensor x = torch::randn({n, kIn}, g);
  return {x, (x.select(1, 0) > 0).to(torch::kLong) + (x.select(1, 1) > 0).to(torch::kLong)};
}

PipelineOptions options(const std::string& schedule, bool reference) {
  PipelineOptions o;
  o.schedule = schedule;
  o.microbatches = kMicro;
  o.reference = reference;
  o.optimizer.lr = 0.05;
  return o;
}

Action skip_action(ActionKind kind, int stage, int micro, int peer) {
  Action a{kind, stage, micro};
  a.peer = peer;
  return a;
}

// The four transfers of route from -> to for micro-batch i.
std::vector<Action> route_transfers(int i, int from = 0, int to = 2) {
  return {skip_action(ActionKind::SendAct, from, i, to), skip_action(ActionKind::RecvAct, to, i, from),
          skip_action(ActionKind::SendGrad, to, i, from), skip_action(ActionKind::RecvGrad, from, i, to)};
}

// Every transfer of route from -> to once per micro-batch on the rank of its stage, nothing else naming
// a peer, and the data's order kept: a receive ends before the F or backward that uses it starts.
void expect_skip_events(const Timeline& t, const Schedule& s, int micros, const std::string& what, int from = 0,
                        int to = 2) {
  std::map<std::tuple<int, int, int, int, int>, int> seen;  // (rank, kind, stage, micro, peer) -> count
  std::map<std::tuple<int, int, int>, const TimedAction*> compute;  // (kind, stage, micro)
  for (const TimedAction& e : t.events) {
    if (e.action.peer >= 0)
      ++seen[{e.rank, static_cast<int>(e.action.kind), e.action.stage, e.action.index, e.action.peer}];
    if (is_compute(e.action.kind)) compute[{static_cast<int>(e.action.kind), e.action.stage, e.action.index}] = &e;
  }
  std::size_t expected = 0;
  for (int i = 0; i < micros; ++i)
    for (const Action& a : route_transfers(i, from, to)) {
      ++expected;
      EXPECT_EQ((seen[{s.rank_of(a.stage), static_cast<int>(a.kind), a.stage, i, a.peer}]), 1)
          << what << ": " << to_string(a) << " on rank " << s.rank_of(a.stage);
    }
  EXPECT_EQ(seen.size(), expected) << what << ": skip transfers of another route";
  for (const TimedAction& e : t.events) {
    if (e.action.peer < 0 || (e.action.kind != ActionKind::RecvAct && e.action.kind != ActionKind::RecvGrad)) continue;
    const bool act = e.action.kind == ActionKind::RecvAct;
    const TimedAction* user = nullptr;
    for (ActionKind k : act ? std::vector<ActionKind>{ActionKind::F} : std::vector<ActionKind>{ActionKind::B, ActionKind::BW}) {
      auto it = compute.find({static_cast<int>(k), e.action.stage, e.action.index});
      if (it != compute.end()) user = it->second;
    }
    ASSERT_NE(user, nullptr) << what << ": no user of " << to_string(e.action);
    EXPECT_LE(e.end, user->start) << what << ": " << to_string(e.action) << " ends after " << to_string(user->action) << " starts";
  }
}

}  // namespace

TEST(SkipRuntime, TheScheduleCarriesTheSkipAndTheTimelineEachTransfer) {
  for (const std::string schedule : {"gpipe", "1f1b", "zb-h1"})
    for (bool reference : {false, true}) {
      const std::string what = schedule + (reference ? " reference" : " fast");
      LocalPipeline pipe(skip_model(), ce, 3, options(schedule, reference));
      const Schedule& s = pipe.schedule();
      ASSERT_EQ(s.skips.size(), 1u) << what;
      EXPECT_EQ(s.skips[0], (SkipEdge{0, 2, 1.0})) << what;
      // The lowered lists hold the transfers on the ranks of their stages; rank 1 never sees the skip.
      for (int i = 0; i < kMicro; ++i)
        for (const Action& a : route_transfers(i)) {
          const auto& row = s.actions[static_cast<std::size_t>(s.rank_of(a.stage))];
          EXPECT_EQ(std::count(row.begin(), row.end(), a), 1) << what << ": " << to_string(a);
        }
      for (const Action& a : s.actions[1]) EXPECT_LT(a.peer, 0) << what << ": " << to_string(a);
      // Two steps: the first agrees the layouts at each receive's place, the second (fast path) posts
      // the skip receives and waits for them at the actions that use them.
      double first = 0, last = 0;
      for (int step = 0; step < 3; ++step) {
        const auto [x, y] = samples(step, kBatch);
        const StepStats st = pipe.train_steps(Bundle(x), y, kBatch, 1);
        expect_skip_events(st.timeline, s, kMicro, what + " step " + std::to_string(step));
        (step == 0 ? first : last) = st.loss;
      }
      EXPECT_TRUE(std::isfinite(last)) << what;
      EXPECT_NE(first, last) << what << ": the weights did not change";
    }
}

TEST(SkipRuntime, LoopedSchedulesRouteBetweenRanksOrHandOverOnOne) {
  // One layer per stage: the skip goes from stage 0 to stage 5. Interleaved puts them on ranks 0 and 2,
  // so the transfers are there; the V shape puts both on rank 0, where the skip is handed over in memory
  // and no transfer appears, in the lists or in the timeline.
  for (const std::string schedule : {"interleaved", "zb-v"}) {
    PipelineOptions o = options(schedule, false);
    o.microbatches = 6;
    o.virtual_stages = 2;
    if (schedule == "zb-v") o.virtual_stages = 1;  // the V shapes hold two stages per rank anyway
    LocalPipeline pipe(skip_model(), ce, 3, o);
    const Schedule& s = pipe.schedule();
    ASSERT_EQ(s.skips, (std::vector<SkipEdge>{SkipEdge{0, 5, 1.0}})) << schedule;
    const bool one_rank = s.rank_of(0) == s.rank_of(5);
    EXPECT_EQ(one_rank, schedule == "zb-v");
    for (int step = 0; step < 2; ++step) {
      const auto [x, y] = samples(step, kBatch);
      const StepStats st = pipe.train_steps(Bundle(x), y, kBatch, 1);
      if (one_rank) {
        for (const auto& row : s.actions)
          for (const Action& a : row) EXPECT_LT(a.peer, 0) << schedule << ": " << to_string(a);
        for (const TimedAction& e : st.timeline.events) EXPECT_LT(e.action.peer, 0) << schedule << ": " << to_string(e.action);
      } else {
        expect_skip_events(st.timeline, s, 6, schedule + " step " + std::to_string(step), 0, 5);
      }
    }
  }
}

TEST(SkipRuntime, EvaluationAndSeveralStepsPerCallRouteTheSkipByTheirSchedules) {
  LocalPipeline pipe(skip_model(), ce, 3, options("1f1b", false));
  // Evaluation's forward-only schedule sends the skip too: the outputs of the model run in one piece.
  const torch::Tensor ex = samples(9, kBatch).first;
  std::vector<torch::Tensor> outs(3);
  run_on_threads(3, [&](int r) { outs[static_cast<std::size_t>(r)] = pipe.rank(r).forward_only(Bundle(ex), kBatch); });
  ASSERT_TRUE(outs[2].defined());
  {
    torch::NoGradGuard no_grad;
    Bundle b(ex);
    auto whole = skip_model();
    for (auto& any : *whole) {
      if (auto bm = std::dynamic_pointer_cast<BundleModule>(any.ptr()))
        b = bm->forward(std::move(b));
      else
        b.set(kMainTensor, any.forward<torch::Tensor>(b.at(kMainTensor)));
    }
    EXPECT_TRUE(torch::allclose(outs[2], b.at(kMainTensor), 1e-5, 1e-6));
  }
  // A call of two steps runs the two-step schedule, with the edge, and moves micro-batches 0..7.
  const auto [x, y] = samples(5, 2 * kBatch);
  const StepStats st = pipe.train_steps(Bundle(x), y, 2 * kBatch, 2);
  const Schedule& two = pipe.rank(0).schedule_for(2);
  EXPECT_EQ(two.skips, pipe.schedule().skips);
  expect_skip_events(st.timeline, two, 2 * kMicro, "two steps per call");
}

TEST(SkipRuntime, TheTrainersReportGathersTheTransfersAndPredictsTheSkipsMemory) {
  // GPipe: every forward of stage 2 runs before its first backward, so whatever the measured times, the
  // last rank holds all m skips (one stage activation each) at its peak: m more than without the edge;
  // the other ranks hold none.
  const int p = 3;
  auto transports = make_local_transports(p);
  auto model = skip_model();
  TrainData d;
  d.train_size = 64;
  d.batch = [](int step, int64_t n) {
    auto [x, y] = samples(100 + step, n);
    return std::make_pair(Bundle(x), y);
  };
  TrainerOptions to;
  to.steps = 2;
  to.batch_size = kBatch;
  to.eval_every = 0;
  std::vector<RunReport> reports(p);
  std::vector<Schedule> schedules(p);
  run_on_threads(
      p,
      [&](int r) {
        PipelineRank rank(model, ce, transports[static_cast<std::size_t>(r)], options("gpipe", false));
        auto t = transports[static_cast<std::size_t>(r)];
        Trainer trainer(rank, t, t, &d, to);
        const TrainResult res = trainer.run();
        reports[static_cast<std::size_t>(r)] = trainer.report(res);
        schedules[static_cast<std::size_t>(r)] = rank.schedule();
      },
      [&](int r) { transports[static_cast<std::size_t>(r)]->abort("rank " + std::to_string(r) + " failed"); });
  for (int r = 0; r < p; ++r) {
    const Schedule& s = schedules[static_cast<std::size_t>(r)];
    ASSERT_EQ(s.skips, (std::vector<SkipEdge>{SkipEdge{0, 2, 1.0}})) << "rank " << r;
    const RunReport& rep = reports[static_cast<std::size_t>(r)];
    expect_skip_events(rep.timeline, s, kMicro, "gathered on rank " + std::to_string(r));
    // The prediction is the simulation of the rank's schedule from the measured costs: with the edge.
    Schedule without = strip_communication(s);
    without.skips.clear();
    const SimResult base = simulate(without, measured_costs(rep.timeline, s.stages));
    ASSERT_EQ(rep.predicted.metrics.per_rank.size(), 3u);
    for (int q = 0; q < p; ++q)
      EXPECT_DOUBLE_EQ(rep.predicted.metrics.per_rank[static_cast<std::size_t>(q)].peak_memory,
                       base.metrics.per_rank[static_cast<std::size_t>(q)].peak_memory + (q == 2 ? kMicro : 0))
          << "rank " << r << " predicts rank " << q;
  }
}

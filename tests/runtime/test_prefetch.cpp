// The fast path's receives (executor.cpp: receive, prefetch_from): a receive is never waited for at its
// place in the lowered list, only by the compute action that consumes it, whatever the prefetch window.
// looped-bfs is the case that needs it: a rank's list places all m receives of a stage's inputs before
// its first F, more than the window holds, and a receive that blocked at its place held up the rank's
// other work (issue 14: efficiency 0.77 on the GPT benchmark). Also: the fast path with a small or no
// window gives the reference path's numbers bitwise.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "pipetrain/core/generators.h"
#include "pipetrain/runtime/executor.h"

using namespace pipetrain;

namespace {

constexpr int64_t kIn = 4, kHidden = 6, kOut = 2, kBatch = 16;

torch::nn::Sequential make_model(uint64_t seed) {  // 8 layers: 2 per stage on 4 stages
  torch::manual_seed(seed);
  torch::nn::Sequential m;
  m->push_back(torch::nn::Linear(kIn, kHidden));
  for (int k = 0; k < 3; ++k) {
    m->push_back(torch::nn::Tanh());
    m->push_back(torch::nn::Linear(kHidden, kHidden));
  }
  m->push_back(torch::nn::Linear(kHidden, kOut));
  return m;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); }

PipelineOptions options_for(const std::string& schedule, int m, int prefetch) {
  PipelineOptions o;
  o.schedule = schedule;
  o.microbatches = m;
  o.virtual_stages = schedule_traits(schedule).virtual_stages ? 2 : 1;
  o.prefetch = prefetch;
  return o;
}

bool consumes(const Action& compute, const Action& recv) {
  if (compute.stage != recv.stage || compute.index != recv.index) return false;
  if (recv.kind == ActionKind::RecvAct) return compute.kind == ActionKind::F;
  return compute.kind == ActionKind::B || compute.kind == ActionKind::BW;
}

}  // namespace

TEST(FastPathReceives, AreWaitedForOnlyByTheirConsumer) {
  torch::manual_seed(7);
  const torch::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  int checked = 0;
  for (const std::string schedule : {"looped-bfs", "interleaved-zb", "1f1b"})
    for (int prefetch : {0, 1, 2, 4}) {
      const std::string what = schedule + " prefetch=" + std::to_string(prefetch);
      LocalPipeline pipe(make_model(3), mse, 2, options_for(schedule, 8, prefetch));
      pipe.train_step(x, y);  // agrees the layouts: the first receive of each boundary blocks for its header
      const StepStats s = pipe.train_step(x, y);
      // Each rank's events are in the order it recorded them: a receive waited for by its consumer is
      // recorded just before that action; one waited for at its place is followed by the next action in
      // the list instead.
      const auto& ev = s.timeline.events;
      int receives = 0;
      for (std::size_t k = 0; k < ev.size(); ++k) {
        const Action& a = ev[k].action;
        if (a.kind != ActionKind::RecvAct && a.kind != ActionKind::RecvGrad) continue;
        ++receives;
        ASSERT_LT(k + 1, ev.size()) << what;
        EXPECT_EQ(ev[k + 1].rank, ev[k].rank) << what << ": " << to_string(a) << " is its rank's last event";
        EXPECT_TRUE(consumes(ev[k + 1].action, a))
            << what << ": " << to_string(a) << " was waited for before " << to_string(ev[k + 1].action);
      }
      // Every receive of the lowered lists is in the timeline once.
      int listed = 0;
      for (const auto& list : pipe.schedule().actions)
        for (const Action& a : list) listed += a.kind == ActionKind::RecvAct || a.kind == ActionKind::RecvGrad;
      EXPECT_EQ(receives, listed) << what;
      ++checked;
    }
  EXPECT_EQ(checked, 12);
}

TEST(FastPathReceives, SmallWindowsGiveTheReferenceNumbersBitwise) {
  torch::manual_seed(8);
  const torch::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  for (const std::string schedule : {"looped-bfs", "interleaved-zb"}) {
    PipelineOptions o = options_for(schedule, 8, 4);
    o.reference = true;
    LocalPipeline ref(make_model(5), mse, 2, o);
    const double ref_loss = ref.train_steps(x, y, 2).loss;
    for (int prefetch : {0, 1}) {
      o.reference = false;
      o.prefetch = prefetch;
      LocalPipeline fast(make_model(5), mse, 2, o);
      EXPECT_EQ(fast.train_steps(x, y, 2).loss, ref_loss) << schedule << " prefetch=" << prefetch;
      for (int r = 0; r < 2; ++r) {
        const auto a = ref.rank(r).parameters(), b = fast.rank(r).parameters();
        ASSERT_EQ(a.size(), b.size());
        for (std::size_t k = 0; k < a.size(); ++k)
          EXPECT_TRUE(torch::equal(a[k], b[k])) << schedule << " prefetch=" << prefetch << " rank " << r << " param " << k;
      }
    }
  }
}

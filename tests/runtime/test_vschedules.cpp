// The schedules on V-shaped and looped placements in the executor (in-process transport): transparency —
// one pipelined step of zb-v, v-half, v-min, dualpipev, interleaved-zb and looped-bfs gives the loss and every
// parameter gradient of plain LibTorch gradient accumulation within fp32 relative 1e-5 — for several p
// and m; a V-shaped rank holds its two stages r and 2p-1-r and hands the activation at the turn of the V
// to itself (no receive); the fast and reference paths agree bitwise. Over Gloo processes:
// tests/cli/test_vschedules_cli.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "pipetrain/core/generators.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/split_linear.h"

using namespace pipetrain;

namespace {

constexpr int64_t kIn = 5, kHidden = 8, kOut = 3, kBatch = 8;

// Eight layers (enough for 2 stages on each of 4 ranks): split linears, a plain torch linear and
// parameter-free layers.
torch::nn::Sequential make_model(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m;
  m->push_back(nn::Linear(kIn, kHidden));
  m->push_back(torch::nn::Tanh());
  m->push_back(nn::Linear(kHidden, kHidden));
  m->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
  m->push_back(torch::nn::Linear(kHidden, kHidden));
  m->push_back(torch::nn::GELU());
  m->push_back(nn::Linear(kHidden, kHidden));
  m->push_back(nn::Linear(kHidden, kOut));
  return m;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); }

struct Data {
  torch::Tensor x, y;
};
Data make_data() {
  torch::manual_seed(321);
  return {torch::randn({kBatch, kIn}), torch::randn({kBatch, kOut})};
}

double reference_grads(torch::nn::Sequential model, const Data& d, int m) {
  model->train();
  model->zero_grad();
  double loss = 0;
  for (const auto& [b, e] : split_equal(kBatch, m)) {
    torch::Tensor l = mse(model->forward(d.x.slice(0, b, e)), d.y.slice(0, b, e)) * (double(e - b) / kBatch);
    l.backward();
    loss += l.item<double>();
  }
  return loss;
}

struct PipeRun {
  double loss = 0;
  std::vector<torch::Tensor> grads;
  StepStats stats;
};

PipeRun pipeline_grads(torch::nn::Sequential model, const Data& d, int p, PipelineOptions o) {
  const auto params = model->parameters();
  PipeRun out;
  out.grads.resize(params.size());
  o.on_gradients = [&](int, const std::vector<torch::Tensor>& mine) {
    for (const auto& q : mine)
      for (std::size_t k = 0; k < params.size(); ++k)
        if (params[k].unsafeGetTensorImpl() == q.unsafeGetTensorImpl() && q.grad().defined())
          out.grads[k] = q.grad().clone();
  };
  LocalPipeline pipe(model, mse, p, o);
  out.stats = pipe.train_step(d.x, d.y);
  out.loss = out.stats.loss;
  return out;
}

PipelineOptions options_for(const std::string& schedule, int m) {
  PipelineOptions o;
  o.schedule = schedule;
  o.microbatches = m;
  o.virtual_stages = schedule_traits(schedule).virtual_stages ? 2 : 1;
  return o;
}

const std::vector<std::string> kNew{"zb-v", "v-half", "v-min", "dualpipev", "interleaved-zb", "looped-bfs"};

}  // namespace

TEST(VSchedulesRuntime, TransparencyForEveryNewSchedule) {
  const Data d = make_data();
  int runs = 0;
  for (const std::string& schedule : kNew)
    for (int p : {1, 2, 3, 4})
      for (int m : {1, 3, 4, 8}) {
        if (schedule == "interleaved-zb" && m % p != 0) continue;
        if (schedule == "dualpipev" && m < 2 * p) continue;
        auto ref_model = make_model(11);
        const double ref_loss = reference_grads(ref_model, d, m);
        const PipeRun got = pipeline_grads(make_model(11), d, p, options_for(schedule, m));
        const std::string what = schedule + " p=" + std::to_string(p) + " m=" + std::to_string(m);
        EXPECT_NEAR(got.loss, ref_loss, 1e-5 * std::abs(ref_loss)) << what;
        const auto want = ref_model->parameters();
        ASSERT_EQ(got.grads.size(), want.size());
        for (std::size_t k = 0; k < want.size(); ++k) {
          ASSERT_TRUE(got.grads[k].defined()) << what << ": parameter " << k << " has no gradient";
          const double scale = want[k].grad().abs().max().item<double>() + 1e-12;
          EXPECT_LE((got.grads[k] - want[k].grad()).abs().max().item<double>(), 1e-5 * scale) << what << " param " << k;
        }
        ++runs;
      }
  EXPECT_GE(runs, 75);
}

// Rank r of a V holds stages r and 2p-1-r; the rank at the turn (p-1) runs stage p on the activation
// of its own stage p-1, so its timeline has no receive for stage p, while every other boundary has one.
TEST(VSchedulesRuntime, VRankHoldsTwoStagesAndPassesTheTurnLocally) {
  const int p = 3, m = 4;
  const Data d = make_data();
  PipelineOptions o = options_for("zb-v", m);
  LocalPipeline pipe(make_model(5), mse, p, o);
  for (int r = 0; r < p; ++r) EXPECT_EQ(pipe.rank(r).local_stages(), (std::vector<int>{r, 2 * p - 1 - r}));
  EXPECT_EQ(pipe.schedule().stage_rank, v_placement(p));
  const StepStats s = pipe.train_step(d.x, d.y);
  int turn_receives = 0, other_receives = 0;
  for (const TimedAction& e : s.timeline.events) {
    if (e.action.kind != ActionKind::RecvAct) continue;
    (e.action.stage == p ? turn_receives : other_receives) += 1;
  }
  EXPECT_EQ(turn_receives, 0);
  EXPECT_EQ(other_receives, (2 * p - 2) * m);
}

TEST(VSchedulesRuntime, FastAndReferencePathsAgreeBitwise) {
  const Data d = make_data();
  for (const std::string& schedule : kNew) {
    PipelineOptions o = options_for(schedule, 4);
    o.reference = true;
    const PipeRun ref = pipeline_grads(make_model(3), d, 2, o);
    o.reference = false;
    o.prefetch = 3;
    const PipeRun fast = pipeline_grads(make_model(3), d, 2, o);
    EXPECT_EQ(ref.loss, fast.loss) << schedule;
    for (std::size_t k = 0; k < ref.grads.size(); ++k) {
      EXPECT_TRUE(torch::equal(ref.grads[k], fast.grads[k])) << schedule << " param " << k;
    }
  }
}

TEST(VSchedulesRuntime, TooFewLayersForTwoStagesPerRankIsAUsageError) {
  PipelineOptions o = options_for("v-min", 2);
  try {
    LocalPipeline pipe(make_model(1), mse, 5, o);  // 10 stages, 8 layers
    FAIL() << "expected a UsageError";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("5 ranks x 2"), std::string::npos) << e.what();
  }
}

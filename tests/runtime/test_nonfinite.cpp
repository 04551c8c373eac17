// Checks what a diverged step does (OptimizerOptions::nonfinite, issue 23): a NaN or infinite loss or
// gradient norm stops every rank before that step's optimizer update ("stop", the default) with a
// NonFiniteError naming the step, or drops that step's update ("skip"), on synchronous and asynchronous
// schedules; and that optimizer numbers that are not finite are refused up front.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/transport.h"
#include "pipetrain/runtime/split_linear.h"

using namespace pipetrain;

namespace {

constexpr int64_t kIn = 4, kOut = 3, kBatch = 8;

torch::nn::Sequential make_model() {
  torch::manual_seed(7);
  torch::nn::Sequential m;
  m->push_back(nn::Linear(kIn, 6));
  m->push_back(torch::nn::Tanh());
  m->push_back(nn::Linear(6, 6));
  m->push_back(nn::Linear(6, kOut));
  return m;
}

torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out, target);
}

struct Pipeline {
  std::vector<std::shared_ptr<Transport>> transports;
  std::vector<std::unique_ptr<PipelineRank>> ranks;
  Pipeline(const PipelineOptions& o, int p = 2) {
    transports = make_local_transports(p, std::chrono::seconds(20));
    auto model = make_model();
    for (int r = 0; r < p; ++r) ranks.push_back(std::make_unique<PipelineRank>(model, ce, transports[r], o));
  }
  // One call on every rank; the error each rank threw ("" when none), and the ranks' stats.
  std::vector<std::string> step(const torch::Tensor& x, const torch::Tensor& y, std::vector<StepStats>* stats,
                                int steps = 1) {
    const int p = static_cast<int>(ranks.size());
    std::vector<std::string> errors(static_cast<std::size_t>(p));
    if (stats) stats->assign(static_cast<std::size_t>(p), StepStats{});
    std::vector<std::thread> threads;
    for (int r = 0; r < p; ++r)
      threads.emplace_back([&, r] {
        try {
          StepStats s = ranks[r]->train_steps(x, y, kBatch * steps, steps);
          if (stats) (*stats)[static_cast<std::size_t>(r)] = s;
        } catch (const NonFiniteError& e) {
          errors[static_cast<std::size_t>(r)] = std::string("NonFiniteError: ") + e.what();
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    return errors;
  }
  std::vector<torch::Tensor> weights() const {
    std::vector<torch::Tensor> out;
    for (const auto& r : ranks)
      for (const auto& p : r->parameters()) out.push_back(p.detach().clone());
    return out;
  }
};

PipelineOptions options(const std::string& schedule, const std::string& nonfinite) {
  PipelineOptions o;
  o.schedule = schedule;
  o.microbatches = schedule == "pipedream" ? 1 : 2;
  o.optimizer.name = "sgd";
  o.optimizer.lr = 0.1;
  o.optimizer.nonfinite = nonfinite;
  return o;
}

torch::Tensor inputs(bool poisoned, int steps = 1) {
  torch::manual_seed(3);
  torch::Tensor x = torch::randn({kBatch * steps, kIn});
  if (poisoned) x[1][2] = std::numeric_limits<float>::quiet_NaN();
  return x;
}
torch::Tensor targets(int steps = 1) { return torch::randint(kOut, {kBatch * steps}, torch::kLong); }

bool equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

}  // namespace

// `--lr inf` and a NaN batch used to end "training loss 4.27 -> nan", exit 0. Now every rank stops at
// the step with the same NonFiniteError, and no weight was updated by it.
TEST(NonFinite, StopsEveryRankBeforeTheUpdate) {
  for (const std::string schedule : {"gpipe", "1f1b", "zb-h1"}) {
    Pipeline p(options(schedule, "stop"));
    const torch::Tensor y = targets();
    EXPECT_EQ(p.step(inputs(false), y, nullptr), std::vector<std::string>(2, "")) << schedule;
    const auto before = p.weights();
    // Each rank finds it at its Step; a rank may instead be stopped by another's report of it first.
    const std::vector<std::string> errors = p.step(inputs(true), y, nullptr);
    int own = 0;
    for (const std::string& e : errors) {
      own += e.rfind("NonFiniteError: ", 0) == 0;
      EXPECT_NE(e.find("training diverged at step 2: the loss is NaN and the gradient norm NaN"), std::string::npos)
          << schedule << ": " << e;
    }
    EXPECT_GE(own, 1) << schedule;
    EXPECT_TRUE(equal(before, p.weights())) << schedule << ": a stopped step must not update the weights";
  }
}

// "skip" drops the diverged step's update on every stage and trains on afterwards.
TEST(NonFinite, SkipDropsTheStepAndGoesOn) {
  Pipeline p(options("1f1b", "skip"));
  const torch::Tensor y = targets();
  const auto before = p.weights();
  std::vector<StepStats> stats;
  EXPECT_EQ(p.step(inputs(true), y, &stats), std::vector<std::string>(2, ""));
  for (const StepStats& s : stats) EXPECT_EQ(s.skipped_steps, 1);
  EXPECT_TRUE(equal(before, p.weights()));
  EXPECT_EQ(p.step(inputs(false), y, &stats), std::vector<std::string>(2, ""));
  for (const StepStats& s : stats) EXPECT_EQ(s.skipped_steps, 0);
  EXPECT_TRUE(std::isfinite(stats[0].loss));
  EXPECT_FALSE(equal(before, p.weights()));
}

// An asynchronous schedule: the stage whose own gradient norm is not finite stops the run (the other
// rank is stopped by its abort, with that message), within the transport's bound.
TEST(NonFinite, AsynchronousScheduleStopsToo) {
  Pipeline p(options("pipedream", "stop"));
  const std::vector<std::string> errors = p.step(inputs(true, 2), targets(2), nullptr, 2);
  bool named = false;
  for (const std::string& e : errors) {
    EXPECT_FALSE(e.empty());
    named = named || e.find("training diverged at step") != std::string::npos;
  }
  EXPECT_TRUE(named) << errors[0] << " | " << errors[1];
}

// NaN passed the old `< 0` checks (clipping silently off) and inf reached LibTorch's own checks.
TEST(NonFinite, OptimizerNumbersMustBeFinite) {
  auto refused = [](const std::function<void(OptimizerOptions&)>& change) {
    PipelineOptions o = options("1f1b", "stop");
    change(o.optimizer);
    try {
      check_pipeline_options(o, 2);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  EXPECT_NE(refused([&](OptimizerOptions& o) { o.clip_grad_norm = nan; }).find("clipping norm must be a finite"), std::string::npos);
  EXPECT_NE(refused([&](OptimizerOptions& o) { o.lr = inf; }).find("learning rate must be a finite"), std::string::npos);
  EXPECT_NE(refused([&](OptimizerOptions& o) { o.momentum = nan; }).find("momentum"), std::string::npos);
  EXPECT_NE(refused([&](OptimizerOptions& o) { o.weight_decay = -inf; }).find("weight decay"), std::string::npos);
  EXPECT_NE(refused([&](OptimizerOptions& o) { o.beta2 = 1.0; }).find("beta2"), std::string::npos);
  EXPECT_NE(refused([&](OptimizerOptions& o) { o.nonfinite = "maybe"; }).find("stop, skip or ignore"), std::string::npos);
  EXPECT_EQ(refused([](OptimizerOptions&) {}), "(accepted)");
}

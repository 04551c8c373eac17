// Checks hybrid data + pipeline parallelism (PipelineOptions::data_parallel): two copies of a two-stage
// pipeline over four in-process ranks, each copy on half of the mini-batch, average their gradients per
// stage; the result equals one pipeline on the whole mini-batch with the same micro-batches (fp32
// summation order aside), and the copies' weights stay bitwise equal after steps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/split_linear.h"

using namespace pipetrain;

namespace {

constexpr int64_t kIn = 5, kHidden = 8, kOut = 3, kBatch = 12;

torch::nn::Sequential make_model() {
  std::lock_guard<std::mutex> lock(default_generator_mutex());
  torch::manual_seed(21);
  torch::nn::Sequential m;
  m->push_back(nn::Linear(kIn, kHidden));
  m->push_back(torch::nn::Tanh());
  m->push_back(nn::Linear(kHidden, kHidden));
  m->push_back(nn::Linear(kHidden, kOut));
  return m;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); }

// Gradients by parameter position in the model, as seen after the averaging.
using Grads = std::vector<torch::Tensor>;

}  // namespace

TEST(Hybrid, CopiesStayBitwiseEqual) {
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  for (const std::string schedule : {"gpipe", "1f1b", "zb-h1"}) {
    SCOPED_TRACE(schedule);
    auto world = make_local_transports(4);
    std::vector<torch::nn::Sequential> models{make_model(), make_model()};
    const std::size_t n = models[0]->parameters().size();
    std::vector<Grads> got(2, Grads(n));
    std::vector<double> loss(4);
    run_on_threads(4, [&](int r) {
      const int copy = r / 2, stage = r % 2;
      const auto params = models[static_cast<std::size_t>(copy)]->parameters();
      PipelineOptions o;
      o.schedule = schedule;
      o.microbatches = 3;
      o.optimizer.lr = 0.1;
      o.data_parallel = make_group_transport(world[r], {stage, 2 + stage});
      o.on_gradients = [&, copy](int, const std::vector<torch::Tensor>& held) {
        for (const auto& p : held)
          for (std::size_t k = 0; k < params.size(); ++k)
            if (params[k].unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) got[copy][k] = p.grad().clone();
      };
      PipelineRank rank(models[static_cast<std::size_t>(copy)], mse,
                        make_group_transport(world[r], {2 * copy, 2 * copy + 1}), o);
      const int64_t b = copy * 6;
      for (int step = 0; step < 2; ++step) loss[r] = rank.train_step(x.slice(0, b, b + 6), y.slice(0, b, b + 6), 6).loss;
    });
    for (std::size_t k = 0; k < n; ++k) {
      ASSERT_TRUE(got[0][k].defined() && got[1][k].defined()) << k;
      EXPECT_TRUE(torch::equal(got[0][k], got[1][k])) << "copies saw different averaged gradients, parameter " << k;
    }
    const auto p0 = models[0]->parameters(), p1 = models[1]->parameters();
    for (std::size_t k = 0; k < n; ++k) EXPECT_TRUE(torch::equal(p0[k], p1[k])) << "weights differ, parameter " << k;
    for (int r = 1; r < 4; ++r) EXPECT_EQ(loss[r], loss[0]) << "the step's loss is known on every rank";
  }
}

TEST(Hybrid, FirstStepGradientsEqualTheUnreplicatedPipeline) {
  torch::manual_seed(6);
  const torch::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  auto reference = make_model();
  const auto ref_params = reference->parameters();
  Grads want(ref_params.size());
  PipelineOptions o;
  o.schedule = "1f1b";
  o.microbatches = 6;
  o.on_gradients = [&](int, const std::vector<torch::Tensor>& mine) {
    for (const auto& p : mine)
      for (std::size_t k = 0; k < ref_params.size(); ++k)
        if (ref_params[k].unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) want[k] = p.grad().clone();
  };
  const double want_loss = LocalPipeline(reference, mse, 2, o).train_step(x, y).loss;

  auto world = make_local_transports(4);
  std::vector<torch::nn::Sequential> models{make_model(), make_model()};
  Grads got(ref_params.size());
  std::vector<double> loss(4);
  run_on_threads(4, [&](int r) {
    const int copy = r / 2, stage = r % 2;
    const auto params = models[static_cast<std::size_t>(copy)]->parameters();
    PipelineOptions mine = o;
    mine.microbatches = 3;
    mine.data_parallel = make_group_transport(world[r], {stage, 2 + stage});
    mine.on_gradients = [&, copy](int, const std::vector<torch::Tensor>& held) {
      if (copy != 0) return;
      for (const auto& p : held)
        for (std::size_t k = 0; k < params.size(); ++k)
          if (params[k].unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) got[k] = p.grad().clone();
    };
    PipelineRank rank(models[static_cast<std::size_t>(copy)], mse, make_group_transport(world[r], {2 * copy, 2 * copy + 1}),
                      mine);
    const int64_t b = copy * 6;
    loss[r] = rank.train_step(x.slice(0, b, b + 6), y.slice(0, b, b + 6), 6).loss;
  });
  for (int r = 0; r < 4; ++r) EXPECT_NEAR(loss[r], want_loss, 1e-6 * std::abs(want_loss)) << r;
  for (std::size_t k = 0; k < ref_params.size(); ++k) {
    ASSERT_TRUE(got[k].defined() && want[k].defined()) << k;
    EXPECT_TRUE(torch::allclose(got[k], want[k], 1e-5, 1e-7)) << "parameter " << k;
  }
  // Asynchronous schedules refuse replicas.
  PipelineOptions bad;
  bad.schedule = "pipedream";
  bad.microbatches = 1;
  auto solo = make_local_transports(2);
  bad.data_parallel = make_group_transport(solo[0], {0, 1});
  EXPECT_THROW(PipelineRank(make_model(), mse, make_local_transports(1)[0], bad), UsageError);
}

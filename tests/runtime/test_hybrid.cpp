// Checks hybrid data + pipeline parallelism (PipelineOptions::data_parallel): two copies of a two-stage
// pipeline over four in-process ranks, each copy on half of the mini-batch, average their gradients per
// stage; the result equals one pipeline on the whole mini-batch with the same micro-batches (fp32
// summation order aside), and the copies' weights stay bitwise equal after steps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/checkpoint.h"
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

// ---- stage replication with round-robin micro-batches (1F1B-RR) -------------------------------------

namespace {

// Runs one step of `model`'s layers 0..3 as a pipeline with `replication` (balance `balance`) over
// in-process ranks; returns per parameter position the summed gradients each rank saw (the last
// rank holding it wins; `equal` is cleared when two replicas of a stage disagree bitwise) and the loss.
struct RrRun {
  Grads grads;
  double loss = 0;
  double grad_norm = 0;  // before clipping, of the last step
  bool replicas_equal = true;
  std::vector<torch::nn::Sequential> models;
};

RrRun run_round_robin(const std::vector<int>& replication, const std::string& balance, const std::string& schedule,
                      int m, const torch::Tensor& x, const torch::Tensor& y, int steps, double clip = 0) {
  int ranks = 0;
  for (int r : replication) ranks += r;
  auto world = make_local_transports(ranks);
  RrRun out;
  for (int r = 0; r < ranks; ++r) out.models.push_back(make_model());
  const std::size_t n = out.models[0]->parameters().size();
  std::vector<Grads> seen(static_cast<std::size_t>(ranks), Grads(n));
  std::vector<double> loss(static_cast<std::size_t>(ranks)), norm(static_cast<std::size_t>(ranks));
  run_on_threads(ranks, [&](int r) {
    const auto params = out.models[static_cast<std::size_t>(r)]->parameters();
    PipelineOptions o;
    o.schedule = schedule;
    o.microbatches = m;
    o.balance = balance;
    o.replication = replication;
    o.optimizer.lr = 0.1;
    o.optimizer.clip_grad_norm = clip;
    o.on_gradients = [&, r](int, const std::vector<torch::Tensor>& held) {
      for (const auto& p : held)
        for (std::size_t k = 0; k < params.size(); ++k)
          if (params[k].unsafeGetTensorImpl() == p.unsafeGetTensorImpl() && !seen[static_cast<std::size_t>(r)][k].defined())
            seen[static_cast<std::size_t>(r)][k] = p.grad().clone();
    };
    PipelineRank rank(out.models[static_cast<std::size_t>(r)], mse, world[static_cast<std::size_t>(r)], o);
    for (int step = 0; step < steps; ++step) {
      const StepStats st = rank.train_step(x, y, x.size(0));
      loss[static_cast<std::size_t>(r)] = st.loss;
      norm[static_cast<std::size_t>(r)] = st.grad_norm;
    }
  });
  out.grads.assign(n, torch::Tensor());
  for (int r = 0; r < ranks; ++r)
    for (std::size_t k = 0; k < n; ++k) {
      const torch::Tensor& g = seen[static_cast<std::size_t>(r)][k];
      if (!g.defined()) continue;
      if (out.grads[k].defined() && !torch::equal(out.grads[k], g)) out.replicas_equal = false;
      out.grads[k] = g;
    }
  for (int r = 1; r < ranks; ++r) EXPECT_EQ(loss[static_cast<std::size_t>(r)], loss[0]) << "rank " << r;
  for (int r = 1; r < ranks; ++r) EXPECT_EQ(norm[static_cast<std::size_t>(r)], norm[0]) << "rank " << r;
  out.loss = loss[0];
  out.grad_norm = norm[0];
  return out;
}

}  // namespace

// A replicated run's gradients equal the unreplicated pipeline's (each replica holds its micro-batches'
// share of the full-batch loss; the replicas sum), replicas agree bitwise, and after several steps the
// replicas of a stage hold bitwise the same weights, close to the unreplicated run's.
TEST(RoundRobinRuntime, GradientsEqualTheUnreplicatedPipeline) {
  torch::manual_seed(8);
  const torch::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  struct Case {
    std::vector<int> rep;
    int m;
  };
  // m = 5 over 2 replicas: unequal shares; m = 1 over 2: a replica with no micro-batch at all.
  const std::vector<Case> cases{{{2, 1}, 6}, {{1, 3}, 6}, {{3, 1}, 6}, {{2, 2}, 6}, {{2, 1}, 5}, {{1, 2}, 1}};
  for (const std::string schedule : {"1f1b", "gpipe"})
    for (const Case& c : cases) {
      const std::vector<int>& rep = c.rep;
      const int m = c.m;
      SCOPED_TRACE(schedule + " replication " + std::to_string(rep[0]) + "," + std::to_string(rep[1]) + " m=" +
                   std::to_string(m));
      const RrRun want = run_round_robin({1, 1}, "2,2", schedule, m, x, y, 1);
      const RrRun got = run_round_robin(rep, "2,2", schedule, m, x, y, 1);
      EXPECT_TRUE(got.replicas_equal) << "replicas of a stage saw different summed gradients";
      EXPECT_NEAR(got.loss, want.loss, 1e-6 * std::abs(want.loss));
      // The global norm counts each stage once, not once per replica.
      EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-5 * want.grad_norm);
      for (std::size_t k = 0; k < want.grads.size(); ++k) {
        ASSERT_TRUE(got.grads[k].defined() && want.grads[k].defined()) << k;
        EXPECT_TRUE(torch::allclose(got.grads[k], want.grads[k], 1e-5, 1e-7)) << "parameter " << k;
      }
      // Several steps, clipped by the global norm (so a wrong norm would change the weights): the
      // replicas' weights stay bitwise equal and follow the unreplicated run.
      const double clip = 0.5 * want.grad_norm;
      const RrRun a = run_round_robin(rep, "2,2", schedule, m, x, y, 4, clip);
      const RrRun b = run_round_robin({1, 1}, "2,2", schedule, m, x, y, 4, clip);
      int rank = 0;
      for (std::size_t st = 0; st < rep.size(); ++st) {
        const int first = rank;
        for (int q = 0; q < rep[st]; ++q, ++rank) {
          const auto mine = a.models[static_cast<std::size_t>(rank)]->parameters();
          const auto lead = a.models[static_cast<std::size_t>(first)]->parameters();
          const auto ref = b.models[st]->parameters();  // unreplicated: stage st is rank st
          // Stage st holds layers 2 st, 2 st + 1: parameters from position 2 st (Linear) on.
          for (std::size_t k = 0; k < mine.size(); ++k) {
            const bool held = st == 0 ? k < 2 : k >= 2;
            if (!held) continue;
            EXPECT_TRUE(torch::equal(mine[k], lead[k])) << "replica " << q << " of stage " << st << " parameter " << k;
            EXPECT_TRUE(torch::allclose(mine[k], ref[k], 1e-4, 1e-6)) << "stage " << st << " parameter " << k;
          }
        }
      }
      EXPECT_NEAR(a.loss, b.loss, 1e-4 * std::abs(b.loss));
    }
}

TEST(RoundRobinRuntime, RefusesWhatItCannotRun) {
  auto expect_error = [](const PipelineOptions& o, int ranks, const std::string& part) {
    auto world = make_local_transports(ranks);
    try {
      PipelineRank rank(make_model(), mse, world[0], o);
      ADD_FAILURE() << "no error, expected '" << part << "'";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  PipelineOptions o;
  o.replication = {2, 1};
  expect_error(o, 4, "replication 2,1 needs 3 ranks (their sum) but there are 4");
  o.schedule = "zb-h1";
  expect_error(o, 3, "run with --schedule 1f1b or gpipe");
  o.schedule = "pipedream";
  o.microbatches = 1;
  expect_error(o, 3, "run with --schedule 1f1b or gpipe");
  o.schedule = "1f1b";
  o.microbatches = 4;
  o.replication = {2, 0};
  expect_error(o, 2, "stage replication 0 must be >= 1");
  // One optimizer step per call.
  o.replication = {2, 1};
  auto world = make_local_transports(3);
  PipelineRank rank(make_model(), mse, world[0], o);
  try {
    rank.train_steps(torch::randn({8, kIn}), torch::randn({8, kOut}), 8, 2);
    ADD_FAILURE() << "two steps per call ran";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("run one optimizer step per call, got 2"), std::string::npos) << e.what();
  }
}

// A checkpoint of a replicated run holds every layer once, written by its stage's first replica (the
// replicas' weights are equal): the manifest checks out, and an unreplicated pipeline loads it with the
// replicated run's weights and optimizer state.
TEST(RoundRobinRuntime, CheckpointsWriteEachLayerOnce) {
  torch::manual_seed(9);
  const torch::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("pipetrain-rr-ckpt-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const std::vector<int> rep{2, 1};
  auto world = make_local_transports(3);
  std::vector<torch::nn::Sequential> models{make_model(), make_model(), make_model()};
  run_on_threads(3, [&](int r) {
    PipelineOptions o;
    o.microbatches = 4;
    o.balance = "2,2";
    o.replication = rep;
    o.optimizer.name = "adam";
    o.optimizer.lr = 0.01;
    PipelineRank rank(models[static_cast<std::size_t>(r)], mse, world[static_cast<std::size_t>(r)], o);
    for (int step = 0; step < 2; ++step) rank.train_step(x, y, kBatch);
    save_checkpoint(rank, *world[static_cast<std::size_t>(r)], dir.string(), nlohmann::json::object());
  });
  ASSERT_NO_THROW(read_checkpoint(dir.string()));  // sizes and CRC-32 of every layer file match
  auto plain = make_local_transports(2);
  std::vector<torch::nn::Sequential> loaded{make_model(), make_model()};
  run_on_threads(2, [&](int r) {
    PipelineOptions o;
    o.microbatches = 4;
    o.balance = "2,2";
    o.optimizer.name = "adam";
    PipelineRank rank(loaded[static_cast<std::size_t>(r)], mse, plain[static_cast<std::size_t>(r)], o);
    load_checkpoint(rank, dir.string());
    EXPECT_EQ(rank.step(), 2);
  });
  // Stage 0 (parameters 0, 1) from rank 0 of the replicated run, stage 1 (2..5) from rank 2.
  const auto a0 = models[0]->parameters(), a2 = models[2]->parameters();
  const auto b0 = loaded[0]->parameters(), b1 = loaded[1]->parameters();
  for (std::size_t k = 0; k < a0.size(); ++k) {
    if (k < 2)
      EXPECT_TRUE(torch::equal(b0[k], a0[k])) << k;
    else
      EXPECT_TRUE(torch::equal(b1[k], a2[k])) << k;
  }
  std::filesystem::remove_all(dir);
}

// Checks the executor on the in-process transport. The main test is transparency (docs/ALGORITHMS.md §1.8,
// P-SYNC-1): for every synchronous schedule, p in {1, 2, 4} and m in {1, 3, 8}, one pipelined step gives
// the loss and every parameter gradient of plain LibTorch gradient accumulation over the same
// micro-batches (same model, same seed), within fp32 relative 1e-5. Also: the fast and reference paths
// agree bitwise; every re-materialisation mode gives the same numbers, with dropout too; optimizers and
// global-norm clipping match LibTorch's; a failing rank, a program's own error on one thread, one rank
// stepping once more than the others, or a drifting shape stops every rank with a message; bad options
// are UsageErrors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "pipetrain/core/error.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/split_linear.h"

using namespace pipetrain;

namespace {

constexpr int64_t kIn = 6, kHidden = 10, kOut = 3, kBatch = 12;

// Eight layers mixing split linears, a plain torch linear (no B/W split) and parameter-free layers.
torch::nn::Sequential make_model(uint64_t seed, double dropout = 0.0) {
  torch::manual_seed(seed);
  torch::nn::Sequential m;
  m->push_back(nn::Linear(kIn, kHidden));
  m->push_back(torch::nn::Tanh());
  m->push_back(nn::Linear(kHidden, kHidden));
  m->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
  m->push_back(torch::nn::Linear(kHidden, kHidden));
  m->push_back(torch::nn::Dropout(dropout));
  m->push_back(nn::Linear(kHidden, kHidden));
  m->push_back(nn::Linear(kHidden, kOut));
  return m;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

struct Data {
  torch::Tensor x, y;
};
Data make_data(uint64_t seed = 123) {
  torch::manual_seed(seed);
  return {torch::randn({kBatch, kIn}), torch::randn({kBatch, kOut})};
}

// Plain LibTorch gradient accumulation over the same micro-batches; returns the loss.
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

// Runs one pipelined step and returns (loss, gradients in model parameter order).
std::pair<double, std::vector<torch::Tensor>> pipeline_grads(torch::nn::Sequential model, const Data& d, int p,
                                                             PipelineOptions o) {
  const auto params = model->parameters();
  std::vector<torch::Tensor> grads(params.size());
  o.on_gradients = [&](int, const std::vector<torch::Tensor>& mine) {
    // Runs on every rank's thread; each copies the gradients of the parameters it owns.
    for (const auto& p : mine)
      for (std::size_t k = 0; k < params.size(); ++k)
        if (params[k].unsafeGetTensorImpl() == p.unsafeGetTensorImpl() && p.grad().defined())
          grads[k] = p.grad().clone();
  };
  LocalPipeline pipe(model, mse, p, o);
  const StepStats s = pipe.train_step(d.x, d.y);
  return {s.loss, grads};
}

void expect_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                  const std::string& what, double rtol = 1e-5) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t k = 0; k < want.size(); ++k) {
    ASSERT_TRUE(got[k].defined()) << what << ": parameter " << k << " has no gradient";
    const double scale = want[k].abs().max().item<double>() + 1e-12;
    const double err = (got[k] - want[k]).abs().max().item<double>();
    EXPECT_LE(err, rtol * scale) << what << ": parameter " << k << " max error " << err << " (scale " << scale << ")";
  }
}

std::vector<torch::Tensor> grads_of(torch::nn::Sequential model) {
  std::vector<torch::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.grad().clone());
  return out;
}

}  // namespace

TEST(Executor, TransparencyEverySynchronousSchedule) {
  const Data d = make_data();
  int runs = 0;
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-auto"})
    for (int p : {1, 2, 4})
      for (int m : {1, 3, 8}) {
        PipelineOptions o;
        o.schedule = schedule;
        o.microbatches = m;
        if (schedule == "interleaved") {
          if (m % p != 0) continue;
          o.virtual_stages = 2;
        }
        auto ref_model = make_model(7);
        const double ref_loss = reference_grads(ref_model, d, m);
        const auto [loss, grads] = pipeline_grads(make_model(7), d, p, o);
        const std::string what = schedule + " p=" + std::to_string(p) + " m=" + std::to_string(m);
        EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss)) << what;
        expect_close(grads, grads_of(ref_model), what);
        ++runs;
      }
  EXPECT_GE(runs, 45);
}

TEST(Executor, FastAndReferencePathsAgreeBitwise) {
  const Data d = make_data();
  for (const std::string schedule : {"1f1b", "zb-h1", "interleaved"}) {
    PipelineOptions o;
    o.schedule = schedule;
    o.microbatches = 4;
    o.virtual_stages = schedule == "interleaved" ? 2 : 1;
    o.reference = true;
    const auto ref = pipeline_grads(make_model(3), d, 2, o);
    o.reference = false;
    o.prefetch = 3;
    const auto fast = pipeline_grads(make_model(3), d, 2, o);
    EXPECT_EQ(ref.first, fast.first) << schedule;
    for (std::size_t k = 0; k < ref.second.size(); ++k) EXPECT_TRUE(torch::equal(ref.second[k], fast.second[k])) << schedule;
  }
}

// A tester's finding (2026-11-28): re-materialisation ran each checkpointed forward twice in training
// mode, so BatchNorm's running statistics took two updates per micro-batch and the evaluated (and saved)
// model differed from a run without it. The recompute puts the stage's buffers back.
TEST(Executor, RematerialisationLeavesRunningStatisticsAsWithout) {
  const Data d = make_data();
  auto bn_model = [] {
    torch::manual_seed(11);
    torch::nn::Sequential m;
    m->push_back(torch::nn::Linear(kIn, 8));
    m->push_back(torch::nn::BatchNorm1d(8));
    m->push_back(torch::nn::Tanh());
    m->push_back(torch::nn::Linear(8, 8));
    m->push_back(torch::nn::BatchNorm1d(8));
    m->push_back(torch::nn::Linear(8, kOut));
    return m;
  };
  std::vector<std::vector<torch::Tensor>> buffers;
  for (Checkpoint c : {Checkpoint::Never, Checkpoint::Always, Checkpoint::ExceptLast}) {
    torch::nn::Sequential m = bn_model();
    PipelineOptions o;
    o.schedule = "gpipe";
    o.microbatches = 3;
    o.checkpoint = c;
    LocalPipeline pipe(m, mse, 2, o);
    for (int k = 0; k < 2; ++k) pipe.train_step(d.x, d.y);
    std::vector<torch::Tensor> b;
    for (const auto& t : m->buffers()) b.push_back(t.clone());
    buffers.push_back(b);
  }
  ASSERT_FALSE(buffers[0].empty());
  for (std::size_t r = 1; r < buffers.size(); ++r)
    for (std::size_t k = 0; k < buffers[0].size(); ++k)
      EXPECT_TRUE(torch::equal(buffers[r][k], buffers[0][k])) << "mode " << r << " buffer " << k;
}

TEST(Executor, CheckpointModesGiveTheSameNumbersWithDropout) {
  // Within one schedule every checkpoint mode gives bitwise the same loss and gradients: the recompute
  // reseeds the forward's RNG, so dropout masks match. Across schedules the masks are the same too
  // (seeded per step, stage and micro-batch), but gradients are summed in another order (GPipe runs
  // backwards in reverse), so they agree to rounding.
  const Data d = make_data();
  for (double dropout : {0.0, 0.3}) {
    std::vector<std::pair<double, std::vector<torch::Tensor>>> first_of_schedule;
    for (const std::string schedule : {"gpipe", "1f1b", "zb-h1"}) {
      std::vector<std::pair<double, std::vector<torch::Tensor>>> runs;
      for (Checkpoint c : {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always}) {
        PipelineOptions o;
        o.schedule = schedule;
        o.microbatches = 4;
        o.checkpoint = c;
        o.seed = 99;
        runs.push_back(pipeline_grads(make_model(5, dropout), d, 2, o));
      }
      for (std::size_t r = 1; r < runs.size(); ++r) {
        EXPECT_EQ(runs[r].first, runs[0].first) << schedule << " dropout " << dropout << " mode " << r;
        for (std::size_t k = 0; k < runs[0].second.size(); ++k)
          EXPECT_TRUE(torch::equal(runs[r].second[k], runs[0].second[k])) << schedule << " dropout " << dropout;
      }
      first_of_schedule.push_back(runs[0]);
    }
    for (std::size_t r = 1; r < first_of_schedule.size(); ++r) {
      EXPECT_NEAR(first_of_schedule[r].first, first_of_schedule[0].first, 1e-6);
      expect_close(first_of_schedule[r].second, first_of_schedule[0].second, "across schedules");
    }
  }
  // Dropout really is active: another seed gives another loss.
  PipelineOptions o;
  o.seed = 100;
  const auto other = pipeline_grads(make_model(5, 0.3), d, 2, o);
  o.seed = 99;
  EXPECT_NE(other.first, pipeline_grads(make_model(5, 0.3), d, 2, o).first);
}

TEST(Executor, SplitLinearBackwardEqualsFused) {
  torch::manual_seed(1);
  nn::Linear split(5, 4);
  torch::manual_seed(1);
  torch::nn::Linear plain(5, 4);
  ASSERT_TRUE(torch::equal(split->weight, plain->weight));  // same initialisation as torch::nn::Linear
  ASSERT_TRUE(torch::equal(split->bias, plain->bias));
  const torch::Tensor x0 = torch::randn({3, 2, 5});
  const torch::Tensor g = torch::randn({3, 2, 4});
  // Fused, through torch::nn::Linear.
  torch::Tensor xa = x0.clone().requires_grad_(true);
  plain->forward(xa).backward(g);
  // B then W, through the store.
  torch::Tensor xb = x0.clone().requires_grad_(true);
  WeightGradStore store;
  {
    WeightGradStore::Scope scope(&store);
    split->forward(xb).backward(g);
  }
  EXPECT_TRUE(torch::allclose(xb.grad(), xa.grad(), 1e-6, 1e-7));
  EXPECT_FALSE(split->weight.grad().defined());  // deferred to W
  EXPECT_EQ(store.size(), 1u);
  store.run();
  EXPECT_TRUE(store.empty());
  EXPECT_TRUE(torch::allclose(split->weight.grad(), plain->weight.grad(), 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(split->bias.grad(), plain->bias.grad(), 1e-6, 1e-7));
  // Without a store the backward is fused.
  split->zero_grad();
  split->forward(x0).backward(g);
  EXPECT_TRUE(torch::allclose(split->weight.grad(), plain->weight.grad(), 1e-6, 1e-7));
  // Without a bias, too.
  torch::manual_seed(2);
  nn::Linear nobias(torch::nn::LinearOptions(5, 4).bias(false));
  torch::manual_seed(2);
  torch::nn::Linear plain_nobias(torch::nn::LinearOptions(5, 4).bias(false));
  ASSERT_FALSE(nobias->bias.defined());
  plain_nobias->forward(x0).backward(g);
  {
    WeightGradStore::Scope scope(&store);
    nobias->forward(x0).backward(g);
  }
  store.run();
  EXPECT_TRUE(torch::allclose(nobias->weight.grad(), plain_nobias->weight.grad(), 1e-6, 1e-7));
}

TEST(Executor, OptimizersAndClippingMatchLibTorch) {
  const Data d = make_data();
  for (const std::string name : {"sgd", "adam", "adamw"})
    for (double clip : {0.0, 0.05}) {
      OptimizerOptions oo;
      oo.name = name;
      oo.lr = 0.05;
      oo.momentum = 0.9;
      oo.weight_decay = 0.01;
      oo.clip_grad_norm = clip;
      // Reference: full-batch gradient, LibTorch optimizer, LibTorch clipping.
      auto ref = make_model(11);
      std::unique_ptr<torch::optim::Optimizer> opt;
      if (name == "sgd")
        opt = std::make_unique<torch::optim::SGD>(ref->parameters(), torch::optim::SGDOptions(oo.lr).momentum(0.9).weight_decay(0.01));
      else if (name == "adam")
        opt = std::make_unique<torch::optim::Adam>(ref->parameters(), torch::optim::AdamOptions(oo.lr).weight_decay(0.01));
      else
        opt = std::make_unique<torch::optim::AdamW>(ref->parameters(), torch::optim::AdamWOptions(oo.lr).weight_decay(0.01));
      PipelineOptions o;
      o.schedule = "1f1b";
      o.microbatches = 3;
      o.optimizer = oo;
      auto model = make_model(11);
      LocalPipeline pipe(model, mse, 2, o);
      for (int step = 0; step < 3; ++step) {
        const double ref_loss = reference_grads(ref, d, 3);
        const double norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), clip > 0 ? clip : 1e30);
        opt->step();
        const StepStats s = pipe.train_step(d.x, d.y);
        EXPECT_NEAR(s.loss, ref_loss, 1e-5 * ref_loss) << name << " step " << step;
        EXPECT_NEAR(s.grad_norm, norm, 1e-5 * norm) << name << " step " << step;
      }
      const auto a = model->parameters(), b = ref->parameters();
      for (std::size_t k = 0; k < a.size(); ++k)
        EXPECT_TRUE(torch::allclose(a[k], b[k], 1e-4, 1e-6)) << name << " clip " << clip << " parameter " << k;
    }
}

TEST(Executor, LossIsKnownOnEveryRankAndTimelineIsRecorded) {
  auto transports = make_local_transports(2);
  const Data d = make_data();
  PipelineOptions o;
  o.schedule = "zb-h1";
  o.microbatches = 4;
  auto model = make_model(2);
  PipelineRank r0(model, mse, transports[0], o), r1(model, mse, transports[1], o);
  StepStats s0, s1;
  std::thread t([&] { s1 = r1.train_step(torch::Tensor(), d.y, kBatch); });  // rank 1 never sees inputs
  s0 = r0.train_step(d.x, torch::Tensor(), kBatch);                           // rank 0 never sees targets
  t.join();
  EXPECT_GT(s0.loss, 0);
  EXPECT_EQ(s0.loss, s1.loss);
  EXPECT_EQ(s0.grad_norm, s1.grad_norm);
  EXPECT_EQ(s0.timeline.events.size(), r0.schedule().actions[0].size());
  for (const TimedAction& e : s0.timeline.events) EXPECT_LE(e.start, e.end);
  const Metrics m = compute_metrics(s1.timeline);
  EXPECT_GT(m.per_rank[1].busy, 0);
}

namespace {
// Returns its input, but throws on its `fail_call`-th call or widens its output from then on.
struct FaultyImpl : torch::nn::Module {
  FaultyImpl(int fail_call, bool widen) : fail_call(fail_call), widen(widen) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (calls++ == fail_call) {
      if (widen) return torch::cat({x, x}, 1);
      throw std::runtime_error("injected failure");
    }
    return x;
  }
  int fail_call, calls = 0;
  bool widen;
};
TORCH_MODULE(Faulty);

// The message of the error one training step raises, or "no error".
std::string step_error(LocalPipeline& pipe, const Data& d) {
  try {
    pipe.train_step(d.x, d.y);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}
}  // namespace

TEST(Executor, FailingRankStopsEveryRankWithItsMessage) {
  const Data d = make_data();
  auto model = make_model(1);
  model->push_back(Faulty(2, false));  // layer 8: on rank 1 with a 2-stage uniform balance
  model->push_back(nn::Linear(kOut, kOut));
  PipelineOptions o;
  o.microbatches = 4;
  LocalPipeline pipe(model, mse, 2, o);
  const std::string msg = step_error(pipe, d);
  EXPECT_NE(msg.find("rank 1 at 1F2: injected failure"), std::string::npos) << msg;
}

// After a failure inside a step the next call failed with the old message again, as if it had caused it;
// it is refused saying that the pipeline stopped earlier and how to go on.
TEST(Executor, ALocalPipelineThatFailedInsideAStepRefusesLaterCallsSayingWhy) {
  const Data d = make_data();
  auto model = make_model(1);
  model->push_back(Faulty(2, false));
  model->push_back(nn::Linear(kOut, kOut));
  PipelineOptions o;
  o.microbatches = 4;
  LocalPipeline pipe(model, mse, 2, o);
  ASSERT_NE(step_error(pipe, d).find("injected failure"), std::string::npos);
  for (const std::string& msg : {step_error(pipe, d), [&] {
         try {
           pipe.evaluate(Bundle(d.x), d.y, kBatch);
         } catch (const RemoteFailure& e) {
           return std::string(e.what());
         }
         return std::string("no error");
       }()}) {
    EXPECT_NE(msg.find("rank 1 failed: this LocalPipeline stopped at that failure earlier (rank 1 at 1F2: injected "
                       "failure)"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("build a new LocalPipeline"), std::string::npos) << msg;
  }
}

// A program's own code throws on one rank (a checkpoint that does not fit, say) under run_on_threads
// without on_error: the other rank stops at once and the program's error is what is reported. Before,
// rank 0 waited out its transport's timeout and that timeout was the error.
TEST(Executor, UsersOwnErrorOnOneThreadStopsTheOthersWithIt) {
  const Data d = make_data();
  const std::vector<torch::nn::Sequential> models{make_model(1), make_model(1)};
  auto transports = make_local_transports(2, std::chrono::seconds(60));
  std::string rank0;
  const auto start = std::chrono::steady_clock::now();
  try {
    run_on_threads(2, [&](int r) {
      PipelineRank rank(models[r], mse, transports[r], PipelineOptions{});
      if (r == 1) throw std::runtime_error("the checkpoint holds another model");
      try {
        rank.train_step(d.x, d.y, kBatch);
      } catch (const RemoteFailure& e) {
        rank0 = e.what();
        throw;
      }
    });
    ADD_FAILURE() << "no error";
  } catch (const RemoteFailure& e) {
    ADD_FAILURE() << "reported another rank's report, not the cause: " << e.what();
  } catch (const std::exception& e) {
    EXPECT_EQ(std::string(e.what()), "the checkpoint holds another model");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_NE(rank0.find("rank 1 failed: the checkpoint holds another model"), std::string::npos) << rank0;
}

// One rank calls train_step once more than the other: it stops within seconds, saying that the other
// finished while it waits for its message. Before, it waited out the transport's timeout.
TEST(Executor, OneStepMoreOnOneRankStopsWithinSecondsNamingBoth) {
  const Data d = make_data();
  const std::vector<torch::nn::Sequential> models{make_model(1), make_model(1)};
  auto transports = make_local_transports(2, std::chrono::seconds(60));
  const auto start = std::chrono::steady_clock::now();
  std::string error = "no error";
  try {
    run_on_threads(2, [&](int r) {
      PipelineRank rank(models[r], mse, transports[r], PipelineOptions{});
      for (int step = 0; step < (r == 0 ? 2 : 1); ++step) rank.train_step(d.x, d.y, kBatch);
    });
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_NE(error.find("rank 1 finished while rank 0 waits for a message from rank 1"), std::string::npos) << error;
  EXPECT_NE(error.find("the same number of train_step calls"), std::string::npos) << error;
}

TEST(Executor, DriftingShapeIsAnErrorNamingStageAndShapes) {
  const Data d = make_data();
  torch::manual_seed(0);
  torch::nn::Sequential model;
  model->push_back(nn::Linear(kIn, 4));
  model->push_back(Faulty(1, true));  // second micro-batch comes out twice as wide
  model->push_back(nn::Linear(4, kOut));
  PipelineOptions o;
  o.microbatches = 4;  // 12 samples: every micro-batch has 3
  o.balance = "2,1";
  LocalPipeline pipe(model, mse, 2, o);
  const std::string msg = step_error(pipe, d);
  EXPECT_NE(msg.find("activations of stage 0 for micro-batch 1 are {x: [3, 8] Float (grad)} but what was agreed "
                     "at first use is {x: [3, 4] Float (grad)}"),
            std::string::npos)
      << msg;
}

TEST(Executor, BadOptionsAreUsageErrors) {
  auto model = make_model(1);
  auto expect_usage = [&](PipelineOptions o, int p, const std::string& part) {
    try {
      LocalPipeline pipe(model, mse, p, o);
      const Data d = make_data();
      pipe.train_step(d.x, d.y);
      ADD_FAILURE() << "accepted: " << part;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  PipelineOptions o;
  o.microbatches = 13;
  expect_usage(o, 2, "13 micro-batches but the batch has only 12 samples");
  o = {};
  o.microbatches = 0;
  expect_usage(o, 2, "micro-batches must be >= 1");
  o = {};
  o.balance = "4,3";
  expect_usage(o, 2, "sums to 7 but the model has 8 layers");
  o.balance = "8,0";
  expect_usage(o, 2, "gives stage 1 0 layers");
  o = {};
  expect_usage(o, 9, "9 stages but the model has 8 layers");
  o.schedule = "fifo";
  expect_usage(o, 2, "valid schedules are");
  o.schedule = "interleaved";  // virtual_stages 1 would run plain 1F1B (before: silently)
  expect_usage(o, 2, "schedule 'interleaved' loops several stages over each rank, but virtual_stages is 1");
  expect_usage(o, 2, "give virtual_stages 2 or more, or ask for 1f1b");
  o.schedule = "looped-bfs";
  expect_usage(o, 2, "which gives it without a loop: give virtual_stages 2 or more");
  o.schedule = "pipedream";  // asynchronous schedules: test_async.cpp has the rest
  expect_usage(o, 2, "a mini-batch is one micro-batch: got 4 micro-batches per step; use --microbatches 1");
  o = {};
  o.optimizer.name = "lion";
  expect_usage(o, 2, "unknown optimizer 'lion'");
  o = {};
  o.optimizer.lr = -1;
  expect_usage(o, 2, "learning rate must be > 0");
  EXPECT_THROW(parse_checkpoint("sometimes"), UsageError);
  if (!torch::cuda::is_available()) {
    o = {};
    o.device = torch::Device(torch::kCUDA, 0);
    expect_usage(o, 2, "this LibTorch has no CUDA device");
  }
}

// A zero-bubble schedule on layers without a B/W split says, once per rank, how much of the backward
// stays fused when that is more than a tenth of the rank's parameters (before: an empty W without a
// word). Only with backward_split "explicit": by default autograd splits every layer (issue 24). At 4 + 4 layers rank 1 holds a torch::nn::Linear (layer 4, 110 of its 110 + 110 + 33
// parameters); rank 0's LayerNorm (layer 3) is 20 of 70 + 110 + 20, a tenth: no warning.
TEST(Executor, ZeroBubbleOnLayersWithoutASplitSaysHowMuchStaysFused) {
  auto model = make_model(1);
  auto stderr_of = [&](const PipelineOptions& o) {  // what building the pipeline prints
    ::testing::internal::CaptureStderr();
    { LocalPipeline pipe(model, mse, 2, o); }
    return ::testing::internal::GetCapturedStderr();
  };
  PipelineOptions o;
  o.schedule = "zb-h1";
  o.balance = "4,4";
  EXPECT_EQ(stderr_of(o), "");  // auto: nothing stays fused
  o.backward_split = "explicit";
  const std::string err = stderr_of(o);
  EXPECT_NE(err.find("pipetrain rank 1: warning: schedule 'zb-h1' splits the backward into B and W, but 43% of this "
                     "rank's trainable parameters (110 of 253, in layers 4 (torch::nn::Linear)) are in modules "
                     "without a split"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("pipetrain::nn::Linear for torch::nn::Linear"), std::string::npos) << err;
  EXPECT_EQ(err.find("rank 0: warning"), std::string::npos) << err;
  EXPECT_EQ(err.find("rank 1: warning", err.find("rank 1: warning") + 1), std::string::npos) << "twice: " << err;
  o.balance = "5,3";  // rank 0: the LayerNorm and the torch::nn::Linear, 130 of 310; rank 1 splits all
  const std::string err2 = stderr_of(o);
  EXPECT_NE(err2.find("pipetrain rank 0: warning: schedule 'zb-h1' splits the backward into B and W, but 42% of this "
                      "rank's trainable parameters (130 of 310, in layers 3 (torch::nn::LayerNorm), 4 "
                      "(torch::nn::Linear))"),
            std::string::npos)
      << err2;
  EXPECT_EQ(err2.find("rank 1: warning"), std::string::npos) << err2;
  o.schedule = "1f1b";  // no W: nothing to say
  EXPECT_EQ(stderr_of(o), "");
}

// The pipeline's forward_only and evaluate against the plain model's forward (in eval mode); the evaluation.
static EvalStats expect_forward_as_plain(LocalPipeline& pipe, torch::nn::Sequential& model, const Data& d) {
  model->eval();
  const torch::Tensor want = model->forward(d.x).detach();
  model->train();
  const torch::Tensor got = pipe.forward_only(Bundle(d.x), kBatch);
  EXPECT_TRUE(got.defined() && torch::allclose(got, want, 1e-5, 1e-6));
  const EvalStats e = pipe.evaluate(Bundle(d.x), d.y, kBatch);
  EXPECT_NEAR(e.loss, mse(want, d.y).item<double>(), 1e-5);
  return e;
}

// LocalPipeline's bundle step, forward_only and evaluate are its ranks' (before it had none of them), and
// transport(r) is rank r's.
TEST(Executor, LocalPipelineEvaluatesAndStepsOnBundles) {
  const Data d = make_data();
  auto model = make_model(1);
  LocalPipeline pipe(model, mse, 2, PipelineOptions{});
  const EvalStats e = expect_forward_as_plain(pipe, model, d);
  EXPECT_EQ(e.samples, kBatch);
  const double bundle_loss = pipe.train_step(Bundle(d.x), d.y, kBatch).loss;
  EXPECT_NEAR(bundle_loss, e.loss, 1e-5);  // the first step's loss is that of the weights evaluated
  EXPECT_EQ(pipe.transport(1)->rank(), 1);
  EXPECT_EQ(pipe.transport(1)->world_size(), 2);
}

// On a V placement a rank holds two consecutive stages (zb-v's rank 1: stages 1 and 2), and a forward-only
// pass read the gradient flags the stage before never recorded: train's default evaluation and sample
// crashed (SIGSEGV) on every V schedule (a tester's finding, 2026-11-28).
TEST(Executor, VSchedulesEvaluateAndRunForwardOnly) {
  const Data d = make_data();
  for (const char* schedule : {"zb-v", "v-half", "v-min", "dualpipev"}) {
    SCOPED_TRACE(schedule);
    auto model = make_model(1);
    PipelineOptions o;
    o.schedule = schedule;
    o.microbatches = 4;
    LocalPipeline pipe(model, mse, 2, o);
    const EvalStats e = expect_forward_as_plain(pipe, model, d);
    // A training step after them, and the evaluation again after the step.
    EXPECT_NEAR(pipe.train_step(d.x, d.y).loss, e.loss, 1e-5);
    EXPECT_LT(pipe.evaluate(Bundle(d.x), d.y, kBatch).loss, e.loss);
  }
}

TEST(Executor, ParameterBalanceSplitsByParameterCount) {
  auto model = make_model(1);
  PipelineOptions o;
  o.balance = "parameters";
  LocalPipeline pipe(model, mse, 2, o);
  // Parameter counts per layer: 70, 0, 110, 20, 110, 0, 110, 33 (prefix sums 70, 70, 180, 200, 310,
  // 310, 420, 453). Cutting after layer 3 gives max(200, 253) = 253; after layer 2, max(180, 273) = 273;
  // after layer 4, max(310, 143) = 310. So 4,4 is the optimal min-max split.
  EXPECT_EQ(pipe.balance(), (std::vector<int>{4, 4}));
  // A model where parameters and uniform disagree: Linear(6,100) has 700 parameters, Linear(100,3) 303,
  // the two Tanh none. Uniform gives 2,2 (1003 | 0); cutting after the first layer gives 700 | 303.
  torch::nn::Sequential skewed;
  skewed->push_back(nn::Linear(kIn, 100));
  skewed->push_back(nn::Linear(100, kOut));
  skewed->push_back(torch::nn::Tanh());
  skewed->push_back(torch::nn::Tanh());
  EXPECT_EQ(LocalPipeline(skewed, mse, 2, o).balance(), (std::vector<int>{1, 3}));
  o.balance = "uniform";
  EXPECT_EQ(LocalPipeline(skewed, mse, 2, o).balance(), (std::vector<int>{2, 2}));
}

// issue 16: the pipeline reseeded LibTorch's default generator before every forward and left it so, so
// a program that seeds once and then draws its batches with torch::randn on each rank got other
// batches after the first step than without the pipeline. The forwards (with dropout, so they draw)
// must leave the caller's stream exactly where it was, on every schedule path (with and without
// re-materialisation).
TEST(Executor, LeavesTheCallersRandomStreamAlone) {
  for (const char* checkpoint : {"never", "always"}) {
    PipelineOptions o;
    o.schedule = "1f1b";
    o.microbatches = 3;
    o.checkpoint = parse_checkpoint(checkpoint);
    LocalPipeline pipe(make_model(4, /*dropout=*/0.5), mse, 2, o);
    torch::manual_seed(99);
    const torch::Tensor want1 = torch::randn({kBatch, kIn});
    const torch::Tensor want2 = torch::randn({kBatch, kIn});
    const torch::Tensor want3 = torch::randn({4});
    torch::manual_seed(99);
    const torch::Tensor x1 = torch::randn({kBatch, kIn});
    pipe.train_step(x1, torch::zeros({kBatch, kOut}));
    const torch::Tensor x2 = torch::randn({kBatch, kIn});
    pipe.train_step(x2, torch::zeros({kBatch, kOut}));
    const torch::Tensor x3 = torch::randn({4});
    EXPECT_TRUE(torch::equal(x1, want1)) << checkpoint;
    EXPECT_TRUE(torch::equal(x2, want2)) << checkpoint << ": the first step moved the caller's generator";
    EXPECT_TRUE(torch::equal(x3, want3)) << checkpoint;
  }
}

// issue 15: the forwards save and restore the default CPU generator by copying its engine and its
// cached normal samples. A one-element randn draws two normals and keeps the second for the next
// draw: that cached sample must survive the pipeline's forwards too.
TEST(Executor, KeepsTheCallersCachedNormalSample) {
  PipelineOptions o;
  o.schedule = "gpipe";
  o.microbatches = 2;
  LocalPipeline pipe(make_model(4, /*dropout=*/0.5), mse, 2, o);
  const torch::Tensor x = torch::ones({kBatch, kIn}), y = torch::zeros({kBatch, kOut});
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    torch::manual_seed(5);
    torch::randn({1}, dtype);  // leaves the pair's second sample cached
    const torch::Tensor want = torch::randn({1}, dtype);
    torch::manual_seed(5);
    torch::randn({1}, dtype);
    pipe.train_step(x, y);
    const torch::Tensor got = torch::randn({1}, dtype);
    EXPECT_TRUE(torch::equal(got, want)) << dtype << ": " << got.item<double>() << " against " << want.item<double>();
  }
}

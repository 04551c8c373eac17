// The library's training loop (runtime/trainer.h) on in-process ranks: the learning-rate schedule's
// shape; a Trainer's losses are bitwise those of driving PipelineRank::train_step by hand with the same
// learning rates; callbacks see every step once, evaluations at step 0, on the cadence and at the end,
// checkpoints on their cadence; a run resumed from a Trainer's checkpoint ends bitwise where an
// uninterrupted one does; a stop request ends every rank after the same step and, asked to, writes a
// checkpoint there; an asynchronous schedule runs several steps per call and cuts calls at evaluations
// (only those that run); a per-token held-out loss does not depend on the evaluation batch;
// two data-parallel copies of a pipeline train on their halves of each batch; bad options are refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <filesystem>
#include <mutex>
#include <set>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/checkpoint.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/split_linear.h"
#include "pipetrain/runtime/trainer.h"

using namespace pipetrain;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kIn = 6, kHidden = 16, kOut = 3, kBatch = 8, kEval = 20;

torch::nn::Sequential make_model() {
  torch::manual_seed(7);
  torch::nn::Sequential m;
  m->push_back(nn::Linear(kIn, kHidden));
  m->push_back(torch::nn::Tanh());
  m->push_back(nn::Linear(kHidden, kHidden));
  m->push_back(torch::nn::Tanh());
  m->push_back(nn::Linear(kHidden, kOut));
  return m;
}

torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out, target);
}

// A learnable, deterministic data set: the class is the sign pattern of two input features.
std::pair<torch::Tensor, torch::Tensor> samples(int64_t seed, int64_t n) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
  torch::Tensor x = torch::randn({n, kIn}, g);
  torch::Tensor y = (x.select(1, 0) > 0).to(torch::kLong) + (x.select(1, 1) > 0.5).to(torch::kLong);
  return {x, y};
}

TrainData data() {
  TrainData d;
  d.train_size = 64;
  d.eval_size = kEval;
  d.batch = [](int step, int64_t n) { return samples(1000 + step, n); };
  d.eval_batch = [](int64_t begin, int64_t n) {
    auto [x, y] = samples(99, kEval);
    return std::make_pair(x.slice(0, begin, begin + n), y.slice(0, begin, begin + n));
  };
  return d;
}

PipelineOptions options(const std::string& schedule = "1f1b") {
  PipelineOptions o;
  o.schedule = schedule;
  o.microbatches = 2;
  o.seed = 3;
  o.optimizer.name = "adam";
  o.optimizer.lr = 1e-2;
  return o;
}

struct Recorded {
  std::vector<StepRecord> steps;
  std::vector<std::pair<int, double>> evals;  // (step, loss)
  std::vector<int> checkpoints;
};

// Runs a Trainer on every rank of a p-rank pipeline (threads over in-process transports) and returns
// rank 0's result and what its callbacks saw.
struct TrainerRun {
  TrainResult result;
  Recorded seen;
  std::vector<TrainResult> all;
};
TrainerRun run_trainer(int p, TrainerOptions to, const PipelineOptions& po = options(),
                std::function<void(int rank, PipelineOptions&)> tweak = {}, const TrainData& d = data()) {
  auto transports = make_local_transports(p);
  auto model = make_model();
  TrainerRun out;
  out.all.resize(static_cast<std::size_t>(p));
  std::mutex mu;
  run_on_threads(
      p,
      [&](int r) {
        PipelineOptions o = po;
        if (tweak) tweak(r, o);
        PipelineRank rank(model, ce, transports[static_cast<std::size_t>(r)], o);
        TrainerCallbacks cb;
        if (r == 0) {
          cb.on_step = [&](const StepRecord& s) { out.seen.steps.push_back(s); };
          cb.on_eval = [&](int step, const EvalResult& e) { out.seen.evals.emplace_back(step, e.loss); };
          cb.on_checkpoint = [&](int step, const std::string&) { out.seen.checkpoints.push_back(step); };
        }
        auto t = transports[static_cast<std::size_t>(r)];
        Trainer trainer(rank, t, t, &d, to, cb);
        TrainResult res = trainer.run();
        std::lock_guard<std::mutex> lk(mu);
        out.all[static_cast<std::size_t>(r)] = res;
      },
      [&](int r) { transports[static_cast<std::size_t>(r)]->abort("rank " + std::to_string(r) + " failed"); });
  out.result = out.all[0];
  return out;
}

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("pipetrain-trainer-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::remove_all(d.string() + ".partial");
  return d;
}

}  // namespace

TEST(LrSchedule, WarmsUpLinearlyThenDecaysToATenthOfThePeak) {
  LrSchedule l;
  l.peak = 1.0;
  l.kind = "cosine";
  l.warmup = 4;
  EXPECT_DOUBLE_EQ(l.at(0, 20), 0.25);
  EXPECT_DOUBLE_EQ(l.at(3, 20), 1.0);
  EXPECT_DOUBLE_EQ(l.at(4, 20), 1.0);           // the decay starts at the peak
  EXPECT_NEAR(l.at(19, 20), 0.1, 1e-12);        // and ends at a tenth of it
  for (int k = 5; k < 20; ++k) EXPECT_LT(l.at(k, 20), l.at(k - 1, 20)) << k;
  l.kind = "linear";
  EXPECT_NEAR(l.at(19, 20), 0.1, 1e-12);
  EXPECT_NEAR(l.at(4 + 15 / 2, 20), 1.0 - 0.9 * (7.0 / 15.0), 1e-12);
  l.kind = "constant";
  EXPECT_DOUBLE_EQ(l.at(12, 20), 1.0);
  l.warmup = -1;  // default: 5% of the run, at most 100
  EXPECT_EQ(l.warmup_steps(1000), 50);
  EXPECT_EQ(l.warmup_steps(10000), 100);
  EXPECT_EQ(l.warmup_steps(10), 0);
}

TEST(Trainer, LossesAreBitwiseThoseOfTrainStepsByHand) {
  TrainerOptions to;
  to.steps = 6;
  to.batch_size = kBatch;
  to.lr = {1e-2, "cosine", 2};
  to.eval_every = 0;
  const TrainerRun run = run_trainer(2, to);
  ASSERT_EQ(run.seen.steps.size(), 6u);

  // The same run by hand.
  auto transports = make_local_transports(2);
  auto model = make_model();
  std::vector<double> by_hand;
  run_on_threads(2, [&](int r) {
    PipelineRank rank(model, ce, transports[static_cast<std::size_t>(r)], options());
    for (int k = 0; k < 6; ++k) {
      rank.set_learning_rate(to.lr.at(k, 6));
      auto [x, y] = samples(1000 + k, kBatch);
      const StepStats s = rank.train_step(x, y, kBatch);
      if (r == 0) by_hand.push_back(s.losses.at(0));
    }
  });
  for (int k = 0; k < 6; ++k) {
    EXPECT_EQ(run.seen.steps[static_cast<std::size_t>(k)].step, k + 1);
    EXPECT_EQ(run.seen.steps[static_cast<std::size_t>(k)].loss, by_hand[static_cast<std::size_t>(k)]) << "step " << k;
    EXPECT_DOUBLE_EQ(run.seen.steps[static_cast<std::size_t>(k)].lr, to.lr.at(k, 6));
  }
  EXPECT_EQ(run.result.first_loss, by_hand.front());
  EXPECT_EQ(run.result.last_loss, by_hand.back());
  EXPECT_EQ(run.result.reached, 6);
  EXPECT_EQ(run.result.stopped_by, 0);
  EXPECT_EQ(run.result.step_ms.size(), 6u);
  EXPECT_TRUE(run.seen.evals.empty());  // eval_every 0: none
}

TEST(Trainer, EvaluatesOnItsCadenceAndTheLossFalls) {
  TrainerOptions to;
  to.steps = 30;
  to.batch_size = kBatch;
  to.lr = {2e-2, "constant", 0};
  to.eval_every = 10;
  to.stage_times = true;
  const TrainerRun run = run_trainer(2, to);
  std::vector<int> at;
  for (const auto& e : run.seen.evals) at.push_back(e.first);
  EXPECT_EQ(at, (std::vector<int>{0, 10, 20, 30}));
  ASSERT_TRUE(run.result.first_eval && run.result.last_eval);
  EXPECT_EQ(run.result.last_eval->samples, kEval);
  EXPECT_LT(run.result.last_eval->loss, 0.8 * run.result.first_eval->loss);
  // The step records carry their evaluation and, asked for, the stages' busy times.
  EXPECT_TRUE(run.seen.steps[9].eval.has_value());
  EXPECT_FALSE(run.seen.steps[8].eval.has_value());
  ASSERT_EQ(run.seen.steps[0].busy_ms.size(), 2u);
  EXPECT_GT(run.seen.steps[0].busy_ms[0], 0.0);
  EXPECT_GT(run.seen.steps[0].pass_ms, 0.0);
}

TEST(Trainer, AResumedRunEndsBitwiseWhereAnUninterruptedOneDoes) {
  const fs::path dir = fresh_dir("resume");
  TrainerOptions to;
  to.steps = 8;
  to.batch_size = kBatch;
  to.eval_every = 0;
  to.run_description = [](int steps) { return nlohmann::json{{"test", "trainer"}, {"steps", steps}}; };
  const TrainerRun whole = run_trainer(2, to);

  TrainerOptions first = to;
  first.save_dir = dir.string();
  first.save_every = 3;
  first.steps = 8;
  // Stop after step 3 (the first call that sees the request is the one before step 4).
  std::atomic<int> calls{0};
  first.stop_requested = [&calls] { return calls.fetch_add(1) >= 2 * 3 ? 15 : 0; };  // 2 ranks poll per call
  const TrainerRun part = run_trainer(2, first);
  EXPECT_EQ(part.result.stopped_by, 15);
  EXPECT_EQ(part.result.reached, 3);
  EXPECT_EQ(part.all[1].reached, 3);  // every rank stopped after the same step
  EXPECT_EQ(part.seen.checkpoints, (std::vector<int>{3}));
  EXPECT_EQ(read_checkpoint(dir.string()).at("step").get<int>(), 3);

  TrainerOptions rest = to;
  rest.resume_dir = dir.string();
  const TrainerRun resumed = run_trainer(2, rest);
  EXPECT_EQ(resumed.result.start, 3);
  ASSERT_EQ(resumed.seen.steps.size(), 5u);
  EXPECT_EQ(resumed.seen.steps.front().step, 4);
  EXPECT_EQ(resumed.result.last_loss, whole.result.last_loss);
  for (int k = 0; k < 5; ++k)
    EXPECT_EQ(resumed.seen.steps[static_cast<std::size_t>(k)].loss, whole.seen.steps[static_cast<std::size_t>(k + 3)].loss)
        << "step " << k + 4;
  fs::remove_all(dir);
}

TEST(Trainer, AStopCanWriteACheckpointAtTheStepReached) {
  const fs::path dir = fresh_dir("interrupt");
  TrainerOptions to;
  to.steps = 10;
  to.batch_size = kBatch;
  to.eval_every = 0;
  to.save_dir = dir.string();
  to.save_on_interrupt = true;
  std::atomic<int> calls{0};
  to.stop_requested = [&calls] { return calls.fetch_add(1) == 2 * 4 ? 2 : 0; };  // one rank sees it before step 5
  const TrainerRun run = run_trainer(2, to);
  EXPECT_EQ(run.result.stopped_by, 2);
  EXPECT_EQ(run.result.reached, 4);
  EXPECT_EQ(run.result.last_saved, 4);
  EXPECT_EQ(read_checkpoint(dir.string()).at("step").get<int>(), 4);
  fs::remove_all(dir);
}

TEST(Trainer, AsynchronousSchedulesRunSeveralStepsPerCallCutAtEvaluations) {
  TrainerOptions to;
  to.steps = 12;
  to.batch_size = kBatch;
  to.eval_every = 5;
  int total = 12;
  const LrSchedule lr = to.lr;
  PipelineOptions po = options("pipedream");
  po.microbatches = 1;  // pipedream steps per micro-batch
  const TrainerRun run = run_trainer(2, to, po, [&](int, PipelineOptions& o) {
    o.learning_rate = [lr, &total](int k) { return lr.at(k, total); };
  });
  ASSERT_EQ(run.seen.steps.size(), 12u);
  // Calls of 5, 5 and 2 steps: the last call's statistics hold 2 steps.
  EXPECT_EQ(run.result.last.steps, 2);
  std::vector<int> at;
  for (const auto& e : run.seen.evals) at.push_back(e.first);
  EXPECT_EQ(at, (std::vector<int>{0, 5, 10, 12}));
  for (const StepRecord& s : run.seen.steps) EXPECT_TRUE(std::isfinite(s.loss));
}

TEST(Trainer, AsynchronousCallsAreNotCutAtEvaluationsThatDoNotRun) {
  // Data without a held-out split: no evaluation runs, so the default cadence (ten per run) must not cut
  // the run into calls (each drains the pipeline): one call of 12 steps, the losses of eval_every 0.
  TrainData d = data();
  d.eval_size = 0;
  d.eval_batch = nullptr;
  PipelineOptions po = options("pipedream");
  po.microbatches = 1;
  TrainerOptions to;
  to.steps = 12;
  to.batch_size = kBatch;
  to.lr = {1e-2, "constant", 0};
  to.eval_every = -1;
  const TrainerRun cadence = run_trainer(2, to, po, {}, d);
  to.eval_every = 0;
  const TrainerRun none = run_trainer(2, to, po, {}, d);
  EXPECT_TRUE(cadence.seen.evals.empty());
  EXPECT_EQ(cadence.result.last.steps, 12);
  ASSERT_EQ(cadence.seen.steps.size(), 12u);
  ASSERT_EQ(none.seen.steps.size(), 12u);
  for (std::size_t k = 0; k < 12; ++k) EXPECT_EQ(cadence.seen.steps[k].loss, none.seen.steps[k].loss) << "step " << k + 1;
}

TEST(Trainer, AHeldOutPerTokenLossDoesNotDependOnTheEvaluationBatch) {
  // Targets -1 are padding, irregularly spread: chunks of the same number of samples hold different
  // numbers of real targets, so each chunk's mean must weigh by those (EvalStats::loss_units), not by
  // its samples; accuracy likewise by its predictions.
  auto transports = make_local_transports(1);
  const Loss per_token = Loss::per_token([](const torch::Tensor& out, const torch::Tensor& t) {
    const torch::Tensor sum = torch::nn::functional::cross_entropy(
        out, t, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1).reduction(torch::kSum));
    return LossTerm(sum, (t >= 0).sum());
  });
  PipelineRank rank(make_model(), per_token, transports[0], options());
  TrainData d = data();
  d.eval_batch = [](int64_t begin, int64_t n) {
    auto [x, y] = samples(99, kEval);
    for (int64_t i = 0; i < kEval; ++i)
      if (i % 3 == 0 || i % 7 == 1) y[i] = -1;
    return std::make_pair(x.slice(0, begin, begin + n), y.slice(0, begin, begin + n));
  };
  std::vector<EvalResult> results;
  for (const int64_t chunk : {int64_t{1}, int64_t{4}, int64_t{6}, kEval}) {
    TrainerOptions to;
    to.steps = 1;
    to.batch_size = kBatch;
    to.eval_batch = chunk;
    Trainer t(rank, transports[0], transports[0], &d, to);
    results.push_back(t.evaluate(kEval));
  }
  // The whole held-out set at once, by hand: the mean over its real targets.
  auto [x, y] = d.eval_batch(0, kEval);
  torch::NoGradGuard no_grad;
  const EvalStats whole = rank.evaluate(x, y, kEval);
  ASSERT_GT(whole.loss_units, 0);
  EXPECT_LT(whole.loss_units, kEval);
  for (std::size_t k = 0; k < results.size(); ++k) {
    EXPECT_NEAR(results[k].loss, whole.loss, 1e-6 * whole.loss) << "chunk " << k;
    EXPECT_NEAR(results[k].accuracy, whole.accuracy, 1e-12) << "chunk " << k;
    EXPECT_EQ(results[k].samples, kEval);
  }
}

TEST(Trainer, RefusesBadOptionsByName) {
  auto transports = make_local_transports(1);
  auto model = make_model();
  PipelineRank rank(model, ce, transports[0], options());
  const TrainData d = data();
  TrainerOptions to;
  to.batch_size = kBatch;
  to.lr.kind = "exponential";
  try {
    Trainer t(rank, transports[0], transports[0], &d, to);
    FAIL() << "an unknown learning-rate schedule was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'exponential'"), std::string::npos) << e.what();
  }
  to.lr.kind = "cosine";
  EXPECT_THROW(Trainer(rank, transports[0], transports[0], nullptr, to), std::invalid_argument);  // rank 0 needs data
  to.steps = 0;  // neither steps nor epochs
  Trainer t(rank, transports[0], transports[0], &d, to);
  try {
    t.prepare();
    FAIL() << "a run with neither steps nor epochs was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--steps"), std::string::npos) << e.what();
  }
  to.epochs = 1.5;  // 64 samples, batches of 8: 12 steps
  Trainer by_epochs(rank, transports[0], transports[0], &d, to);
  by_epochs.prepare();
  EXPECT_EQ(by_epochs.total(), 12);
}

TEST(Trainer, TwoCopiesOfAPipelineTrainOnTheirHalvesOfEachBatch) {
  // World of 4 ranks = 2 copies of a 2-stage pipeline; each copy's ranks are a contiguous block.
  auto world = make_local_transports(4);
  // One model per copy (a rank trains its stage's layers in place; the copies must not share them).
  std::vector<torch::nn::Sequential> models{make_model(), make_model()};
  const TrainData d = data();
  TrainerOptions to;
  to.steps = 3;
  to.batch_size = 2 * kBatch;
  to.eval_every = 0;
  std::vector<TrainResult> results(4);
  std::vector<std::vector<torch::Tensor>> params(4);
  std::mutex mu;
  std::set<int64_t> seen_rows;  // micro-batch sizes the loss saw (under mu: both copies' last stages write)
  run_on_threads(4, [&](int r) {
    auto w = world[static_cast<std::size_t>(r)];
    const int copy = r / 2;
    auto pipeline = make_group_transport(w, {2 * copy, 2 * copy + 1});
    auto replicas = make_group_transport(w, {r % 2, r % 2 + 2});
    PipelineOptions o = options();
    o.data_parallel = replicas;
    // The loss sees each micro-batch: its size tells which share of the batch the copy trains on.
    auto loss = [&seen_rows, &mu](const torch::Tensor& out, const torch::Tensor& target) {
      {
        std::lock_guard<std::mutex> lk(mu);
        seen_rows.insert(target.size(0));
      }
      return ce(out, target);
    };
    PipelineRank rank(models[static_cast<std::size_t>(copy)], loss, pipeline, o);
    Trainer t(rank, w, pipeline, &d, to);
    TrainResult res = t.run();
    std::lock_guard<std::mutex> lk(mu);
    results[static_cast<std::size_t>(r)] = res;
    for (const torch::Tensor& q : rank.parameters()) params[static_cast<std::size_t>(r)].push_back(q.detach().clone());
  });
  // The copies train on halves of each batch and step with averaged gradients: as one pipeline on the
  // whole batch (within rounding), and a stage's weights stay bitwise equal across the copies.
  EXPECT_EQ(seen_rows, (std::set<int64_t>{kBatch / 2}));  // half of the 2 x kBatch batch, in 2 micro-batches
  const TrainerRun one = run_trainer(2, to);
  ASSERT_EQ(one.result.reached, 3);
  for (const auto& r : results) {
    EXPECT_NEAR(r.first_loss, one.result.first_loss, 1e-5);
    EXPECT_NEAR(r.last_loss, one.result.last_loss, 1e-5);
  }
  for (int stage = 0; stage < 2; ++stage) {
    const auto& a = params[static_cast<std::size_t>(stage)];
    const auto& b = params[static_cast<std::size_t>(stage + 2)];
    ASSERT_EQ(a.size(), b.size());
    ASSERT_FALSE(a.empty());
    for (std::size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(torch::equal(a[k], b[k])) << "stage " << stage << " tensor " << k;
  }
  for (const auto& r : results) EXPECT_EQ(r.reached, 3);
}

namespace {

// A run of `steps` steps saving to `dir` (checkpoint-folder tests): no evaluation, the test's run description.
TrainerOptions saving_to(const fs::path& dir, int steps) {
  TrainerOptions to;
  to.steps = steps;
  to.batch_size = kBatch;
  to.eval_every = 0;
  to.save_dir = dir.string();
  to.run_description = [](int n) { return nlohmann::json{{"test", "trainer"}, {"steps", n}}; };
  return to;
}

// The message of what `f` throws ("" when it does not throw).
template <class F>
std::string thrown(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void write_text(const fs::path& p, const std::string& text) {
  std::FILE* f = std::fopen(p.c_str(), "w");
  ASSERT_NE(f, nullptr) << p;
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

void remove_with_siblings(const fs::path& dir) {
  for (const char* tail : {"", ".partial", ".old", ".pipetrain-lock", ".step-4", ".step-6", ".step-6-2"})
    fs::remove_all(dir.string() + tail);
}

}  // namespace

// A file that appears in the --save folder during the run (a log written there, a user's notes): the
// save cannot replace the folder (it never deletes what it did not write), but the run's training is
// not lost: the complete checkpoint is kept as DIR.step-N, the error names it and the file, and a run
// resumes from it.
TEST(Trainer, AFileThatAppearsInTheSaveFolderDoesNotLoseTheCheckpoint) {
  const fs::path dir = fresh_dir("foreign");
  remove_with_siblings(dir);
  TrainerOptions to = saving_to(dir, 4);
  auto transports = make_local_transports(2);
  auto model = make_model();
  const TrainData d = data();
  const std::string error = thrown([&] {
    run_on_threads(
        2,
        [&](int r) {
          PipelineRank rank(model, ce, transports[static_cast<std::size_t>(r)], options());
          TrainerCallbacks cb;
          if (r == 0)
            cb.on_step = [&](const StepRecord& s) {
              if (s.step == 2) {  // during the run, before the end's save
                fs::create_directories(dir);
                write_text(dir / "train.jsonl", "{}\n");
              }
            };
          auto t = transports[static_cast<std::size_t>(r)];
          Trainer(rank, t, t, &d, to, cb).run();
        },
        [&](int r) { transports[static_cast<std::size_t>(r)]->abort("rank " + std::to_string(r) + " failed"); });
  });
  const fs::path kept = dir.string() + ".step-4";
  EXPECT_NE(error.find(kept.string()), std::string::npos) << error;
  EXPECT_NE(error.find("train.jsonl"), std::string::npos) << error;
  EXPECT_NE(error.find("--resume " + kept.string()), std::string::npos) << error;
  EXPECT_EQ(read_checkpoint(kept.string()).at("step").get<int>(), 4);
  EXPECT_TRUE(fs::exists(dir / "train.jsonl"));  // untouched
  EXPECT_FALSE(fs::exists(dir.string() + ".partial"));

  TrainerOptions more = to;
  more.steps = 6;
  more.resume_dir = kept.string();
  more.save_dir = kept.string();
  const TrainerRun resumed = run_trainer(2, more);
  EXPECT_EQ(resumed.result.start, 4);
  EXPECT_EQ(read_checkpoint(kept.string()).at("step").get<int>(), 6);
  remove_with_siblings(dir);
}

// The same when the save folder is a checkpoint (a resumed run saving over it) and a user's file
// appears in it: the old checkpoint and the file stay as they were, the new one is kept beside it (under
// the next free name when DIR.step-N is taken).
TEST(Trainer, ANoteAddedToTheCheckpointFolderKeepsBothCheckpoints) {
  const fs::path dir = fresh_dir("notes");
  remove_with_siblings(dir);
  TrainerOptions to = saving_to(dir, 4);
  run_trainer(2, to);
  write_text(dir / "notes.txt", "mine\n");
  fs::create_directories(dir.string() + ".step-6");  // taken: the next free name is used
  TrainerOptions more = to;
  more.steps = 6;
  more.resume_dir = dir.string();
  const std::string error = thrown([&] { run_trainer(2, more); });
  const fs::path kept = dir.string() + ".step-6-2";
  EXPECT_NE(error.find(kept.string()), std::string::npos) << error;
  EXPECT_NE(error.find("notes.txt"), std::string::npos) << error;
  EXPECT_EQ(read_checkpoint(kept.string()).at("step").get<int>(), 6);
  EXPECT_EQ(read_checkpoint(dir.string()).at("step").get<int>(), 4);
  EXPECT_TRUE(fs::exists(dir / "notes.txt"));
  EXPECT_TRUE(fs::is_empty(dir.string() + ".step-6"));
  remove_with_siblings(dir);
}

// A run holds its save folder's lock from prepare() to its end: a second run saving there is refused
// before it trains, with the holder's pid; once the holder is gone (released, or killed: the kernel
// drops an flock with its process) the folder is free again.
TEST(CheckpointDirLock, ASecondHolderIsRefusedWithThePidAndAKilledHolderDoesNotBlock) {
  const fs::path dir = fresh_dir("lock");
  remove_with_siblings(dir);
  {
    CheckpointDirLock held(dir.string(), "--save");
    const std::string error = thrown([&] { CheckpointDirLock again(dir.string(), "--save"); });
    EXPECT_NE(error.find("another run is saving to " + dir.string()), std::string::npos) << error;
    EXPECT_NE(error.find("pid " + std::to_string(::getpid())), std::string::npos) << error;
    EXPECT_NE(thrown([&] { check_checkpoint_dir_unlocked(dir.string()); }), "");
    EXPECT_NE(thrown([&] { prepare_checkpoint_dir(dir.string(), "--save"); }), "");
  }
  EXPECT_EQ(thrown([&] { CheckpointDirLock again(dir.string()); }), "");  // released
  EXPECT_FALSE(fs::exists(dir.string() + ".pipetrain-lock"));              // and removed

  // A holder killed with SIGKILL: its lock file stays, its lock does not.
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    try {
      CheckpointDirLock held(dir.string());
      (void)!::write(ready[1], "x", 1);
      for (;;) ::pause();
    } catch (...) {
    }
    ::_exit(3);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  const std::string error = thrown([&] { CheckpointDirLock again(dir.string()); });
  EXPECT_NE(error.find("pid " + std::to_string(child)), std::string::npos) << error;
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ::close(ready[0]);
  ::close(ready[1]);
  EXPECT_TRUE(fs::exists(dir.string() + ".pipetrain-lock"));  // stale
  EXPECT_EQ(thrown([&] { CheckpointDirLock again(dir.string()); }), "");

  // A user's own file of that name is neither written nor taken.
  write_text(dir.string() + ".pipetrain-lock", "my notes\n");
  EXPECT_NE(thrown([&] { CheckpointDirLock again(dir.string()); }).find("not written by pipetrain"), std::string::npos);
  std::ifstream in(dir.string() + ".pipetrain-lock");
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "my notes");
  remove_with_siblings(dir);
}

TEST(Trainer, ASecondRunSavingToTheSameFolderIsRefusedBeforeItTrains) {
  const fs::path dir = fresh_dir("second");
  remove_with_siblings(dir);
  CheckpointDirLock other(dir.string());  // "the first run"
  TrainerOptions to = saving_to(dir, 4);
  std::atomic<int> steps{0};
  const std::string error = thrown([&] {
    auto transports = make_local_transports(2);
    auto model = make_model();
    const TrainData d = data();
    run_on_threads(2, [&](int r) {
      PipelineRank rank(model, ce, transports[static_cast<std::size_t>(r)], options());
      TrainerCallbacks cb;
      cb.on_step = [&](const StepRecord&) { ++steps; };
      auto t = transports[static_cast<std::size_t>(r)];
      Trainer(rank, t, t, &d, to, cb).run();
    });
  });
  EXPECT_NE(error.find("another run is saving to " + dir.string()), std::string::npos) << error;
  EXPECT_NE(error.find("pid " + std::to_string(::getpid())), std::string::npos) << error;
  EXPECT_EQ(steps.load(), 0);
  EXPECT_FALSE(fs::exists(dir));
  remove_with_siblings(dir);
}

// A stop asked for during an asynchronous call that holds the rest of the run (the vote before each
// call never sees it) is still reported: the run ends as stopped, after the end's checkpoint.
TEST(Trainer, AStopDuringTheLastAsynchronousCallIsReported) {
  const fs::path dir = fresh_dir("async-stop");
  remove_with_siblings(dir);
  TrainerOptions to = saving_to(dir, 6);
  to.save_on_interrupt = true;
  std::atomic<int> calls{0};
  to.stop_requested = [&calls] { return calls.fetch_add(1) >= 2 ? 15 : 0; };  // after the call began
  int total = 6;
  const LrSchedule lr = to.lr;
  PipelineOptions po = options("pipedream");
  po.microbatches = 1;
  const TrainerRun run = run_trainer(2, to, po, [&](int, PipelineOptions& o) {
    o.learning_rate = [lr, &total](int k) { return lr.at(k, total); };
  });
  EXPECT_EQ(run.result.last.steps, 6);  // one call
  EXPECT_EQ(run.result.stopped_by, 15);
  EXPECT_EQ(run.all[1].stopped_by, 15);
  EXPECT_EQ(run.result.reached, 6);
  EXPECT_EQ(read_checkpoint(dir.string()).at("step").get<int>(), 6);
  remove_with_siblings(dir);
}

// Checks forward-only passes (evaluation) and per-layer checkpoints (runtime/checkpoint.h) on the
// in-process transport: the pipelined forward equals the model's own forward in evaluation mode; a run
// resumed from a checkpoint continues with bitwise the same losses as an uninterrupted run (SGD with
// momentum, Adam, AdamW), also when the checkpoint is loaded at another pipeline degree (then within
// fp32 rounding); corrupted, truncated and mismatched checkpoints are refused with what is wrong, and a
// save replaces the previous checkpoint whole.
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>
#include <zlib.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <thread>

#include "pipetrain/core/error.h"
#include "pipetrain/plan/costs.h"
#include "pipetrain/runtime/checkpoint.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/profiler.h"
#include "pipetrain/runtime/split_linear.h"

using namespace pipetrain;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kIn = 5, kHidden = 8, kOut = 4, kBatch = 12;

torch::nn::Sequential make_model(uint64_t seed, double dropout = 0.0) {
  torch::manual_seed(seed);
  torch::nn::Sequential m;
  m->push_back(nn::Linear(kIn, kHidden));
  m->push_back(torch::nn::Tanh());
  m->push_back(torch::nn::Dropout(dropout));
  m->push_back(nn::Linear(kHidden, kHidden));
  m->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
  m->push_back(nn::Linear(kHidden, kOut));
  return m;
}

torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out, target);
}

struct Batch {
  torch::Tensor x, y;
};
Batch batch(int step) {
  torch::manual_seed(1000 + step);
  return {torch::randn({kBatch, kIn}), torch::randint(kOut, {kBatch}, torch::kLong)};
}

// All ranks of one pipeline as PipelineRanks over in-process transports, driven on threads.
struct Ranks {
  std::vector<std::unique_ptr<PipelineRank>> ranks;
  std::vector<std::shared_ptr<Transport>> transports;
  Ranks(torch::nn::Sequential model, int p, const PipelineOptions& o) {
    transports = make_local_transports(p);
    for (int r = 0; r < p; ++r) ranks.push_back(std::make_unique<PipelineRank>(model, ce, transports[r], o));
  }
  int size() const { return static_cast<int>(ranks.size()); }
  template <class F>
  void each(F f) {
    run_on_threads(size(), [&](int r) { f(*ranks[r], *transports[r]); });
  }
  std::vector<double> train(int steps) {
    std::vector<double> losses;
    for (int k = 0; k < steps; ++k) {
      std::vector<double> l(size());
      const int step = ranks[0]->step();
      const Batch b = batch(step);
      each([&](PipelineRank& pr, Transport& t) { l[t.rank()] = pr.train_step(b.x, b.y, kBatch).loss; });
      losses.push_back(l[0]);
    }
    return losses;
  }
  void save(const std::string& dir) {
    each([&](PipelineRank& pr, Transport& t) { save_checkpoint(pr, t, dir, {{"model", {{"width", kHidden}}}}); });
  }
  void load(const std::string& dir) {
    each([&](PipelineRank& pr, Transport&) { load_checkpoint(pr, dir); });
  }
};

PipelineOptions options(const std::string& optimizer, const std::string& schedule = "1f1b", int m = 3) {
  PipelineOptions o;
  o.schedule = schedule;
  o.microbatches = m;
  o.optimizer.name = optimizer;
  o.optimizer.lr = optimizer == "sgd" ? 0.1 : 0.01;
  o.optimizer.momentum = optimizer == "sgd" ? 0.9 : 0.0;
  o.optimizer.weight_decay = optimizer == "adamw" ? 0.01 : 0.0;
  return o;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("pipetrain-test-ckpt-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(d);
  return d;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(no UsageError)";
}

}  // namespace

TEST(ForwardOnly, EqualsTheModelInEvaluationMode) {
  for (int p : {1, 2, 3})
    for (int m : {1, 4}) {
      auto model = make_model(7, /*dropout=*/0.5);
      const Batch b = batch(0);
      model->eval();
      const torch::Tensor want = model->forward(b.x).detach();
      model->train();
      Ranks ranks(model, p, options("sgd", "1f1b", m));
      std::vector<torch::Tensor> out(p);
      std::vector<EvalStats> ev(p);
      ranks.each([&](PipelineRank& pr, Transport& t) {
        out[t.rank()] = pr.forward_only(b.x, kBatch, m);
        ev[t.rank()] = pr.evaluate(b.x, b.y, kBatch, m);
      });
      for (int r = 0; r + 1 < p; ++r) EXPECT_FALSE(out[r].defined()) << "rank " << r << " does not hold the last stage";
      ASSERT_TRUE(out[p - 1].defined());
      EXPECT_TRUE(torch::allclose(out[p - 1], want, 1e-5, 1e-6)) << "p=" << p << " m=" << m;
      const double loss = ce(want, b.y).item<double>();
      const double acc = want.argmax(1).eq(b.y).sum().item<double>() / kBatch;
      for (int r = 0; r < p; ++r) {  // known on every rank
        EXPECT_NEAR(ev[r].loss, loss, 1e-5 * std::abs(loss));
        EXPECT_DOUBLE_EQ(ev[r].accuracy, acc);
      }
      // Training mode is back after the pass: dropout makes two training forwards differ.
      EXPECT_TRUE(model->is_training());
    }
}

TEST(ForwardOnly, InterleavedStagesAndFloatTargetsHaveNoAccuracy) {
  auto model = make_model(3);
  const Batch b = batch(1);
  const torch::Tensor want = model->forward(b.x).detach();
  PipelineOptions o = options("sgd", "interleaved", 4);
  o.virtual_stages = 2;
  Ranks ranks(model, 2, o);
  std::vector<torch::Tensor> out(2);
  ranks.each([&](PipelineRank& pr, Transport& t) { out[t.rank()] = pr.forward_only(b.x, kBatch); });
  // Stage 3 (the last) lives on rank 1 when v = 2, p = 2.
  ASSERT_TRUE(out[1].defined());
  EXPECT_TRUE(torch::allclose(out[1], want, 1e-5, 1e-6));
}

TEST(Checkpoint, ResumeGivesBitwiseTheSameLosses) {
  for (const std::string opt : {"sgd", "adam", "adamw"}) {
    SCOPED_TRACE(opt);
    const fs::path dir = fresh_dir("resume-" + opt);
    Ranks straight(make_model(11), 2, options(opt));
    const std::vector<double> want = straight.train(5);

    Ranks first(make_model(11), 2, options(opt));
    const std::vector<double> head = first.train(2);
    EXPECT_EQ(head, std::vector<double>(want.begin(), want.begin() + 2));
    first.save(dir.string());
    // A model built from another seed: everything that matters must come from the checkpoint.
    Ranks resumed(make_model(99), 2, options(opt));
    resumed.load(dir.string());
    EXPECT_EQ(resumed.ranks[0]->step(), 2);
    const std::vector<double> tail = resumed.train(3);
    EXPECT_EQ(tail, std::vector<double>(want.begin() + 2, want.end())) << "resumed losses differ";
    fs::remove_all(dir);
  }
}

TEST(Checkpoint, LoadsAtAnotherPipelineDegree) {
  const fs::path dir = fresh_dir("regroup");
  Ranks straight(make_model(5), 2, options("adam"));
  const std::vector<double> want = straight.train(4);
  Ranks first(make_model(5), 2, options("adam"));
  first.train(2);
  first.save(dir.string());
  for (int p : {1, 3}) {
    SCOPED_TRACE(p);
    Ranks resumed(make_model(77), p, options("adam", "gpipe", 2));
    resumed.load(dir.string());
    // Same math, other grouping and micro-batching: equal up to fp32 summation order.
    const std::vector<double> tail = resumed.train(2);
    for (int k = 0; k < 2; ++k) EXPECT_NEAR(tail[k], want[2 + k], 1e-5 * std::abs(want[2 + k]));
  }
  fs::remove_all(dir);
}

TEST(Checkpoint, RefusesCorruptedTruncatedAndMismatched) {
  const fs::path dir = fresh_dir("corrupt");
  Ranks ranks(make_model(5), 2, options("sgd"));
  ranks.train(1);
  ranks.save(dir.string());
  const nlohmann::json m = read_checkpoint(dir.string());
  EXPECT_EQ(m.at("layers"), 6);
  EXPECT_EQ(m.at("step"), 1);
  const fs::path layer = dir / "layer-00003.pt";
  std::string bytes;
  {
    std::ifstream in(layer, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto write = [&](const std::string& b) { std::ofstream(layer, std::ios::binary | std::ios::trunc) << b; };
  std::string flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x5a;
  write(flipped);
  EXPECT_NE(error_of([&] { read_checkpoint(dir.string()); }).find("layer-00003.pt fails its CRC-32 check"),
            std::string::npos);
  {  // Loading checks the files a rank reads, too (not only the CLI's up-front read_checkpoint).
    PipelineRank all_layers(make_model(5), ce, make_local_transports(1)[0], options("sgd", "1f1b", 1));
    EXPECT_NE(error_of([&] { load_checkpoint(all_layers, dir.string()); }).find("fails its CRC-32 check"),
              std::string::npos);
  }
  write(bytes.substr(0, bytes.size() - 10));
  EXPECT_NE(error_of([&] { read_checkpoint(dir.string()); }).find("truncated"), std::string::npos);
  write(bytes);
  EXPECT_NO_THROW(read_checkpoint(dir.string()));
  // Another model (wider layers): refused naming the tensor and both shapes, before any weight changes.
  torch::manual_seed(1);
  torch::nn::Sequential wide;
  wide->push_back(nn::Linear(kIn, kHidden + 1));
  wide->push_back(torch::nn::Tanh());
  wide->push_back(torch::nn::Dropout(0.0));
  wide->push_back(nn::Linear(kHidden + 1, kHidden));
  wide->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
  wide->push_back(nn::Linear(kHidden, kOut));
  auto t = make_local_transports(1);
  PipelineRank solo(wide, ce, t[0], options("sgd", "1f1b", 1));
  const std::string err = error_of([&] { load_checkpoint(solo, dir.string()); });
  EXPECT_NE(err.find("param/weight"), std::string::npos) << err;
  EXPECT_NE(err.find("[8, 5]"), std::string::npos) << err;
  // Another optimizer's state is refused too.
  PipelineRank adam(make_model(5), ce, make_local_transports(1)[0], options("adam", "1f1b", 1));
  EXPECT_NE(error_of([&] { load_checkpoint(adam, dir.string()); }).find("optimizer (adam)"), std::string::npos);
  // Not a checkpoint at all.
  EXPECT_NE(error_of([&] { read_checkpoint((dir / "nope").string()); }).find("does not exist"), std::string::npos);
  fs::remove(dir / "manifest.json");
  EXPECT_NE(error_of([&] { read_checkpoint(dir.string()); }).find("no manifest.json"), std::string::npos);
  fs::remove_all(dir);
}

// A tester's finding (2026-11-28): a rank whose last layer file was damaged (or whose last layer had
// another shape) loaded its earlier layers and then refused, leaving the earlier layers' checkpoint
// weights in a model at step 0. A refusal now leaves the rank as it was.
TEST(Checkpoint, ARefusedLoadLeavesTheRankAsItWas) {
  const fs::path dir = fresh_dir("refused-load");
  Ranks saved(make_model(5), 1, options("adam"));
  saved.train(3);
  saved.save(dir.string());
  auto weights_of = [](PipelineRank& r) {
    std::vector<torch::Tensor> out;
    for (const auto& p : r.parameters()) out.push_back(p.detach().clone());
    return out;
  };
  auto unchanged = [](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!torch::equal(a[i], b[i])) return false;
    return true;
  };
  // The last layer damaged: every earlier layer's file is good.
  const fs::path last = dir / "layer-00005.pt";
  std::string bytes;
  {
    std::ifstream in(last, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::string flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x5a;
  std::ofstream(last, std::ios::binary | std::ios::trunc) << flipped;
  PipelineRank fresh(make_model(9), ce, make_local_transports(1)[0], options("adam", "1f1b", 1));
  const std::vector<torch::Tensor> before = weights_of(fresh);
  EXPECT_NE(error_of([&] { load_checkpoint(fresh, dir.string()); }).find("fails its CRC-32 check"), std::string::npos);
  EXPECT_TRUE(unchanged(before, weights_of(fresh)));
  EXPECT_EQ(fresh.step(), 0);
  std::ofstream(last, std::ios::binary | std::ios::trunc) << bytes;
  // The last layer of another shape: refused before the first layer is loaded.
  torch::manual_seed(2);
  torch::nn::Sequential other;
  other->push_back(nn::Linear(kIn, kHidden));
  other->push_back(torch::nn::Tanh());
  other->push_back(torch::nn::Dropout(0.0));
  other->push_back(nn::Linear(kHidden, kHidden));
  other->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
  other->push_back(nn::Linear(kHidden, kOut + 1));
  PipelineRank wider(other, ce, make_local_transports(1)[0], options("adam", "1f1b", 1));
  const std::vector<torch::Tensor> wider_before = weights_of(wider);
  const std::string err = error_of([&] { load_checkpoint(wider, dir.string()); });
  EXPECT_NE(err.find("layer 5 tensor 'param/weight' has shape [4, 8] in the checkpoint but [5, 8]"), std::string::npos)
      << err;
  EXPECT_TRUE(unchanged(wider_before, weights_of(wider)));
  EXPECT_EQ(wider.step(), 0);
  // And the good checkpoint still loads.
  EXPECT_NO_THROW(load_checkpoint(fresh, dir.string()));
  EXPECT_EQ(fresh.step(), 3);
  fs::remove_all(dir);
}

TEST(Checkpoint, SaveReplacesThePreviousWholeAndClearsLeftovers) {
  const fs::path dir = fresh_dir("replace");
  Ranks ranks(make_model(5), 2, options("sgd"));
  ranks.train(1);
  ranks.save(dir.string());
  fs::create_directories(dir.string() + ".partial");  // as left by a crashed save (marked as ours)
  std::ofstream(dir.string() + ".partial/.pipetrain-partial");
  std::ofstream(dir.string() + ".partial/layer-00000.pt") << "x";
  ranks.train(2);
  ranks.save(dir.string());
  EXPECT_EQ(read_checkpoint(dir.string()).at("step"), 3);
  EXPECT_FALSE(fs::exists(dir.string() + ".partial"));
  EXPECT_FALSE(fs::exists(dir.string() + ".old"));
  EXPECT_FALSE(fs::exists(dir / ".pipetrain-partial"));
  fs::remove_all(dir);
}

// issue 16: `--save DIR` deleted whatever was at DIR. A save never deletes or replaces what is not a
// pipetrain checkpoint: a user's folder, a DIR.old or a DIR.partial it did not make. Nothing is written.
TEST(Checkpoint, SaveRefusesWhatIsNotOurs) {
  const fs::path dir = fresh_dir("notours");
  fs::create_directories(dir);
  std::ofstream(dir / "thesis.txt") << "precious";
  // A refused save aborts the pipeline's transport (every rank stops), so each attempt gets new ranks.
  auto refused_save = [](const fs::path& where) {
    Ranks ranks(make_model(5), 2, options("sgd"));
    ranks.train(1);
    return error_of([&] { ranks.save(where.string()); });
  };
  // The save is not put in its place, but the run's training is not lost: it is kept beside it.
  std::string err = refused_save(dir);
  EXPECT_NE(err.find("is a folder that is not a pipetrain checkpoint"), std::string::npos) << err;
  EXPECT_NE(err.find("thesis.txt"), std::string::npos) << err;
  EXPECT_NE(err.find("complete in " + dir.string() + ".step-1"), std::string::npos) << err;
  EXPECT_EQ(read_checkpoint(dir.string() + ".step-1").at("step"), 1);
  fs::remove_all(dir.string() + ".step-1");
  EXPECT_NE(error_of([&] { prepare_checkpoint_dir(dir.string()); }).find("not a pipetrain checkpoint"), std::string::npos);
  std::ifstream in(dir / "thesis.txt");
  std::string text;
  in >> text;
  EXPECT_EQ(text, "precious");
  EXPECT_FALSE(fs::exists(dir.string() + ".partial"));
  EXPECT_FALSE(fs::exists(dir / "manifest.json"));
  // A user's DIR.partial is not ours to delete either: the save, which writes there first, is refused.
  // A user's DIR.old is left alone (a save needs that name only on a file system that cannot exchange
  // folders, and then refuses).
  const fs::path ckpt = fresh_dir("notours-ckpt");
  for (const std::string suffix : {".old", ".partial"}) {
    const fs::path theirs = ckpt.string() + suffix;
    fs::create_directories(theirs);
    std::ofstream(theirs / "notes.txt") << "mine";
    err = refused_save(ckpt);
    if (suffix == ".partial")
      EXPECT_NE(err.find(theirs.string() + " exists and"), std::string::npos) << suffix << ": " << err;
    else
      EXPECT_EQ(err, "(no UsageError)");
    EXPECT_TRUE(fs::exists(theirs / "notes.txt")) << suffix;
    fs::remove_all(theirs);
    fs::remove_all(ckpt);
  }
  // An empty folder is fine (mkdir first, then save into it).
  fs::create_directories(ckpt);
  Ranks ranks(make_model(5), 2, options("sgd"));
  ranks.train(1);
  ranks.save(ckpt.string());
  EXPECT_EQ(read_checkpoint(ckpt.string()).at("step"), 1);
  fs::remove_all(dir);
  fs::remove_all(ckpt);
}

namespace {

// Ranks trained for one step with `optimizer` and saved into `dir`.
Ranks saved_after_one_step(const fs::path& dir, const std::string& optimizer = "sgd") {
  Ranks ranks(make_model(5), 2, options(optimizer));
  ranks.train(1);
  ranks.save(dir.string());
  return ranks;
}

// Two saves into `dir` (steps 1 and 2), with a copy of the first in `prev`: the checkpoint the second
// replaced, as a stop before its removal would leave it.
void two_saves(Ranks& ranks, const fs::path& dir, const fs::path& prev) {
  ranks.train(1);
  ranks.save(dir.string());
  fs::copy(dir, prev);
  ranks.train(1);
  ranks.save(dir.string());  // step 2; its manifest records step 1's as replaced
}

}  // namespace

// A stop between the fallback path's two renames leaves no DIR, the new checkpoint complete in
// DIR.partial (unmarked) and the one it replaced in DIR.old: the new one's manifest proves both ours, so
// the next save finishes that swap (never deleting the only complete copy) and then saves as usual.
TEST(Checkpoint, SaveFinishesAnInterruptedSwap) {
  const fs::path dir = fresh_dir("onlycopy"), prev = fresh_dir("onlycopy-prev");
  Ranks ranks(make_model(5), 2, options("sgd"));
  two_saves(ranks, dir, prev);
  fs::rename(dir, dir.string() + ".partial");  // as the stop left it
  fs::rename(prev, dir.string() + ".old");
  EXPECT_EQ(prepare_checkpoint_dir(dir.string()), dir.string());  // allowed, and changes nothing
  EXPECT_TRUE(fs::exists(dir.string() + ".old/manifest.json"));
  EXPECT_TRUE(fs::exists(dir.string() + ".partial/manifest.json"));
  ranks.train(1);
  ranks.save(dir.string());
  EXPECT_EQ(read_checkpoint(dir.string()).at("step"), 3);
  EXPECT_FALSE(fs::exists(dir.string() + ".old"));
  EXPECT_FALSE(fs::exists(dir.string() + ".partial"));
  fs::remove_all(dir);
}

// issue 23: `mv run run.old; train --save run` deleted the user's run.old (the save's recovery took any
// checkpoint at DIR.old for its own and moved it into DIR, then replaced it). A DIR.old the save cannot
// prove its own is never touched.
TEST(Checkpoint, SaveNeverTakesAUsersOldFolder) {
  const fs::path dir = fresh_dir("usersold");
  const fs::path old = dir.string() + ".old";
  Ranks ranks = saved_after_one_step(dir);
  fs::rename(dir, old);  // the user keeps this run aside
  const std::string before = [&] { std::ifstream in(old / "manifest.json"); return std::string(std::istreambuf_iterator<char>(in), {}); }();
  EXPECT_EQ(prepare_checkpoint_dir(dir.string()), dir.string());
  ranks.train(2);
  ranks.save(dir.string());
  EXPECT_EQ(read_checkpoint(dir.string()).at("step"), 3);
  EXPECT_EQ(read_checkpoint(old.string()).at("step"), 1);  // whole: every layer file reads and checks
  const std::string after = [&] { std::ifstream in(old / "manifest.json"); return std::string(std::istreambuf_iterator<char>(in), {}); }();
  EXPECT_EQ(before, after);
  fs::remove_all(dir);
  fs::remove_all(old);
}

// issue 23: a complete checkpoint copied to DIR.partial was deleted by `--save DIR` (anything holding a
// manifest was taken for a leftover of ours). Only a marked folder, or the checkpoint DIR's manifest
// says it replaced, is ours; this one is refused and kept.
TEST(Checkpoint, SaveRefusesACheckpointCopiedToDotPartial) {
  const fs::path a = fresh_dir("copied-a"), b = fresh_dir("copied-b");
  const fs::path partial = b.string() + ".partial";
  Ranks ranks(make_model(5), 2, options("sgd"));
  ranks.train(1);
  ranks.save(a.string());
  fs::copy(a, partial);
  // No DIR: a first save stopped before its rename would leave the same; refused, kept, and said so.
  const std::string e = error_of([&] { prepare_checkpoint_dir(b.string()); });
  EXPECT_NE(e.find(partial.string() + " holds a complete checkpoint at step 1 and " + b.string() + " does not exist"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("Nothing was deleted"), std::string::npos) << e;
  // Also when DIR exists: its manifest does not name this copy as what it replaced.
  Ranks again(make_model(5), 2, options("sgd"));
  again.train(1);
  fs::rename(partial, a.string() + ".keep");
  again.save(b.string());
  fs::rename(a.string() + ".keep", partial);
  const std::string err = error_of([&] { again.save(b.string()); });
  EXPECT_NE(err.find(partial.string() + " exists and"), std::string::npos) << err;
  EXPECT_EQ(read_checkpoint(partial.string()).at("step"), 1);
  fs::remove_all(a);
  fs::remove_all(b);
  fs::remove_all(partial);
}

// issue 23: `--resume ck --save ck` where ck also held the user's notes.txt and results/r.txt deleted
// both (the "a folder holding anything else is refused" check was skipped when a manifest was present).
// A checkpoint folder may hold only its manifest and the files it lists; anything else is refused,
// named, at start-up and at save time, and kept.
TEST(Checkpoint, SaveRefusesACheckpointFolderHoldingOtherFiles) {
  const fs::path dir = fresh_dir("extras");
  Ranks ranks = saved_after_one_step(dir);
  std::ofstream(dir / "notes.txt") << "mine";
  fs::create_directories(dir / "results");
  std::ofstream(dir / "results" / "r.txt") << "also mine";
  std::string err = error_of([&] { prepare_checkpoint_dir(dir.string()); });
  EXPECT_NE(err.find("also holds notes.txt, results"), std::string::npos) << err;
  Ranks again(make_model(5), 2, options("sgd"));
  again.load(dir.string());
  again.train(1);
  err = error_of([&] { again.save(dir.string()); });
  EXPECT_NE(err.find("notes.txt"), std::string::npos) << err;
  EXPECT_TRUE(fs::exists(dir / "notes.txt"));
  EXPECT_TRUE(fs::exists(dir / "results" / "r.txt"));
  EXPECT_EQ(read_checkpoint(dir.string()).at("step"), 1);
  EXPECT_FALSE(fs::exists(dir.string() + ".partial"));
  // The new checkpoint (step 2) is kept beside DIR, complete, and named in the error.
  EXPECT_NE(err.find("complete in " + dir.string() + ".step-2"), std::string::npos) << err;
  EXPECT_EQ(read_checkpoint(dir.string() + ".step-2").at("step"), 2);
  fs::remove_all(dir.string() + ".step-2");
  fs::remove_all(dir);
}

// A stop after the exchange but before the previous checkpoint's removal leaves it in DIR.partial,
// unmarked: DIR's manifest records its fingerprint, so the next save proves it ours and removes it
// (file by file from its manifest).
TEST(Checkpoint, SaveClearsThePreviousCheckpointItReplaced) {
  const fs::path dir = fresh_dir("replaced"), prev = fresh_dir("replaced-prev");
  Ranks ranks(make_model(5), 2, options("sgd"));
  two_saves(ranks, dir, prev);
  fs::rename(prev, dir.string() + ".partial");
  EXPECT_EQ(prepare_checkpoint_dir(dir.string()), dir.string());
  ranks.train(1);
  ranks.save(dir.string());
  EXPECT_EQ(read_checkpoint(dir.string()).at("step"), 3);
  EXPECT_FALSE(fs::exists(dir.string() + ".partial"));
  fs::remove_all(dir);
}

// Two runs saving to one folder: the second is told that another run is saving there (the first holds
// a lock on its marker), not "No such file or directory"; nothing of the first is touched.
TEST(Checkpoint, SecondRunSavingToTheSameFolderIsTold) {
  const fs::path dir = fresh_dir("twosavers");
  const fs::path partial = dir.string() + ".partial";
  fs::create_directories(partial);
  std::ofstream(partial / ".pipetrain-partial");
  std::ofstream(partial / "layer-00000.pt") << "being written";
  const int fd = ::open((partial / ".pipetrain-partial").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);  // as the other run's leader holds it
  EXPECT_NE(error_of([&] { prepare_checkpoint_dir(dir.string()); }).find("another run is saving to"), std::string::npos);
  Ranks ranks(make_model(5), 2, options("sgd"));
  ranks.train(1);
  const std::string err = error_of([&] { ranks.save(dir.string()); });
  EXPECT_NE(err.find("another run is saving to"), std::string::npos) << err;
  EXPECT_TRUE(fs::exists(partial / "layer-00000.pt"));
  ::close(fd);  // that run is gone: its marked leftovers are ours to clear
  Ranks later(make_model(5), 2, options("sgd"));
  later.train(1);
  later.save(dir.string());
  EXPECT_EQ(read_checkpoint(dir.string()).at("step"), 1);
  EXPECT_FALSE(fs::exists(partial));
  fs::remove_all(dir);
}

// Reading a checkpoint while another run replaces it reported a false CRC failure ("corrupted"); now
// a read that fails because the manifest changed meanwhile says so.
TEST(Checkpoint, ReadingWhileAnotherRunSavesIsNotCalledCorrupted) {
  const fs::path dir = fresh_dir("readwhilesave");
  Ranks ranks = saved_after_one_step(dir);
  std::atomic<bool> done{false};
  std::vector<std::string> wrong;
  std::thread reader([&] {
    while (!done) {
      const std::string err = error_of([&] { read_checkpoint(dir.string()); });
      if (err != "(no UsageError)" && err.find("was replaced by a save while it was read") == std::string::npos &&
          wrong.size() < 3)
        wrong.push_back(err);
    }
  });
  for (int k = 0; k < 40; ++k) ranks.save(dir.string());
  done = true;
  reader.join();
  EXPECT_TRUE(wrong.empty()) << wrong.front();
  fs::remove_all(dir);
}

namespace {

// Replaces layer `layer`'s file in checkpoint `dir` with `state` (pickled as a save does) and updates
// the manifest's size and CRC-32 to match, as a well-formed but foreign file would be.
void rewrite_layer(const fs::path& dir, int layer, const std::vector<std::pair<std::string, torch::Tensor>>& state) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, t] : state) dict.insert(name, t);
  const std::vector<char> bytes = torch::pickle_save(dict);
  char name[32];
  std::snprintf(name, sizeof name, "layer-%05d.pt", layer);
  std::ofstream(dir / name, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::ifstream in(dir / "manifest.json");
  nlohmann::json m = nlohmann::json::parse(in);
  m["files"][layer]["bytes"] = bytes.size();
  m["files"][layer]["crc32"] = static_cast<uint32_t>(crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes.data()),
                                                           static_cast<uInt>(bytes.size())));
  std::ofstream(dir / "manifest.json", std::ios::trunc) << m.dump(2);
}

}  // namespace

// issue 23: a checkpoint with NaN weights (valid CRC) resumed "nan -> nan", exit 0; a float64 layer file
// failed with LibTorch's "INTERNAL ASSERT FAILED ... report a bug to PyTorch". Both are refused, naming
// the file and the tensor.
TEST(Checkpoint, RefusesNonFiniteAndWronglyTypedTensors) {
  const fs::path dir = fresh_dir("nanweights");
  Ranks ranks = saved_after_one_step(dir, "adam");
  auto state = ranks.ranks[0]->layer_state(0);
  std::vector<std::pair<std::string, torch::Tensor>> bad = state;
  bad[0].second = bad[0].second.clone();
  bad[0].second.view({-1})[0] = std::numeric_limits<float>::quiet_NaN();
  rewrite_layer(dir, 0, bad);
  Ranks again(make_model(5), 2, options("adam"));
  std::string err = error_of([&] { again.load(dir.string()); });
  EXPECT_NE(err.find("holds NaN or infinite values"), std::string::npos) << err;
  EXPECT_NE(err.find(bad[0].first), std::string::npos) << err;
  std::vector<std::pair<std::string, torch::Tensor>> wide;
  for (const auto& [name, t] : state) wide.emplace_back(name, t.is_floating_point() ? t.to(torch::kDouble) : t);
  rewrite_layer(dir, 0, wide);
  Ranks third(make_model(5), 2, options("adam"));
  err = error_of([&] { third.load(dir.string()); });
  EXPECT_NE(err.find("is Double in the checkpoint but Float in the model"), std::string::npos) << err;
  fs::remove_all(dir);
}

// A corrupted manifest may be crafted: a version nested 100,000 levels deep overflowed the stack while
// the error message printed it. The nesting is bounded and messages show a short excerpt.
TEST(Checkpoint, DeeplyNestedManifestIsRefusedShortly) {
  const fs::path dir = fresh_dir("deep");
  Ranks ranks = saved_after_one_step(dir);
  std::string text;
  {
    std::ifstream in(dir / "manifest.json");
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::size_t at = text.find("\"version\": 1");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 12, "\"version\": " + deep);
  std::ofstream(dir / "manifest.json", std::ios::trunc) << text;
  const std::string err = error_of([&] { read_checkpoint(dir.string()); });
  EXPECT_NE(err.find("nest more than 64 levels deep"), std::string::npos) << err.substr(0, 300);
  EXPECT_LT(err.size(), 600u);
  // A shallower one that parses: its version is echoed as an excerpt, not whole.
  text.replace(at, 11 + deep.size(), "\"version\": [" + [] { std::string s; for (int i = 0; i < 20000; ++i) s += "1,"; return s + "1"; }() + "]");
  std::ofstream(dir / "manifest.json", std::ios::trunc) << text;
  const std::string err2 = error_of([&] { read_checkpoint(dir.string()); });
  EXPECT_NE(err2.find("has version [1,1,"), std::string::npos) << err2.substr(0, 300);
  EXPECT_LT(err2.size(), 600u);
  fs::remove_all(dir);
}

// issue 23: a manifest with "stages": 0 passed (the unsigned branch skipped the lower bound).
TEST(Checkpoint, ManifestFieldsBelowTheirRangeAreRefused) {
  const fs::path dir = fresh_dir("stageszero");
  Ranks ranks = saved_after_one_step(dir);
  std::ifstream in(dir / "manifest.json");
  nlohmann::json m = nlohmann::json::parse(in);
  m["stages"] = 0u;
  std::ofstream(dir / "manifest.json", std::ios::trunc) << m.dump(2);
  const std::string err = error_of([&] { read_checkpoint(dir.string()); });
  EXPECT_NE(err.find("stages is 0, not a whole number in 1.."), std::string::npos) << err;
  fs::remove_all(dir);
}

// Every rank of a run checks --save at start-up, at the same moment. Their probes of the parent folder
// used one shared name (DIR.partial), so a rank whose mkdir came second failed with "File exists" (seen
// in `make demo`). Many concurrent calls on one new, nested path must all succeed and leave nothing.
TEST(Checkpoint, ConcurrentPreparesOfOneFolderAllSucceed) {
  const fs::path base = fresh_dir("concurrent");
  const std::string dir = (base / "a" / "b" / "ckpt").string();
  std::atomic<int> failures{0};
  std::string first_error;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&] {
      for (int k = 0; k < 50; ++k) {
        try {
          prepare_checkpoint_dir(dir);
        } catch (const std::exception& e) {
          if (failures++ == 0) {
            std::lock_guard<std::mutex> g(mu);
            first_error = e.what();
          }
        }
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0) << first_error;
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(base / "a" / "b")) left.push_back(e.path().filename().string());
  EXPECT_TRUE(left.empty()) << left.front();
  fs::remove_all(base);
}

// `--save ckpt/` failed every save and left ckpt/.partial; `.` and unwritable places failed only at the
// first save, after training. prepare_checkpoint_dir finds them first and normalises the name.
TEST(Checkpoint, SavePathsAreCheckedBeforeTraining) {
  const fs::path base = fresh_dir("paths");
  fs::create_directories(base);
  EXPECT_EQ(prepare_checkpoint_dir((base / "ckpt").string() + "//"), (base / "ckpt").string());
  EXPECT_FALSE(fs::exists(base / "ckpt.partial"));  // the probe leaves nothing
  EXPECT_FALSE(fs::exists(base / "ckpt"));
  EXPECT_EQ(prepare_checkpoint_dir((base / "a" / "b").string()), (base / "a" / "b").string());
  EXPECT_TRUE(fs::is_directory(base / "a"));  // parents are created
  for (const std::string bad : {".", "..", "/", "ckpt/.", ""})
    EXPECT_NE(error_of([&] { prepare_checkpoint_dir(bad); }).find("checkpoint folder"), std::string::npos) << bad;
  EXPECT_NE(error_of([&] { prepare_checkpoint_dir(".", "--save"); }).find("--save ."), std::string::npos);
  std::ofstream(base / "file") << "x";
  EXPECT_NE(error_of([&] { prepare_checkpoint_dir((base / "file").string()); }).find("is a file"), std::string::npos);
  EXPECT_NE(error_of([&] { prepare_checkpoint_dir("/proc/pipetrain-ckpt"); }).find("cannot create"), std::string::npos);
  // A trailing slash saves into the folder itself.
  Ranks ranks(make_model(5), 2, options("sgd"));
  ranks.train(1);
  ranks.save((base / "ckpt").string() + "/");
  EXPECT_EQ(read_checkpoint((base / "ckpt").string()).at("step"), 1);
  EXPECT_FALSE(fs::exists(base / "ckpt" / ".partial"));
  fs::remove_all(base);
}

// Reads never leave the checkpoint folder and never read more than the manifest says: a manifest naming
// ../outside.pt or an absolute path, a layer file that is a symlink (to /dev/zero), sizes beyond the
// file, a negative balance and a step past 2^31 are refused, naming what is wrong.
TEST(Checkpoint, ReadsStayInsideTheFolder) {
  const fs::path dir = fresh_dir("escape");
  Ranks ranks = saved_after_one_step(dir);
  const nlohmann::json good = read_checkpoint(dir.string());
  auto with = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json m = good;
    change(m);
    std::ofstream(dir / "manifest.json", std::ios::trunc) << m.dump(2);
    return error_of([&] { read_checkpoint(dir.string()); });
  };
  // A copy of layer 0 outside the folder, with the right size and CRC: still refused.
  fs::copy_file(dir / "layer-00000.pt", dir.parent_path() / ("outside-" + std::to_string(::getpid()) + ".pt"),
                fs::copy_options::overwrite_existing);
  std::string err = with([&](nlohmann::json& m) {
    m["files"][0]["file"] = "../outside-" + std::to_string(::getpid()) + ".pt";
  });
  EXPECT_NE(err.find("inside its folder"), std::string::npos) << err;
  fs::remove(dir.parent_path() / ("outside-" + std::to_string(::getpid()) + ".pt"));
  err = with([](nlohmann::json& m) { m["files"][1]["file"] = "/etc/passwd"; });
  EXPECT_NE(err.find("\"/etc/passwd\""), std::string::npos) << err;
  err = with([](nlohmann::json& m) { m["balance"] = {100, -96}; });
  EXPECT_NE(err.find("balance [100,-96]"), std::string::npos) << err;
  err = with([](nlohmann::json& m) { m["step"] = 1e15; });
  EXPECT_NE(err.find("step is 1e+15"), std::string::npos) << err;
  err = with([](nlohmann::json& m) { m["files"][2]["bytes"] = -5; });
  EXPECT_NE(err.find("bytes is -5"), std::string::npos) << err;
  EXPECT_EQ(with([](nlohmann::json&) {}), "(no UsageError)");
  // A layer file replaced by a symlink to /dev/zero: refused without reading it.
  fs::rename(dir / "layer-00002.pt", dir / "real.pt");
  fs::create_symlink("/dev/zero", dir / "layer-00002.pt");
  err = error_of([&] { read_checkpoint(dir.string()); });
  EXPECT_NE(err.find("is a symbolic link"), std::string::npos) << err;
  fs::remove(dir / "layer-00002.pt");
  // ... or by a much larger file: refused by its size before it is read.
  { std::ofstream big(dir / "layer-00002.pt", std::ios::binary); big.seekp(1 << 24); big.put('x'); }
  err = error_of([&] { read_checkpoint(dir.string()); });
  EXPECT_NE(err.find("has 16777217 bytes but the manifest says"), std::string::npos) << err;
  fs::remove(dir / "layer-00002.pt");
  fs::rename(dir / "real.pt", dir / "layer-00002.pt");
  EXPECT_NO_THROW(read_checkpoint(dir.string()));
  fs::remove_all(dir);
}

// A save onto a full file system fails with a clear message, removes its DIR.partial and keeps the
// previous checkpoint. Needs root to mount a small tmpfs; skipped otherwise.
TEST(Checkpoint, FullDiskKeepsThePreviousCheckpoint) {
  const fs::path mnt = fresh_dir("fulldisk");
  fs::create_directories(mnt);
  if (std::system(("mount -t tmpfs -o size=1m tmpfs " + mnt.string() + " 2>/dev/null").c_str()) != 0) {
    fs::remove_all(mnt);
    GTEST_SKIP() << "cannot mount a small tmpfs here (needs root): the full-disk case is not checked";
  }
  const fs::path dir = mnt / "ckpt";
  Ranks ranks = saved_after_one_step(dir);
  // Fill the file system to the last byte.
  {
    std::ofstream fill(mnt / "filler", std::ios::binary);
    const std::string block(4096, 'x');
    while (fill.write(block.data(), static_cast<std::streamsize>(block.size()))) fill.flush();
  }
  ranks.train(1);
  std::string err;
  try {
    ranks.save(dir.string());
  } catch (const std::exception& e) {
    err = e.what();
  }
  EXPECT_NE(err.find("disk is full"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(dir.string() + ".partial")) << [&] {
    std::string left = err;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir.string() + ".partial", ec)) left += " " + e.path().filename().string();
    return left;
  }();
  EXPECT_EQ(read_checkpoint(dir.string()).at("step"), 1);
  (void)std::system(("umount " + mnt.string()).c_str());
  fs::remove_all(mnt);
}

TEST(Checkpoint, RunDifferencesNameEachKey) {
  const nlohmann::json saved = {{"model", {{"name", "gpt"}, {"d_model", 128}}}, {"data", {{"vocabulary", "abc"}}}};
  const nlohmann::json now = {{"model", {{"name", "gpt"}, {"d_model", 256}}}, {"data", {{"vocabulary", "abd"}}}};
  const auto d = run_differences(saved, now, {"model", "data"});
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0], "model.d_model: 128 in the checkpoint, 256 in this run");
  EXPECT_EQ(d[1], "data.vocabulary: \"abc\" in the checkpoint, \"abd\" in this run");
  EXPECT_TRUE(run_differences(saved, saved, {"model", "data"}).empty());
}

// The profiler (runtime/profiler.h) on the same small model: one entry per layer with the real output
// sizes and parameter bytes, B/W split for every layer with parameters (backward_split auto: the
// LayerNorm through autograd) or only for pipetrain::nn::Linear (explicit), Adam's state counted twice,
// extra micro-batch sizes in increasing order, and a JSON round trip.
TEST(Profiler, MeasuresEveryLayer) {
  auto model = make_model(3);
  ProfilerOptions o;
  o.repeats = 3;
  o.warmup = 1;
  o.extra_sizes = {16, 2};
  o.backward_split = "explicit";
  const Profile linear_only = profile_model(model, torch::randn({4, kIn}), o);
  // Linear, Tanh, Dropout, Linear, LayerNorm, Linear
  const std::vector<bool> explicit_split{true, false, false, true, false, true};
  for (std::size_t i = 0; i < 6; ++i) EXPECT_EQ(linear_only.layers[i].bw_split, explicit_split[i]) << i;
  EXPECT_EQ(linear_only.layers[4].weight_grad_ms, 0.0);
  o.backward_split = "auto";
  const Profile p = profile_model(model, torch::randn({4, kIn}), o);
  ASSERT_EQ(p.layers.size(), 6u);
  EXPECT_EQ(p.micro_batch_size, 4);
  const std::vector<bool> split{true, false, false, true, true, true};
  const std::vector<int64_t> width{kHidden, kHidden, kHidden, kHidden, kHidden, kOut};
  for (std::size_t i = 0; i < 6; ++i) {
    const LayerProfile& l = p.layers[i];
    EXPECT_EQ(l.bw_split, split[i]) << i << " " << l.type;
    EXPECT_EQ(l.activation_bytes, 4.0 * width[i] * 4) << i;
    double params = 0;
    for (const auto& t : model->ptr(i)->parameters()) params += t.numel() * 4.0;
    EXPECT_EQ(l.parameter_bytes, params) << i;
    EXPECT_EQ(l.optimizer_bytes, 2 * params) << i;
    EXPECT_GE(l.forward_ms, 0.0);
    ASSERT_EQ(l.by_micro_batch.size(), 2u);
    EXPECT_EQ(l.by_micro_batch[0].micro_batch_size, 2);
    EXPECT_EQ(l.by_micro_batch[1].micro_batch_size, 16);
  }
  EXPECT_EQ(p.layers[0].type, "Linear");
  EXPECT_EQ(p.layers[4].type, "LayerNorm");
  EXPECT_EQ(profile_from_json_text(profile_to_json_text(p)).layers.size(), 6u);
  // The optimizer step is timed for every layer with weights, and only for those (Tanh, Dropout).
  const std::vector<bool> has_weights{true, false, false, true, true, true};
  for (std::size_t i = 0; i < 6; ++i)
    if (has_weights[i]) {
      EXPECT_GT(p.layers[i].optimizer_ms, 0.0) << i;
    } else {
      EXPECT_EQ(p.layers[i].optimizer_ms, 0.0) << i;
    }
  // The model's gradients are left cleared.
  for (const auto& t : model->parameters()) EXPECT_TRUE(!t.grad().defined() || t.grad().abs().sum().item<double>() == 0);
  // Timing the optimizer's steps leaves the weights as they were, whatever the optimizer.
  std::vector<torch::Tensor> before;
  for (const auto& t : model->parameters()) before.push_back(t.detach().clone());
  for (const char* name : {"adam", "adamw", "sgd", "sgd-momentum"}) {
    ProfilerOptions each;
    each.repeats = 2;
    each.warmup = 0;
    each.optimizer = name;
    const Profile q = profile_model(model, torch::randn({4, kIn}), each);
    EXPECT_GT(q.layers[0].optimizer_ms, 0.0) << name;
    const auto after = model->parameters();
    for (std::size_t k = 0; k < before.size(); ++k) EXPECT_TRUE(torch::equal(before[k], after[k])) << name << " " << k;
  }
  ProfilerOptions bad;
  bad.optimizer = "lion";
  EXPECT_THROW(profile_model(model, torch::randn({4, kIn}), bad), UsageError);
}

// The memory tests' profile: one run of a batch of 32 x 16, no warm-up (heap figures need no repeats).
Profile profile_once(torch::nn::Sequential model) {
  ProfilerOptions o;
  o.repeats = 1;
  o.warmup = 0;
  return profile_model(std::move(model), torch::randn({32, 16}), o);
}

// A layer that keeps much more than it outputs (a 1024-wide hidden layer between 16-wide ends): its
// saved_bytes is the hidden activation the ReLU keeps plus the output (32 x (1024 + 16) floats, within
// the heap's rounding), while activation_bytes stays the output alone; the memory model (stage costs,
// the "memory" balance) then uses saved_bytes, and a profile without it falls back on activation_bytes.
struct WideImpl : torch::nn::Module {
  torch::nn::Linear up{nullptr}, down{nullptr};
  WideImpl() : up(register_module("up", torch::nn::Linear(16, 1024))), down(register_module("down", torch::nn::Linear(1024, 16))) {}
  torch::Tensor forward(const torch::Tensor& x) { return down(torch::relu(up(x))); }
};
TORCH_MODULE(Wide);

TEST(Profiler, SavedBytesCountWhatTheForwardKeeps) {
  torch::nn::Sequential model{Wide(), torch::nn::Tanh()};
  const Profile p = profile_once(model);
  const double hidden = 32.0 * 1024 * 4, out = 32.0 * 16 * 4;
  EXPECT_EQ(p.layers[0].activation_bytes, out);
  EXPECT_GE(p.layers[0].saved_bytes, hidden + out);
  EXPECT_LE(p.layers[0].saved_bytes, 1.1 * (hidden + out));
  EXPECT_GE(p.layers[1].saved_bytes, out);  // tanh keeps its result
  EXPECT_LE(p.layers[1].saved_bytes, out + 4096);
  const Profile back = profile_from_json_text(profile_to_json_text(p));
  EXPECT_EQ(back.layers[0].saved_bytes, p.layers[0].saved_bytes);
  EXPECT_EQ(p.layers[0].held_bytes(), p.layers[0].saved_bytes);
  LayerProfile old = p.layers[0];
  old.saved_bytes = 0;
  EXPECT_EQ(old.held_bytes(), out);
}

// The same wide layer built from pipetrain's split Linear (B and W apart): after its B, W still needs each
// Linear's input and output gradient, so the layer holds the kept hidden activation plus the hidden
// output gradient (2 x 32 x 1024 floats) and B frees nothing of what the forward kept. stage_costs turns
// that into the cost model's b_release_fraction; a profile that did not measure it keeps the default.
struct SplitWideImpl : torch::nn::Module {
  pipetrain::nn::Linear up{nullptr}, down{nullptr};
  SplitWideImpl()
      : up(register_module("up", pipetrain::nn::Linear(16, 1024))),
        down(register_module("down", pipetrain::nn::Linear(1024, 16))) {}
  torch::Tensor forward(const torch::Tensor& x) { return down(torch::relu(up(x))); }
};
TORCH_MODULE(SplitWide);

TEST(Profiler, WHeldBytesCountWhatBKeepsForW) {
  torch::nn::Sequential model{SplitWide(), torch::nn::Tanh()};
  const Profile p = profile_once(model);
  const double hidden = 32.0 * 1024 * 4, out = 32.0 * 16 * 4;
  ASSERT_TRUE(p.layers[0].bw_split);
  EXPECT_GE(p.layers[0].w_held_bytes, 2 * hidden);
  EXPECT_LE(p.layers[0].w_held_bytes, 1.1 * (2 * hidden + 2 * out));
  EXPECT_FALSE(p.layers[1].bw_split);
  EXPECT_LT(p.layers[1].w_held_bytes, 0);  // not a split layer: nothing to measure
  const Profile back = profile_from_json_text(profile_to_json_text(p));
  EXPECT_EQ(back.layers[0].w_held_bytes, p.layers[0].w_held_bytes);
  EXPECT_LT(back.layers[1].w_held_bytes, 0);
  // B keeps at least all the layer held, so the whole model's B frees only the Tanh's share.
  const double h0 = p.layers[0].held_bytes(), h1 = p.layers[1].held_bytes();
  EXPECT_DOUBLE_EQ(stage_costs(p, {1, 1}, StageCostOptions{}).b_release_fraction, 1.0 - h0 / (h0 + h1));
  Profile unmeasured = p;
  unmeasured.layers[0].w_held_bytes = -1;
  EXPECT_DOUBLE_EQ(stage_costs(unmeasured, {1, 1}, StageCostOptions{}).b_release_fraction, CostModel{}.b_release_fraction);
}

// A split Linear that is the layer's last operation keeps the layer's output gradient for W (its weight
// gradient is grad_output^T x input): that gradient arrives from the next stage and stays until W, so
// w_held_bytes counts it. (The layer's input, also kept for W, is the previous layer's output or a
// received buffer: counted there, not here.) Measured with the gradient allocated before the window, it
// was left out (128 KiB here).
TEST(Profiler, WHeldBytesCountTheOutputGradientWKeeps) {
  torch::nn::Sequential model{pipetrain::nn::Linear(16, 1024)};
  const Profile p = profile_once(model);
  const double input = 32.0 * 16 * 4, out_grad = 32.0 * 1024 * 4;
  ASSERT_TRUE(p.layers[0].bw_split);
  EXPECT_GE(p.layers[0].w_held_bytes, out_grad);
  EXPECT_LE(p.layers[0].w_held_bytes, 1.1 * (out_grad + input) + 4096);
}

// With a loss and a target, the last layer is timed with the loss on its output (forward and backward):
// the loss sees the last layer's output and the matching target rows at every size, every other layer
// is timed without it, and the activation bytes stay the layer's output. A target with other rows is
// refused.
TEST(Profiler, LastLayerIncludesTheLoss) {
  auto model = make_model(3);
  ProfilerOptions o;
  o.repeats = 2;
  o.warmup = 1;
  o.extra_sizes = {2, 8};
  std::vector<std::pair<int64_t, int64_t>> seen;  // (output rows, target rows) per loss call
  o.loss = [&](const torch::Tensor& out, const torch::Tensor& target) {
    EXPECT_EQ(out.size(1), kOut);
    seen.emplace_back(out.size(0), target.size(0));
    return torch::mse_loss(out, target);
  };
  o.target = torch::randn({4, kOut});
  const Profile p = profile_model(model, torch::randn({4, kIn}), o);
  // Per size (4, then 2 and 8): warm-up + repeats runs, each with a forward for the whole backward and one
  // for the B/W split; at the profiled size one more forward measures what the layer keeps.
  ASSERT_EQ(seen.size(), 3u * (1 + 2) * 2 + 1);
  for (std::size_t k = 0; k < seen.size(); ++k) {
    EXPECT_EQ(seen[k].first, seen[k].second) << k;
    EXPECT_EQ(seen[k].first, k < 7 ? 4 : k < 13 ? 2 : 8) << k;
  }
  EXPECT_EQ(p.layers.back().activation_bytes, 4.0 * kOut * 4);
  o.target = torch::randn({3, kOut});
  EXPECT_THROW(profile_model(model, torch::randn({4, kIn}), o), UsageError);
}

// issue 23: profile_runtime (public) called torch::manual_seed(1), so a caller's random numbers after
// profiling depended on it (the trap LocalPipeline had). The caller's generator is left as it was.
TEST(Profiler, RuntimeProfilingLeavesTheCallersGeneratorAlone) {
  torch::manual_seed(42);
  const torch::Tensor expected = torch::randn({4});
  torch::manual_seed(42);
  RuntimeProfilerOptions o;
  o.iters = 2;
  o.warmup = 0;
  o.steps = 1;
  o.sizes = {64};
  auto transports = make_local_transports(2, std::chrono::seconds(30));
  run_on_threads(2, [&](int r) { profile_runtime(transports[r], "local", o); });
  EXPECT_TRUE(torch::equal(torch::randn({4}), expected));
}

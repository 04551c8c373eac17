// Checks forward-only passes (evaluation) and per-layer checkpoints (runtime/checkpoint.h) on the
// in-process transport: the pipelined forward equals the model's own forward in evaluation mode; a run
// resumed from a checkpoint continues with bitwise the same losses as an uninterrupted run (SGD with
// momentum, Adam, AdamW), also when the checkpoint is loaded at another pipeline degree (then within
// fp32 rounding); corrupted, truncated and mismatched checkpoints are refused with what is wrong, and a
// save replaces the previous checkpoint whole.
#include <gtest/gtest.h>
#include <torch/torch.h>

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
  std::string err = refused_save(dir);
  EXPECT_NE(err.find("is a folder that is not a pipetrain checkpoint"), std::string::npos) << err;
  EXPECT_NE(error_of([&] { prepare_checkpoint_dir(dir.string()); }).find("not a pipetrain checkpoint"), std::string::npos);
  std::ifstream in(dir / "thesis.txt");
  std::string text;
  in >> text;
  EXPECT_EQ(text, "precious");
  EXPECT_FALSE(fs::exists(dir.string() + ".partial"));
  EXPECT_FALSE(fs::exists(dir / "manifest.json"));
  // A user's DIR.old or DIR.partial is not ours to delete either.
  const fs::path ckpt = fresh_dir("notours-ckpt");
  for (const std::string suffix : {".old", ".partial"}) {
    const fs::path theirs = ckpt.string() + suffix;
    fs::create_directories(theirs);
    std::ofstream(theirs / "notes.txt") << "mine";
    err = refused_save(ckpt);
    EXPECT_NE(err.find(theirs.string() + " exists and"), std::string::npos) << suffix << ": " << err;
    EXPECT_TRUE(fs::exists(theirs / "notes.txt")) << suffix;
    fs::remove_all(theirs);
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

// A crash between the fallback path's two renames leaves DIR.old as the only complete checkpoint (and
// a DIR.partial): the next save first moves DIR.old back to DIR, so the complete copy is never the one
// deleted, then replaces it as usual.
TEST(Checkpoint, SaveKeepsTheOnlyCompleteCopy) {
  const fs::path dir = fresh_dir("onlycopy");
  Ranks ranks(make_model(5), 2, options("sgd"));
  ranks.train(1);
  ranks.save(dir.string());
  fs::rename(dir, dir.string() + ".old");  // as the crash left it: no DIR, a complete DIR.old
  fs::create_directories(dir.string() + ".partial");
  std::ofstream(dir.string() + ".partial/.pipetrain-partial");
  EXPECT_EQ(prepare_checkpoint_dir(dir.string()), dir.string());  // allowed, and changes nothing
  EXPECT_TRUE(fs::exists(dir.string() + ".old/manifest.json"));
  ranks.train(1);
  ranks.save(dir.string());
  EXPECT_EQ(read_checkpoint(dir.string()).at("step"), 2);
  EXPECT_FALSE(fs::exists(dir.string() + ".old"));
  EXPECT_FALSE(fs::exists(dir.string() + ".partial"));
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
    EXPECT_NE(error_of([&] { prepare_checkpoint_dir(bad); }).find("--save"), std::string::npos) << bad;
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
  Ranks ranks(make_model(5), 2, options("sgd"));
  ranks.train(1);
  ranks.save(dir.string());
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
  Ranks ranks(make_model(5), 2, options("sgd"));
  ranks.train(1);
  ranks.save(dir.string());
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
// sizes and parameter bytes, B/W split exactly for the layers holding pipetrain::nn::Linear, Adam's
// state counted twice, extra micro-batch sizes in increasing order, and a JSON round trip.
TEST(Profiler, MeasuresEveryLayer) {
  auto model = make_model(3);
  ProfilerOptions o;
  o.repeats = 3;
  o.warmup = 1;
  o.extra_sizes = {16, 2};
  const Profile p = profile_model(model, torch::randn({4, kIn}), o);
  ASSERT_EQ(p.layers.size(), 6u);
  EXPECT_EQ(p.micro_batch_size, 4);
  const std::vector<bool> split{true, false, false, true, false, true};  // Linear, Tanh, Dropout, Linear, LayerNorm, Linear
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
  // The model's gradients are left cleared.
  for (const auto& t : model->parameters()) EXPECT_TRUE(!t.grad().defined() || t.grad().abs().sum().item<double>() == 0);
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

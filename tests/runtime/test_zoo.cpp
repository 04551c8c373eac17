// Checks the model zoo and the data sets (zoo/models.h, zoo/data.h): layer counts and shapes, the
// GPT's causal mask (a position's output never depends on later tokens), heavy first and last GPT layers
// (what parameter balancing must see), the VGG and ResNet models (shapes, split Linear layers, residual
// identity, learning, pipeline transparency), bad configurations as UsageErrors, deterministic data; the
// IDX parser on files written here (plain and gzipped, and broken ones); the real Fashion-MNIST and King
// James Bible when their Debian packages are installed (skipped otherwise); character-level text data.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>
#include <zlib.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/split_linear.h"
#include "pipetrain/runtime/stage.h"
#include "pipetrain/runtime/transport.h"
#include "pipetrain/runtime/verify.h"
#include "pipetrain/zoo/data.h"
#include "pipetrain/zoo/models.h"

using namespace pipetrain;

TEST(Zoo, GptShapesAndCausality) {
  zoo::GptConfig c;
  c.vocab = 20;
  c.seq_len = 8;
  c.d_model = 16;
  c.heads = 2;
  c.layers = 3;
  torch::manual_seed(0);
  auto gpt = zoo::make_gpt(c);
  EXPECT_EQ(layer_count(gpt), 5);
  torch::Tensor x = torch::randint(20, {2, 8}, torch::kLong);
  torch::Tensor y = gpt->forward(x);
  EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{2, 8, 20}));
  torch::Tensor x2 = x.clone();
  x2.slice(1, 5, 8).fill_(3);  // change only the last three tokens
  torch::Tensor y2 = gpt->forward(x2);
  EXPECT_TRUE(torch::allclose(y.slice(1, 0, 5), y2.slice(1, 0, 5), 1e-6, 1e-6));
  EXPECT_FALSE(torch::allclose(y.slice(1, 5, 8), y2.slice(1, 5, 8), 1e-6, 1e-6));
  // The first and last layers grow with the vocabulary (vocab x d_model each), a block does not
  // (about 12 d_model^2): with a real vocabulary they are the heaviest layers.
  c.vocab = 2000;
  auto big = zoo::make_gpt(c);
  const auto counts = layer_parameter_counts(big);
  EXPECT_GT(counts.front(), counts[1]);
  EXPECT_GT(counts.back(), counts[1]);
}

TEST(Zoo, MlpShapes) {
  zoo::MlpConfig c;
  c.inputs = 12;
  c.hidden = 7;
  c.classes = 3;
  c.layers = 3;
  auto mlp = zoo::make_mlp(c);
  EXPECT_EQ(layer_count(mlp), 3);
  EXPECT_EQ(mlp->forward(torch::randn({4, 3, 4})).sizes().vec(), (std::vector<int64_t>{4, 3}));
}

TEST(Zoo, BadConfigurations) {
  zoo::GptConfig c;
  c.heads = 3;
  EXPECT_THROW(zoo::make_gpt(c), UsageError);
  c = {};
  c.layers = 0;
  EXPECT_THROW(zoo::make_gpt(c), UsageError);
  c = {};
  c.dropout = 1.0;
  EXPECT_THROW(zoo::make_gpt(c), UsageError);
  zoo::MlpConfig m;
  m.hidden = 0;
  EXPECT_THROW(zoo::make_mlp(m), UsageError);
  c = {};
  c.seq_len = 4;
  auto gpt = zoo::make_gpt(c);
  EXPECT_THROW(gpt->forward(torch::zeros({1, 5}, torch::kLong)), UsageError);
}

TEST(Zoo, SyntheticDataIsDeterministicAndShifted) {
  auto a = zoo::make_synthetic_tokens(10, 6, 3), b = zoo::make_synthetic_tokens(10, 6, 3);
  const zoo::Batch x = a->batch(5, 4), y = b->batch(5, 4), z = a->batch(6, 4);
  EXPECT_TRUE(torch::equal(x.input, y.input));
  EXPECT_FALSE(torch::equal(x.input, z.input));
  EXPECT_TRUE(torch::equal(x.input.slice(1, 1, 6), x.target.slice(1, 0, 5)));  // targets are the next tokens
  EXPECT_LT(x.input.max().item<int64_t>(), 10);
  auto c = zoo::make_synthetic_classes(5, 3, 1);
  const zoo::Batch k = c->batch(0, 8);
  EXPECT_EQ(k.target.sizes().vec(), (std::vector<int64_t>{8}));
}

TEST(Zoo, VerifyDetectsADifferentModel) {
  // verify_transparency must be able to fail: a factory that builds a different model each call makes
  // the pipelined and the plain gradients differ.
  int calls = 0;
  auto factory = [&] {
    torch::manual_seed(calls++);
    zoo::MlpConfig c;
    c.inputs = 5;
    c.hidden = 6;
    c.classes = 3;
    c.layers = 2;
    return zoo::make_mlp(c);
  };
  auto data = zoo::make_synthetic_classes(5, 3, 0);
  auto transports = make_local_transports(1);
  PipelineOptions o;
  o.microbatches = 2;
  const zoo::Batch b6 = data->batch(0, 6);
  const VerifyResult r = verify_transparency(factory, zoo::cross_entropy, transports[0], o, b6.input, b6.target);
  EXPECT_FALSE(r.ok(1e-3));
  EXPECT_GT(r.max_grad_error, 1e-3);
}

namespace {

// Substring check with the message in the failure output.
#define EXPECT_THROW_WITH(statement, text)                                                       \
  do {                                                                                           \
    try {                                                                                        \
      statement;                                                                                 \
      ADD_FAILURE() << #statement " did not throw";                                              \
    } catch (const UsageError& e) {                                                              \
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << "message: " << e.what(); \
    }                                                                                            \
  } while (0)

int split_linear_count(const torch::nn::Sequential& m) {
  int n = 0;
  for (const auto& module : m->modules(/*include_self=*/false))
    if (dynamic_cast<const pipetrain::nn::LinearImpl*>(module.get())) ++n;
  return n;
}

// Loss on one fixed batch after `steps` Adam steps, and before them.
std::pair<double, double> fit(torch::nn::Sequential m, const zoo::Batch& b, int steps) {
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-3));
  double first = 0, last = 0;
  for (int k = 0; k <= steps; ++k) {
    opt.zero_grad();
    torch::Tensor loss = zoo::cross_entropy(m->forward(b.input), b.target);
    (k == 0 ? first : last) = loss.item<double>();
    if (k == steps) break;
    loss.backward();
    opt.step();
  }
  return {first, last};
}

zoo::Batch tiny_images(int64_t n) {
  torch::manual_seed(123);
  return {torch::randn({n, 1, 28, 28}), torch::randint(10, {n}, torch::kLong), {}};
}

torch::nn::Sequential seeded_small_cnn() {
  torch::manual_seed(3);
  zoo::CnnConfig c;
  c.width = 4;
  c.hidden = 16;
  return zoo::make_cnn(c);
}

torch::nn::Sequential seeded_small_resnet() {
  torch::manual_seed(3);
  zoo::ResNetConfig c;
  c.width = 4;
  return zoo::make_resnet(c);
}

// A fresh directory under the system's temporary directory, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pipetrain-zoo-XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// An IDX file of unsigned bytes: big-endian magic and dimensions, then `bytes`.
std::string idx_bytes(uint32_t magic, const std::vector<uint32_t>& dims, const std::vector<uint8_t>& bytes) {
  std::string out;
  auto word = [&](uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xff));
  };
  word(magic);
  for (uint32_t d : dims) word(d);
  out.append(bytes.begin(), bytes.end());
  return out;
}

void write_file(const std::string& path, const std::string& bytes, bool gzip) {
  if (gzip) {
    gzFile f = gzopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
    ASSERT_EQ(gzclose(f), Z_OK);
  } else {
    std::ofstream(path, std::ios::binary) << bytes;
  }
}

std::vector<uint8_t> counting(std::size_t n, int start = 0) {
  std::vector<uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((start + i * 7) % 256);
  return v;
}

// A Fashion-MNIST directory with `train` and `test` 4x4 images; labels are i % 10 unless given.
void write_fashion(const TempDir& dir, uint32_t train, uint32_t test, uint32_t train_labels, bool gzip) {
  const std::string gz = gzip ? ".gz" : "";
  write_file(dir.file("train-images-idx3-ubyte" + gz), idx_bytes(0x803, {train, 4, 4}, counting(train * 16)), gzip);
  write_file(dir.file("t10k-images-idx3-ubyte" + gz), idx_bytes(0x803, {test, 4, 4}, counting(test * 16, 3)), gzip);
  std::vector<uint8_t> labels(train_labels), test_labels(test);
  for (uint32_t i = 0; i < train_labels; ++i) labels[i] = static_cast<uint8_t>(i % 10);
  for (uint32_t i = 0; i < test; ++i) test_labels[i] = static_cast<uint8_t>((i + 5) % 10);
  write_file(dir.file("train-labels-idx1-ubyte" + gz), idx_bytes(0x801, {train_labels}, labels), gzip);
  write_file(dir.file("t10k-labels-idx1-ubyte" + gz), idx_bytes(0x801, {test}, test_labels), gzip);
}

bool have_fashion_mnist() {
  return std::filesystem::exists(std::string(zoo::kFashionMnistDir) + "/train-images-idx3-ubyte.gz") ||
         std::filesystem::exists(std::string(zoo::kFashionMnistDir) + "/train-images-idx3-ubyte");
}

// Raw pixels (exact integers) back from a normalised batch.
torch::Tensor pixels(const torch::Tensor& input) {
  return (input * zoo::kFashionMnistStd + zoo::kFashionMnistMean).mul(255).round().to(torch::kLong);
}

// One exact integer per sample (pixels and label), for comparing multisets of samples.
torch::Tensor fingerprints(const torch::Tensor& raw_pixels, const torch::Tensor& labels) {
  torch::manual_seed(5);
  const torch::Tensor w = torch::randint(1, 1 << 20, {raw_pixels[0].numel()}, torch::kLong);
  return raw_pixels.reshape({raw_pixels.size(0), -1}).matmul(w) * 16 + labels;
}

}  // namespace

// --- models --------------------------------------------------------------------------------------

TEST(Zoo, CnnIsVgg16Shaped) {
  torch::manual_seed(0);
  auto cnn = zoo::make_cnn({});
  EXPECT_EQ(layer_count(cnn), 16);        // 13 conv layers + 3 fully connected
  EXPECT_EQ(split_linear_count(cnn), 3);  // the three FC layers split their backward
  EXPECT_EQ(cnn->forward(torch::randn({3, 1, 28, 28})).sizes().vec(), (std::vector<int64_t>{3, 10}));
  // Channels follow VGG's 1, 2, 4, 8, 8 multiples of width: the last conv is 8w -> 8w, 3x3.
  zoo::CnnConfig c;
  c.width = 2;
  c.hidden = 5;
  c.classes = 7;
  c.channels = 3;
  c.image_size = 8;
  auto small = zoo::make_cnn(c);
  const auto counts = layer_parameter_counts(small);
  ASSERT_EQ(counts.size(), 16u);
  EXPECT_EQ(counts[0], 3 * 2 * 9 + 2);      // conv1_1
  EXPECT_EQ(counts[12], 16 * 16 * 9 + 16);  // conv5_3
  EXPECT_EQ(counts[13], 16 * 5 + 5);        // fc6 sees 8w features after the global pool
  EXPECT_EQ(small->forward(torch::randn({2, 3, 8, 8})).sizes().vec(), (std::vector<int64_t>{2, 7}));
}

TEST(Zoo, ResNetShapesAndLayers) {
  torch::manual_seed(0);
  auto net = zoo::make_resnet({});
  EXPECT_EQ(layer_count(net), 8);  // stem + 3 stages x 2 blocks + head
  EXPECT_EQ(split_linear_count(net), 1);
  EXPECT_EQ(net->forward(torch::randn({3, 1, 28, 28})).sizes().vec(), (std::vector<int64_t>{3, 10}));
  zoo::ResNetConfig c;
  c.stages = 2;
  c.blocks = 3;
  c.width = 4;
  c.classes = 5;
  auto other = zoo::make_resnet(c);
  EXPECT_EQ(layer_count(other), 8);
  EXPECT_EQ(other->forward(torch::randn({2, 1, 28, 28})).sizes().vec(), (std::vector<int64_t>{2, 5}));
  // Only the first block of a later stage changes shape, so only it has a projection shortcut.
  std::vector<bool> projects;
  for (const auto& child : other->children())
    projects.push_back(child->named_parameters().contains("shortcut_conv.weight"));
  EXPECT_EQ(projects, (std::vector<bool>{false, false, false, false, true, false, false, false}));
}

TEST(Zoo, ResidualBlockIsTheIdentityWithoutItsBranch) {
  torch::manual_seed(0);
  auto net = zoo::make_resnet({});
  auto block = net->children()[1];  // block1_1: 16 -> 16 channels, stride 1, identity shortcut
  const torch::Tensor x = torch::relu(torch::randn({2, 16, 7, 7}));  // a stem output is non-negative
  auto forward = [&] { return (net->begin() + 1)->forward<torch::Tensor>(x); };
  const torch::Tensor before = forward();
  EXPECT_FALSE(torch::allclose(before, x));
  {
    torch::NoGradGuard no_grad;
    auto params = block->named_parameters();
    params["bn2.weight"].zero_();
    params["bn2.bias"].zero_();
  }
  EXPECT_TRUE(torch::equal(forward(), x));
}

TEST(Zoo, CnnAndResNetLearnATinyBatch) {
  const zoo::Batch b = tiny_images(16);
  torch::manual_seed(1);
  // Random labels on noise: only memorisation lowers the loss (ln 10 = 2.30 at the start).
  const auto cnn = fit(zoo::make_cnn({}), b, 40);
  EXPECT_LT(cnn.second, 0.6 * cnn.first) << "cnn loss " << cnn.first << " -> " << cnn.second;
  torch::manual_seed(1);
  zoo::ResNetConfig r;
  r.width = 8;
  const auto resnet = fit(zoo::make_resnet(r), b, 40);
  EXPECT_LT(resnet.second, 0.6 * resnet.first) << "resnet loss " << resnet.first << " -> " << resnet.second;
}

TEST(Zoo, CnnAndResNetArePipelineTransparent) {
  // Cut into 2 stages with zero-bubble (CNN: split Linear backward) and 1F1B (ResNet: BatchNorm per
  // micro-batch), the pipelined step must give plain gradient accumulation's loss and gradients.
  const zoo::Batch b = tiny_images(8);
  auto check = [&](std::function<torch::nn::Sequential()> seeded_factory, const std::string& schedule) {
    // The ranks (threads) call the factory while other ranks already run forwards, which reseed LibTorch's
    // one default generator; seeding inside the factory would then give the ranks different weights. So
    // the weights are drawn once, here, and every model the factory builds copies them.
    const torch::nn::Sequential original = seeded_factory();
    auto factory = [&] {
      torch::nn::Sequential m = seeded_factory();
      torch::NoGradGuard no_grad;
      const auto from = original->named_parameters(), from_buffers = original->named_buffers();
      for (auto& p : m->named_parameters()) p.value().copy_(from[p.key()]);
      for (auto& buffer : m->named_buffers()) buffer.value().copy_(from_buffers[buffer.key()]);
      return m;
    };
    auto transports = make_local_transports(2);
    std::vector<VerifyResult> results(2);
    PipelineOptions o;
    o.schedule = schedule;
    o.microbatches = 4;
    run_on_threads(2,
                   [&](int r) { results[r] = verify_transparency(factory, zoo::cross_entropy, transports[r], o, b.input, b.target); });
    for (const VerifyResult& r : results) EXPECT_TRUE(r.ok(1e-4)) << schedule << ": grad error " << r.max_grad_error;
  };
  check(seeded_small_cnn, "zb-h1");
  check(seeded_small_resnet, "1f1b");
}

TEST(Zoo, UNetSkipsCrossStageCutsTransparently) {
  // 6 layers at 3 stages: level 0's skip goes from stage 0 straight to stage 2, level 1's rides the
  // bundle to the next stage. The pipelined step gives plain gradient accumulation's loss and gradients.
  const zoo::Batch b = tiny_images(8);
  zoo::UNetConfig c;
  c.width = 2;
  torch::manual_seed(4);
  const torch::nn::Sequential original = zoo::make_unet(c);
  auto factory = [&] {
    torch::nn::Sequential m = zoo::make_unet(c);
    torch::NoGradGuard no_grad;
    const auto from = original->named_parameters();
    for (auto& p : m->named_parameters()) p.value().copy_(from[p.key()]);
    return m;
  };
  EXPECT_EQ(layer_count(original), 6);
  for (const std::string schedule : {"gpipe", "1f1b", "zb-h1"}) {
    auto transports = make_local_transports(3);
    std::vector<VerifyResult> results(3);
    PipelineOptions o;
    o.schedule = schedule;
    o.microbatches = 4;
    run_on_threads(3, [&](int r) {
      results[r] = verify_transparency(factory, zoo::cross_entropy, transports[r], o, b.input, b.target);
    });
    for (const VerifyResult& r : results) EXPECT_TRUE(r.ok(1e-4)) << schedule << ": grad error " << r.max_grad_error;
  }
  zoo::UNetConfig bad;
  bad.depth = 5;
  EXPECT_THROW_WITH(zoo::make_unet(bad), "--depth 5");
}

TEST(Zoo, BadCnnAndResNetConfigurations) {
  zoo::CnnConfig c;
  c.image_size = 7;
  EXPECT_THROW_WITH(zoo::make_cnn(c), "at least 8x8");
  c = {};
  c.width = 0;
  EXPECT_THROW_WITH(zoo::make_cnn(c), "--width");
  zoo::ResNetConfig r;
  r.blocks = 0;
  EXPECT_THROW_WITH(zoo::make_resnet(r), "--blocks");
  r = {};
  r.stages = 9;
  EXPECT_THROW_WITH(zoo::make_resnet(r), "--stages 9");
}

// --- IDX files and Fashion-MNIST ------------------------------------------------------------------

TEST(Zoo, IdxParserReadsPlainAndGzippedFiles) {
  TempDir dir;
  const std::vector<uint8_t> bytes = counting(3 * 2 * 4);
  const std::string images = idx_bytes(0x803, {3, 2, 4}, bytes);
  write_file(dir.file("images"), images, false);
  write_file(dir.file("images.gz"), images, true);
  const torch::Tensor expected =
      torch::tensor(std::vector<int64_t>(bytes.begin(), bytes.end())).to(torch::kUInt8).view({3, 2, 4});
  EXPECT_TRUE(torch::equal(zoo::read_idx_images(dir.file("images")), expected));
  EXPECT_TRUE(torch::equal(zoo::read_idx_images(dir.file("images.gz")), expected));
  write_file(dir.file("labels.gz"), idx_bytes(0x801, {3}, {9, 0, 4}), true);
  EXPECT_TRUE(torch::equal(zoo::read_idx_labels(dir.file("labels.gz")), torch::tensor({9, 0, 4}).to(torch::kUInt8)));
}

TEST(Zoo, IdxParserRejectsBrokenFiles) {
  TempDir dir;
  write_file(dir.file("labels"), idx_bytes(0x801, {3}, {1, 2, 3}), false);
  EXPECT_THROW_WITH(zoo::read_idx_images(dir.file("labels")), dir.file("labels") + ": magic number 0x00000801");
  write_file(dir.file("short.gz"), idx_bytes(0x803, {2, 3, 3}, counting(17)), true);
  EXPECT_THROW_WITH(zoo::read_idx_images(dir.file("short.gz")), "truncated");
  write_file(dir.file("long"), idx_bytes(0x801, {2}, {1, 2, 3}), false);
  EXPECT_THROW_WITH(zoo::read_idx_labels(dir.file("long")), dir.file("long") + " holds more than");
  write_file(dir.file("header"), idx_bytes(0x803, {2}, {}), false);
  EXPECT_THROW_WITH(zoo::read_idx_images(dir.file("header")), "inside its 16-byte IDX header");
  EXPECT_THROW_WITH(zoo::read_idx_images(dir.file("missing")), "cannot open " + dir.file("missing"));
}

TEST(Zoo, FashionMnistFromSmallFiles) {
  for (bool gzip : {false, true}) {
    TempDir dir;
    write_fashion(dir, 6, 3, 6, gzip);
    auto data = zoo::make_fashion_mnist(dir.path(), 1);
    EXPECT_EQ(data->name(), "fashion-mnist");
    EXPECT_EQ(data->train_size(), 6);
    EXPECT_EQ(data->eval_size(), 3);
    const zoo::Batch e = data->eval_batch(1, 2);
    EXPECT_EQ(e.input.sizes().vec(), (std::vector<int64_t>{2, 1, 4, 4}));
    EXPECT_EQ(e.input.scalar_type(), torch::kFloat);
    EXPECT_TRUE(torch::equal(e.target, torch::tensor({6, 7}, torch::kLong)));  // file order
    const std::vector<uint8_t> raw = counting(3 * 16, 3);
    const double second = (raw[16] / 255.0 - zoo::kFashionMnistMean) / zoo::kFashionMnistStd;
    EXPECT_NEAR(e.input[0][0][0][0].item<double>(), second, 1e-6);
    EXPECT_THROW(data->eval_batch(2, 2), UsageError);
    // One epoch of B = 2 draws each training sample once: labels 0..5 each appear once.
    std::vector<int64_t> seen;
    for (int step = 0; step < 3; ++step) {
      const torch::Tensor y = data->batch(step, 2).target;
      seen.insert(seen.end(), y.data_ptr<int64_t>(), y.data_ptr<int64_t>() + 2);
    }
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  }
}

TEST(Zoo, FashionMnistRejectsMismatchedAndMissingFiles) {
  TempDir dir;
  write_fashion(dir, 6, 3, 5, true);
  EXPECT_THROW_WITH(zoo::make_fashion_mnist(dir.path(), 0), dir.file("train-labels-idx1-ubyte.gz") + " holds 5 labels");
  TempDir empty;
  EXPECT_THROW_WITH(zoo::make_fashion_mnist(empty.path(), 0), "apt-get install dataset-fashion-mnist");
  TempDir bad_label;
  write_fashion(bad_label, 6, 3, 6, false);
  write_file(bad_label.file("t10k-labels-idx1-ubyte"), idx_bytes(0x801, {3}, {1, 10, 2}), false);
  EXPECT_THROW_WITH(zoo::make_fashion_mnist(bad_label.path(), 0), "label 10 at index 1");
  TempDir bad_magic;
  write_fashion(bad_magic, 6, 3, 6, false);
  write_file(bad_magic.file("t10k-images-idx3-ubyte"), idx_bytes(0x801, {3}, {1, 2, 3}), false);
  EXPECT_THROW_WITH(zoo::make_fashion_mnist(bad_magic.path(), 0), bad_magic.file("t10k-images-idx3-ubyte"));
}

TEST(Zoo, FashionMnistRealData) {
  if (!have_fashion_mnist()) GTEST_SKIP() << zoo::kFashionMnistDir << " is absent (Debian's dataset-fashion-mnist)";
  const auto start = std::chrono::steady_clock::now();
  auto data = zoo::make_fashion_mnist(zoo::kFashionMnistDir, 7);
  std::printf("[ info ] Fashion-MNIST loaded in %.3f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  ASSERT_EQ(data->train_size(), 60000);
  ASSERT_EQ(data->eval_size(), 10000);
  const zoo::Batch test = data->eval_batch(0, 10000);
  EXPECT_EQ(test.input.sizes().vec(), (std::vector<int64_t>{10000, 1, 28, 28}));
  EXPECT_NEAR(test.input.mean().item<double>(), 0.0, 0.05);  // normalised with the published statistics
  EXPECT_NEAR(test.input.std().item<double>(), 1.0, 0.05);
  EXPECT_EQ(torch::bincount(test.target).min().item<int64_t>(), 1000);  // 1000 test images per class

  // Same step, same batch; another step or seed, another batch.
  auto again = zoo::make_fashion_mnist(zoo::kFashionMnistDir, 7);
  auto other = zoo::make_fashion_mnist(zoo::kFashionMnistDir, 8);
  EXPECT_TRUE(torch::equal(data->batch(3, 100).input, again->batch(3, 100).input));
  EXPECT_FALSE(torch::equal(data->batch(3, 100).input, data->batch(4, 100).input));
  EXPECT_FALSE(torch::equal(data->batch(3, 100).target, other->batch(3, 100).target));

  // Epoch 0 with B = 1000 (60 steps) is every training sample exactly once: compare the multiset of
  // sample fingerprints with the training file's.
  std::vector<torch::Tensor> inputs, targets;
  for (int step = 0; step < 60; ++step) {
    const zoo::Batch b = data->batch(step, 1000);
    inputs.push_back(pixels(b.input));
    targets.push_back(b.target);
  }
  const torch::Tensor labels = torch::cat(targets);
  EXPECT_EQ(labels.min().item<int64_t>(), 0);
  EXPECT_EQ(labels.max().item<int64_t>(), 9);
  EXPECT_EQ(torch::bincount(labels).min().item<int64_t>(), 6000);  // all 10 classes, 6000 each
  const torch::Tensor epoch = std::get<0>(fingerprints(torch::cat(inputs), labels).sort());
  const std::string dir = zoo::kFashionMnistDir;
  const std::string images = std::filesystem::exists(dir + "/train-images-idx3-ubyte")
                                 ? dir + "/train-images-idx3-ubyte"
                                 : dir + "/train-images-idx3-ubyte.gz";
  const std::string label_file = std::filesystem::exists(dir + "/train-labels-idx1-ubyte")
                                     ? dir + "/train-labels-idx1-ubyte"
                                     : dir + "/train-labels-idx1-ubyte.gz";
  const torch::Tensor file = std::get<0>(
      fingerprints(zoo::read_idx_images(images).to(torch::kLong), zoo::read_idx_labels(label_file).to(torch::kLong))
          .sort());
  EXPECT_TRUE(torch::equal(epoch, file));
  // Epoch 1 is another order, and batches that straddle epochs follow the global position formula:
  // step 8 of B = 7000 holds positions 56000..62999, so its samples 4000..4999 are step 60 of B = 1000.
  EXPECT_FALSE(torch::equal(data->batch(60, 1000).target, data->batch(0, 1000).target));
  EXPECT_TRUE(torch::equal(data->batch(8, 7000).input.slice(0, 4000, 5000), data->batch(60, 1000).input));
  EXPECT_TRUE(torch::equal(data->batch(8, 7000).input.slice(0, 0, 1000), data->batch(56, 1000).input));
}

// --- text ----------------------------------------------------------------------------------------

TEST(Zoo, TextEncodingRoundTrips) {
  auto data = zoo::make_text("hello world, hello text", "hello", 4, 0, 0.0);
  EXPECT_EQ(data->vocabulary(), " ,dehlortwx");  // sorted distinct bytes
  const torch::Tensor ids = zoo::encode_text(data->vocabulary(), "hello there");
  EXPECT_TRUE(torch::equal(ids.slice(0, 0, 3), torch::tensor({4, 3, 5}, torch::kLong)));
  EXPECT_EQ(zoo::decode_text(data->vocabulary(), ids), "hello there");
  EXPECT_EQ(zoo::decode_text(data->vocabulary(), ids.view({1, 11})), "hello there");
  EXPECT_THROW_WITH(zoo::encode_text(data->vocabulary(), "hello!"), "'!' (byte 0x21) at position 5");
  EXPECT_THROW_WITH(zoo::decode_text(data->vocabulary(), torch::tensor({3, 11}, torch::kLong)), "token id 11");
  EXPECT_THROW(zoo::encode_text("aa", "a"), UsageError);
}

TEST(Zoo, TextWindowsAreShiftedDeterministicAndSplit) {
  // The training part uses "abcd", the held-out part "xyz": samples show which part they came from.
  std::string text;
  torch::manual_seed(0);
  const torch::Tensor r = torch::randint(4, {900}, torch::kLong);
  for (int i = 0; i < 900; ++i) text += "abcd"[r[i].item<int64_t>()];
  for (int i = 0; i < 100; ++i) text += "xyz"[i % 3];
  auto data = zoo::make_text(text, "split", 8, 5, 0.1);
  EXPECT_EQ(data->vocabulary(), "abcdxyz");
  EXPECT_EQ(data->train_size(), 900 / 8);
  EXPECT_EQ(data->eval_size(), 99 / 8);
  const zoo::Batch b = data->batch(3, 64);
  EXPECT_EQ(b.input.sizes().vec(), (std::vector<int64_t>{64, 8}));
  EXPECT_TRUE(torch::equal(b.input.slice(1, 1, 8), b.target.slice(1, 0, 7)));  // targets are the next tokens
  EXPECT_LT(b.target.max().item<int64_t>(), 4);                                // training characters only
  for (int64_t i = 0; i < 64; ++i) {
    const std::string window = zoo::decode_text(data->vocabulary(), torch::cat({b.input[i], b.target[i].slice(0, 7)}));
    EXPECT_NE(text.substr(0, 900).find(window), std::string::npos) << window;
  }
  auto again = zoo::make_text(text, "split", 8, 5, 0.1), reseeded = zoo::make_text(text, "split", 8, 6, 0.1);
  EXPECT_TRUE(torch::equal(b.input, again->batch(3, 64).input));
  EXPECT_FALSE(torch::equal(b.input, data->batch(4, 64).input));
  EXPECT_FALSE(torch::equal(b.input, reseeded->batch(3, 64).input));
  // Held-out windows tile the last 100 characters in order.
  const zoo::Batch e = data->eval_batch(0, data->eval_size());
  EXPECT_EQ(zoo::decode_text(data->vocabulary(), e.input), text.substr(900, 96));
  EXPECT_EQ(zoo::decode_text(data->vocabulary(), e.target), text.substr(901, 96));
  EXPECT_THROW(data->eval_batch(10, 3), UsageError);
}

TEST(Zoo, TextRejectsBadArguments) {
  EXPECT_THROW_WITH(zoo::make_text("abcdef", "t", 0, 0), "--seq-len 0");
  EXPECT_THROW_WITH(zoo::make_text("abcdef", "t", 2, 0, 1.0), "must lie in [0, 1)");
  EXPECT_THROW_WITH(zoo::make_text("abc", "t", 4, 0, 0.0), "fewer than one window");
  // The fix in numbers: 210 characters hold out 21 = --seq-len 20 + 1; or a context of 9 fits the 10 held out.
  EXPECT_THROW_WITH(zoo::make_text(std::string(100, 'a'), "t", 20, 0, 0.1),
                    "holds out 10 of its 100 characters (10%) for evaluation, fewer than one window of --seq-len + 1 = "
                    "21: use a text of at least 210 characters, or --seq-len 9 or less");
}

TEST(Zoo, TextFiles) {
  TempDir dir;
  write_file(dir.file("t.txt"), "some text\n", false);
  EXPECT_EQ(zoo::read_text_file(dir.file("t.txt")), "some text\n");
  write_file(dir.file("empty.txt"), "", false);
  EXPECT_THROW_WITH(zoo::read_text_file(dir.file("empty.txt")), dir.file("empty.txt") + " is empty");
  EXPECT_THROW_WITH(zoo::read_text_file(dir.file("none.txt")), dir.file("none.txt") + " does not exist");
  EXPECT_THROW_WITH(zoo::load_kjv(dir.file("no-such-bible")), "apt-get install bible-kjv");
}

TEST(Zoo, KingJamesBible) {
  if (access("/usr/bin/bible", X_OK) != 0) GTEST_SKIP() << "the bible program is absent (Debian's bible-kjv)";
  const std::string kjv = zoo::load_kjv();
  EXPECT_GT(kjv.size(), 4000000u);
  EXPECT_EQ(kjv.rfind("In the beginning God created the heaven and the earth.\nAnd the earth", 0), 0u);
  const std::string last = "The grace of our Lord Jesus Christ be with you all. Amen.\n";  // Revelation 22:21
  EXPECT_EQ(kjv.substr(kjv.size() - last.size()), last);
  EXPECT_EQ(kjv.find_first_of("0123456789"), std::string::npos);  // verse references are gone
  std::set<char> distinct(kjv.begin(), kjv.end());
  EXPECT_GE(distinct.size(), 55u);
  EXPECT_LE(distinct.size(), 80u);
  auto data = zoo::make_text(kjv, "kjv", 64, 0);
  EXPECT_EQ(data->vocabulary().size(), distinct.size());
  EXPECT_GT(data->eval_size(), 6000);
}

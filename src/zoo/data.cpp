#include "pipetrain/zoo/data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "pipetrain/core/random.h"
#include "pipetrain/runtime/trainer.h"
#include "seeded.h"

namespace pipetrain::zoo {

at::Generator seeded_generator(uint64_t seed, uint64_t k) {
  return at::make_generator<at::CPUGeneratorImpl>(splitmix64(splitmix64(seed) ^ k));
}
namespace {

at::Generator generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

class SyntheticTokens : public Dataset {
 public:
  SyntheticTokens(int64_t vocab, int64_t seq_len, uint64_t seed) : vocab_(vocab), seq_len_(seq_len), seed_(seed) {
    at::Generator g = generator(seed);
    next_ = torch::randint(vocab, {vocab}, g, torch::kLong);
  }
  std::string name() const override { return "synthetic-tokens"; }
  Batch batch(int64_t step, int64_t n) override {
    at::Generator g = generator(seed_ * 1000003ULL + static_cast<uint64_t>(step) + 1);
    torch::Tensor seq = torch::empty({n, seq_len_ + 1}, torch::kLong);
    torch::Tensor cur = torch::randint(vocab_, {n}, g, torch::kLong);
    seq.select(1, 0).copy_(cur);
    for (int64_t t = 1; t <= seq_len_; ++t) {
      torch::Tensor follow = next_.index_select(0, cur);
      torch::Tensor noise = torch::randint(vocab_, {n}, g, torch::kLong);
      torch::Tensor keep = torch::rand({n}, g) < 0.9;
      cur = torch::where(keep, follow, noise);
      seq.select(1, t).copy_(cur);
    }
    return {seq.slice(1, 0, seq_len_).contiguous(), seq.slice(1, 1, seq_len_ + 1).contiguous(), {}};
  }

 private:
  int64_t vocab_, seq_len_;
  uint64_t seed_;
  torch::Tensor next_;
};

class SyntheticClasses : public Dataset {
 public:
  SyntheticClasses(int64_t features, int64_t classes, uint64_t seed) : features_(features), seed_(seed) {
    at::Generator g = generator(seed);
    teacher_ = torch::randn({features, classes}, g);
  }
  std::string name() const override { return "synthetic-classes"; }
  Batch batch(int64_t step, int64_t n) override {
    at::Generator g = generator(seed_ * 1000003ULL + static_cast<uint64_t>(step) + 1);
    torch::Tensor x = torch::randn({n, features_}, g);
    return {x, x.matmul(teacher_).argmax(1), {}};
  }

 private:
  int64_t features_;
  uint64_t seed_;
  torch::Tensor teacher_;
};

}  // namespace

std::unique_ptr<Dataset> make_synthetic_tokens(int64_t vocab, int64_t seq_len, uint64_t seed) {
  return std::make_unique<SyntheticTokens>(vocab, seq_len, seed);
}

std::unique_ptr<Dataset> make_synthetic_classes(int64_t features, int64_t classes, uint64_t seed) {
  return std::make_unique<SyntheticClasses>(features, classes, seed);
}

TrainData train_data(Dataset& d) {
  TrainData t;
  t.train_size = d.train_size();
  t.eval_size = d.eval_size();
  // The input with its mask, when the samples have one (variable lengths).
  auto input = [](const Batch& b) { return b.mask.defined() ? Bundle{{"x", b.input}, {"mask", b.mask}} : Bundle(b.input); };
  t.batch = [&d, input](int step, int64_t batch_size) {
    Batch b = d.batch(step, batch_size);
    return std::make_pair(input(b), b.target);
  };
  if (t.eval_size > 0)
    t.eval_batch = [&d, input](int64_t begin, int64_t count) {
      Batch b = d.eval_batch(begin, count);
      return std::make_pair(input(b), b.target);
    };
  return t;
}

}  // namespace pipetrain::zoo

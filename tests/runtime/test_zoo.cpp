// Checks the model zoo and the synthetic data (zoo/models.h, zoo/data.h): layer counts and shapes, the
// GPT's causal mask (a position's output never depends on later tokens), heavy first and last GPT layers
// (what parameter balancing must see), bad configurations as UsageErrors, and deterministic data.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/stage.h"
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
  const VerifyResult r = verify_transparency(factory, zoo::cross_entropy, transports[0], o, data->batch(0, 6));
  EXPECT_FALSE(r.ok(1e-3));
  EXPECT_GT(r.max_grad_error, 1e-3);
}

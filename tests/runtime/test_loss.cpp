// The loss over bundles and its normalisation (runtime/loss.h): the loss sees the last stage's whole
// output bundle (a padding mask that travelled with the activations, a second output) and the target
// bundle (two targets); with per-token normalisation (Loss::per_token) the step's loss and gradients
// are the full batch's token mean for variable lengths with padding and an uneven split, on gpipe,
// 1f1b, zb-h1, interleaved, a V schedule and pipedream, against one plain LibTorch pass over the whole
// batch. The per-sample weighting of per-micro-batch token means is shown to differ on the same data, so
// the comparison can fail. Bad combinations and bad loss terms are refused with the fix.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <map>
#include <string>
#include <vector>
#include <mutex>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/split_linear.h"

using namespace pipetrain;
namespace F = torch::nn::functional;

namespace {

constexpr int64_t kBatch = 10, kLen = 6, kDim = 5, kHidden = 8, kVocab = 7;

// x -> x, plus a second output "aux" computed from x ([B, T, 1]).
struct AuxHeadImpl : BundleModule {
  nn::Linear head{nullptr};
  AuxHeadImpl() { head = register_module("head", nn::Linear(kVocab, 1)); }
  Bundle forward(Bundle in) override {
    in.set("aux", head(in.at("x")));
    return in;
  }
};

torch::nn::Sequential make_model() {
  torch::manual_seed(11);
  torch::nn::Sequential m;
  m->push_back(nn::Linear(kDim, kHidden));  // split backward: zero-bubble schedules defer their W
  m->push_back(torch::nn::Tanh());
  m->push_back(nn::Linear(kHidden, kHidden));
  m->push_back(torch::nn::Tanh());
  m->push_back(nn::Linear(kHidden, kVocab));
  m->push_back(std::make_shared<AuxHeadImpl>());
  return m;
}

// Samples of lengths 6, 6, 5, 5, ..., 1 (long ones first, so micro-batches of one size hold very
// different numbers of tokens), padded to kLen; the mask marks the real tokens.
struct Batch {
  Bundle input, target;
};
Batch make_batch() {
  torch::manual_seed(5);
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < kBatch; ++i) lengths.push_back(std::max<int64_t>(1, kLen - i / 2));
  const torch::Tensor len = torch::tensor(lengths).unsqueeze(1);
  const torch::Tensor mask = torch::arange(kLen).unsqueeze(0) < len;  // [B, T] bool
  Batch b;
  b.input = Bundle{{"x", torch::randn({kBatch, kLen, kDim}) * mask.unsqueeze(-1)}, {"mask", mask}};
  b.target = Bundle{{"y", torch::randint(kVocab, {kBatch, kLen}).masked_fill(mask.logical_not(), -1)},
                    {"z", torch::randn({kBatch, kLen})}};
  return b;
}

// Per-token sum over the real tokens (the mask came with the activations) of the cross entropy of x
// against y plus half the squared error of aux against z, and the number of real tokens.
LossTerm token_sum(const Bundle& out, const Bundle& target) {
  const torch::Tensor mask = out.at("mask").flatten();
  const torch::Tensor nll = F::cross_entropy(out.at("x").flatten(0, 1), target.at("y").flatten().clamp_min(0),
                                             F::CrossEntropyFuncOptions().reduction(torch::kNone));
  const torch::Tensor se = (out.at("aux").flatten() - target.at("z").flatten()).pow(2);
  return LossTerm((nll + 0.5 * se).masked_select(mask).sum(), mask.sum());
}

// The model run as plain LibTorch on a whole bundle.
Bundle run_plain(torch::nn::Sequential model, Bundle b) {
  for (auto& any : *model) {
    if (auto bm = std::dynamic_pointer_cast<BundleModule>(any.ptr()))
      b = bm->forward(std::move(b));
    else
      b.set("x", any.forward<torch::Tensor>(b.at("x")));
  }
  return b;
}

struct Reference {
  double loss = 0;
  std::map<std::string, torch::Tensor> grads;
};
// The full batch at once: the token mean of the per-token losses and its gradients.
Reference full_batch(const Batch& b) {
  auto model = make_model();
  const LossTerm t = token_sum(run_plain(model, b.input), b.target);
  torch::Tensor l = t.value / t.count;
  l.backward();
  Reference r;
  r.loss = l.item<double>();
  for (const auto& item : model->named_parameters()) r.grads[item.key()] = item.value().grad().clone();
  return r;
}

struct Captured {
  std::mutex mu;
  std::map<std::string, torch::Tensor> grads;
};

// One pipelined step of `loss` on the batch; the gradients each rank's stages end the step with.
StepStats pipelined(const std::string& schedule, int ranks, int m, const Loss& loss, const Batch& b, Captured& cap) {
  auto model = make_model();
  std::map<const void*, std::string> names;
  for (const auto& item : model->named_parameters()) names[item.value().unsafeGetTensorImpl()] = item.key();
  PipelineOptions o;
  o.schedule = schedule;
  o.microbatches = m;
  if (schedule == "interleaved") o.virtual_stages = 2;
  o.optimizer.lr = 0.1;
  o.on_gradients = [&](int, const std::vector<torch::Tensor>& params) {
    std::lock_guard<std::mutex> g(cap.mu);
    for (const auto& p : params) cap.grads[names.at(p.unsafeGetTensorImpl())] = p.grad().clone();
  };
  LocalPipeline pipe(model, loss, ranks, o);
  return pipe.train_step(b.input, b.target, kBatch);
}

double max_grad_error(const std::map<std::string, torch::Tensor>& got, const Reference& ref) {
  double err = 0;
  EXPECT_EQ(got.size(), ref.grads.size());
  for (const auto& [name, want] : ref.grads) {
    auto it = got.find(name);
    if (it == got.end()) {
      ADD_FAILURE() << "no gradient for " << name;
      continue;
    }
    err = std::max(err, (it->second - want).abs().max().item<double>() / (want.abs().max().item<double>() + 1e-12));
  }
  return err;
}

}  // namespace

TEST(Loss, PerTokenEqualsTheFullBatchForVariableLengthsOnEverySynchronousSchedule) {
  const Batch b = make_batch();
  const Reference ref = full_batch(b);
  struct Case {
    const char* schedule;
    int ranks, m;
  };
  for (const Case& c : {Case{"gpipe", 3, 4}, Case{"1f1b", 3, 4}, Case{"1f1b", 2, 3}, Case{"zb-h1", 3, 4},
                        Case{"interleaved", 2, 4}, Case{"zb-v", 2, 4}, Case{"v-half", 2, 4}}) {
    Captured cap;
    const StepStats s = pipelined(c.schedule, c.ranks, c.m, Loss::per_token(token_sum), b, cap);
    EXPECT_NEAR(s.loss, ref.loss, 1e-6 * ref.loss) << c.schedule << " p=" << c.ranks << " m=" << c.m;
    EXPECT_LE(max_grad_error(cap.grads, ref), 2e-6) << c.schedule << " p=" << c.ranks << " m=" << c.m;
  }
}

TEST(Loss, PerSampleWeightingOfTokenMeansIsNotTheFullBatchTokenMean) {
  // The same data with each micro-batch's own token mean weighted by b_k / N (what a mean loss gets):
  // visibly off, so the test above can tell the two apart.
  const Batch b = make_batch();
  const Reference ref = full_batch(b);
  Captured cap;
  const Loss mean = [](const Bundle& out, const Bundle& target) -> LossTerm {
    const LossTerm t = token_sum(out, target);
    return t.value / t.count;
  };
  const StepStats s = pipelined("1f1b", 3, 4, mean, b, cap);
  EXPECT_GT(std::abs(s.loss - ref.loss), 1e-3 * ref.loss);
  EXPECT_GT(max_grad_error(cap.grads, ref), 1e-3);
}

TEST(Loss, PerTokenOverSeveralStepsPerCallAndPipeDream) {
  const Batch b = make_batch();
  // pipedream: one micro-batch per step, so the whole batch is one micro-batch, divided at once.
  {
    const Reference ref = full_batch(b);
    Captured cap;
    const StepStats s = pipelined("pipedream", 2, 1, Loss::per_token(token_sum), b, cap);
    EXPECT_NEAR(s.loss, ref.loss, 1e-6 * ref.loss);
    EXPECT_LE(max_grad_error(cap.grads, ref), 2e-6);
  }
  // Two steps in one call: each step's loss is the token mean of its own half of the batch.
  auto model = make_model();
  PipelineOptions o;
  o.schedule = "1f1b";
  o.microbatches = 2;
  o.optimizer.lr = 1e-9;  // the second step's weights stay those of the first to float precision
  LocalPipeline pipe(model, Loss::per_token(token_sum), 2, o);
  const StepStats s = pipe.train_steps(b.input, b.target, kBatch, 2);
  ASSERT_EQ(s.losses.size(), 2u);
  for (int k = 0; k < 2; ++k) {
    const int64_t begin = k * kBatch / 2, end = begin + kBatch / 2;
    Batch half{b.input.slice(begin, end), b.target.slice(begin, end)};
    EXPECT_NEAR(s.losses[static_cast<std::size_t>(k)], full_batch(half).loss, 1e-5) << "step " << k;
  }
}

TEST(Loss, EvaluatePerTokenIsTheFullBatchTokenMean) {
  const Batch b = make_batch();
  const Reference ref = full_batch(b);
  auto model = make_model();
  PipelineOptions o;
  o.microbatches = 4;
  LocalPipeline pipe(model, Loss::per_token(token_sum), 3, o);
  const EvalStats e = pipe.evaluate(b.input, b.target, kBatch, 3);
  EXPECT_NEAR(e.loss, ref.loss, 1e-6 * ref.loss);
  // The output bundle of every micro-batch comes back whole (its mask and second output included).
  std::vector<Bundle> outs;
  run_on_threads(3, [&](int r) {
    auto got = pipe.rank(r).forward_outputs(b.input, kBatch, 3);
    if (!got.empty()) outs = got;
  });
  ASSERT_EQ(outs.size(), 3u);
  EXPECT_TRUE(outs[0].has("aux") && outs[0].has("mask"));
}

TEST(Loss, TensorLossStillWorksWithABundleTarget) {
  // A plain (output, target) loss reads the target bundle's "x"; a tensor target is that bundle.
  torch::manual_seed(2);
  torch::nn::Sequential plain(torch::nn::Linear(kDim, kHidden), torch::nn::Tanh(), torch::nn::Linear(kHidden, kVocab));
  LossFn mse = [](const torch::Tensor& out, const torch::Tensor& target) { return F::mse_loss(out, target); };
  PipelineOptions o;
  LocalPipeline pipe(plain, mse, 2, o);
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({8, kDim}), y = torch::randn({8, kVocab});
  const double want = F::mse_loss(plain->forward(x), y).item<double>();
  EXPECT_NEAR(pipe.train_step(Bundle(x), Bundle(y), 8).loss, want, 1e-6);
}

TEST(Loss, BadCombinationsAndTermsAreRefusedWithTheFix) {
  const Batch b = make_batch();
  PipelineOptions o;
  o.schedule = "2bw";
  o.microbatches = 2;
  try {
    LocalPipeline pipe(make_model(), Loss::per_token(token_sum), 2, o);
    FAIL() << "2bw with a per-token loss was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'2bw'"), std::string::npos) << e.what();
  }
  o.schedule = "1f1b";
  // A per-token loss that gives no count, and a per-sample loss that gives one.
  const Loss no_count = Loss::per_token([](const Bundle& out, const Bundle& target) -> LossTerm {
    return token_sum(out, target).value;
  });
  const Loss counted = [](const Bundle& out, const Bundle& target) { return token_sum(out, target); };
  for (const auto& [loss, want] : {std::pair<Loss, std::string>{no_count, "LossTerm(sum, count)"},
                                   {counted, "Loss::per_token"}}) {
    LocalPipeline pipe(make_model(), loss, 2, o);
    try {
      pipe.train_step(b.input, b.target, kBatch);
      FAIL() << "accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
}

TEST(Loss, PerTokenAcrossDataParallelCopiesIsTheFullBatchTokenMean) {
  // Two copies of a 2-stage pipeline, copy 0 on the 5 long samples, copy 1 on the 5 short ones: their
  // counts differ, so averaging the copies' token means would be off; the summed counts are not.
  const Batch b = make_batch();
  const Reference ref = full_batch(b);
  auto world = make_local_transports(4);
  std::vector<torch::nn::Sequential> models{make_model(), make_model()};
  std::vector<std::map<std::string, torch::Tensor>> got(2);
  std::vector<double> loss(4);
  std::mutex mu;
  run_on_threads(4, [&](int r) {
    const int copy = r / 2, stage = r % 2;
    std::map<const void*, std::string> names;
    for (const auto& item : models[static_cast<std::size_t>(copy)]->named_parameters())
      names[item.value().unsafeGetTensorImpl()] = item.key();
    PipelineOptions o;
    o.schedule = "1f1b";
    o.microbatches = 2;
    o.data_parallel = make_group_transport(world[static_cast<std::size_t>(r)], {stage, 2 + stage});
    o.on_gradients = [&, copy](int, const std::vector<torch::Tensor>& held) {
      std::lock_guard<std::mutex> g(mu);
      for (const auto& p : held) got[static_cast<std::size_t>(copy)][names.at(p.unsafeGetTensorImpl())] = p.grad().clone();
    };
    PipelineRank rank(models[static_cast<std::size_t>(copy)], Loss::per_token(token_sum),
                      make_group_transport(world[static_cast<std::size_t>(r)], {2 * copy, 2 * copy + 1}), o);
    const int64_t begin = copy * kBatch / 2, end = begin + kBatch / 2;
    loss[static_cast<std::size_t>(r)] =
        rank.train_step(b.input.slice(begin, end), b.target.slice(begin, end), kBatch / 2).loss;
  });
  for (int r = 0; r < 4; ++r) EXPECT_NEAR(loss[static_cast<std::size_t>(r)], ref.loss, 1e-6 * ref.loss) << "rank " << r;
  for (int copy = 0; copy < 2; ++copy) EXPECT_LE(max_grad_error(got[static_cast<std::size_t>(copy)], ref), 2e-6) << "copy " << copy;
}

// A user's findings (2026-11-28): a loss computed from a detached output (or under a NoGradGuard) trained
// nothing, step after step, and reported its loss; a bundle entry with other rows than batch_size was cut
// silently (rows past it dropped) or failed in a message about the model's shapes.
TEST(LossContract, ALossWithoutAGraphAndRowsOtherThanTheBatchAreRefused) {
  auto mlp = [] {
    torch::manual_seed(0);
    torch::nn::Sequential m;
    for (int i = 0; i < 4; ++i) m->push_back(torch::nn::Linear(4, 4));
    return m;
  };
  PipelineOptions o;
  o.microbatches = 2;
  o.optimizer.lr = 0.1;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({8, 4}), y = torch::randn({8, 4});
  auto detached = [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out.detach(), t); };
  {
    auto m = mlp();
    const torch::Tensor before = m->parameters()[0].clone();
    LocalPipeline p(m, detached, 2, o);
    try {
      p.train_step(x, y, 8);
      FAIL() << "a loss without a graph trained";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("has no autograd graph"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(torch::equal(m->parameters()[0], before));
  }
  auto mse = [](const torch::Tensor& a, const torch::Tensor& b) { return torch::mse_loss(a, b); };
  {  // frozen weights and nothing upstream that learns: a loss without a graph is what it can be
    auto m = mlp();
    for (auto& w : m->parameters()) w.set_requires_grad(false);
    LocalPipeline p(m, detached, 1, o);
    EXPECT_NO_THROW(p.train_step(x, y, 8));
  }
  LocalPipeline p(mlp(), mse, 2, o);
  const std::pair<Bundle, int64_t> bad[] = {
      {Bundle{{"x", x}}, 6},                                // 8 rows, batch 6: the last 2 were dropped
      {Bundle{{"x", x}}, 10},                               // 8 rows, batch 10
      {Bundle{{"x", x}, {"mask", torch::ones({6, 4})}}, 8},  // an entry of 6 rows
  };
  for (const auto& [in, n] : bad) {
    try {
      p.train_step(in, y, n);
      FAIL() << "batch_size " << n << " accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("rows but batch_size is " + std::to_string(n)), std::string::npos)
          << e.what();
    }
  }
  EXPECT_NO_THROW(p.train_step(Bundle{{"x", x}}, y, 8));
  // An entry left undefined is named (LibTorch's "Expected a proper Tensor"); refused before the ranks
  // start, like the rows above, so the pipeline goes on.
  LocalPipeline q(mlp(), mse, 2, o);
  try {
    q.train_step(Bundle{{"x", x}, {"mask", torch::Tensor()}}, y, 8);
    FAIL() << "an undefined entry was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("entry 'mask' is an undefined tensor"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(q.train_step(Bundle{{"x", x}}, y, 8));
}

// An error inside the user's loss said "rank 1 at 1F0: The size of tensor a (4) must match ..." in
// training, and leaked LibTorch's backtrace from evaluate: both now name the loss and what it got.
TEST(LossContract, ALossThatFailsIsNamedWithWhatItGot) {
  torch::manual_seed(0);
  torch::nn::Sequential m;
  for (int i = 0; i < 4; ++i) m->push_back(torch::nn::Linear(4, 4));
  PipelineOptions o;
  o.microbatches = 2;
  auto mse = [](const torch::Tensor& a, const torch::Tensor& b) { return torch::mse_loss(a, b); };
  LocalPipeline p(m, mse, 2, o);
  const torch::Tensor x = torch::randn({8, 4});
  try {
    p.train_step(x, torch::randn({8, 3}), 8);
    FAIL() << "a failing loss trained";
  } catch (const std::exception& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("the loss function failed on micro-batch 0, output {x: [4, 4] Float"), std::string::npos) << w;
    EXPECT_NE(w.find("target {x: [4, 3] Float}"), std::string::npos) << w;
  }
  LocalPipeline q(m, mse, 2, o);
  try {
    q.evaluate(x, torch::randn({8, 2}), 8);
    FAIL() << "a failing loss evaluated";
  } catch (const std::exception& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("the loss function failed on the batch, output {x: [8, 4] Float"), std::string::npos) << w;
    EXPECT_EQ(w.find("frame #"), std::string::npos) << w;
  }
}

// Ranks built with other PipelineOptions (a rank-dependent configuration mistake) waited for each other's
// transfers for ever (another schedule) or failed in a message about the loss's shapes (another m): the
// first call now compares them and every rank names the difference.
TEST(LossContract, RanksGivenOtherOptionsAreToldWhatDiffers) {
  for (const std::string what : {"schedule", "micro-batch count"}) {
    const auto ts = make_local_transports(2);
    std::vector<std::string> errors(2);
    try {
      run_on_threads(2, [&](int r) {
        torch::manual_seed(0);
        torch::nn::Sequential m(torch::nn::Linear(4, 8), torch::nn::Tanh(), torch::nn::Linear(8, 2));
        PipelineOptions o;
        o.microbatches = 4;
        if (r == 1 && what == "schedule") o.schedule = "gpipe";
        if (r == 1 && what != "schedule") o.microbatches = 2;
        PipelineRank rank(m, [](const torch::Tensor& a, const torch::Tensor& b) { return torch::mse_loss(a, b); },
                          ts[static_cast<std::size_t>(r)], o);
        try {
          rank.train_step(torch::randn({8, 4}), torch::randn({8, 2}), 8);
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
          throw;
        }
      });
    } catch (const std::exception&) {
    }
    // Each rank throws its own message, or (the first to throw aborts the others) carries the other's.
    for (int r = 0; r < 2; ++r)
      EXPECT_NE(errors[static_cast<std::size_t>(r)].find("have another " + what + " than rank "), std::string::npos)
          << what << ", rank " << r << ": " << errors[static_cast<std::size_t>(r)];
  }
}

// An infinite learning rate from PipelineOptions::learning_rate or set_learning_rate was taken (every weight
// NaN after the step), while OptimizerOptions::lr refused it.
TEST(LossContract, AnInfiniteLearningRateIsRefusedBeforeTheStep) {
  torch::manual_seed(0);
  torch::nn::Sequential m(torch::nn::Linear(4, 4), torch::nn::Tanh(), torch::nn::Linear(4, 4));
  PipelineOptions o;
  o.microbatches = 2;
  o.learning_rate = [](int) { return std::numeric_limits<double>::infinity(); };
  LocalPipeline p(m, [](const torch::Tensor& a, const torch::Tensor& b) { return torch::mse_loss(a, b); }, 2, o);
  try {
    p.train_step(torch::randn({4, 4}), torch::randn({4, 4}));
    FAIL() << "an infinite learning rate stepped";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("must be a finite number > 0, got inf"), std::string::npos) << e.what();
  }
  for (const auto& w : m->parameters()) EXPECT_TRUE(torch::isfinite(w).all().item<bool>());
  LocalPipeline q(m, [](const torch::Tensor& a, const torch::Tensor& b) { return torch::mse_loss(a, b); }, 2,
                  PipelineOptions{});
  EXPECT_THROW(q.rank(0).set_learning_rate(std::numeric_limits<double>::infinity()), UsageError);
}

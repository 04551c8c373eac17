// Zero bubble for any layer (issue 24): on schedules with W actions, B computes only the stage input's
// gradients through autograd and W the parameters' gradients from the kept graph (autograd_split.h), for
// plain LibTorch layers (torch::nn::Linear, Conv1d, LayerNorm, MultiheadAttention) with no split of their
// own. Checked here: gradients equal plain gradient accumulation on zb-h1, zb-h2, zb-v, v-half, v-min,
// dualpipev and interleaved-zb, with skips, with re-materialisation; before a rank's first W no parameter
// has a gradient yet (B really leaves them to W); W frees the kept graph; no fused-share warning.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "autograd_split.h"
#include "pass_util.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/split_linear.h"

using namespace pipetrain;

namespace {

constexpr int64_t kIn = 5, kWidth = 16, kOut = 3, kBatch = 8;

// [B, 16] -> a 1-d convolution over 2 channels of 8 -> [B, 16].
struct ConvImpl : torch::nn::Module {
  torch::nn::Conv1d conv{nullptr};
  ConvImpl() { conv = register_module("conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(2, 2, 3).padding(1))); }
  torch::Tensor forward(const torch::Tensor& x) { return conv(x.view({x.size(0), 2, 8})).view({x.size(0), kWidth}); }
};
TORCH_MODULE(Conv);

// [B, 16] -> self-attention over 4 tokens of 4, plus the residual -> [B, 16].
struct AttentionImpl : torch::nn::Module {
  torch::nn::MultiheadAttention attn{nullptr};
  AttentionImpl() { attn = register_module("attn", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(4, 2))); }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor t = x.view({x.size(0), 4, 4}).transpose(0, 1);  // [T, B, E]
    return x + std::get<0>(attn(t, t, t)).transpose(0, 1).reshape({x.size(0), kWidth});
  }
};
TORCH_MODULE(Attention);

// Eight layers of plain LibTorch (enough for 2 stages on each of 4 ranks), none with a split of its own.
torch::nn::Sequential make_model(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m;
  m->push_back(torch::nn::Linear(kIn, kWidth));
  m->push_back(torch::nn::Tanh());
  m->push_back(Conv());
  m->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
  m->push_back(Attention());
  m->push_back(torch::nn::Linear(kWidth, kWidth));
  m->push_back(torch::nn::GELU());
  m->push_back(torch::nn::Linear(kWidth, kOut));
  return m;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); }

struct Data {
  torch::Tensor x, y;
};
Data make_data() {
  torch::manual_seed(321);
  return {torch::randn({kBatch, kIn}), torch::randn({kBatch, kOut})};
}

double reference_grads(const std::function<torch::Tensor(const torch::Tensor&)>& forward, const Data& d, int m) {
  double loss = 0;
  for (const auto& [b, e] : split_equal(kBatch, m)) {
    torch::Tensor l = mse(forward(d.x.slice(0, b, e)), d.y.slice(0, b, e)) * (double(e - b) / kBatch);
    l.backward();
    loss += l.item<double>();
  }
  return loss;
}

// One pipelined step: its loss and every gradient in the model's parameter order, and, per rank, whether a
// B ran before the rank's first W (or BW) and whether a parameter of the rank had a gradient by then.
struct PipeRun {
  double loss = 0;
  std::vector<torch::Tensor> grads;
  std::vector<int> b_before_w;
  std::vector<char> grad_before_w;
};

PipeRun pipeline_run(torch::nn::Sequential model, const Data& d, int p, PipelineOptions o) {
  const auto params = model->parameters();
  PipeRun out;
  out.grads.resize(params.size());
  out.b_before_w.assign(static_cast<std::size_t>(p), 0);
  out.grad_before_w.assign(static_cast<std::size_t>(p), 0);
  std::vector<char> seen_w(static_cast<std::size_t>(p), 0);
  std::vector<std::vector<torch::Tensor>> mine(static_cast<std::size_t>(p));
  o.on_gradients = [&](int, const std::vector<torch::Tensor>& held) {
    for (const auto& q : held)
      for (std::size_t k = 0; k < params.size(); ++k)
        if (params[k].unsafeGetTensorImpl() == q.unsafeGetTensorImpl() && q.grad().defined())
          out.grads[k] = q.grad().clone();
  };
  o.before_action = [&](int rank, int, const Action& a) {  // on the rank's own thread: its own entries only
    const auto r = static_cast<std::size_t>(rank);
    if (seen_w[r]) return;
    if (a.kind == ActionKind::B) ++out.b_before_w[r];
    if (a.kind != ActionKind::W && a.kind != ActionKind::BW) return;
    seen_w[r] = 1;
    for (const auto& q : mine[r])
      if (q.grad().defined() && q.grad().abs().sum().item<double>() != 0) out.grad_before_w[r] = 1;
  };
  LocalPipeline pipe(model, mse, p, o);
  for (int r = 0; r < p; ++r) mine[static_cast<std::size_t>(r)] = pipe.rank(r).parameters();
  out.loss = pipe.train_step(d.x, d.y).loss;
  return out;
}

PipelineOptions options_for(const std::string& schedule, int m) {
  PipelineOptions o;
  o.schedule = schedule;
  o.microbatches = m;
  o.virtual_stages = schedule_traits(schedule).virtual_stages ? 2 : 1;
  return o;
}

void expect_same(const PipeRun& got, double ref_loss, const std::vector<torch::Tensor>& want, const std::string& what) {
  EXPECT_NEAR(got.loss, ref_loss, 1e-5 * std::abs(ref_loss)) << what;
  ASSERT_EQ(got.grads.size(), want.size());
  for (std::size_t k = 0; k < want.size(); ++k) {
    ASSERT_TRUE(got.grads[k].defined()) << what << ": parameter " << k << " has no gradient";
    const double scale = want[k].grad().abs().max().item<double>() + 1e-12;
    EXPECT_LE((got.grads[k] - want[k].grad()).abs().max().item<double>(), 1e-5 * scale) << what << " param " << k;
  }
}

// Every rank that ran a B before its first W had no parameter gradient by then, and some rank did.
void expect_deferred(const PipeRun& got, const std::string& what) {
  int ranks_with_b = 0;
  for (std::size_t r = 0; r < got.b_before_w.size(); ++r) {
    if (got.b_before_w[r] == 0) continue;
    ++ranks_with_b;
    EXPECT_FALSE(got.grad_before_w[r]) << what << ": rank " << r << " had parameter gradients after "
                                       << got.b_before_w[r] << " B actions, before its first W";
  }
  EXPECT_GT(ranks_with_b, 0) << what;
}

const std::vector<std::string> kZeroBubble{"zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "dualpipev", "interleaved-zb"};

}  // namespace

TEST(AutogradSplit, PlainTorchLayersMatchPlainTrainingAndDeferWeightGradientsToW) {
  const Data d = make_data();
  int runs = 0;
  for (const std::string& schedule : kZeroBubble)
    for (int p : {2, 4})
      for (int m : {4, 8}) {
        if (schedule == "interleaved-zb" && m % p != 0) continue;
        if (schedule == "dualpipev" && m < 2 * p) continue;
        auto ref = make_model(11);
        const double ref_loss = reference_grads([&](const torch::Tensor& x) { return ref->forward(x); }, d, m);
        const PipeRun got = pipeline_run(make_model(11), d, p, options_for(schedule, m));
        const std::string what = schedule + " p=" + std::to_string(p) + " m=" + std::to_string(m);
        expect_same(got, ref_loss, ref->parameters(), what);
        expect_deferred(got, what);
        ++runs;
      }
  EXPECT_GE(runs, 20);
}

TEST(AutogradSplit, EveryModeAndReMaterialisationGiveTheSameGradients) {
  const Data d = make_data();
  for (const std::string schedule : {"zb-h1", "zb-v"})
    for (const std::string mode : {"auto", "autograd"})
      for (Checkpoint c : {Checkpoint::Never, Checkpoint::Always, Checkpoint::ExceptLast}) {
        auto ref = make_model(5);
        const double ref_loss = reference_grads([&](const torch::Tensor& x) { return ref->forward(x); }, d, 4);
        PipelineOptions o = options_for(schedule, 4);
        o.backward_split = mode;
        o.checkpoint = c;
        const PipeRun got = pipeline_run(make_model(5), d, 2, o);
        const std::string what = schedule + " " + mode + " checkpoint " + std::to_string(static_cast<int>(c));
        expect_same(got, ref_loss, ref->parameters(), what);
        expect_deferred(got, what);
      }
}

// pipetrain::nn::Linear next to plain layers: its explicit split (auto) or autograd's (autograd), both
// deferred, both exact; "explicit" keeps today's behaviour (torch layers' gradients in B).
TEST(AutogradSplit, SplitLinearMixedWithPlainLayersInEveryMode) {
  const Data d = make_data();
  auto mixed = [](uint64_t seed) {
    torch::manual_seed(seed);
    torch::nn::Sequential m;
    m->push_back(nn::Linear(kIn, kWidth));
    m->push_back(torch::nn::Tanh());
    m->push_back(torch::nn::Linear(kWidth, kWidth));
    m->push_back(nn::Linear(kWidth, kWidth));
    m->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    m->push_back(nn::Linear(kWidth, kOut));
    return m;
  };
  for (const std::string mode : {"auto", "autograd", "explicit"}) {
    auto ref = mixed(3);
    const double ref_loss = reference_grads([&](const torch::Tensor& x) { return ref->forward(x); }, d, 4);
    PipelineOptions o = options_for("zb-h1", 4);
    o.backward_split = mode;
    const PipeRun got = pipeline_run(mixed(3), d, 2, o);
    expect_same(got, ref_loss, ref->parameters(), "zb-h1 " + mode);
    if (mode != "explicit") expect_deferred(got, "zb-h1 " + mode);
  }
  auto linears = [](uint64_t seed) {  // auto: every stage all nn::Linear, the explicit split alone
    torch::manual_seed(seed);
    torch::nn::Sequential m;
    m->push_back(nn::Linear(kIn, kWidth));
    m->push_back(torch::nn::Tanh());
    m->push_back(nn::Linear(kWidth, kWidth));
    m->push_back(nn::Linear(kWidth, kOut));
    return m;
  };
  for (const std::string mode : {"auto", "autograd"}) {
    auto ref = linears(4);
    const double ref_loss = reference_grads([&](const torch::Tensor& x) { return ref->forward(x); }, d, 4);
    PipelineOptions o = options_for("zb-h1", 4);
    o.backward_split = mode;
    const PipeRun got = pipeline_run(linears(4), d, 2, o);
    expect_same(got, ref_loss, ref->parameters(), "zb-h1 nn::Linear only " + mode);
    expect_deferred(got, "zb-h1 nn::Linear only " + mode);
  }
  PipelineOptions bad = options_for("zb-h1", 4);
  bad.backward_split = "fused";
  EXPECT_THROW(check_pipeline_options(bad, 2), UsageError);
}

namespace {

// Skips across stages, every layer a BundleModule over plain torch::nn::Linear (examples/skips_zbv.cpp).
struct Down : BundleModule {
  Down(int64_t in, std::string skip) : fc(register_module("fc", torch::nn::Linear(in, kWidth))), skip(std::move(skip)) {}
  Bundle forward(Bundle b) override {
    const torch::Tensor y = torch::relu(fc(b.at(kMainTensor)));
    b.set(skip, y);
    b.set(kMainTensor, y);
    return b;
  }
  std::vector<std::string> stashes() const override { return {skip}; }
  torch::nn::Linear fc;
  std::string skip;
};
struct Up : BundleModule {
  explicit Up(std::string skip) : fc(register_module("fc", torch::nn::Linear(2 * kWidth, kWidth))), skip(std::move(skip)) {}
  Bundle forward(Bundle b) override {
    b.set(kMainTensor, torch::tanh(fc(torch::cat({b.at(kMainTensor), b.take(skip)}, 1))));
    return b;
  }
  std::vector<std::string> pops() const override { return {skip}; }
  torch::nn::Linear fc;
  std::string skip;
};
struct Head : BundleModule {
  Head(int64_t in, int64_t out) : fc(register_module("fc", torch::nn::Linear(in, out))) {}
  Bundle forward(Bundle b) override {
    b.set(kMainTensor, fc(b.at(kMainTensor)));
    return b;
  }
  torch::nn::Linear fc;
};

torch::nn::Sequential make_skip_model(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m;
  m->push_back(std::make_shared<Down>(kIn, "s1"));
  m->push_back(std::make_shared<Down>(kWidth, "s2"));
  m->push_back(std::make_shared<Head>(kWidth, kWidth));
  m->push_back(std::make_shared<Up>("s2"));
  m->push_back(std::make_shared<Up>("s1"));
  m->push_back(std::make_shared<Head>(kWidth, kOut));
  return m;
}

}  // namespace

TEST(AutogradSplit, SkipsAcrossStagesOnEveryZeroBubbleSchedule) {
  const Data d = make_data();
  for (const std::string& schedule : kZeroBubble) {
    const int p = 3, m = 6;
    auto ref = make_skip_model(7);
    auto plain = [&](const torch::Tensor& x) {
      Bundle b{{kMainTensor, x}};
      for (const auto& layer : ref->children()) b = std::dynamic_pointer_cast<BundleModule>(layer)->forward(std::move(b));
      return b.at(kMainTensor);
    };
    const double ref_loss = reference_grads(plain, d, m);
    PipelineOptions o = options_for(schedule, m);
    const PipeRun got = pipeline_run(make_skip_model(7), d, p, o);
    expect_same(got, ref_loss, ref->parameters(), schedule + " with skips");
    expect_deferred(got, schedule + " with skips");
  }
}

TEST(AutogradSplit, NoFusedShareWarningForPlainLayersUnlessExplicit) {
  const Data d = make_data();
  for (const std::string mode : {"auto", "explicit"}) {
    PipelineOptions o = options_for("zb-h1", 4);
    o.backward_split = mode;
    ::testing::internal::CaptureStderr();
    { LocalPipeline pipe(make_model(1), mse, 2, o); }
    const std::string err = ::testing::internal::GetCapturedStderr();
    if (mode == "auto")
      EXPECT_EQ(err.find("warning: schedule 'zb-h1' splits the backward"), std::string::npos) << err;
    else
      EXPECT_NE(err.find("warning: schedule 'zb-h1' splits the backward"), std::string::npos) << err;
  }
}

// The helper itself: B gives the input gradient and no parameter gradient, keeps the graph for W and
// nothing more; W gives the parameter gradients of a fused backward and frees the graph.
TEST(AutogradSplit, BKeepsTheGraphForWAndWFreesIt) {
  for (bool explicit_linear : {true, false}) {
    torch::manual_seed(0);
    torch::nn::Linear a(4, 6);
    nn::Linear b(6, 6);
    torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({6}));
    const torch::Tensor x0 = torch::randn({3, 4});
    const torch::Tensor g = torch::randn({3, 6});
    auto run = [&](const torch::Tensor& x) { return norm(b(torch::tanh(a(x)))); };

    torch::Tensor xr = x0.clone().requires_grad_(true);
    run(xr).backward(g);
    std::vector<torch::Tensor> want;
    for (auto* m : std::vector<torch::nn::Module*>{a.get(), b.get(), norm.get()})
      for (auto& q : m->parameters()) {
        want.push_back(q.grad().clone());
        q.mutable_grad() = torch::Tensor();
      }

    torch::Tensor x = x0.clone().requires_grad_(true);
    torch::Tensor y = run(x);
    std::weak_ptr<torch::autograd::Node> node = y.grad_fn();
    WeightGradStore store;
    pipetrain::detail::backward_input({y}, {g}, {x}, store, explicit_linear);
    y = torch::Tensor();
    ASSERT_TRUE(x.grad().defined());
    EXPECT_TRUE(torch::allclose(x.grad(), xr.grad(), 1e-5, 1e-6));
    for (auto* m : std::vector<torch::nn::Module*>{a.get(), b.get(), norm.get()})
      for (auto& q : m->parameters()) EXPECT_FALSE(q.grad().defined()) << "B computed a weight gradient";
    EXPECT_FALSE(node.expired()) << "B must keep the graph for W";
    EXPECT_FALSE(store.empty());
    store.run();
    EXPECT_TRUE(node.expired()) << "W must free the graph";
    EXPECT_TRUE(store.empty());
    std::size_t k = 0;
    for (auto* m : std::vector<torch::nn::Module*>{a.get(), b.get(), norm.get()})
      for (auto& q : m->parameters()) {
        ASSERT_TRUE(q.grad().defined());
        EXPECT_TRUE(torch::allclose(q.grad(), want[k], 1e-5, 1e-6)) << "parameter " << k;
        ++k;
      }
  }
}

// A stage whose input needs no gradient (stage 0): B computes nothing, W the whole backward.
TEST(AutogradSplit, WithoutAnInputGradientWDoesTheWholeBackward) {
  torch::manual_seed(0);
  torch::nn::Linear a(4, 3);
  const torch::Tensor x = torch::randn({2, 4});
  torch::Tensor loss = a(x).pow(2).sum();
  WeightGradStore store;
  pipetrain::detail::backward_input({loss}, {}, {}, store, true);
  EXPECT_FALSE(a->weight.grad().defined());
  store.run();
  ASSERT_TRUE(a->weight.grad().defined());
  const torch::Tensor y = torch::linear(x, a->weight.detach(), a->bias.detach());
  EXPECT_TRUE(torch::allclose(a->weight.grad(), 2 * y.t().mm(x), 1e-5, 1e-6));
}

// Between B and W a stage holds what W needs (the frontier's saved tensors, the captured gradients), not
// the activations only the input gradient needed: a chain of elementwise layers before a linear one keeps
// about one activation per layer without the release, about three with it.
TEST(AutogradSplit, BReleasesWhatOnlyTheInputGradientNeeded) {
  torch::manual_seed(0);
  constexpr int64_t rows = 256, width = 64, depth = 8;
  const double act = static_cast<double>(rows * width * sizeof(float));
  torch::nn::Linear head(width, width);
  torch::Tensor x = torch::randn({rows, width}).requires_grad_(true);
  const torch::Tensor g = torch::randn({rows, width});
  WeightGradStore store;
  const double before = pipetrain::detail::heap_in_use();
  {
    torch::Tensor h = x;
    for (int64_t k = 0; k < depth; ++k) h = torch::sin(h) * 1.5;  // each saves an activation for dX only
    torch::Tensor y = head(h);
    h = torch::Tensor();
    pipetrain::detail::backward_input({y}, {g}, {x}, store, true);
  }
  const double held = pipetrain::detail::heap_in_use() - before - act;  // less x.grad, which leaves the stage
  EXPECT_LT(held, 4 * act) << "B kept " << held / act << " activations for W";
  store.run();
  EXPECT_TRUE(head->weight.grad().defined());
  EXPECT_LT(pipetrain::detail::heap_in_use() - before - act, 2 * act) << "W must free the graph";
}

// A hook on an intermediate tensor (here doubling its gradient) runs once, in B, as in a fused backward.
TEST(AutogradSplit, ATensorHookRunsOnceAndCountsOnce) {
  torch::manual_seed(0);
  torch::nn::Linear a(4, 4), b(4, 4);
  const torch::Tensor x0 = torch::randn({3, 4});
  const torch::Tensor g = torch::randn({3, 4});
  int calls = 0;
  auto run = [&](const torch::Tensor& x) {
    torch::Tensor h = a(x);
    h.register_hook([&calls](torch::Tensor grad) {
      ++calls;
      return grad * 2;
    });
    return b(torch::tanh(h));
  };
  torch::Tensor xr = x0.clone().requires_grad_(true);
  run(xr).backward(g);
  const torch::Tensor want_a = a->weight.grad().clone(), want_b = b->weight.grad().clone();
  a->weight.mutable_grad() = torch::Tensor();
  b->weight.mutable_grad() = torch::Tensor();
  a->bias.mutable_grad() = torch::Tensor();
  b->bias.mutable_grad() = torch::Tensor();
  calls = 0;
  torch::Tensor x = x0.clone().requires_grad_(true);
  WeightGradStore store;
  pipetrain::detail::backward_input({run(x)}, {g}, {x}, store, true);
  store.run();
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(torch::allclose(x.grad(), xr.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(a->weight.grad(), want_a, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(b->weight.grad(), want_b, 1e-5, 1e-6));
}

// Checks the UMPIPE runtime (PipelineOptions::umpipe, src/runtime/umpipe_pass.h) against docs/ALGORITHMS.md
// §7.6: P-U7, the gradient of random unequal plans (every stage its own forward and backward cuts)
// equals the full-batch gradient of a plain single-process model, and training follows the plain run;
// P-U6, every sample passes every stage exactly once per pass, in stream order, in both directions, in
// the chunk sizes the plan gives; and the refusals (plan and batch, BatchNorm, dropout, stage count,
// schedule), each with a message naming the value.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <random>

#include "pipetrain/core/error.h"
#include "pipetrain/plan/umpipe.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/zoo/models.h"

using namespace pipetrain;

namespace {

// A random composition of n: every cut between samples with one probability, itself random per row, so
// rows range from a few large chunks to many small ones.
std::vector<int> random_row(int n, std::mt19937& gen) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const double density = 0.1 + 0.7 * u(gen);
  std::vector<int> row;
  int run = 1;
  for (int t = 0; t + 1 < n; ++t) {
    if (u(gen) < density) {
      row.push_back(run);
      run = 1;
    } else {
      ++run;
    }
  }
  row.push_back(run);
  return row;
}

UmpipePlan random_plan(int stages, int n, std::mt19937& gen) {
  UmpipePlan plan;
  for (int j = 0; j < stages; ++j) {
    plan.forward.push_back(random_row(n, gen));
    plan.backward.push_back(random_row(n, gen));
  }
  return plan;
}

std::string text(const UmpipePlan& plan) {
  std::string s;
  for (std::size_t j = 0; j < plan.forward.size(); ++j) {
    s += "stage " + std::to_string(j) + " F";
    for (int b : plan.forward[j]) s += " " + std::to_string(b);
    s += " | B";
    for (int b : plan.backward[j]) s += " " + std::to_string(b);
    s += "\n";
  }
  return s;
}

PipelineOptions umpipe_options(const UmpipePlan& plan) {
  PipelineOptions o;
  o.schedule = "gpipe";
  o.microbatches = 2;
  o.optimizer.name = "sgd";
  o.optimizer.lr = 0.05;
  o.optimizer.momentum = 0.9;
  o.optimizer.clip_grad_norm = 0;
  o.umpipe = std::make_shared<UmpipePlan>(plan);
  return o;
}

struct Problem {
  std::function<torch::nn::Sequential()> make;
  torch::Tensor x, y;
};

Problem mlp_problem(int64_t n) {
  zoo::MlpConfig c;
  c.inputs = 10;
  c.hidden = 12;
  c.classes = 5;
  c.layers = 4;
  Problem p;
  p.make = [c] {
    std::lock_guard<std::mutex> lock(default_generator_mutex());
    torch::manual_seed(3);
    return zoo::make_mlp(c);
  };
  torch::manual_seed(11);
  p.x = torch::randn({n, c.inputs});
  p.y = torch::randint(0, c.classes, {n}, torch::kLong);
  return p;
}

Problem gpt_problem(int64_t n) {
  zoo::GptConfig c;
  c.vocab = 11;
  c.seq_len = 6;
  c.d_model = 16;
  c.heads = 2;
  c.layers = 2;  // 4 pipeline layers: embedding, 2 blocks, head
  c.dropout = 0;
  Problem p;
  p.make = [c] {
    std::lock_guard<std::mutex> lock(default_generator_mutex());
    torch::manual_seed(4);
    return zoo::make_gpt(c);
  };
  torch::manual_seed(12);
  p.x = torch::randint(0, c.vocab, {n, c.seq_len}, torch::kLong);
  p.y = torch::randint(0, c.vocab, {n, c.seq_len}, torch::kLong);
  return p;
}

// The plain run: the whole model on the whole batch, mean loss, the same optimizer.
struct Reference {
  std::vector<double> losses;
  std::vector<torch::Tensor> grads;  // of the first step, by parameter position
  std::vector<torch::Tensor> weights;
};
Reference reference_run(const Problem& p, int steps) {
  auto model = p.make();
  const auto params = model->parameters();
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  Reference r;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    torch::Tensor loss = zoo::cross_entropy(model->forward(p.x), p.y);
    loss.backward();
    r.losses.push_back(loss.item<double>());
    if (s == 0)
      for (const auto& t : params) r.grads.push_back(t.grad().clone());
    opt.step();
  }
  for (const auto& t : params) r.weights.push_back(t.detach().clone());
  return r;
}

}  // namespace

// P-U7: random unequal plans on 2, 3 and 4 stages give the full-batch gradient and loss, and training
// stays with the plain run.
TEST(UmpipeRuntime, RandomPlansGiveTheFullBatchGradient) {
  constexpr int64_t kN = 13;
  constexpr int kSteps = 3;
  std::mt19937 gen(2024);
  for (const std::string name : {"mlp", "gpt"}) {
    const Problem problem = name == "mlp" ? mlp_problem(kN) : gpt_problem(kN);
    const Reference want = reference_run(problem, kSteps);
    for (int p : {2, 3, 4})
      for (int trial = 0; trial < 2; ++trial) {
        const UmpipePlan plan = random_plan(p, kN, gen);
        SCOPED_TRACE(name + ", " + std::to_string(p) + " stages\n" + text(plan));
        auto model = problem.make();
        const auto params = model->parameters();
        std::vector<torch::Tensor> got(params.size());
        std::vector<int> calls(static_cast<std::size_t>(p), 0);
        PipelineOptions o = umpipe_options(plan);
        o.on_gradients = [&](int rank, const std::vector<torch::Tensor>& held) {
          if (calls[static_cast<std::size_t>(rank)]++ > 0) return;  // the first step only
          for (const auto& t : held)
            for (std::size_t k = 0; k < params.size(); ++k)
              if (params[k].unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) got[k] = t.grad().clone();
        };
        LocalPipeline pipe(model, zoo::cross_entropy, p, o);
        for (int s = 0; s < kSteps; ++s) {
          const StepStats st = pipe.train_step(problem.x, problem.y);
          EXPECT_NEAR(st.loss, want.losses[static_cast<std::size_t>(s)], 1e-5 * std::abs(want.losses[0])) << "step " << s;
        }
        for (std::size_t k = 0; k < params.size(); ++k) {
          ASSERT_TRUE(got[k].defined()) << "parameter " << k;
          EXPECT_TRUE(torch::allclose(got[k], want.grads[k], 1e-4, 1e-6))
              << "parameter " << k << ": max difference " << (got[k] - want.grads[k]).abs().max().item<double>();
          EXPECT_TRUE(torch::allclose(params[k].detach(), want.weights[k], 1e-4, 1e-5))
              << "weights after " << kSteps << " steps, parameter " << k;
        }
      }
  }
}

namespace {

// What one layer of the tracing model saw: sample ids, in order, and the rows per call, separately for
// the forward phase (no graph), the recompute of the backward phase, and the backward itself.
struct Seen {
  std::vector<int> forward_ids, recompute_ids, backward_ids;
  std::vector<int> forward_sizes, recompute_sizes, backward_sizes;
};

std::vector<int> ids_of(const torch::Tensor& rows) {
  std::vector<int> out;
  const torch::Tensor col = rows.select(1, 0).to(torch::kDouble);
  for (int64_t i = 0; i < col.size(0); ++i) out.push_back(static_cast<int>(std::lround(col[i].item<double>())));
  return out;
}

// Identity on the rows (column 0 carries the sample id); its backward notes the ids of the rows it
// passes the gradient of. The weight w (never changed: its gradient is zero) makes autograd run the
// backward on stage 0 too, whose input needs no gradient.
struct RecordFn : torch::autograd::Function<RecordFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               int64_t seen) {
    ctx->saved_data["seen"] = seen;
    ctx->saved_data["ids"] = x.detach().clone();
    return x.clone() + 0 * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto* seen = reinterpret_cast<Seen*>(ctx->saved_data["seen"].toInt());
    const std::vector<int> ids = ids_of(ctx->saved_data["ids"].toTensor());
    seen->backward_sizes.push_back(static_cast<int>(ids.size()));
    seen->backward_ids.insert(seen->backward_ids.end(), ids.begin(), ids.end());
    return {g[0], torch::zeros({1}), torch::Tensor()};
  }
};

struct RecorderImpl : torch::nn::Module {
  RecorderImpl() { w = register_parameter("w", torch::ones({1})); }
  torch::Tensor forward(const torch::Tensor& x) {
    const std::vector<int> ids = ids_of(x);
    if (!torch::GradMode::is_enabled()) {
      seen.forward_sizes.push_back(static_cast<int>(ids.size()));
      seen.forward_ids.insert(seen.forward_ids.end(), ids.begin(), ids.end());
      return x.clone();
    }
    seen.recompute_sizes.push_back(static_cast<int>(ids.size()));
    seen.recompute_ids.insert(seen.recompute_ids.end(), ids.begin(), ids.end());
    return RecordFn::apply(x, w, reinterpret_cast<int64_t>(&seen));
  }
  torch::Tensor w;
  Seen seen;
};
TORCH_MODULE(Recorder);

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); }

}  // namespace

// P-U6: each stage sees every sample exactly once per pass, in stream order, in chunks of its own rows.
TEST(UmpipeRuntime, EverySamplePassesEveryStageOnceInOrder) {
  constexpr int kN = 17, kLayers = 4;
  std::mt19937 gen(7);
  std::vector<int> stream(kN);
  for (int i = 0; i < kN; ++i) stream[static_cast<std::size_t>(i)] = i;
  for (int p : {2, 3, 4})
    for (int trial = 0; trial < 3; ++trial) {
      const UmpipePlan plan = random_plan(p, kN, gen);
      SCOPED_TRACE(std::to_string(p) + " stages\n" + text(plan));
      torch::nn::Sequential model;
      std::vector<Recorder> layers;
      for (int l = 0; l < kLayers; ++l) {
        layers.emplace_back();
        model->push_back(layers.back());
      }
      torch::Tensor x = torch::randn({kN, 3});
      x.select(1, 0).copy_(torch::arange(kN, torch::kFloat));
      const torch::Tensor y = torch::randn({kN, 3});
      PipelineOptions o = umpipe_options(plan);
      LocalPipeline pipe(model, mse, p, o);
      const StepStats st = pipe.train_step(x, y);
      const std::vector<int> balance = pipe.balance();
      int layer = 0;
      for (int j = 0; j < p; ++j) {
        const bool last = j == p - 1;
        for (int k = 0; k < balance[static_cast<std::size_t>(j)]; ++k, ++layer) {
          SCOPED_TRACE("stage " + std::to_string(j) + ", layer " + std::to_string(layer));
          const Seen& s = layers[static_cast<std::size_t>(layer)]->seen;
          if (last) {  // its forward is folded into its backward's recompute
            EXPECT_TRUE(s.forward_ids.empty());
          } else {
            EXPECT_EQ(s.forward_ids, stream);
            EXPECT_EQ(s.forward_sizes, plan.forward[static_cast<std::size_t>(j)]);
          }
          EXPECT_EQ(s.recompute_ids, stream);
          EXPECT_EQ(s.recompute_sizes, plan.backward[static_cast<std::size_t>(j)]);
          EXPECT_EQ(s.backward_ids, stream);
          EXPECT_EQ(s.backward_sizes, plan.backward[static_cast<std::size_t>(j)]);
        }
        int forwards = 0, backwards = 0;
        for (const TimedAction& e : st.timeline.events) {
          if (e.action.stage != j) continue;
          EXPECT_EQ(e.rank, j);
          forwards += e.action.kind == ActionKind::F;
          backwards += e.action.kind == ActionKind::BW;
        }
        EXPECT_EQ(forwards, last ? 0 : static_cast<int>(plan.forward[static_cast<std::size_t>(j)].size()));
        EXPECT_EQ(backwards, static_cast<int>(plan.backward[static_cast<std::size_t>(j)].size()));
      }
      EXPECT_EQ(st.timeline.schedule, "umpipe");
      // The loss is the mean over the whole batch, whatever the cuts.
      EXPECT_NEAR(st.loss, mse(x, y).item<double>(), 1e-6 * mse(x, y).item<double>());
    }
}

namespace {

// The UsageError's message from building a pipeline (and running one step), or "" when none came.
std::string refusal(const torch::nn::Sequential& model, const PipelineOptions& o, int ranks, const torch::Tensor& x,
                    const torch::Tensor& y, LossFn loss = mse) {
  try {
    LocalPipeline pipe(model, loss, ranks, o);
    pipe.train_step(x, y);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

torch::nn::Sequential small_model(torch::nn::AnyModule middle) {
  std::lock_guard<std::mutex> lock(default_generator_mutex());
  torch::manual_seed(1);
  torch::nn::Sequential m;
  m->push_back(torch::nn::Linear(4, 4));
  m->push_back(std::move(middle));
  m->push_back(torch::nn::Linear(4, 4));
  return m;
}

}  // namespace

TEST(UmpipeRuntime, RefusesWhatItCannotRun) {
  const torch::Tensor x = torch::randn({8, 4}), y = torch::randn({8, 4});
  const UmpipePlan plan{{{3, 5}, {2, 6}}, {{8}, {1, 7}}};
  const auto plain = [] { return small_model(torch::nn::AnyModule(torch::nn::Tanh())); };

  std::string msg = refusal(plain(), umpipe_options(plan), 2, x.slice(0, 0, 6), y.slice(0, 0, 6));
  EXPECT_NE(msg.find("cuts a mini-batch of 8 samples but this step has 6"), std::string::npos) << msg;

  msg = refusal(small_model(torch::nn::AnyModule(torch::nn::BatchNorm1d(4))), umpipe_options(plan), 2, x, y);
  EXPECT_NE(msg.find("layer 1 (BatchNorm1d) holds BatchNorm1d"), std::string::npos) << msg;

  msg = refusal(small_model(torch::nn::AnyModule(torch::nn::Dropout(0.25))), umpipe_options(plan), 2, x, y);
  EXPECT_NE(msg.find("holds Dropout with p = 0.25"), std::string::npos) << msg;
  zoo::GptConfig gpt;
  gpt.layers = 1;
  gpt.d_model = 8;
  gpt.heads = 2;
  gpt.vocab = 5;
  gpt.seq_len = 4;
  gpt.dropout = 0.1;
  msg = refusal(zoo::make_gpt(gpt), umpipe_options(plan), 2, x, y);
  EXPECT_NE(msg.find("with p = 0.1"), std::string::npos) << msg;
  // Dropout with p = 0 is an identity: accepted.
  EXPECT_EQ(refusal(small_model(torch::nn::AnyModule(torch::nn::Dropout(0.0))), umpipe_options(plan), 2, x, y), "");

  const UmpipePlan three{{{8}, {8}, {8}}, {{8}, {8}, {8}}};
  msg = refusal(plain(), umpipe_options(three), 2, x, y);
  EXPECT_NE(msg.find("the UMPIPE plan has 3 stages"), std::string::npos) << msg;
  EXPECT_NE(msg.find("has 2 ranks"), std::string::npos) << msg;

  const UmpipePlan uneven{{{3, 5}, {2, 5}}, {{8}, {1, 7}}};  // stage 1's forward covers 7 samples
  msg = refusal(plain(), umpipe_options(uneven), 2, x, y);
  EXPECT_NE(msg.find("stage 1 forward partition sums to 7"), std::string::npos) << msg;

  PipelineOptions o = umpipe_options(plan);
  o.schedule = "1f1b";
  msg = refusal(plain(), o, 2, x, y);
  EXPECT_NE(msg.find("not '1f1b': use --schedule gpipe"), std::string::npos) << msg;
  o.schedule = "2bw";
  msg = refusal(plain(), o, 2, x, y);
  EXPECT_NE(msg.find("'2bw' is asynchronous"), std::string::npos) << msg;

  // One step per call.
  LocalPipeline pipe(plain(), mse, 2, umpipe_options(plan));
  try {
    pipe.train_steps(torch::cat({x, x}), torch::cat({y, y}), 2);
    ADD_FAILURE() << "two steps per call were accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("one optimizer step per call"), std::string::npos) << e.what();
  }
}

// Evaluation keeps the normal forward schedule, and a pipeline that trained with UMPIPE evaluates the
// same as the plain model with its weights.
TEST(UmpipeRuntime, EvaluationAfterUmpipeSteps) {
  const Problem problem = mlp_problem(12);
  const UmpipePlan plan{{{5, 7}, {1, 11}}, {{12}, {4, 4, 4}}};
  auto model = problem.make();
  LocalPipeline pipe(model, zoo::cross_entropy, 2, umpipe_options(plan));
  pipe.train_step(problem.x, problem.y);
  std::vector<EvalStats> evals(2);
  auto& r0 = pipe.rank(0);
  auto& r1 = pipe.rank(1);
  run_on_threads(2, [&](int r) {
    evals[static_cast<std::size_t>(r)] = (r == 0 ? r0 : r1).evaluate(problem.x, problem.y, 12, 3);
  });
  torch::NoGradGuard no_grad;
  const double want = zoo::cross_entropy(model->forward(problem.x), problem.y).item<double>();
  EXPECT_NEAR(evals[0].loss, want, 1e-5);
  EXPECT_NEAR(evals[1].loss, want, 1e-5);
  // and training goes on after the evaluation
  const StepStats st = pipe.train_step(problem.x, problem.y);
  EXPECT_TRUE(std::isfinite(st.loss));
}

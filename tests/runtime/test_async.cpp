// Oracle tests for the asynchronous schedules (docs/ALGORITHMS.md §5 and §6) on the in-process transport.
//
// The expectations come from a plain sequential reference written here, never from the executor: a
// Linear+Tanh MLP in float64 whose forward and backward are done by hand (so the weights of the forward
// and of the backward can differ, as they do without stashing and under SpecTrain), and SGD, momentum
// SGD and Adam updates written out from LibTorch's formulas. Each policy is a rule "mini-batch i uses
// stage s's version V at its forward and V' at its backward, extrapolated by s steps", taken from the
// docs/ALGORITHMS.md section the test names:
//   pipedream (stash)  V = V' = max(0, i - (p-1-s))                                   P-WS-1, P-WS-3
//   vertical sync      V = V' = max(0, i - (p-1)) on every stage                        P-VS-1
//   2bw                step k uses version max(0, k-1): W(k+1) = W(k) - lr grad(W(k-1))  P-2BW-2, P-2BW-3
//   no stash           V = max(0, i - (p-1-s)) forward, V' = i (the current weights) backward
//   spectrain          V, V' as no stash, extrapolated by s_F, s_B counted on a unit-time simulation
//                      of PipeDream's 1F1B written here (§6.1's target: the start of BW(0, i))
//   pipeoptim (Adam)   forward V extrapolated by i - V along Adam's direction, backward current
// Versions count within one call (the pipeline fills and drains once per train_steps call). Each test
// also checks that the same run is far from the reference of a different rule, so it could fail.
// Further: the versions the executor reports (forward and backward agree; vertical sync agrees across
// stages), the extra weight sets per stage (P-WS-2, P-2BW-1), the counted s against §6.1's closed form
// (P-WP-4), prediction with s = 0 and with a constant update (P-WP-1, P-WP-2), master weights and
// optimizer state bitwise unchanged by predicted passes (P-WP-3), batch-norm statistics not stashed,
// K synchronous steps in one call equal K calls bitwise, and bad combinations are UsageErrors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <tuple>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/split_linear.h"
#include "pipetrain/runtime/weights.h"
#include "torch_compat.h"

using namespace pipetrain;

namespace {

constexpr int64_t kIn = 5, kHidden = 7, kOut = 3, kMini = 4;  // kMini: samples per mini-batch

// p stages of (Linear, Tanh) in float64. Even stages use pipetrain's split Linear (a custom autograd
// function that saves the weight parameter itself), odd stages torch's Linear (addmm saves a view of
// the weight): the two ways autograd keeps a weight for the backward are both covered.
torch::nn::Sequential make_mlp(int p, uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m;
  for (int s = 0; s < p; ++s) {
    const int64_t in = s == 0 ? kIn : kHidden, out = s == p - 1 ? kOut : kHidden;
    if (s % 2 == 0)
      m->push_back(nn::Linear(in, out));
    else
      m->push_back(torch::nn::Linear(in, out));
    m->push_back(torch::nn::Tanh());
  }
  m->to(torch::kDouble);
  return m;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); }

struct Data {
  torch::Tensor x, y;
};
Data make_data(int64_t rows, uint64_t seed = 11) {
  torch::manual_seed(seed);
  return {torch::randn({rows, kIn}, torch::kDouble), torch::randn({rows, kOut}, torch::kDouble)};
}

struct RefOptimizer {
  std::string name = "sgd";
  double lr = 0.1, momentum = 0.0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
};

// One stage's weights after some steps, with the optimizer state that goes with them.
struct Version {
  std::vector<torch::Tensor> w;    // weight, bias
  std::vector<torch::Tensor> buf;  // SGD momentum buffers (undefined before the first step)
  std::vector<torch::Tensor> m1, m2;
  int64_t adam_step = 0;
};

// Which weights a pass uses: the stage's version `version`, extrapolated `predict` steps along the
// optimizer's direction (0: the version itself).
struct Spec {
  int version = 0;
  int predict = 0;
};
using SpecFn = std::function<Spec(int stage, int step)>;

// The sequential reference: stage s's history of versions, mini-batches one after the other.
class Reference {
 public:
  Reference(torch::nn::Sequential model, int p, RefOptimizer o) : p_(p), o_(std::move(o)), history_(p) {
    for (int s = 0; s < p; ++s) {
      Version v;
      for (const auto& t : model[static_cast<std::size_t>(2 * s)]->parameters()) v.w.push_back(t.detach().clone());
      history_[static_cast<std::size_t>(s)].push_back(v);
    }
  }

  // Step k over its micro-batches (sample ranges of x, y; each loss scaled by its share of the
  // mini-batch). Appends version k+1 of every stage; returns the step's loss.
  double step(int k, const Data& d, const std::vector<std::pair<int64_t, int64_t>>& micro, int64_t mini_size,
              const SpecFn& fwd, const SpecFn& bwd) {
    std::vector<std::vector<torch::Tensor>> grads(static_cast<std::size_t>(p_));
    double loss = 0;
    for (const auto& [b, e] : micro) {
      std::vector<torch::Tensor> xs(static_cast<std::size_t>(p_)), ys(static_cast<std::size_t>(p_));
      torch::Tensor x = d.x.slice(0, b, e);
      for (int s = 0; s < p_; ++s) {
        const auto w = weights(s, fwd(s, k));
        xs[static_cast<std::size_t>(s)] = x;
        x = torch::tanh(x.matmul(w[0].t()) + w[1]);
        ys[static_cast<std::size_t>(s)] = x;
      }
      const double scale = static_cast<double>(e - b) / static_cast<double>(mini_size);
      const torch::Tensor diff = x - d.y.slice(0, b, e);
      loss += (diff * diff).mean().item<double>() * scale;
      torch::Tensor dy = 2.0 * diff / static_cast<double>(diff.numel()) * scale;
      for (int s = p_ - 1; s >= 0; --s) {
        const auto w = weights(s, bwd(s, k));
        const torch::Tensor y = ys[static_cast<std::size_t>(s)];
        const torch::Tensor dz = dy * (1.0 - y * y);
        auto& g = grads[static_cast<std::size_t>(s)];
        const torch::Tensor gw = dz.t().matmul(xs[static_cast<std::size_t>(s)]), gb = dz.sum(0);
        if (g.empty()) {
          g = {gw, gb};
        } else {
          g[0] = g[0] + gw;
          g[1] = g[1] + gb;
        }
        dy = dz.matmul(w[0]);
      }
    }
    for (int s = 0; s < p_; ++s) update(s, grads[static_cast<std::size_t>(s)]);
    return loss;
  }

  const std::vector<torch::Tensor>& newest(int s) const { return history_[static_cast<std::size_t>(s)].back().w; }

 private:
  std::vector<torch::Tensor> weights(int s, Spec spec) const {
    const Version& v = history_[static_cast<std::size_t>(s)].at(static_cast<std::size_t>(spec.version));
    if (spec.predict == 0) return v.w;
    std::vector<torch::Tensor> out;
    for (std::size_t k = 0; k < v.w.size(); ++k) {
      torch::Tensor dir;
      if (o_.name == "sgd") {
        dir = v.buf.empty() ? torch::Tensor() : v.buf[k];
      } else if (v.adam_step > 0) {
        const double bc1 = 1 - std::pow(o_.beta1, static_cast<double>(v.adam_step));
        const double bc2 = 1 - std::pow(o_.beta2, static_cast<double>(v.adam_step));
        dir = (v.m1[k] / bc1) / (v.m2[k].sqrt() / std::sqrt(bc2) + o_.eps);
      }
      out.push_back(dir.defined() ? v.w[k] - spec.predict * o_.lr * dir : v.w[k]);
    }
    return out;
  }

  // LibTorch's SGD (momentum: buf = momentum * buf + g, the first buf = g) and Adam, written out.
  void update(int s, const std::vector<torch::Tensor>& g) {
    const Version& v = history_[static_cast<std::size_t>(s)].back();
    Version n;
    n.adam_step = v.adam_step;
    for (std::size_t k = 0; k < v.w.size(); ++k) {
      if (o_.name == "sgd") {
        torch::Tensor d = g[k];
        if (o_.momentum != 0) {
          d = v.buf.empty() ? g[k].clone() : (v.buf[k] * o_.momentum).add(g[k], 1.0);
          n.buf.push_back(d);
        }
        n.w.push_back(v.w[k].add(d, -o_.lr));
      } else {
        const int64_t step = v.adam_step + 1;
        const torch::Tensor m1 = (v.m1.empty() ? torch::zeros_like(g[k]) : v.m1[k] * o_.beta1).add(g[k], 1 - o_.beta1);
        const torch::Tensor m2 =
            (v.m2.empty() ? torch::zeros_like(g[k]) : v.m2[k] * o_.beta2).addcmul(g[k], g[k], 1 - o_.beta2);
        const double bc1 = 1 - std::pow(o_.beta1, static_cast<double>(step));
        const double bc2 = 1 - std::pow(o_.beta2, static_cast<double>(step));
        n.m1.push_back(m1);
        n.m2.push_back(m2);
        n.w.push_back(v.w[k].addcdiv(m1, m2.sqrt() / std::sqrt(bc2) + o_.eps, -o_.lr / bc1));
        n.adam_step = step;
      }
    }
    history_[static_cast<std::size_t>(s)].push_back(n);
  }

  int p_;
  RefOptimizer o_;
  std::vector<std::vector<Version>> history_;
};

// Runs the reference over the steps of one call: `steps` mini-batches of kMini samples, m micro-batches
// each (equal splits, as the executor's). Returns the per-step losses.
std::vector<double> run_reference(Reference& ref, const Data& d, int steps, int m, int64_t offset, const SpecFn& fwd,
                                  const SpecFn& bwd) {
  std::vector<double> losses;
  for (int k = 0; k < steps; ++k) {
    const int64_t base = offset + k * kMini;
    std::vector<std::pair<int64_t, int64_t>> micro;
    for (const auto& [b, e] : split_equal(kMini, m)) micro.emplace_back(base + b, base + e);
    losses.push_back(ref.step(k, d, micro, kMini, fwd, bwd));
  }
  return losses;
}

PipelineOptions async_options(const std::string& schedule, int m, RefOptimizer r) {
  PipelineOptions o;
  o.schedule = schedule;
  o.microbatches = m;
  o.optimizer.name = r.name;
  o.optimizer.lr = r.lr;
  o.optimizer.momentum = r.momentum;
  o.optimizer.beta1 = r.beta1;
  o.optimizer.beta2 = r.beta2;
  o.optimizer.eps = r.eps;
  return o;
}

// Largest relative difference between the pipeline's stage weights and the reference's newest.
double weight_error(LocalPipeline& pipe, const Reference& ref, int p) {
  double worst = 0;
  for (int s = 0; s < p; ++s) {
    const auto got = pipe.rank(s).parameters();
    const auto& want = ref.newest(s);
    EXPECT_EQ(got.size(), want.size());
    for (std::size_t k = 0; k < std::min(got.size(), want.size()); ++k) {
      const double scale = want[k].abs().max().item<double>() + 1e-12;
      worst = std::max(worst, (got[k].detach() - want[k]).abs().max().item<double>() / scale);
    }
  }
  return worst;
}

double loss_error(const std::vector<double>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0;
  for (std::size_t k = 0; k < std::min(got.size(), want.size()); ++k)
    worst = std::max(worst, std::abs(got[k] - want[k]) / (std::abs(want[k]) + 1e-12));
  return worst;
}

constexpr double kTol = 1e-10;  // float64, different operation order from autograd's
constexpr double kFar = 1e-5;   // a wrong rule must miss by at least this much

int delayed(int i, int d) { return std::max(0, i - d); }

// Versions each pass used, by (stage, micro-batch), from the executor's record.
std::map<std::pair<int, int>, std::pair<WeightUse, WeightUse>> uses_by_pass(const StepStats& st) {
  std::map<std::pair<int, int>, std::pair<WeightUse, WeightUse>> out;
  for (const WeightUse& u : st.weight_uses) {
    auto& pass = out[{u.stage, u.micro}];
    (u.kind == ActionKind::F ? pass.first : pass.second) = u;
  }
  return out;
}

int peak_extra(const StepStats& st, int stage) {
  for (const WeightMemory& w : st.weight_memory)
    if (w.stage == stage) return w.peak_extra_sets;
  ADD_FAILURE() << "no weight memory record for stage " << stage;
  return -1;
}

// PipeDream's 1F1B (§5.1.1: stage s runs p-1-s warm-up forwards, then alternates F and BW, stepping
// after each BW) simulated by the reference executor of §1.6 with F = 1, BW = 2 (the executor's unit
// costs F = B = W = 1) and steps that take no time; SpecTrain's s (§6.1) is the number of the stage's
// steps completed in (pass start, start of BW(0, i)].
struct SpecTrainCounts {
  std::map<std::pair<int, int>, int> f, b;
};
SpecTrainCounts spectrain_counts(int p, int n) {
  struct Task {
    char kind;  // 'F', 'B', 'S'
    int stage, i;
  };
  std::vector<std::vector<Task>> order(static_cast<std::size_t>(p));
  for (int s = 0; s < p; ++s) {
    auto& o = order[static_cast<std::size_t>(s)];
    const int w = std::min(p - 1 - s, n);
    for (int i = 0; i < w; ++i) o.push_back({'F', s, i});
    for (int i = 0; i < n; ++i) {
      if (i + w < n) o.push_back({'F', s, i + w});
      o.push_back({'B', s, i});
      o.push_back({'S', s, i});
    }
  }
  std::map<std::tuple<char, int, int>, double> start, finish;
  std::vector<double> free_at(static_cast<std::size_t>(p), 0);
  std::vector<std::size_t> ptr(static_cast<std::size_t>(p), 0);
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int s = 0; s < p; ++s) {
      auto& o = order[static_cast<std::size_t>(s)];
      while (ptr[static_cast<std::size_t>(s)] < o.size()) {
        const Task t = o[ptr[static_cast<std::size_t>(s)]];
        std::vector<std::tuple<char, int, int>> deps;
        if (t.kind == 'F' && s > 0) deps.emplace_back('F', s - 1, t.i);
        if (t.kind == 'B' && s < p - 1) deps.emplace_back('B', s + 1, t.i);
        double begin = free_at[static_cast<std::size_t>(s)];
        bool ready = true;
        for (const auto& dep : deps) {
          if (!finish.count(dep)) ready = false;
          else begin = std::max(begin, finish[dep]);
        }
        if (!ready) break;
        const double cost = t.kind == 'F' ? 1 : t.kind == 'B' ? 2 : 0;
        start[{t.kind, s, t.i}] = begin;
        finish[{t.kind, s, t.i}] = begin + cost;
        free_at[static_cast<std::size_t>(s)] = begin + cost;
        ++ptr[static_cast<std::size_t>(s)];
        progressed = true;
      }
    }
  }
  SpecTrainCounts c;
  for (int s = 0; s < p; ++s)
    for (int i = 0; i < n; ++i) {
      const double target = start.at({'B', 0, i});
      auto count = [&](double from) {
        int k = 0;
        for (int j = 0; j < n; ++j) {
          const double t = finish.at({'S', s, j});
          k += t > from && t <= target;
        }
        return k;
      };
      c.f[{s, i}] = count(start.at({'F', s, i}));
      c.b[{s, i}] = count(start.at({'B', s, i}));
    }
  return c;
}

}  // namespace

// P-WS-3, P-WS-1, P-WS-2: pipedream with stashing is per-stage delayed SGD; F and BW use one version.
TEST(AsyncOracle, PipeDreamStashIsPerStageDelayedUpdates) {
  // Adam too: unlike LibTorch's SGD it updates the parameter itself (bumping its version counter), the
  // case the version bookkeeping of weights.h is for.
  for (const auto& [p, optimizer] : std::vector<std::pair<int, std::string>>{{2, "sgd"}, {4, "sgd"}, {4, "adam"}}) {
    const int K = 10;
    const Data d = make_data(2 * K * kMini);
    RefOptimizer r;
    r.name = optimizer;
    if (optimizer == "adam") r.lr = 0.02;
    auto model = make_mlp(p, 3);
    Reference ref(make_mlp(p, 3), p, r);
    Reference naive(make_mlp(p, 3), p, r);
    LocalPipeline pipe(model, mse, p, async_options("pipedream", 1, r));
    // Two calls: the delays restart with each call (the pipeline fills and drains once per call), from
    // the K versions the first call made.
    for (int call = 0; call < 2; ++call) {
      auto stash = [p, call](int s, int i) { return Spec{call * K + delayed(i, p - 1 - s), 0}; };
      auto now = [call](int, int i) { return Spec{call * K + i, 0}; };
      const int64_t b = call * K * kMini, e = (call + 1) * K * kMini;
      const Data part{d.x.slice(0, b, e), d.y.slice(0, b, e)};
      const StepStats st = pipe.train_steps(part.x, part.y, K);
      const auto want = run_reference(ref, d, K, 1, call * K * kMini, stash, stash);
      run_reference(naive, d, K, 1, call * K * kMini, now, now);
      EXPECT_LE(loss_error(st.losses, want), kTol) << optimizer << " p=" << p << " call " << call;
      EXPECT_EQ(st.steps, K);
      for (const auto& [key, fb] : uses_by_pass(st)) {
        const auto [s, i] = key;
        EXPECT_EQ(fb.first.version, fb.second.version) << "stage " << s << " micro-batch " << i;  // P-WS-1
        EXPECT_EQ(fb.first.version, call * K + delayed(i, p - 1 - s)) << "stage " << s << " micro-batch " << i;
      }
      for (int s = 0; s < p; ++s) EXPECT_EQ(peak_extra(st, s), p - 1 - s) << "stage " << s;  // P-WS-2: p-s sets
    }
    EXPECT_LE(weight_error(pipe, ref, p), kTol) << optimizer << " p=" << p;
    EXPECT_GE(weight_error(pipe, naive, p), kFar) << optimizer << " p=" << p << ": staleness should matter";
  }
}

// P-VS-1: with vertical sync every stage uses stage 0's version, max(0, i - (p-1)).
TEST(AsyncOracle, VerticalSyncUsesOneVersionIndexPerMiniBatch) {
  const int p = 4, K = 10;
  const Data d = make_data(K * kMini);
  RefOptimizer r;
  r.lr = 0.2;
  Reference ref(make_mlp(p, 5), p, r), stash_ref(make_mlp(p, 5), p, r);
  PipelineOptions o = async_options("pipedream", 1, r);
  o.vertical_sync = true;
  LocalPipeline pipe(make_mlp(p, 5), mse, p, o);
  const StepStats st = pipe.train_steps(d.x, d.y, K);
  auto vs = [p](int, int i) { return Spec{delayed(i, p - 1), 0}; };
  auto stash = [p](int s, int i) { return Spec{delayed(i, p - 1 - s), 0}; };
  EXPECT_LE(loss_error(st.losses, run_reference(ref, d, K, 1, 0, vs, vs)), kTol);
  run_reference(stash_ref, d, K, 1, 0, stash, stash);
  EXPECT_LE(weight_error(pipe, ref, p), kTol);
  EXPECT_GE(weight_error(pipe, stash_ref, p), kFar);
  for (const auto& [key, fb] : uses_by_pass(st)) {
    EXPECT_EQ(fb.first.version, delayed(key.second, p - 1)) << "stage " << key.first << " micro-batch " << key.second;
    EXPECT_EQ(fb.second.version, fb.first.version);
  }
  // Stage s keeps the versions from the oldest in flight to its newest: at most p sets.
  for (int s = 0; s < p; ++s) {
    EXPECT_LE(peak_extra(st, s), p - 1) << "stage " << s;
    EXPECT_GE(peak_extra(st, s), p - 1 - s) << "stage " << s;
  }
}

// P-2BW-3, P-2BW-2, P-2BW-1: 2bw is one-step-delayed SGD with gradients accumulated over m micro-batches.
TEST(AsyncOracle, TwoBwIsOneStepDelayedSgd) {
  for (const auto& [p, m] : std::vector<std::pair<int, int>>{{2, 2}, {4, 4}, {3, 4}}) {
    const int K = 5;
    const Data d = make_data(K * kMini);
    RefOptimizer r;
    r.lr = 0.3;
    Reference ref(make_mlp(p, 9), p, r), naive(make_mlp(p, 9), p, r);
    LocalPipeline pipe(make_mlp(p, 9), mse, p, async_options("2bw", m, r));
    const StepStats st = pipe.train_steps(d.x, d.y, K);
    auto delayed_one = [](int, int k) { return Spec{delayed(k, 1), 0}; };
    auto now = [](int, int k) { return Spec{k, 0}; };
    const std::string what = "p=" + std::to_string(p) + " m=" + std::to_string(m);
    EXPECT_LE(loss_error(st.losses, run_reference(ref, d, K, m, 0, delayed_one, delayed_one)), kTol) << what;
    run_reference(naive, d, K, m, 0, now, now);
    EXPECT_LE(weight_error(pipe, ref, p), kTol) << what;
    EXPECT_GE(weight_error(pipe, naive, p), kFar) << what;
    for (const auto& [key, fb] : uses_by_pass(st)) {
      EXPECT_EQ(fb.first.version, fb.second.version) << what;
      EXPECT_EQ(fb.first.version, delayed(key.second / m, 1)) << what << " micro-batch " << key.second;
    }
    for (int s = 0; s < p; ++s) EXPECT_EQ(peak_extra(st, s), 1) << what << " stage " << s;  // two versions
  }
}

// The stale baseline: the backward sees the current weights (and the forward's activations).
TEST(AsyncOracle, NoStashBackwardUsesCurrentWeights) {
  const int p = 4, K = 10;
  const Data d = make_data(K * kMini);
  RefOptimizer r;
  r.lr = 0.2;
  Reference ref(make_mlp(p, 6), p, r), stash_ref(make_mlp(p, 6), p, r);
  PipelineOptions o = async_options("pipedream", 1, r);
  o.weight_stashing = false;
  LocalPipeline pipe(make_mlp(p, 6), mse, p, o);
  const StepStats st = pipe.train_steps(d.x, d.y, K);
  auto fwd = [p](int s, int i) { return Spec{delayed(i, p - 1 - s), 0}; };
  auto now = [](int, int i) { return Spec{i, 0}; };
  EXPECT_LE(loss_error(st.losses, run_reference(ref, d, K, 1, 0, fwd, now)), kTol);
  run_reference(stash_ref, d, K, 1, 0, fwd, fwd);
  EXPECT_LE(weight_error(pipe, ref, p), kTol);
  EXPECT_GE(weight_error(pipe, stash_ref, p), kFar);
  for (int s = 0; s < p; ++s) EXPECT_EQ(peak_extra(st, s), 0) << "stage " << s;  // nothing kept
}

// SpecTrain (§6.1): both passes use W - s lr v with v the momentum buffer and s counted on the schedule.
TEST(AsyncOracle, SpecTrainPredictsBothPasses) {
  const int p = 4, K = 10;
  const Data d = make_data(K * kMini);
  RefOptimizer r;
  r.lr = 0.1;
  r.momentum = 0.9;
  const SpecTrainCounts c = spectrain_counts(p, K);
  Reference ref(make_mlp(p, 8), p, r), plain(make_mlp(p, 8), p, r);
  LocalPipeline pipe(make_mlp(p, 8), mse, p, async_options("spectrain", 1, r));
  EXPECT_EQ(pipe.rank(0).weight_policy(), WeightPolicy::SpecTrain);
  const StepStats st = pipe.train_steps(d.x, d.y, K);
  auto fwd = [&](int s, int i) { return Spec{delayed(i, p - 1 - s), c.f.at({s, i})}; };
  auto bwd = [&](int s, int i) { return Spec{i, c.b.at({s, i})}; };
  auto fwd0 = [&](int s, int i) { return Spec{delayed(i, p - 1 - s), 0}; };
  auto bwd0 = [&](int, int i) { return Spec{i, 0}; };
  EXPECT_LE(loss_error(st.losses, run_reference(ref, d, K, 1, 0, fwd, bwd)), kTol);
  run_reference(plain, d, K, 1, 0, fwd0, bwd0);  // the same without prediction (no stash)
  EXPECT_LE(weight_error(pipe, ref, p), kTol);
  EXPECT_GE(weight_error(pipe, plain, p), kFar);
  for (const auto& [key, fb] : uses_by_pass(st)) {
    EXPECT_EQ(fb.first.predicted, c.f.at(key)) << "F stage " << key.first << " micro-batch " << key.second;
    EXPECT_EQ(fb.second.predicted, c.b.at(key)) << "BW stage " << key.first << " micro-batch " << key.second;
  }
  // One prediction buffer per micro-batch in flight: p - s on stage s.
  for (int s = 0; s < p; ++s) EXPECT_EQ(peak_extra(st, s), p - s) << "stage " << s;
}

// PipeOptim (§6.2): with Adam, the forward only, s = the stage's own steps between F and BW, along
// Adam's direction; the backward uses the current weights.
TEST(AsyncOracle, PipeOptimPredictsTheForwardAlongAdam) {
  const int p = 3, K = 9;
  const Data d = make_data(K * kMini);
  RefOptimizer r;
  r.name = "adam";
  r.lr = 0.02;
  Reference ref(make_mlp(p, 4), p, r), plain(make_mlp(p, 4), p, r);
  LocalPipeline pipe(make_mlp(p, 4), mse, p, async_options("spectrain", 1, r));
  EXPECT_EQ(pipe.rank(0).weight_policy(), WeightPolicy::PipeOptim);
  const StepStats st = pipe.train_steps(d.x, d.y, K);
  auto fwd = [&](int s, int i) { return Spec{delayed(i, p - 1 - s), i - delayed(i, p - 1 - s)}; };
  auto fwd0 = [&](int s, int i) { return Spec{delayed(i, p - 1 - s), 0}; };
  auto bwd = [&](int, int i) { return Spec{i, 0}; };
  EXPECT_LE(loss_error(st.losses, run_reference(ref, d, K, 1, 0, fwd, bwd)), kTol);
  run_reference(plain, d, K, 1, 0, fwd0, bwd);
  EXPECT_LE(weight_error(pipe, ref, p), kTol);
  EXPECT_GE(weight_error(pipe, plain, p), kFar);
  for (const auto& [key, fb] : uses_by_pass(st)) {
    if (key.second >= p) {
      EXPECT_EQ(fb.first.predicted, p - 1 - key.first);  // full pipeline: s = p-1-stage
    }
    EXPECT_EQ(fb.second.predicted, 0);
  }
}

// P-WP-4: the counted s equals §6.1's closed form once the pipeline is full (equal F and B times).
TEST(AsyncWeights, CountedStepsMatchTheClosedForm) {
  for (int p : {2, 3, 4, 5, 6}) {
    const int n = 4 * p;
    for (const StageCost& cost : {StageCost{1, 1, 0, 1}, StageCost{2, 1, 1, 1}}) {  // T_F = T_BW
      const StepCounts c = count_spectrain_steps(generate("spectrain", GeneratorOptions{p, n, 1, 1, 0, {}}),
                                                 CostModel::uniform(p, cost));
      for (int r = 0; r < p; ++r)
        for (int i = p; i < n - p; ++i) {
          EXPECT_EQ(c.forward.at({r, i}), p - 1 - r / 2) << "p=" << p << " stage " << r << " micro-batch " << i;
          EXPECT_EQ(c.backward.at({r, i}), (r + 1) / 2) << "p=" << p << " stage " << r << " micro-batch " << i;
        }
    }
  }
  // During the fill the first mini-batch sees fewer future steps: stage 0's forward of mini-batch 0 none.
  const StepCounts c = count_spectrain_steps(generate("spectrain", GeneratorOptions{4, 12, 1, 1, 0, {}}), CostModel{});
  EXPECT_EQ(c.forward.at({0, 0}), 0);
}

// P-WP-1, P-WP-2: s = 0 is the identity bitwise; with a constant update the prediction is exact.
TEST(AsyncWeights, PredictionIdentityAndExactness) {
  const torch::Tensor w = torch::randn({4, 3}, torch::kDouble);
  const torch::Tensor v = torch::randn({4, 3}, torch::kDouble);
  EXPECT_TRUE(torch::equal(predict_weight(w, v, 0, 0.1), w));
  EXPECT_TRUE(torch::equal(predict_weight(w, torch::Tensor(), 5, 0.1), w));
  EXPECT_FALSE(torch::equal(predict_weight(w, v, 1, 0.1), w));
  // Momentum SGD on a loss linear in W (constant gradient g) from the converged buffer g / (1 - momentum):
  // every step subtracts lr * 2g. Values are small dyadic fractions, so all arithmetic is exact.
  const double lr = 0.25, momentum = 0.5;
  torch::Tensor p = torch::tensor({1.5, -2.0, 0.25}, torch::kDouble).requires_grad_(true);
  const torch::Tensor g = torch::tensor({0.5, 1.0, -0.25}, torch::kDouble);
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(lr).momentum(momentum));
  auto state = std::make_unique<torch::optim::SGDParamState>();
  state->momentum_buffer(g / (1 - momentum));
  opt.state()[compat::optimizer_state_key(p)] = std::move(state);
  const torch::Tensor direction = update_direction(opt, p);
  ASSERT_TRUE(direction.defined());
  for (int s : {1, 2, 3, 5}) {
    const torch::Tensor predicted = predict_weight(p, update_direction(opt, p), s, lr);
    torch::Tensor truth = p.detach().clone();
    {
      torch::Tensor q = p.detach().clone().requires_grad_(true);
      torch::optim::SGD o2({q}, torch::optim::SGDOptions(lr).momentum(momentum));
      auto st2 = std::make_unique<torch::optim::SGDParamState>();
      st2->momentum_buffer(g / (1 - momentum));
      o2.state()[compat::optimizer_state_key(q)] = std::move(st2);
      for (int k = 0; k < s; ++k) {
        q.mutable_grad() = g.clone();
        o2.step();
      }
      truth = q.detach().clone();
    }
    EXPECT_TRUE(torch::equal(predicted, truth)) << "s=" << s << " predicted " << predicted << " truth " << truth;
  }
}

// P-WP-3: predicted passes (forward and backward, with autograd between) leave the master weights, their
// storage and the optimizer state bitwise unchanged; the pass itself sees other weights.
TEST(AsyncWeights, PredictionLeavesMasterAndOptimizerStateUntouched) {
  for (const std::string name : {"sgd", "adamw"}) {
    torch::manual_seed(2);
    torch::nn::Linear layer(4, 3);
    layer->to(torch::kDouble);
    std::vector<torch::Tensor> params = layer->parameters();
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (name == "sgd")
      opt = std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    else
      opt = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.1).weight_decay(0.1));
    const torch::Tensor x = torch::randn({5, 4}, torch::kDouble);
    for (int k = 0; k < 2; ++k) {  // some optimizer state
      layer->forward(x).pow(2).sum().backward();
      opt->step();
      opt->zero_grad();
    }
    std::vector<torch::Tensor> before, state_before;
    std::vector<const void*> storage;
    for (const auto& p : params) {
      before.push_back(p.detach().clone());
      storage.push_back(p.data_ptr());
      state_before.push_back(update_direction(*opt, p).clone());
    }
    StageWeights w(params, opt.get());
    std::vector<torch::Tensor> scratch;
    w.enter(PassWeights{-1, 3}, true, scratch);
    EXPECT_FALSE(torch::equal(params[0].detach(), before[0])) << name << ": the forward should see predicted weights";
    torch::Tensor y = layer->forward(x).pow(2).sum();
    w.leave();
    w.enter(PassWeights{-1, 1}, false, scratch);
    y.backward();
    w.leave();
    w.finish(PassWeights{-1, 1}, false, scratch);
    EXPECT_TRUE(scratch.empty());
    for (std::size_t k = 0; k < params.size(); ++k) {
      EXPECT_TRUE(torch::equal(params[k].detach(), before[k])) << name << " parameter " << k;
      EXPECT_EQ(params[k].data_ptr(), storage[k]) << name << " parameter " << k;
      EXPECT_TRUE(torch::equal(update_direction(*opt, params[k]), state_before[k])) << name << " state " << k;
      EXPECT_TRUE(params[k].grad().defined());
    }
    EXPECT_EQ(w.peak_extra_sets(), 1);
  }
}

// The forward and backward of one micro-batch see the same weights, even though a step changed the
// master weights in between (stash), and the optimizer steps the newest weights.
TEST(AsyncWeights, StashSwapsTheForwardVersionInForTheBackward) {
  torch::manual_seed(3);
  torch::nn::Linear layer(3, 2);
  layer->to(torch::kDouble);
  std::vector<torch::Tensor> params = layer->parameters();
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.5));
  WeightPlan plan;
  plan.policy = WeightPolicy::Stash;
  plan.forward[{0, 0}] = plan.backward[{0, 0}] = PassWeights{0, -1};
  plan.forward[{0, 1}] = plan.backward[{0, 1}] = PassWeights{1, -1};
  StageWeights w(params, &opt);
  w.begin_call(plan, 0);
  const torch::Tensor x = torch::randn({4, 3}, torch::kDouble), dy = torch::randn({4, 2}, torch::kDouble);
  const torch::Tensor w0 = params[0].detach().clone();
  std::vector<torch::Tensor> none;
  w.enter(plan.forward[{0, 0}], true, none);
  torch::Tensor xi = x.clone().requires_grad_(true);
  torch::Tensor y = layer->forward(xi);
  w.leave();
  w.finish(plan.forward[{0, 0}], true, none);
  // A step of another mini-batch's gradient before micro-batch 0's backward.
  for (auto& p : params) p.mutable_grad() = torch::ones_like(p);
  w.step([&] { opt.step(); }, true);
  for (auto& p : params) p.mutable_grad() = torch::Tensor();
  const torch::Tensor w1 = params[0].detach().clone();
  EXPECT_FALSE(torch::equal(w0, w1));
  EXPECT_EQ(w.extra_sets(), 1);
  w.enter(plan.backward[{0, 0}], false, none);
  y.backward(dy);  // would throw "modified by an inplace operation" without the version bookkeeping
  w.leave();
  w.finish(plan.backward[{0, 0}], false, none);
  EXPECT_EQ(w.extra_sets(), 0);  // version 0 is no longer needed
  EXPECT_TRUE(torch::allclose(xi.grad(), dy.matmul(w0), 1e-14, 0)) << "the backward must use version 0";
  EXPECT_TRUE(torch::equal(params[0].detach(), w1));
}

// Batch-norm running statistics are not versioned: a batch norm on the raw input of stage 0 ends with
// the running mean of every forward in order, whatever version its affine weights had.
TEST(AsyncWeights, BatchNormStatisticsAreNotStashed) {
  const int p = 2, K = 6;
  torch::manual_seed(1);
  torch::nn::Sequential model;
  model->push_back(torch::nn::BatchNorm1d(kIn));
  model->push_back(torch::nn::Linear(kIn, kHidden));
  model->push_back(torch::nn::Tanh());
  model->push_back(torch::nn::Linear(kHidden, kOut));
  model->to(torch::kDouble);
  const Data d = make_data(K * kMini);
  PipelineOptions o = async_options("pipedream", 1, RefOptimizer{});
  LocalPipeline pipe(model, mse, p, o);
  pipe.train_steps(d.x, d.y, K);
  torch::Tensor running = torch::zeros({kIn}, torch::kDouble);
  for (int k = 0; k < K; ++k) running = 0.9 * running + 0.1 * d.x.slice(0, k * kMini, (k + 1) * kMini).mean(0);
  auto bn = model[0]->as<torch::nn::BatchNorm1d>();
  EXPECT_TRUE(torch::allclose(bn->running_mean, running, 1e-12, 1e-14)) << bn->running_mean << running;
}

// Fast and reference paths give the same numbers for the asynchronous schedules too.
TEST(AsyncExecutor, FastAndReferencePathsAgreeBitwise) {
  const Data d = make_data(8 * kMini);
  for (const std::string schedule : {"pipedream", "2bw", "spectrain"}) {
    RefOptimizer r;
    r.momentum = 0.9;
    PipelineOptions o = async_options(schedule, schedule == "2bw" ? 4 : 1, r);
    std::vector<std::vector<torch::Tensor>> params;
    std::vector<std::vector<double>> losses;
    for (bool reference : {true, false}) {
      o.reference = reference;
      o.prefetch = 2;
      auto model = make_mlp(4, 1);
      LocalPipeline pipe(model, mse, 4, o);
      losses.push_back(pipe.train_steps(d.x, d.y, schedule == "2bw" ? 4 : 8).losses);
      params.push_back(model->parameters());
    }
    EXPECT_EQ(losses[0], losses[1]) << schedule;
    for (std::size_t k = 0; k < params[0].size(); ++k)
      EXPECT_TRUE(torch::equal(params[0][k], params[1][k])) << schedule;
  }
}

// For a synchronous schedule, K steps in one call are K calls of one step, bitwise: the same
// mini-batches, dropout masks (seeded per step), learning rates and reductions.
TEST(AsyncExecutor, SynchronousStepsPerCallEqualSeparateCalls) {
  auto model_with_dropout = [] {
    torch::manual_seed(4);
    torch::nn::Sequential m;
    m->push_back(nn::Linear(kIn, kHidden));
    m->push_back(torch::nn::Dropout(0.3));
    m->push_back(torch::nn::Linear(kHidden, kHidden));
    m->push_back(torch::nn::Tanh());
    m->push_back(nn::Linear(kHidden, kOut));
    return m;
  };
  torch::manual_seed(5);
  const int K = 3;
  const torch::Tensor x = torch::randn({K * 6, kIn}), y = torch::randn({K * 6, kOut});
  auto lr = [](int step) { return 0.05 * (step + 1); };
  for (const std::string schedule : {"gpipe", "1f1b", "zb-h1"}) {
    PipelineOptions o;
    o.schedule = schedule;
    o.microbatches = 2;
    o.seed = 7;
    o.optimizer.momentum = 0.5;
    o.optimizer.clip_grad_norm = 0.5;
    auto one = model_with_dropout();
    LocalPipeline a(one, mse, 2, o);
    std::vector<double> separate;
    for (int k = 0; k < K; ++k) {
      for (int r = 0; r < 2; ++r) a.rank(r).set_learning_rate(lr(k));
      separate.push_back(a.train_step(x.slice(0, k * 6, (k + 1) * 6), y.slice(0, k * 6, (k + 1) * 6)).loss);
    }
    o.learning_rate = lr;
    auto many = model_with_dropout();
    LocalPipeline b(many, mse, 2, o);
    const StepStats st = b.train_steps(x, y, K);
    EXPECT_EQ(st.losses, separate) << schedule;
    EXPECT_EQ(st.grad_norms.size(), static_cast<std::size_t>(K));
    const auto pa = one->parameters(), pb = many->parameters();
    for (std::size_t k = 0; k < pa.size(); ++k)
      EXPECT_TRUE(torch::equal(pa[k], pb[k])) << schedule << " parameter " << k;
    EXPECT_EQ(b.rank(0).step(), K);
  }
}

// Asynchronous schedules clip each stage's gradient by its own norm and report the global norm per step.
TEST(AsyncExecutor, PerStageClippingAndGlobalNorms) {
  const int p = 2, K = 4;
  const Data d = make_data(K * kMini);
  RefOptimizer r;
  PipelineOptions o = async_options("pipedream", 1, r);
  o.optimizer.clip_grad_norm = 1e-3;
  std::vector<double> stage_norms;
  std::mutex mu;
  o.on_gradients = [&](int, const std::vector<torch::Tensor>& params) {
    double sq = 0;
    for (const auto& t : params) sq += t.grad().pow(2).sum().item<double>();
    std::lock_guard<std::mutex> lock(mu);
    stage_norms.push_back(std::sqrt(sq));
  };
  LocalPipeline pipe(make_mlp(p, 2), mse, p, o);
  const StepStats st = pipe.train_steps(d.x, d.y, K);
  ASSERT_EQ(stage_norms.size(), static_cast<std::size_t>(p * K));  // once per stage and step
  for (double n : stage_norms) EXPECT_LE(n, 1e-3 * (1 + 1e-9));     // clipped per stage
  ASSERT_EQ(st.grad_norms.size(), static_cast<std::size_t>(K));
  for (double n : st.grad_norms) EXPECT_GT(n, 1e-2);  // the global norm before clipping
}

TEST(AsyncExecutor, BadCombinationsAreUsageErrors) {
  auto expect_usage = [](PipelineOptions o, int p, const std::string& part) {
    try {
      LocalPipeline pipe(make_mlp(4, 1), mse, p, o);
      const Data d = make_data(4 * kMini);
      pipe.train_steps(d.x, d.y, 4);
      ADD_FAILURE() << "accepted: " << part;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  PipelineOptions o;
  o.vertical_sync = true;
  expect_usage(o, 2, "vertical sync applies to --schedule pipedream only, not '1f1b'");
  o = async_options("2bw", 4, RefOptimizer{});
  o.vertical_sync = true;
  expect_usage(o, 2, "2bw gives every stage the same version already");
  o = async_options("2bw", 4, RefOptimizer{});
  o.weight_stashing = false;
  expect_usage(o, 2, "--no-stash applies to --schedule pipedream only");
  o = async_options("pipedream", 1, RefOptimizer{});
  o.vertical_sync = true;
  o.weight_stashing = false;
  expect_usage(o, 2, "vertical sync is a weight-stashing policy");
  expect_usage(async_options("pipedream", 2, RefOptimizer{}), 2, "use --microbatches 1");
  expect_usage(async_options("spectrain", 1, RefOptimizer{}), 2, "SGD needs --momentum > 0");
  expect_usage(async_options("2bw", 2, RefOptimizer{}), 4, "use --microbatches 4 or more");
  PipelineOptions one = async_options("pipedream", 1, RefOptimizer{});
  LocalPipeline pipe(make_mlp(2, 1), mse, 2, one);
  const Data d = make_data(3);
  EXPECT_THROW(pipe.train_steps(d.x, d.y, 4), UsageError);  // 4 steps, 3 samples
  EXPECT_THROW(pipe.train_steps(d.x, d.y, 0), UsageError);
  // Refused before its ranks start: the pipeline goes on training.
  EXPECT_NO_THROW(pipe.train_steps(d.x, d.y, 3));
}

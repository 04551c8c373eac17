#include "umpipe_pass.h"

#include "pass_util.h"

#include <torch/autograd.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/dropout.h>

#include <fmt/format.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>

#include "pipetrain/core/generators.h"
#include <utility>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/device.h"

namespace pipetrain {
namespace {

constexpr int kHeaderTag = kUmpipeTagBase;
constexpr int kHeaderLen = detail::kTensorHeaderLen;  // dtype, trailing rank, up to 8 trailing sizes

using detail::now_ms;
using detail::shape_text;

int activation_tag(int chunk) { return kUmpipeTagBase + 1 + 2 * chunk; }
int gradient_tag(int chunk) { return kUmpipeTagBase + 2 + 2 * chunk; }

std::vector<int64_t> boundaries(const std::vector<int>& sizes) {
  std::vector<int64_t> ends;
  int64_t at = 0;
  for (int b : sizes) ends.push_back(at += b);
  return ends;
}

std::vector<int64_t> with_rows(int64_t rows, const std::vector<int64_t>& trailing) {
  std::vector<int64_t> shape{rows};
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  return shape;
}

// The chunks another stage sends to this one, received straight into their rows of one [N, ...]
// buffer. All receives are posted at once; wait_until(row) waits, in stream order, for every chunk that
// starts below `row`.
struct Incoming {
  torch::Tensor rows;  // [N, trailing...] on the CPU
  std::vector<int64_t> ends;
  std::vector<torch::Tensor> views;  // alive until their receive completed
  std::vector<std::unique_ptr<Work>> works;
  std::size_t done = 0;

  void post(Transport& t, int src, const std::vector<int>& sizes, int (*tag)(int)) {
    ends = boundaries(sizes);
    int64_t begin = 0;
    for (int64_t end : ends) {  // all views first: a transport may keep a reference to its tensor
      views.push_back(rows.slice(0, begin, end));
      begin = end;
    }
    for (std::size_t u = 0; u < ends.size(); ++u) works.push_back(t.irecv(views[u], src, tag(static_cast<int>(u))));
  }
  int64_t arrived() const { return done == 0 ? 0 : ends[done - 1]; }
  bool wait_until(int64_t row) {
    bool waited = false;
    while (done < ends.size() && arrived() < row) {
      works[done]->wait();
      works[done].reset();
      views[done] = torch::Tensor();
      ++done;
      waited = true;
    }
    return waited;
  }
};

class Pass {
 public:
  Pass(UmpipePassContext& c, const torch::Tensor& input, const torch::Tensor& target, int64_t samples)
      : c_(c), input_(input), target_(target), n_(samples), j_(c.stage_index), last_(c.stage_index == c.stages - 1) {}

  UmpipePassResult run() {
    if (c_.threads > 0) at::set_num_threads(c_.threads);
    check_batch();
    Timeline& t = c_.timeline;
    t.schedule = "umpipe";
    t.microbatches = 0;
    for (const auto* rows : {&c_.plan.forward, &c_.plan.backward})
      for (const auto& row : *rows) t.microbatches = std::max(t.microbatches, static_cast<int>(row.size()));
    heap0_ = c_.measure_memory ? memory_in_use(c_.device) : 0.0;
    forward_phase();
    backward_phase();
    where_ = Action{ActionKind::SendGrad, j_, -1};
    for (auto& s : sends_) s.second->wait();
    sends_.clear();
    return result_;
  }

  // The chunk in progress, for error messages.
  std::string where() const { return where_.index < 0 ? std::string() : " at " + to_string(where_); }

 private:
  UmpipePassContext& c_;
  const torch::Tensor& input_;
  const torch::Tensor& target_;
  const int64_t n_;
  const int j_;
  const bool last_;
  torch::Tensor stash_;  // the stage's input rows for all N samples
  Incoming activations_, gradients_;
  std::vector<std::pair<torch::Tensor, std::unique_ptr<Work>>> sends_;
  UmpipePassResult result_;
  double heap0_ = 0;
  Action where_{ActionKind::F, 0, -1};

  int rank() const { return c_.transport.rank(); }

  void record(ActionKind kind, int index, double start) {
    c_.timeline.events.push_back(TimedAction{rank(), Action{kind, j_, index}, start, now_ms()});
  }
  void begin(ActionKind kind, int index) {
    where_ = Action{kind, j_, index};
    if (c_.before_action && *c_.before_action) (*c_.before_action)(rank(), c_.step, where_);
  }
  void sample_heap() {
    if (c_.measure_memory) result_.peak_heap_growth = std::max(result_.peak_heap_growth, memory_in_use(c_.device) - heap0_);
  }

  void check_batch() const {
    int64_t planned = 0;
    for (int b : c_.plan.forward.at(0)) planned += b;
    if (planned != n_)
      throw UsageError(fmt::format("the UMPIPE plan cuts a mini-batch of {} samples but this step has {}: plan for "
                                   "this batch size (pipetrain plan --batch-size {}) or train with --batch-size {}",
                                   planned, n_, n_, planned));
    check_umpipe_plan(c_.plan, c_.stages, static_cast<int>(n_));
  }

  // ---- forward: no graph; the stage's input rows are kept for the backward ------------------------
  void forward_phase() {
    if (j_ == 0) {
      if (!input_.defined())
        throw UsageError("rank " + std::to_string(rank()) + " holds stage 0 but train_step got no input batch");
      if (input_.dim() < 1 || input_.size(0) < n_)
        throw UsageError(fmt::format("stage 0's input batch has {} rows but the step has {} samples",
                                     input_.dim() < 1 ? 0 : input_.size(0), n_));
      stash_ = input_.slice(0, 0, n_).to(c_.device);
    } else {
      const double t0 = now_ms();
      if (!c_.links.in.agreed) receive_header();
      activations_.rows = torch::empty(with_rows(n_, c_.links.in.trailing), torch::TensorOptions().dtype(c_.links.in.dtype));
      activations_.post(c_.transport, j_ - 1, c_.plan.forward[static_cast<std::size_t>(j_ - 1)], activation_tag);
      stash_ = activations_.rows;
      header_wait_start_ = t0;
    }
    if (last_) {
      // Its outputs would feed only its own backward, which recomputes them: the forward phase of the
      // last stage is waiting for every input row (GPipe order: no backward before the whole forward).
      for (std::size_t u = 0; u < activations_.ends.size(); ++u) {
        begin(ActionKind::RecvAct, static_cast<int>(u));
        const double t0 = u == 0 ? header_wait_start_ : now_ms();
        activations_.wait_until(activations_.ends[u]);
        record(ActionKind::RecvAct, static_cast<int>(u), t0);
      }
      return;
    }
    const std::vector<int64_t> ends = boundaries(c_.plan.forward[static_cast<std::size_t>(j_)]);
    int64_t a = 0;
    for (std::size_t k = 0; k < ends.size(); ++k) {
      const int64_t b = ends[k];
      const int index = static_cast<int>(k);
      begin(ActionKind::F, index);
      if (j_ > 0) {
        const double t0 = k == 0 ? header_wait_start_ : now_ms();
        if (activations_.wait_until(b) || k == 0) record(ActionKind::RecvAct, index, t0);
      }
      const double t0 = now_ms();
      torch::Tensor y;
      {
        torch::NoGradGuard no_grad;
        y = c_.stage.forward(stash_.slice(0, a, b).to(c_.device));
      }
      record(ActionKind::F, index, t0);
      send_activation(index, y, b - a);
      sample_heap();
      a = b;
    }
  }
  double header_wait_start_ = 0;

  void receive_header() {
    torch::Tensor header = torch::zeros({kHeaderLen}, torch::kLong);
    c_.transport.recv(header, j_ - 1, kHeaderTag);
    const auto* h = header.data_ptr<int64_t>();
    UmpipeLink& in = c_.links.in;
    in.dtype = static_cast<c10::ScalarType>(h[0]);
    in.trailing.assign(h + 2, h + 2 + h[1]);
    in.agreed = true;
  }

  void send_activation(int k, torch::Tensor y, int64_t rows) {
    const double t0 = now_ms();
    where_ = Action{ActionKind::SendAct, j_, k};
    y = y.detach();
    if (y.dim() < 1 || y.size(0) != rows)
      throw std::runtime_error(fmt::format("stage {} returned {} for a chunk of {} samples: UMPIPE needs one output row "
                                           "per sample (the first dimension)",
                                           j_, shape_text(y.sizes().vec(), y.scalar_type()), rows));
    if (!y.device().is_cpu()) y = y.cpu();  // transfers go through host memory
    y = y.contiguous();
    const std::vector<int64_t> trailing(y.sizes().begin() + 1, y.sizes().end());
    UmpipeLink& out = c_.links.out;
    if (!out.agreed) {
      if (!y.is_floating_point())
        throw UsageError(fmt::format("stage {} sends {} activations to stage {}: UMPIPE sends gradients back over every "
                                     "boundary, so they must be floating point; cut the model elsewhere",
                                     j_, c10::toString(y.scalar_type()), j_ + 1));
      if (y.dim() - 1 > kHeaderLen - 2)
        throw UsageError(fmt::format("stage {} sends a tensor with {} dimensions; at most {} are supported", j_, y.dim(),
                                     kHeaderLen - 1));
      torch::Tensor header = torch::zeros({kHeaderLen}, torch::kLong);
      header[0] = static_cast<int64_t>(y.scalar_type());
      header[1] = y.dim() - 1;
      for (int64_t d = 1; d < y.dim(); ++d) header[d + 1] = y.size(d);
      c_.transport.send(header, j_ + 1, kHeaderTag);
      out.trailing = trailing;
      out.dtype = y.scalar_type();
      out.agreed = true;
    } else if (trailing != out.trailing || y.scalar_type() != out.dtype) {
      throw std::runtime_error(fmt::format("stage {} output for chunk {} has shape {} but the shape agreed at first use is "
                                           "{}: a stage's output per sample must not change",
                                           j_, k, shape_text(y.sizes().vec(), y.scalar_type()),
                                           shape_text(with_rows(rows, out.trailing), out.dtype)));
    }
    auto work = c_.transport.isend(y, j_ + 1, activation_tag(k));
    sends_.emplace_back(y, std::move(work));
    record(ActionKind::SendAct, k, t0);
  }

  // ---- backward: each chunk recomputes its rows' forward, then backpropagates ----------------------
  void backward_phase() {
    // The receiver posted every activation receive at its start, so these complete; the outputs go.
    for (auto& s : sends_) s.second->wait();
    sends_.clear();
    if (!last_) {
      const UmpipeLink& out = c_.links.out;
      gradients_.rows = torch::empty(with_rows(n_, out.trailing), torch::TensorOptions().dtype(out.dtype));
      gradients_.post(c_.transport, j_ + 1, c_.plan.backward[static_cast<std::size_t>(j_ + 1)], gradient_tag);
    } else if (!target_.defined()) {
      throw UsageError("rank " + std::to_string(rank()) + " holds the last stage but train_step got no target batch");
    }
    torch::AutoGradMode grad_on(true);
    const std::vector<int64_t> ends = boundaries(c_.plan.backward[static_cast<std::size_t>(j_)]);
    int64_t a = 0;
    for (std::size_t k = 0; k < ends.size(); ++k) {
      const int64_t b = ends[k];
      const int index = static_cast<int>(k);
      begin(ActionKind::BW, index);
      if (!last_) {
        const double t0 = now_ms();
        if (gradients_.wait_until(b)) record(ActionKind::RecvGrad, index, t0);
      }
      const double t0 = now_ms();
      torch::Tensor x = stash_.slice(0, a, b).to(c_.device).detach();
      if (j_ > 0) x.requires_grad_(true);
      torch::Tensor out = c_.stage.forward(x);
      if (last_) {
        torch::Tensor l = c_.loss(out, target_.slice(0, a, b).to(c_.device));
        if (l.numel() != 1)
          throw UsageError(fmt::format("the loss function returned {} values for samples [{}, {}): it must return one "
                                       "(the mean over the micro-batch)",
                                       l.numel(), a, b));
        l = l * (static_cast<double>(b - a) / static_cast<double>(n_));
        result_.loss += l.item<double>();
        if (l.requires_grad()) torch::autograd::backward({l});
      } else {
        const std::vector<int64_t> want = with_rows(b - a, c_.links.out.trailing);
        if (out.sizes().vec() != want)
          throw std::runtime_error(fmt::format("stage {} recomputed {} for samples [{}, {}) but its forward sent {}: the "
                                               "stage's output shape must not depend on the chunk",
                                               j_, shape_text(out.sizes().vec(), out.scalar_type()), a, b,
                                               shape_text(want, c_.links.out.dtype)));
        if (out.requires_grad())
          torch::autograd::backward({out}, {gradients_.rows.slice(0, a, b).to(c_.device, out.scalar_type())});
      }
      record(ActionKind::BW, index, t0);
      if (j_ > 0) {
        const double ts = now_ms();
        where_ = Action{ActionKind::SendGrad, j_, index};
        torch::Tensor g = x.grad().defined() ? x.grad().detach() : torch::zeros_like(x);
        if (!g.device().is_cpu()) g = g.cpu();
        g = g.contiguous();
        auto work = c_.transport.isend(g, j_ - 1, gradient_tag(index));
        sends_.emplace_back(g, std::move(work));
        record(ActionKind::SendGrad, index, ts);
      }
      sample_heap();
      a = b;
    }
  }
};

template <typename M>
bool dropout_rate(const torch::nn::Module& m, double& p) {
  if (const auto* d = dynamic_cast<const M*>(&m)) {
    p = d->options.p();
    return true;
  }
  return false;
}

}  // namespace

UmpipePassResult run_umpipe_pass(UmpipePassContext& context, const torch::Tensor& input, const torch::Tensor& target,
                                 int64_t samples) {
  Pass pass(context, input, target, samples);
  try {
    return pass.run();
  } catch (const RemoteFailure&) {
    throw;
  } catch (const std::exception& e) {
    // LibTorch's errors carry a C++ backtrace in what(); the user needs the message only.
    const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
    const std::string what = torch_error ? torch_error->what_without_backtrace() : e.what();
    const std::string msg = "rank " + std::to_string(context.transport.rank()) + pass.where() + ": " + what;
    context.transport.abort(msg);
    if (dynamic_cast<const UsageError*>(&e)) throw UsageError(msg);
    throw std::runtime_error(msg);
  }
}

void check_umpipe_pipeline(const torch::nn::Sequential& model, const UmpipePlan& plan, const std::string& schedule_name,
                           int virtual_stages, int replicas, const Schedule& schedule, int ranks) {
  const std::string& s = schedule_name;
  const std::string off = " (or train without UMPIPE: --umpipe off)";
  if (!schedule_traits(s).synchronous)
    throw UsageError("schedule '" + s + "' is asynchronous, but UMPIPE runs synchronous steps in GPipe order: use "
                     "--schedule gpipe" + off);
  if (s != "gpipe")
    throw UsageError("UMPIPE runs every stage in GPipe order (all forward chunks, then all backward chunks), not '" + s +
                     "': use --schedule gpipe" + off);
  if (virtual_stages != 1)
    throw UsageError("UMPIPE runs one stage per rank, but " + std::to_string(virtual_stages) +
                     " virtual stages were asked for: use --virtual 1" + off);
  if (replicas > 1)
    throw UsageError("UMPIPE runs one pipeline, but " + std::to_string(replicas) +
                     " data-parallel replicas were asked for: use --replicas 1" + off);
  if (schedule.stages != ranks)
    throw UsageError(fmt::format("UMPIPE runs one stage per rank, but this pipeline has {} stages on {} ranks "
                                 "(replicated stages): run one rank per stage{}",
                                 schedule.stages, ranks, off));
  const int planned = static_cast<int>(plan.forward.size());
  if (planned != ranks || static_cast<int>(plan.backward.size()) != ranks)
    throw UsageError(fmt::format("the UMPIPE plan has {} stages ({} forward and {} backward partitions) but the pipeline "
                                 "has {} ranks: plan for {} ranks (pipetrain plan --ranks {}) or run {} stages",
                                 planned, plan.forward.size(), plan.backward.size(), ranks, ranks, ranks, planned));
  int samples = 0;
  for (int b : plan.forward.at(0)) samples += b;
  check_umpipe_plan(plan, ranks, samples);
  for (const auto* rows : {&plan.forward, &plan.backward})
    for (std::size_t j = 0; j < rows->size(); ++j)
      if (static_cast<int>((*rows)[j].size()) > kUmpipeMaxChunks)
        throw UsageError(fmt::format("the UMPIPE plan cuts stage {}'s {} pass into {} micro-batches; the runtime's "
                                     "message tags allow {}: plan larger micro-batches",
                                     j, rows == &plan.forward ? "forward" : "backward", (*rows)[j].size(),
                                     kUmpipeMaxChunks));
  for (int st = 0; st < schedule.stages; ++st)
    if (schedule.rank_of(st) != st)
      throw UsageError(fmt::format("UMPIPE needs stage j on rank j, but schedule '{}' puts stage {} on rank {}", s, st,
                                   schedule.rank_of(st)));
  const std::vector<std::string> types = layer_type_names(model);
  for (std::size_t i = 0; i < model->size(); ++i) {
    const std::string layer = fmt::format("layer {} ({})", i, types[i]);
    for (const auto& m : model->ptr(i)->modules(/*include_self=*/true)) {
      std::string name = m->name();  // "torch::nn::BatchNorm2dImpl" -> "BatchNorm2d"
      if (const auto colon = name.rfind("::"); colon != std::string::npos) name = name.substr(colon + 2);
      if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
      if (dynamic_cast<const torch::nn::BatchNorm1dImpl*>(m.get()) ||
          dynamic_cast<const torch::nn::BatchNorm2dImpl*>(m.get()) ||
          dynamic_cast<const torch::nn::BatchNorm3dImpl*>(m.get()) || name.find("BatchNorm") != std::string::npos)
        throw UsageError(layer + " holds " + name +
                         ": batch normalisation uses the statistics of each micro-batch, so UMPIPE's unequal micro-batches "
                         "(and its backward, which recomputes the forward on other sample ranges) would change the "
                         "result; use a model without BatchNorm" + off);
      double p = 0;
      if ((dropout_rate<torch::nn::DropoutImpl>(*m, p) || dropout_rate<torch::nn::Dropout2dImpl>(*m, p) ||
           dropout_rate<torch::nn::Dropout3dImpl>(*m, p) || dropout_rate<torch::nn::AlphaDropoutImpl>(*m, p) ||
           dropout_rate<torch::nn::FeatureAlphaDropoutImpl>(*m, p)) &&
          p > 0)
        throw UsageError(fmt::format("{} holds {} with p = {}: UMPIPE's backward recomputes the forward on other sample "
                                     "ranges, so its random masks would not match the forward's; use dropout 0 (--dropout 0)"
                                     "{}",
                                     layer, name, p, off));
    }
  }
}

}  // namespace pipetrain

// UMPIPE (plan/umpipe.h, docs/ALGORITHMS.md §7): time curves, the model and its memory caps, building a
// model from a profile, the scalar evaluator of §7.2, and the plan JSON. The vectorised evaluator is in
// umpipe_vector.cpp, the planners in umpipe_planners.cpp.
#include "pipetrain/plan/umpipe.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>

#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/profile.h"

namespace pipetrain {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

bool finite_nonneg(double x) { return std::isfinite(x) && x >= 0; }

void check_curve(const TimeCurve& c, const std::string& what) {
  if (!c.is_table()) {
    if (!std::isfinite(c.alpha) || !std::isfinite(c.beta))
      throw UsageError(fmt::format("{}: alpha {} and beta {} must be finite", what, c.alpha, c.beta));
    return;
  }
  if (c.sizes.size() != c.ms.size())
    throw UsageError(fmt::format("{}: the table has {} sizes but {} times; give one time per size", what,
                                 c.sizes.size(), c.ms.size()));
  for (std::size_t i = 0; i < c.sizes.size(); ++i) {
    if (!std::isfinite(c.sizes[i]) || c.sizes[i] < 1 || (i > 0 && c.sizes[i] <= c.sizes[i - 1]))
      throw UsageError(
          fmt::format("{}: table sizes must be >= 1 and strictly increasing, got {} at index {}", what, c.sizes[i], i));
    if (!finite_nonneg(c.ms[i]))
      throw UsageError(fmt::format("{}: table time {} at size {} must be finite and >= 0", what, c.ms[i], c.sizes[i]));
  }
}

std::string stage_name(int j) { return fmt::format("UMPIPE stage {}", j); }

// Largest b in [0, N] with fixed + b per_sample <= limit; -1 when even b = 0 does not fit.
int cap_from_memory(double fixed, double per_sample, double limit, int samples) {
  if (!std::isfinite(limit)) return samples;
  const double room = limit - fixed;
  if (room < 0) return -1;
  if (per_sample <= 0) return samples;
  double q = std::floor(room / per_sample);
  if (q >= samples) return samples;
  auto b = static_cast<long long>(q);
  // The division may round either way; settle b exactly against the inequality itself.
  while (b + 1 <= samples && fixed + static_cast<double>(b + 1) * per_sample <= limit) ++b;
  while (b > 0 && fixed + static_cast<double>(b) * per_sample > limit) --b;
  return static_cast<int>(b);
}

// One row of §7.2's recurrence:
//   E_k = max(E_{k-1}, A_k) + t[x_k]   E_0 = e0
//   R_k = max(R_{k-1}, E_k) + c[x_k]   R_0 = 0
// where A_k is the neighbour's R at the first of its micro-batches whose cumulative boundary reaches
// this row's boundary (idxF / idxB), or 0 without a neighbour. Both boundaries rise to N, so the
// two-pointer scan stays inside the neighbour's row. Returns E_n; ends/done/sent may be null.
inline double run_row(const int* x, int n, const double* t, const double* c, const int* nb_ends, const double* nb_sent,
                      double e0, int* ends, double* done, double* sent) {
  double e = e0, r = 0;
  int cum = 0, u = 0;
  for (int k = 0; k < n; ++k) {
    const int b = x[k];
    cum += b;
    double a = 0;
    if (nb_ends) {
      while (nb_ends[u] < cum) ++u;
      a = nb_sent[u];
    }
    e = std::max(e, a) + t[b];
    r = std::max(r, e) + c[b];
    if (ends) ends[k] = cum;
    if (done) done[k] = e;
    if (sent) sent[k] = r;
  }
  return e;
}

}  // namespace

// --- curves ------------------------------------------------------------------------------------------

TimeCurve TimeCurve::affine(double alpha, double beta) {
  TimeCurve c;
  c.alpha = alpha;
  c.beta = beta;
  return c;
}

TimeCurve TimeCurve::table(std::vector<double> sizes, std::vector<double> ms) {
  TimeCurve c;
  c.sizes = std::move(sizes);
  c.ms = std::move(ms);
  if (c.sizes.empty()) throw UsageError("TimeCurve::table: give at least one (size, ms) point");
  check_curve(c, "TimeCurve::table");
  return c;
}

double TimeCurve::operator()(double b) const {
  if (sizes.empty()) return std::max(0.0, alpha + beta * b);
  if (sizes.size() == 1) return std::max(0.0, ms[0] * b / sizes[0]);
  const auto it = std::upper_bound(sizes.begin(), sizes.end(), b);
  std::ptrdiff_t i = (it - sizes.begin()) - 1;
  i = std::clamp<std::ptrdiff_t>(i, 0, static_cast<std::ptrdiff_t>(sizes.size()) - 2);
  const auto k = static_cast<std::size_t>(i);
  const double v = ms[k] + (ms[k + 1] - ms[k]) * (b - sizes[k]) / (sizes[k + 1] - sizes[k]);
  return std::max(0.0, v);
}

TimeCurve fit_affine(const std::vector<double>& sizes, const std::vector<double>& ms) {
  if (sizes.size() != ms.size() || sizes.size() < 2)
    throw UsageError(
        fmt::format("fit_affine: needs at least two (size, ms) points of equal count, got {} sizes and {} times",
                    sizes.size(), ms.size()));
  const double n = static_cast<double>(sizes.size());
  double sx = 0, sy = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    sx += sizes[i];
    sy += ms[i];
  }
  const double mx = sx / n, my = sy / n;
  // Centred sums: the textbook n Sxx - Sx^2 cancels badly when the sizes are large and close.
  double sxx = 0, sxy = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    sxx += (sizes[i] - mx) * (sizes[i] - mx);
    sxy += (sizes[i] - mx) * (ms[i] - my);
  }
  if (!(sxx > 0)) throw UsageError("fit_affine: all sizes are equal; a line needs two distinct sizes");
  const double beta = sxy / sxx;
  return TimeCurve::affine(my - beta * mx, beta);
}

// --- model -------------------------------------------------------------------------------------------

void validate_umpipe_model(const UmpipeModel& model) {
  if (model.samples < 1)
    throw UsageError(fmt::format("UMPIPE: the mini-batch must have >= 1 sample, got {}", model.samples));
  if (model.stages.empty()) throw UsageError("UMPIPE: the model has no stages");
  for (int j = 0; j < model.stage_count(); ++j) {
    const UmpipeStage& s = model.stages[static_cast<std::size_t>(j)];
    const std::string name = stage_name(j);
    check_curve(s.forward, name + " forward");
    check_curve(s.backward, name + " backward");
    check_curve(s.send_forward, name + " send_forward");
    check_curve(s.send_backward, name + " send_backward");
    const StageMemory& m = s.memory;
    for (const auto& [v, field] : {std::pair{m.static_bytes, "static_bytes"},
                                   {m.stash_bytes_per_sample, "stash_bytes_per_sample"},
                                   {m.forward_bytes_per_sample, "forward_bytes_per_sample"},
                                   {m.backward_bytes_per_sample, "backward_bytes_per_sample"}})
      if (!finite_nonneg(v))
        throw UsageError(fmt::format("{}: memory.{} is {}; bytes must be finite and >= 0", name, field, v));
    if (std::isnan(m.limit_bytes) || m.limit_bytes < 0)
      throw UsageError(fmt::format("{}: memory.limit_bytes is {}; use infinity for no limit", name, m.limit_bytes));
    if (s.max_forward < 0 || s.max_backward < 0)
      throw UsageError(fmt::format("{}: max_forward {} / max_backward {} must be >= 0 (0 = no explicit cap)", name,
                                   s.max_forward, s.max_backward));
  }
}

UmpipeCaps umpipe_caps(const UmpipeModel& model) {
  validate_umpipe_model(model);
  UmpipeCaps caps;
  const int n = model.samples;
  for (int j = 0; j < model.stage_count(); ++j) {
    const UmpipeStage& s = model.stages[static_cast<std::size_t>(j)];
    const StageMemory& m = s.memory;
    const double fixed = m.static_bytes + static_cast<double>(n) * m.stash_bytes_per_sample;
    int f = cap_from_memory(fixed, m.forward_bytes_per_sample, m.limit_bytes, n);
    int b = cap_from_memory(fixed, m.backward_bytes_per_sample, m.limit_bytes, n);
    if (f < 1 || b < 1)
      throw UsageError(fmt::format(
          "{}: does not fit its memory limit of {:.0f} bytes: weights and optimizer state {:.0f} + {} samples x "
          "{:.0f} stashed bytes = {:.0f}, plus {:.0f} (forward) / {:.0f} (backward) bytes for a one-sample "
          "micro-batch; raise the limit, use more stages or re-materialise",
          stage_name(j), m.limit_bytes, m.static_bytes, n, m.stash_bytes_per_sample, fixed, m.forward_bytes_per_sample,
          m.backward_bytes_per_sample));
    if (s.max_forward > 0) f = std::min(f, s.max_forward);
    if (s.max_backward > 0) b = std::min(b, s.max_backward);
    caps.forward.push_back(f);
    caps.backward.push_back(b);
  }
  return caps;
}

bool operator==(const UmpipePlan& a, const UmpipePlan& b) { return a.forward == b.forward && a.backward == b.backward; }

std::vector<int> equal_partition(int samples, int parts) {
  if (samples < 1 || parts < 1 || parts > samples)
    throw UsageError(
        fmt::format("equal_partition: need 1 <= parts <= samples, got {} parts of {} samples", parts, samples));
  std::vector<int> v(static_cast<std::size_t>(parts), samples / parts);
  for (int i = 0; i < samples % parts; ++i) ++v[static_cast<std::size_t>(i)];
  return v;
}

UmpipePlan equal_plan(int stages, int samples, int parts) {
  UmpipePlan plan;
  const std::vector<int> row = equal_partition(samples, parts);
  plan.forward.assign(static_cast<std::size_t>(stages), row);
  plan.backward.assign(static_cast<std::size_t>(stages), row);
  return plan;
}

void check_umpipe_plan(const UmpipePlan& plan, int stages, int samples) {
  for (const auto* rows : {&plan.forward, &plan.backward}) {
    const char* dir = rows == &plan.forward ? "forward" : "backward";
    if (static_cast<int>(rows->size()) != stages)
      throw UsageError(
          fmt::format("UMPIPE plan: {} {} partitions for {} stages; give one per stage", rows->size(), dir, stages));
    for (int j = 0; j < stages; ++j) {
      const std::vector<int>& row = (*rows)[static_cast<std::size_t>(j)];
      long long sum = 0;
      for (int x : row) {
        if (x < 1)
          throw UsageError(
              fmt::format("UMPIPE plan: stage {} {} partition has a micro-batch of {} samples; every "
                          "micro-batch needs >= 1",
                          j, dir, x));
        sum += x;
      }
      if (sum != samples)
        throw UsageError(fmt::format("UMPIPE plan: stage {} {} partition sums to {} samples, not the mini-batch's {}",
                                     j, dir, sum, samples));
    }
  }
}

bool within_caps(const UmpipePlan& plan, const UmpipeCaps& caps) {
  for (std::size_t j = 0; j < plan.forward.size(); ++j) {
    for (int x : plan.forward[j])
      if (x > caps.forward[j]) return false;
    for (int y : plan.backward[j])
      if (y > caps.backward[j]) return false;
  }
  return true;
}

std::vector<double> umpipe_peak_bytes(const UmpipeModel& model, const UmpipePlan& plan) {
  check_umpipe_plan(plan, model.stage_count(), model.samples);
  std::vector<double> peak;
  for (int j = 0; j < model.stage_count(); ++j) {
    const StageMemory& m = model.stages[static_cast<std::size_t>(j)].memory;
    const auto& x = plan.forward[static_cast<std::size_t>(j)];
    const auto& y = plan.backward[static_cast<std::size_t>(j)];
    const double fx = *std::max_element(x.begin(), x.end()), by = *std::max_element(y.begin(), y.end());
    peak.push_back(m.static_bytes + static_cast<double>(model.samples) * m.stash_bytes_per_sample +
                   std::max(fx * m.forward_bytes_per_sample, by * m.backward_bytes_per_sample));
  }
  return peak;
}

// --- from a profile ----------------------------------------------------------------------------------

namespace {

// A layer's measured (size, ms) points for one pass, the profile's own size first then by_micro_batch,
// sorted, the profile's own value kept where by_micro_batch repeats its size.
std::vector<std::pair<double, double>> layer_points(const LayerProfile& l, int b0, bool forward) {
  std::vector<std::pair<double, double>> pts{{static_cast<double>(b0), forward ? l.forward_ms : l.backward_ms}};
  for (const SizeMeasurement& s : l.by_micro_batch)
    if (s.micro_batch_size != b0) pts.emplace_back(s.micro_batch_size, forward ? s.forward_ms : s.backward_ms);
  std::sort(pts.begin(), pts.end());
  return pts;
}

// The layer's curve without the final clamp at 0 (stages clamp their sums instead).
struct LayerCurve {
  bool linear = true;  // alpha + beta b everywhere
  double alpha = 0, beta = 0;
  std::vector<std::pair<double, double>> pts;  // table form, >= 2 points
  double at(double b) const {
    if (linear) return alpha + beta * b;
    std::size_t k = 0;
    while (k + 2 < pts.size() && pts[k + 1].first <= b) ++k;
    const auto& [x0, y0] = pts[k];
    const auto& [x1, y1] = pts[k + 1];
    return y0 + (y1 - y0) * (b - x0) / (x1 - x0);
  }
};

LayerCurve layer_curve(const LayerProfile& l, int b0, bool forward, const UmpipeProfileOptions& o) {
  const auto pts = layer_points(l, b0, forward);
  LayerCurve c;
  if (pts.size() == 1) {
    const double t0 = pts[0].second;
    c.alpha = std::min(o.single_size_overhead_ms, t0);
    c.beta = (t0 - c.alpha) / b0;
    return c;
  }
  if (o.fit == UmpipeFit::affine) {
    std::vector<double> xs, ys;
    for (const auto& [x, y] : pts) {
      xs.push_back(x);
      ys.push_back(y);
    }
    const TimeCurve fit = fit_affine(xs, ys);
    c.alpha = fit.alpha;
    c.beta = fit.beta;
    return c;
  }
  c.linear = false;
  c.pts = pts;
  return c;
}

// Sum of layer curves as a stage curve: affine when every layer is linear, else a table on the union of
// the layers' sizes. Each layer is linear between consecutive union sizes and beyond the ends, so the
// table equals the sum everywhere (before the clamp at 0).
TimeCurve stage_curve(const std::vector<LayerCurve>& layers) {
  bool linear = true;
  std::set<double> sizes;
  for (const LayerCurve& c : layers) {
    linear = linear && c.linear;
    for (const auto& pt : c.pts) sizes.insert(pt.first);
  }
  if (linear) {
    double a = 0, b = 0;
    for (const LayerCurve& c : layers) {
      a += c.alpha;
      b += c.beta;
    }
    return TimeCurve::affine(a, b);
  }
  std::vector<double> xs(sizes.begin(), sizes.end()), ys;
  for (double x : xs) {
    double y = 0;
    for (const LayerCurve& c : layers) y += c.at(x);
    ys.push_back(std::max(0.0, y));
  }
  return TimeCurve::table(xs, ys);
}

}  // namespace

UmpipeModel umpipe_model_from_profile(const Profile& profile, const std::vector<int>& balance,
                                      const UmpipeProfileOptions& o) {
  validate_profile(profile);
  check_balance(balance, static_cast<int>(profile.layers.size()));
  if (o.samples < 1) throw UsageError(fmt::format("UMPIPE: the mini-batch must have >= 1 sample, got {}", o.samples));
  if (!(o.bandwidth_bytes_per_s > 0))
    throw UsageError(fmt::format("UMPIPE: bandwidth must be > 0 bytes/s (infinity for free links), got {}",
                                 o.bandwidth_bytes_per_s));
  if (!finite_nonneg(o.latency_ms) || !finite_nonneg(o.single_size_overhead_ms) ||
      !finite_nonneg(o.workspace_activations))
    throw UsageError("UMPIPE: latency_ms, single_size_overhead_ms and workspace_activations must be finite and >= 0");
  if (std::isnan(o.memory_limit_bytes) || o.memory_limit_bytes < 0)
    throw UsageError("UMPIPE: memory_limit_bytes must be >= 0 (infinity for none)");
  const int b0 = profile.micro_batch_size;
  const double per_ms = o.bandwidth_bytes_per_s / 1e3;  // bytes per ms
  UmpipeModel model;
  model.samples = o.samples;
  const int p = static_cast<int>(balance.size());
  std::vector<double> boundary(static_cast<std::size_t>(p), 0.0);  // stage j's last activation at b0
  std::size_t layer = 0;
  for (int j = 0; j < p; ++j) {
    std::vector<LayerCurve> fwd, bwd;
    double static_bytes = 0, act = 0, largest = 0;
    for (int k = 0; k < balance[static_cast<std::size_t>(j)]; ++k, ++layer) {
      const LayerProfile& l = profile.layers[layer];
      fwd.push_back(layer_curve(l, b0, true, o));
      bwd.push_back(layer_curve(l, b0, false, o));
      static_bytes += 2 * l.parameter_bytes + l.optimizer_bytes;
      act += l.activation_bytes;
      largest = std::max(largest, l.activation_bytes);
      boundary[static_cast<std::size_t>(j)] = l.activation_bytes;
    }
    if (o.rematerialise) bwd.insert(bwd.end(), fwd.begin(), fwd.end());
    UmpipeStage s;
    s.forward = stage_curve(fwd);
    s.backward = stage_curve(bwd);
    const double a_full = act / b0, ws = o.workspace_activations * largest / b0;
    const double a_in = j > 0 ? boundary[static_cast<std::size_t>(j - 1)] / b0 : 0.0;
    s.memory.static_bytes = static_bytes;
    s.memory.stash_bytes_per_sample = o.rematerialise ? a_in : a_full;
    s.memory.forward_bytes_per_sample = ws;
    s.memory.backward_bytes_per_sample = o.rematerialise ? a_full + ws : ws;
    s.memory.limit_bytes = o.memory_limit_bytes;
    model.stages.push_back(s);
  }
  for (int j = 0; j < p; ++j) {
    auto link = [&](double bytes_at_b0) {
      return TimeCurve::affine(o.latency_ms, std::isfinite(per_ms) ? bytes_at_b0 / b0 / per_ms : 0.0);
    };
    UmpipeStage& s = model.stages[static_cast<std::size_t>(j)];
    s.send_forward = j + 1 < p ? link(boundary[static_cast<std::size_t>(j)]) : TimeCurve::constant(0);
    s.send_backward = j > 0 ? link(boundary[static_cast<std::size_t>(j - 1)]) : TimeCurve::constant(0);
  }
  validate_umpipe_model(model);
  return model;
}

// --- scalar evaluator --------------------------------------------------------------------------------

UmpipeEvaluator::UmpipeEvaluator(const UmpipeModel& model) {
  validate_umpipe_model(model);
  p_ = model.stage_count();
  n_ = model.samples;
  tables_.assign(static_cast<std::size_t>(4) * p_ * (n_ + 1), 0.0);
  for (int j = 0; j < p_; ++j) {
    const UmpipeStage& s = model.stages[static_cast<std::size_t>(j)];
    const TimeCurve* curves[4] = {&s.forward, &s.backward, &s.send_forward, &s.send_backward};
    // The last stage sends no activations and stage 0 no gradients: their links cost nothing.
    const bool unused[4] = {false, false, j == p_ - 1, j == 0};
    for (int kind = 0; kind < 4; ++kind) {
      double* t = tables_.data() + (static_cast<std::size_t>(kind) * p_ + j) * (n_ + 1);
      for (int b = 1; b <= n_ && !unused[kind]; ++b) t[b] = (*curves[kind])(b);
    }
  }
}

double UmpipeEvaluator::cost(int kind, int stage, int size) const {
  if (kind < 0 || kind > 3 || stage < 0 || stage >= p_ || size < 0 || size > n_)
    throw UsageError(fmt::format("UmpipeEvaluator::cost: kind {} stage {} size {} out of range", kind, stage, size));
  return table(kind, stage)[size];
}

double UmpipeEvaluator::step_ms(const UmpipePlan& plan) const {
  // Scratch reused across calls: a row has at most N micro-batches.
  thread_local std::vector<int> ends[2];
  thread_local std::vector<double> sent[2], finish;
  for (auto& e : ends) e.resize(static_cast<std::size_t>(n_));
  for (auto& s : sent) s.resize(static_cast<std::size_t>(n_));
  finish.resize(static_cast<std::size_t>(p_));
  int cur = 0;
  for (int j = 0; j < p_; ++j) {
    const auto& x = plan.forward[static_cast<std::size_t>(j)];
    const int prev = cur ^ 1;
    finish[static_cast<std::size_t>(j)] =
        run_row(x.data(), static_cast<int>(x.size()), table(0, j), table(2, j), j > 0 ? ends[prev].data() : nullptr,
                sent[prev].data(), 0.0, ends[cur].data(), nullptr, sent[cur].data());
    cur = prev;
  }
  double t = 0;
  for (int j = p_ - 1; j >= 0; --j) {
    const auto& y = plan.backward[static_cast<std::size_t>(j)];
    const int prev = cur ^ 1;
    const double e = run_row(y.data(), static_cast<int>(y.size()), table(1, j), table(3, j),
                             j + 1 < p_ ? ends[prev].data() : nullptr, sent[prev].data(),
                             finish[static_cast<std::size_t>(j)], ends[cur].data(), nullptr, sent[cur].data());
    t = std::max(t, e);
    cur = prev;
  }
  return t;
}

UmpipeRow UmpipeEvaluator::forward_row(int j, const std::vector<int>& sizes, const UmpipeRow* up) const {
  UmpipeRow r;
  const std::size_t n = sizes.size();
  r.ends.resize(n);
  r.done.resize(n);
  r.sent.resize(n);
  run_row(sizes.data(), static_cast<int>(n), table(0, j), table(2, j), up ? up->ends.data() : nullptr,
          up ? up->sent.data() : nullptr, 0.0, r.ends.data(), r.done.data(), r.sent.data());
  return r;
}

UmpipeRow UmpipeEvaluator::backward_row(int j, const std::vector<int>& sizes, const UmpipeRow* down,
                                        double forward_finish) const {
  UmpipeRow r;
  const std::size_t n = sizes.size();
  r.ends.resize(n);
  r.done.resize(n);
  r.sent.resize(n);
  run_row(sizes.data(), static_cast<int>(n), table(1, j), table(3, j), down ? down->ends.data() : nullptr,
          down ? down->sent.data() : nullptr, forward_finish, r.ends.data(), r.done.data(), r.sent.data());
  return r;
}

UmpipeTrace UmpipeEvaluator::trace(const UmpipePlan& plan) const {
  check_umpipe_plan(plan, p_, n_);
  UmpipeTrace tr;
  tr.forward.resize(static_cast<std::size_t>(p_));
  tr.backward.resize(static_cast<std::size_t>(p_));
  for (int j = 0; j < p_; ++j)
    tr.forward[static_cast<std::size_t>(j)] = forward_row(
        j, plan.forward[static_cast<std::size_t>(j)], j > 0 ? &tr.forward[static_cast<std::size_t>(j - 1)] : nullptr);
  for (int j = p_ - 1; j >= 0; --j) {
    tr.backward[static_cast<std::size_t>(j)] =
        backward_row(j, plan.backward[static_cast<std::size_t>(j)],
                     j + 1 < p_ ? &tr.backward[static_cast<std::size_t>(j + 1)] : nullptr,
                     tr.forward[static_cast<std::size_t>(j)].finish());
    tr.step_ms = std::max(tr.step_ms, tr.backward[static_cast<std::size_t>(j)].finish());
  }
  return tr;
}

// --- JSON --------------------------------------------------------------------------------------------

nlohmann::json umpipe_result_to_json(const UmpipeResult& r) {
  nlohmann::json j;
  j["planner"] = r.planner;
  j["stages"] = r.plan.forward.size();
  int samples = 0;
  if (!r.plan.forward.empty()) samples = std::accumulate(r.plan.forward[0].begin(), r.plan.forward[0].end(), 0);
  j["samples"] = samples;
  j["forward"] = r.plan.forward;
  j["backward"] = r.plan.backward;
  j["step_ms"] = r.step_ms;
  if (r.microbatches > 0) j["microbatches"] = r.microbatches;
  if (r.generations > 0) j["generations"] = r.generations;
  return j;
}

UmpipeResult umpipe_result_from_json(const nlohmann::json& j, const std::string& origin) {
  auto fail = [&](const std::string& what) { throw UsageError(origin + ": " + what); };
  if (!j.is_object()) fail("expected an object with \"forward\", \"backward\" and \"step_ms\"");
  for (const char* key : {"forward", "backward", "step_ms", "samples", "stages"})
    if (!j.contains(key)) fail(fmt::format("the field \"{}\" is missing", key));
  if (!j["samples"].is_number_integer() || !j["stages"].is_number_integer())
    fail("\"samples\" and \"stages\" must be integers");
  if (!j["step_ms"].is_number() || !std::isfinite(j["step_ms"].get<double>()) || j["step_ms"].get<double>() < 0)
    fail("\"step_ms\" must be a number of milliseconds >= 0");
  UmpipeResult r;
  r.planner = j.value("planner", std::string("umpipe"));
  r.step_ms = j["step_ms"].get<double>();
  r.microbatches = j.value("microbatches", 0);
  r.generations = j.value("generations", 0);
  for (const char* key : {"forward", "backward"}) {
    const auto& rows = j[key];
    if (!rows.is_array()) fail(fmt::format("\"{}\" must be an array of partitions, one per stage", key));
    std::vector<std::vector<int>> out;
    for (std::size_t s = 0; s < rows.size(); ++s) {
      if (!rows[s].is_array()) fail(fmt::format("{}[{}] must be an array of micro-batch sizes", key, s));
      std::vector<int> row;
      for (const auto& v : rows[s]) {
        if (!v.is_number_integer()) fail(fmt::format("{}[{}] holds {}; sizes are integers", key, s, json_excerpt(v)));
        row.push_back(v.get<int>());
      }
      out.push_back(row);
    }
    (std::string(key) == "forward" ? r.plan.forward : r.plan.backward) = out;
  }
  try {
    check_umpipe_plan(r.plan, j["stages"].get<int>(), j["samples"].get<int>());
  } catch (const UsageError& e) {
    fail(e.what());
  }
  return r;
}

}  // namespace pipetrain

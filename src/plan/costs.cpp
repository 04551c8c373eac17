#include "pipetrain/plan/costs.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "pipetrain/core/error.h"
#include "pipetrain/plan/balance.h"

namespace pipetrain {

double layer_time_at(const LayerProfile& l, int b0, double b, bool forward) {
  const double at_b0 = forward ? l.forward_ms : l.backward_ms;
  std::vector<std::pair<double, double>> pts{{static_cast<double>(b0), at_b0}};
  for (const auto& s : l.by_micro_batch)
    if (s.micro_batch_size != b0) pts.emplace_back(s.micro_batch_size, forward ? s.forward_ms : s.backward_ms);
  if (pts.size() < 2) return at_b0 * b / b0;
  // Inside the measured sizes: straight between the two nearest measurements. A line through all of them
  // misses the bend at small sizes (a transformer block at 1 sample costs more than the line through
  // 1..16 says: the plans with one-sample micro-batches were predicted 15% fast).
  std::sort(pts.begin(), pts.end());
  if (b >= pts.front().first && b <= pts.back().first) {
    std::size_t hi = 1;
    while (hi + 1 < pts.size() && pts[hi].first < b) ++hi;
    const auto& [x0, y0] = pts[hi - 1];
    const auto& [x1, y1] = pts[hi];
    return std::max(0.0, x1 > x0 ? y0 + (y1 - y0) * (b - x0) / (x1 - x0) : y0);
  }
  // Outside them: the least-squares line, which keeps the fixed per-micro-batch cost.
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [x, y] : pts) {
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double n = static_cast<double>(pts.size()), den = n * sxx - sx * sx;
  if (std::abs(den) < 1e-12) return at_b0 * b / b0;
  const double c = (n * sxy - sx * sy) / den, a = (sy - c * sx) / n;
  return std::max(0.0, a + c * b);
}

double transfer_ms(double bytes, double bandwidth_bytes_per_ms, double latency_ms) {
  const bool free_bytes = !(bandwidth_bytes_per_ms > 0) || std::isinf(bandwidth_bytes_per_ms);
  return latency_ms + (free_bytes ? 0.0 : bytes / bandwidth_bytes_per_ms);
}

CostModel stage_costs(const Profile& prof, const std::vector<int>& balance, const StageCostOptions& o) {
  check_balance(balance, static_cast<int>(prof.layers.size()));
  const double scale = o.micro_batch / prof.micro_batch_size;
  CostModel costs;
  double boundary = 0;
  std::vector<double> cut_bytes;  // per boundary: what crosses it (its stage's last layer's output)
  std::size_t layer = 0;
  for (std::size_t s = 0; s < balance.size(); ++s) {
    StageCost sc{0, 0, 0, 0};
    for (int k = 0; k < balance[s]; ++k, ++layer) {
      const LayerProfile& l = prof.layers[layer];
      const double bw = layer_time_at(l, prof.micro_batch_size, o.micro_batch, false);
      const double share_w = l.bw_split && l.b_ms() + l.w_ms() > 0 ? l.w_ms() / (l.b_ms() + l.w_ms()) : 0.0;
      sc.f += layer_time_at(l, prof.micro_batch_size, o.micro_batch, true);
      sc.b += bw * (1 - share_w);
      sc.w += bw * share_w;
      sc.activation += l.held_bytes() * scale;
      // Weight gradients (heap model): a split layer's come with W, the others' with B.
      (l.bw_split ? sc.gradient_w : sc.gradient_b) += l.parameter_bytes;
      if (k + 1 == balance[s]) sc.message = l.activation_bytes * scale;
      if (k + 1 == balance[s] && s + 1 < balance.size()) {
        boundary = std::max(boundary, l.activation_bytes * scale);
        cut_bytes.push_back(l.activation_bytes * scale);
      }
    }
    costs.stage.push_back(sc);
  }
  // Each stage's optimizer step, where the profile measured it (version 3): its layers' times.
  std::vector<double> step(balance.size(), 0.0);
  bool timed_steps = false;
  for (std::size_t s = 0, l = 0; s < balance.size(); ++s)
    for (int k = 0; k < balance[s]; ++k, ++l) {
      step[s] += prof.layers[l].optimizer_ms;
      timed_steps = timed_steps || prof.layers[l].optimizer_ms > 0;
    }
  if (timed_steps) costs.stage_step = std::move(step);
  // What B frees of a micro-batch's activations, from the profile when it measured what split layers
  // keep for their W (every split layer, at least one); else the cost model's default.
  double held = 0, kept_for_w = 0;
  bool measured = false, complete = true;
  for (const LayerProfile& l : prof.layers) {
    held += l.held_bytes();
    if (!l.bw_split) continue;
    if (l.w_held_bytes < 0) {
      complete = false;
    } else {
      measured = true;
      kept_for_w += std::min(l.w_held_bytes, l.held_bytes());
    }
  }
  if (measured && complete && held > 0) costs.b_release_fraction = std::clamp(1.0 - kept_for_w / held, 0.0, 1.0);
  // The heap model's per-stage figure, where the profile measured what split layers keep (the one
  // fraction above cannot say that a stage keeps more after B than its forward saved: autograd's split
  // keeps output gradients for W).
  if (measured)
    for (std::size_t s = 0, at = 0; s < balance.size(); ++s) {
      double w_held = 0;
      bool known = true;
      for (int k = 0; k < balance[s]; ++k, ++at) {
        const LayerProfile& l = prof.layers[at];
        if (!l.bw_split) continue;
        if (l.w_held_bytes < 0) known = false;
        else w_held += l.w_held_bytes * scale;
      }
      if (known) costs.stage[s].w_held = w_held;
    }
  // One transfer time per cut, from the bytes that cross it (what the plan search prices, so simulate
  // --profile reproduces a plan's time); `comm`, the largest, is what the lowered schedules' explicit
  // send/receive actions and transfers between non-neighbouring stages cost.
  costs.comm = balance.size() > 1 ? transfer_ms(boundary, o.bandwidth_bytes_per_ms, o.latency_ms) : 0.0;
  for (double bytes : cut_bytes) costs.boundary_comm.push_back(transfer_ms(bytes, o.bandwidth_bytes_per_ms, o.latency_ms));
  costs.overhead = o.overhead_ms ? *o.overhead_ms : prof.runtime ? prof.runtime->overhead_ms : 0.0;
  return costs;
}

std::optional<TransferOptions> profile_transfers(const Profile& prof) {
  if (!prof.runtime) return std::nullopt;
  TransferOptions t;
  t.latency_ms = prof.runtime->latency_ms;
  t.bandwidth_bytes_per_ms =
      prof.runtime->bandwidth_bytes_per_ms > 0 ? prof.runtime->bandwidth_bytes_per_ms : std::numeric_limits<double>::infinity();
  return t;
}

MeasuredAllReduce::MeasuredAllReduce(std::vector<TransferSample> samples, int measured_ranks)
    : samples_(std::move(samples)), ranks_(measured_ranks) {
  if (samples_.empty() || ranks_ < 2)
    throw UsageError(fmt::format("a measured all-reduce needs samples over at least 2 ranks, got {} over {}: measure "
                                 "the profile again (pipetrain profile --transport NAME)", samples_.size(), ranks_));
  std::sort(samples_.begin(), samples_.end(), [](const TransferSample& a, const TransferSample& b) { return a.bytes < b.bytes; });
  const RuntimeCosts line = fit_transfers(samples_);  // refuses negative or non-finite samples
  line_latency_ms_ = line.latency_ms;
  line_bandwidth_ = line.bandwidth_bytes_per_ms;
}

double MeasuredAllReduce::ms(double bytes, int replicas) const {
  if (replicas < 2) return 0.0;
  const double share = (replicas - 1.0) / replicas, measured = (ranks_ - 1.0) / ranks_;
  const double x = bytes * share / measured;  // the bytes whose time at the measured rank count is the answer
  const std::vector<TransferSample>& s = samples_;
  if (x < s.front().bytes) {
    const double line = line_latency_ms_ + (line_bandwidth_ > 0 ? x / line_bandwidth_ : 0.0);
    return std::max(0.0, std::min(line, s.front().one_way_ms));
  }
  for (std::size_t k = 1; k < s.size(); ++k)
    if (x <= s[k].bytes) {
      const double span = s[k].bytes - s[k - 1].bytes;
      const double f = span > 0 ? (x - s[k - 1].bytes) / span : 1.0;
      return s[k - 1].one_way_ms + f * (s[k].one_way_ms - s[k - 1].one_way_ms);
    }
  const TransferSample& last = s.back();
  if (s.size() == 1 || s[s.size() - 2].bytes >= last.bytes)
    return last.bytes > 0 ? last.one_way_ms * x / last.bytes : last.one_way_ms;
  const TransferSample& prev = s[s.size() - 2];
  const double slope = std::max(0.0, (last.one_way_ms - prev.one_way_ms) / (last.bytes - prev.bytes));
  return last.one_way_ms + slope * (x - last.bytes);
}

double measured_allreduce_ms(const std::vector<TransferSample>& samples, int measured_ranks, double bytes,
                             int replicas) {
  return MeasuredAllReduce(samples, measured_ranks).ms(bytes, replicas);
}

std::vector<double> stage_static_bytes(const Profile& prof, const std::vector<int>& balance) {
  check_balance(balance, static_cast<int>(prof.layers.size()));
  std::vector<double> out;
  std::size_t layer = 0;
  for (int n : balance) {
    double bytes = 0;
    for (int k = 0; k < n; ++k, ++layer) bytes += 2 * prof.layers[layer].parameter_bytes + prof.layers[layer].optimizer_bytes;
    out.push_back(bytes);
  }
  return out;
}

double ring_allreduce_ms(double bytes, int ranks, double bandwidth_bytes_per_ms, double latency_ms) {
  if (ranks < 2) return 0.0;
  const double r = ranks;
  const bool free_bytes = !(bandwidth_bytes_per_ms > 0) || std::isinf(bandwidth_bytes_per_ms);
  return 2 * (r - 1) / r * (free_bytes ? 0.0 : bytes / bandwidth_bytes_per_ms) + 2 * (r - 1) * latency_ms;
}

double group_allreduce_ms(double bytes, int ranks, double bandwidth_bytes_per_ms, double latency_ms) {
  if (ranks < 2) return 0.0;
  const double r = ranks;
  const bool free_bytes = !(bandwidth_bytes_per_ms > 0) || std::isinf(bandwidth_bytes_per_ms);
  return 2 * (r - 1) / r * (free_bytes ? 0.0 : bytes / bandwidth_bytes_per_ms) + 2 * latency_ms;
}

void add_stage_step(CostModel& costs, const std::vector<double>& extra) {
  if (costs.stage_step.empty()) {
    costs.stage_step = extra;
    return;
  }
  if (costs.stage_step.size() != extra.size())
    throw std::logic_error("add_stage_step: " + std::to_string(extra.size()) + " step costs for " +
                           std::to_string(costs.stage_step.size()) + " stages");
  for (std::size_t s = 0; s < extra.size(); ++s) costs.stage_step[s] += extra[s];
}

std::vector<double> replica_allreduce_ms(const Profile& prof, const std::vector<int>& balance,
                                         const std::vector<int>& replication, double bandwidth_bytes_per_ms,
                                         double latency_ms) {
  check_balance(balance, static_cast<int>(prof.layers.size()));
  if (replication.size() != balance.size())
    throw UsageError("replication lists " + std::to_string(replication.size()) + " stages but the balance has " +
                     std::to_string(balance.size()) + ": give one replica count per stage");
  std::vector<double> out;
  std::size_t layer = 0;
  for (std::size_t s = 0; s < balance.size(); ++s) {
    double params = 0;
    for (int k = 0; k < balance[s]; ++k, ++layer) params += prof.layers[layer].parameter_bytes;
    out.push_back(group_allreduce_ms(params, replication[s], bandwidth_bytes_per_ms, latency_ms));
  }
  return out;
}

}  // namespace pipetrain

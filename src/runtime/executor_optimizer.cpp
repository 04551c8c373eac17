// PipelineRank's optimizer steps: the flush of a synchronous step (loss and global norm all-reduced,
// gradients clipped, the non-finite policy), gradients all-reduced over replicas, tied weights kept equal,
// and the stage's optimizer stepped through its weight versions. Declared in executor_impl.h.
#include "executor_impl.h"

#include <torch/optim.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "pipetrain/core/error.h"
#include "fused_optimizer.h"
#include "torch_compat.h"

namespace pipetrain {

namespace {

using detail::host_doubles;
using detail::host_tensor;
using detail::number_text;

// 52 bits of FNV-1a over `n` bytes: exact as a double, so all-reducible (only compared within a run).
double hash52(const unsigned char* p, std::size_t n) {
  uint64_t h = 14695981039346656037ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return static_cast<double>(h >> 12);
}

// hash52 of the tensor's bytes.
double value_hash(const torch::Tensor& t) {
  const torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
  return hash52(static_cast<const unsigned char*>(c.data_ptr()),
                static_cast<std::size_t>(c.numel()) * c.element_size());
}

}  // namespace

void PipelineRank::Impl::clip_to(const std::vector<torch::Tensor>& params, double norm, double clip, double scale) {
  double coef = scale;
  if (clip > 0 && norm > clip) coef *= clip / (norm + 1e-6);
  if (coef == 1.0) return;
  torch::NoGradGuard no_grad;
  for (const auto& p : params)
    if (p.grad().defined()) p.mutable_grad().mul_(coef);
}

void PipelineRank::Impl::reduce_and_clip(int k) {
  const auto uk = static_cast<std::size_t>(k);
  // The step's last sends complete before the flush's collectives. Their receivers take them before
  // their own Step, so this cannot deadlock; and a send left in flight may need this rank's transport
  // threads while the collective keeps its core busy: over gloo with ranks bound to one core each, the
  // MLP's last gradient then arrived 5 ms late whenever the Step reached its all-reduce quickly.
  finish_sends();
  std::vector<torch::Tensor> params;
  for (const auto& [s, ps] : stage_params)
    for (const auto& p : ps) params.push_back(p);
  if (options.data_parallel && options.data_parallel->world_size() > 1)
    all_reduce_gradients(*options.data_parallel, params, &step_loss[uk], per_token ? &step_count[uk] : nullptr);
  if (stage_replicas) all_reduce_gradients(*stage_replicas, params, nullptr);
  sum_tied_gradients();
  std::vector<torch::Tensor> counted;  // each tied weight once
  for (const auto& p : params)
    if (std::none_of(tied_copies.begin(), tied_copies.end(), [&](const TiedCopy& c) {
          return !c.primary && c.param.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
        }))
      counted.push_back(p);
  // Only the norm leader's share is counted (its replicas hold the same, already reduced, gradients), so
  // only it pays for the pass over them. Third entry: a bit per rank (the first 52; exact in a double)
  // whose share of the gradients is not finite.
  const double sq = norm_leader ? detail::gradient_sum_of_squares(counted) : 0.0;
  const double flag = std::isfinite(sq) ? 0.0 : std::ldexp(1.0, std::min(rank(), 51));
  // Fourth entry (per-token loss): the step's token count, by which the summed losses and gradients are
  // divided here (a step without tokens counts 1: its sums are zero).
  torch::Tensor t = per_token ? host_tensor({step_loss[uk], sq, flag, step_count[uk]}) : host_tensor({step_loss[uk], sq, flag});
  transport->all_reduce_sum(t);
  const double* sums = host_doubles(t);
  const double count = per_token && sums[3] > 0 ? sums[3] : 1.0;
  step_loss[uk] = sums[0] / count;
  step_sq[uk] = sums[1] / (count * count);
  if (!std::isfinite(step_loss[uk]) || !std::isfinite(step_sq[uk])) nonfinite_step(k, sums[2]);
  clip_to(params, std::sqrt(step_sq[uk]), options.optimizer.clip_grad_norm, 1.0 / count);
  step_reduced[uk] = 1;
  if (options.on_gradients) options.on_gradients(rank(), params);
}

void PipelineRank::Impl::nonfinite_step(int k, double rank_bits) {
  const auto uk = static_cast<std::size_t>(k);
  if (options.optimizer.nonfinite == "ignore") return;
  if (options.optimizer.nonfinite == "skip") {
    step_skipped[uk] = 1;
    return;
  }
  std::string stages;
  const auto bits = static_cast<uint64_t>(rank_bits);
  for (int s = 0; s < schedule.stages; ++s) {
    const int r = std::min(schedule.rank_of(s), 51);
    if (bits >> r & 1u) stages += (stages.empty() ? "" : ", ") + std::to_string(s);
  }
  throw NonFiniteError(fmt::format(
      "training diverged at step {}: the loss is {} and the gradient norm {}{}; no optimizer step was taken. "
      "Lower the learning rate, clip gradients (--clip), or resume from the last checkpoint{}",
      step + k + 1, number_text(step_loss[uk]), number_text(std::sqrt(step_sq[uk])),
      stages.empty() ? "" : " (gradients not finite on stage " + stages + ")",
      " (or skip such steps: --nonfinite skip)"));
}

void PipelineRank::Impl::check_options_agree() {
  if (options_checked) return;
  options_checked = true;
  const int p = transport->world_size();
  if (p < 2) return;
  // What every rank must agree on, one column each: ranks given other options waited for each other's
  // transfers for ever (another schedule) or failed in a message about the loss's shapes (another m).
  auto text_hash = [](const std::string& text) {
    return hash52(reinterpret_cast<const unsigned char*>(text.data()), text.size());
  };
  std::string balance_text;
  for (int n : balance) balance_text += std::to_string(n) + ",";
  struct Column {
    const char* what;
    std::string value;
    double number;
  };
  const std::vector<Column> columns{
      {"schedule", schedule.name, text_hash(schedule.name)},
      {"micro-batch count", std::to_string(generator.microbatches), static_cast<double>(generator.microbatches)},
      {"virtual stage count", std::to_string(generator.virtual_stages), static_cast<double>(generator.virtual_stages)},
      {"stage count", std::to_string(schedule.stages), static_cast<double>(schedule.stages)},
      {"balance", balance_text.empty() ? std::string("-") : balance_text.substr(0, balance_text.size() - 1),
       text_hash(balance_text)}};
  const auto n = static_cast<int64_t>(columns.size());
  torch::Tensor table = torch::zeros({p, n}, torch::kDouble);
  for (int64_t c = 0; c < n; ++c) table[rank()][c] = columns[static_cast<std::size_t>(c)].number;
  transport->all_reduce_sum(table);
  const auto t = table.accessor<double, 2>();
  for (int64_t c = 0; c < n; ++c) {
    std::string other;
    for (int r = 0; r < p; ++r)
      if (t[r][c] != t[rank()][c]) other += (other.empty() ? "" : ", ") + std::to_string(r);
    if (!other.empty())
      throw UsageError("the ranks were given other PipelineOptions: rank(s) " + other + " have another " +
                       columns[static_cast<std::size_t>(c)].what + " than rank " + std::to_string(rank()) + "'s " +
                       columns[static_cast<std::size_t>(c)].value + ": every rank of a pipeline must pass the same "
                       "schedule, micro-batches, virtual stages and balance");
  }
}

void PipelineRank::Impl::check_ties_agree() {
  if (ties_checked || options.tied.empty()) return;
  if (layerwise) return share_ties();
  const int p = transport->world_size();
  const auto n = static_cast<int64_t>(options.tied.size());
  torch::Tensor hashes = torch::zeros({p, n}, torch::kDouble);  // 0: no copy; else 1 + value_hash
  for (const auto& c : tied_copies) hashes[rank()][c.group] = 1 + value_hash(c.param);
  transport->all_reduce_sum(hashes);
  ties_checked = true;
  const auto h = hashes.accessor<double, 2>();
  for (int64_t g = 0; g < n; ++g) {
    int first = -1;
    std::string same, other;
    for (int r = 0; r < p; ++r) {
      if (h[r][g] == 0) continue;
      if (first < 0) first = r;
      std::string& list = h[r][g] == h[first][g] ? same : other;
      list += (list.empty() ? "" : ", ") + std::to_string(r);
    }
    if (other.empty()) continue;
    std::string members;
    for (const ParameterRef& m : options.tied[static_cast<std::size_t>(g)])
      members += (members.empty() ? "" : ", ") + std::to_string(m.layer) + ":" + m.name;
    throw UsageError("tie group " + std::to_string(g) + " (" + members + ") has other values on rank(s) " + other +
                     " than on rank(s) " + same + ", so its copies would train apart: build the model the same way "
                     "on every rank (e.g. torch::manual_seed with one seed before building it), or load one "
                     "checkpoint into every rank");
  }
}

void PipelineRank::Impl::share_ties() {
  const auto n = static_cast<int64_t>(options.tied.size());
  torch::Tensor sizes = torch::zeros({n, 3}, torch::kDouble);  // numel sum, holders, squared numel sum
  for (const auto& c : tied_copies) {
    const double k = static_cast<double>(c.param.numel());
    sizes[c.group][0] += k;
    sizes[c.group][1] += 1;
    sizes[c.group][2] += k * k;
  }
  transport->all_reduce_sum(sizes);
  ties_checked = true;
  const auto z = sizes.accessor<double, 2>();
  tied_numel.assign(static_cast<std::size_t>(n), 0);
  std::vector<int64_t> offset{0};
  for (int64_t g = 0; g < n; ++g) {
    const double mean = z[g][1] > 0 ? z[g][0] / z[g][1] : 0;
    if (z[g][1] > 0 && z[g][2] != mean * mean * z[g][1]) {
      std::string members;
      for (const ParameterRef& m : options.tied[static_cast<std::size_t>(g)])
        members += (members.empty() ? "" : ", ") + std::to_string(m.layer) + ":" + m.name;
      throw UsageError("tie group " + std::to_string(g) + " (" + members + ") has members of different sizes on "
                       "different ranks: tied parameters must have one shape and dtype");
    }
    tied_numel[static_cast<std::size_t>(g)] = static_cast<int64_t>(mean);
    offset.push_back(offset.back() + tied_numel[static_cast<std::size_t>(g)]);
  }
  torch::Tensor flat = torch::zeros({offset.back()}, torch::kDouble);
  for (const auto& c : tied_copies) {
    const ParameterRef& first = options.tied[static_cast<std::size_t>(c.group)].front();
    if (c.layer == first.layer && c.name == first.name)
      flat.slice(0, offset[static_cast<std::size_t>(c.group)], offset[static_cast<std::size_t>(c.group) + 1])
          .copy_(c.param.detach().reshape({-1}).to(torch::kCPU, torch::kDouble));
  }
  transport->all_reduce_sum(flat);
  torch::NoGradGuard no_grad;
  for (auto& c : tied_copies) {
    const auto g = static_cast<std::size_t>(c.group);
    c.param.copy_(flat.slice(0, offset[g], offset[g + 1]).view(c.param.sizes()));
  }
}

void PipelineRank::Impl::sum_tied_gradients() {
  if (options.tied.empty()) return;
  std::vector<int64_t> offset(tied_numel.size() + 1, 0);
  for (std::size_t g = 0; g < tied_numel.size(); ++g) offset[g + 1] = offset[g] + tied_numel[g];
  torch::Tensor flat = torch::zeros({offset.back()}, torch::kDouble);
  for (const auto& c : tied_copies)
    if (c.param.grad().defined())
      flat.slice(0, offset[static_cast<std::size_t>(c.group)], offset[static_cast<std::size_t>(c.group) + 1])
          .add_(c.param.grad().detach().reshape({-1}).to(torch::kCPU, torch::kDouble));
  transport->all_reduce_sum(flat);
  torch::NoGradGuard no_grad;
  for (auto& c : tied_copies) {
    const auto g = static_cast<std::size_t>(c.group);
    torch::Tensor sum = flat.slice(0, offset[g], offset[g + 1]).view(c.param.sizes()).to(c.param.device(), c.param.scalar_type());
    if (c.param.grad().defined())
      c.param.mutable_grad().copy_(sum);
    else
      c.param.mutable_grad() = sum.clone();
  }
}

void PipelineRank::Impl::all_reduce_gradients(Transport& group, const std::vector<torch::Tensor>& params, double* loss,
                                              double* count) {
  const int64_t replicas = loss && !count ? group.world_size() : 1;
  torch::NoGradGuard no_grad;
  if (!params.empty()) {
    c10::ScalarType dtype = params.front().scalar_type();
    for (const auto& p : params) dtype = c10::promoteTypes(dtype, p.scalar_type());
    std::vector<torch::Tensor> parts;
    parts.reserve(params.size());
    for (const auto& p : params)
      parts.push_back(p.grad().defined() ? p.grad().detach().reshape({-1}).to(torch::kCPU, dtype)
                                         : torch::zeros({p.numel()}, torch::TensorOptions().dtype(dtype)));
    torch::Tensor all = torch::cat(parts);
    parts.clear();
    group.all_reduce_sum(all);
    const torch::Tensor divisor = torch::scalar_tensor(static_cast<double>(replicas), torch::kDouble);
    int64_t at = 0;
    for (const auto& p : params) {
      const torch::Tensor sum = all.slice(0, at, at + p.numel()).view(p.sizes());
      at += p.numel();
      if (!p.grad().defined()) {
        const_cast<torch::Tensor&>(p).mutable_grad() =
            (replicas != 1 ? sum.div(divisor) : sum.clone()).to(p.device(), p.scalar_type());
      } else if (replicas == 1) {
        p.mutable_grad().copy_(sum);
      } else if (p.grad().is_cpu() && p.grad().scalar_type() == dtype) {
        torch::Tensor g = p.mutable_grad();
        at::div_out(g, sum, divisor);  // the mean, written straight into the gradient
      } else {
        p.mutable_grad().copy_(sum.div(divisor));
      }
    }
  }
  if (loss || count) {
    torch::Tensor exact = torch::tensor({loss ? *loss : 0.0, count ? *count : 0.0}, torch::kDouble);
    group.all_reduce_sum(exact);
    if (loss) *loss = exact[0].item<double>() / static_cast<double>(replicas);
    if (count) *count = exact[1].item<double>();
  }
}

void PipelineRank::Impl::optimizer_step(int s, int k) {
  if (k < 0 || k >= static_cast<int>(step_sizes.size()))
    throw std::logic_error("Step " + std::to_string(k) + " outside the call's " + std::to_string(step_sizes.size()) +
                           " steps");
  if (!async) {
    if (!step_reduced[static_cast<std::size_t>(k)]) reduce_and_clip(k);
  } else {
    // No stage knows the others' gradients of this mini-batch yet: clip by the stage's own norm; the
    // global norm is summed at the end of the call.
    const std::vector<torch::Tensor>& params = stage_params.at(s);
    const double sq = detail::gradient_sum_of_squares(params);
    step_sq[static_cast<std::size_t>(k)] += sq;
    if (!std::isfinite(sq) && options.optimizer.nonfinite == "stop")
      throw NonFiniteError(fmt::format(
          "training diverged at step {}: stage {}'s gradient norm is {}; no optimizer step was taken there. Lower "
          "the learning rate, clip gradients (--clip), or resume from the last checkpoint (or skip such steps: "
          "--nonfinite skip)", step + k + 1, s, number_text(std::sqrt(sq))));
    if (!std::isfinite(sq) && options.optimizer.nonfinite == "skip") {
      for (auto& p : params) const_cast<torch::Tensor&>(p).mutable_grad() = torch::Tensor();
      stats.skipped_steps += 1;
      return;
    }
    clip_to(params, std::sqrt(sq), options.optimizer.clip_grad_norm);
    if (options.on_gradients) options.on_gradients(rank(), params);
  }
  auto it = optimizers.find(s);
  if (it != optimizers.end() && options.learning_rate) {
    const double lr = options.learning_rate(step + k);
    if (!(lr > 0) || !std::isfinite(lr))  // an infinite one turned every weight to NaN in the step
      throw UsageError("learning rate of step " + std::to_string(step + k) + " must be a finite number > 0, got " +
                       std::to_string(lr));
    for (auto& group : it->second->param_groups()) group.options().set_lr(lr);
  }
  if (!async && step_skipped[static_cast<std::size_t>(k)]) {  // nonfinite "skip": no stage steps
    for (auto& p : stage_params.at(s)) p.mutable_grad() = torch::Tensor();
    stats.skipped_steps += 1;
    return;
  }
  weights.at(s).step([&] { if (it != optimizers.end()) detail::optimizer_step(*it->second); }, async);
  for (auto& p : stage_params.at(s)) p.mutable_grad() = torch::Tensor();
}

torch::optim::OptimizerParamState* PipelineRank::Impl::optim_state(int s, const torch::Tensor& p) {
  auto it = optimizers.find(s);
  if (it == optimizers.end()) return nullptr;
  auto& state = it->second->state();
  auto found = state.find(compat::optimizer_state_key(p));
  return found == state.end() ? nullptr : found->second.get();
}

}  // namespace pipetrain

// PipelineRank's passes: the interpreter that runs a rank's action list (timing each action on the
// rank's device), the call's setup and totals, and the schedules and weight plans each call uses.
// Declared in executor_impl.h.
#include "executor_impl.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/validate.h"
#include "pipetrain/runtime/device.h"
#include "pass_util.h"

namespace pipetrain {

namespace {

using detail::host_doubles;
using detail::host_tensor;
using detail::number_text;
using detail::SkipRoute;

// The routes as the schedule's skip edges (schedule.h), in the same order, so a skip transfer's route
// (skip_carried) indexes both. A route weighs one stage activation per tensor it carries: the memory unit
// of the cost models built from measured timelines (measured_costs gives every stage an activation of
// 1), which measure no bytes.
std::vector<SkipEdge> skip_edges(const std::vector<SkipRoute>& routes) {
  std::vector<SkipEdge> out;
  for (const SkipRoute& r : routes) out.push_back(SkipEdge{r.from, r.to, static_cast<double>(r.names.size())});
  return out;
}

}  // namespace

bool PipelineRank::Impl::run_action(const Action& a, int pos) {
  switch (a.kind) {
    case ActionKind::F: forward(a.stage, a.index); break;
    case ActionKind::B: backward(a.stage, a.index, true); break;
    case ActionKind::BW: backward(a.stage, a.index, false); break;
    case ActionKind::W: weight(a.stage, a.index); break;
    case ActionKind::SendAct: {
      if (a.peer >= 0) {
        send_skip(a);
        break;
      }
      std::vector<char> flags;
      const Bundle out = outgoing(a.stage, slot(a.stage, a.index), flags);
      send(a.stage, 0, a.index, out, flags, pass->rank_of(a.stage + 1, a.index));
      break;
    }
    case ActionKind::SendGrad:
      if (a.peer >= 0) return send_skip_grad(a);
      send(a.stage, 1, a.index, slot(a.stage, a.index).input_grad, {}, pass->rank_of(a.stage - 1, a.index));
      slot(a.stage, a.index).input_grad = Bundle();
      break;
    case ActionKind::RecvAct:
    case ActionKind::RecvGrad: return a.peer >= 0 ? receive_skip(a, pos) : receive(a, pos);
    case ActionKind::Step: optimizer_step(a.stage, a.index); break;
  }
  return true;
}

void check_batch_rows(const Bundle& in, const Bundle& tgt, int64_t n, bool every_entry_defined) {
  // Every entry is cut by rows of the batch: one with other rows would train on a part of it (rows past
  // batch_size were dropped without a word) or fail later in a message about the model's shapes.
  for (const auto& [what, bundle] : {std::pair<const char*, const Bundle*>{"input", &in}, {"target", &tgt}})
    for (const auto& [name, t] : bundle->items()) {
      if (!t.defined() && every_entry_defined)
        throw UsageError(std::string(what) + " entry '" + name + "' is an undefined tensor; every entry of a batch "
                         "needs one row per sample (fill it, or leave the entry out)");
      if (t.defined() && t.dim() > 0 && t.size(0) != n)
        throw UsageError(std::string(what) + " entry '" + name + "' has " + std::to_string(t.size(0)) +
                         " rows but batch_size is " + std::to_string(n) + ": every entry holds one row per sample "
                         "of the batch; pass batch_size " + std::to_string(t.size(0)) + " or slice the entries to " +
                         std::to_string(n) + " rows");
    }
}

void check_steps_per_call(int steps, int64_t n) {
  if (steps < 1) throw UsageError("steps per call must be >= 1, got " + std::to_string(steps));
  if (steps > n)
    throw UsageError("a call of " + std::to_string(steps) + " steps needs at least one sample per step but the " +
                     "batch has " + std::to_string(n) + ": pass more samples or fewer steps");
}

void PipelineRank::Impl::begin_pass(const Bundle& in, const Bundle& tgt, int64_t n, int steps, int m) {
  check_steps_per_call(steps, n);
  check_batch_rows(in, tgt, n, false);
  ranges.clear();
  step_sizes.clear();
  for (const auto& [b, e] : split_equal(n, steps)) {
    step_sizes.push_back(e - b);
    for (const auto& [mb, me] : split_equal(e - b, m)) ranges.emplace_back(b + mb, b + me);
  }
  per_step = m;
  input = in;
  target = tgt;
  batch_size = n;
  step_loss.assign(static_cast<std::size_t>(steps), 0.0);
  step_sq.assign(static_cast<std::size_t>(steps), 0.0);
  step_count.assign(static_cast<std::size_t>(steps), 0.0);
  step_reduced.assign(static_cast<std::size_t>(steps), 0);
  step_skipped.assign(static_cast<std::size_t>(steps), 0);
  slots.clear();
  posted.clear();
  posted_skips.clear();
  prefetch_cursor = 0;
  pending_sends.clear();
  stats = StepStats{};
  stats.step = step;
  stats.steps = steps;
  stats.timeline.schedule = schedule.name;
  stats.timeline.ranks = schedule.ranks;
  stats.timeline.microbatches = m;
  stats.timeline.virtual_stages = schedule.virtual_stages_per_rank();
  stats.timeline.unit = "ms";
}

void PipelineRank::Impl::run_list(const std::vector<Action>& actions) {
  // On a GPU with allocator statistics, the device's bytes in tensors; else the C heap (device.h).
  const torch::Device where = rank_device->device();
  const double heap0 = options.measure_memory ? memory_in_use(where) : 0.0;
  stats.timeline.events.reserve(2 * actions.size());  // an action and its receive's wait at most
  // The rank's device times each action: on the CPU with the host clock; on a GPU from events on the
  // rank's stream, since the host clock around an action measures its kernel launches, not its work.
  // The times come at the end of the list (timed: timeline index, handle).
  detail::RankDevice& device = *rank_device;
  std::vector<std::pair<std::size_t, std::size_t>> timed;
  timed.reserve(actions.size());
  device.begin_timing();
  std::size_t pos = 0;
  try {
    for (; pos < actions.size(); ++pos) {
      if (!options.reference) prefetch_from(actions, pos);
      if (options.before_action && !forward_mode) options.before_action(rank(), step, actions[pos]);
      await_inputs(actions[pos], stats.timeline);
      const std::size_t handle = device.start_action();
      if (run_action(actions[pos], static_cast<int>(pos))) {
        device.end_action(handle);
        timed.emplace_back(stats.timeline.events.size(), handle);
        stats.timeline.events.push_back(TimedAction{rank(), actions[pos], 0.0, 0.0});  // timed below
      }
      if (!options.reference) reap_sends();
      if (options.measure_memory) stats.peak_heap_growth = std::max(stats.peak_heap_growth, memory_in_use(where) - heap0);
    }
    finish_sends();
    if (!forward_mode) finish_call();
    const std::vector<std::pair<double, double>> times = device.finish_timing();
    for (const auto& [event, handle] : timed) {
      stats.timeline.events[event].start = times[handle].first;
      stats.timeline.events[event].end = times[handle].second;
    }
  } catch (const RemoteFailure&) {
    throw;
  } catch (const std::exception& e) {
    const std::string where = pos < actions.size() ? " at " + to_string(actions[pos]) : std::string();
    // LibTorch's errors carry a C++ backtrace in what(); the user needs the message only.
    const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
    const std::string what = torch_error ? torch_error->what_without_backtrace() : e.what();
    const std::string msg = "rank " + std::to_string(rank()) + where + ": " + what;
    transport->abort(msg);
    if (dynamic_cast<const UsageError*>(&e)) throw UsageError(msg);
    if (dynamic_cast<const NonFiniteError*>(&e)) throw NonFiniteError(msg);
    throw std::runtime_error(msg);
  }
}

void PipelineRank::Impl::finish_call() {
  const std::size_t K = step_sizes.size();
  if (!async) {
    for (std::size_t k = 0; k < K; ++k)  // a rank without Step actions still joins the reductions
      if (!step_reduced[k]) reduce_and_clip(static_cast<int>(k));
  } else {
    std::vector<double> values(step_loss);
    values.insert(values.end(), step_sq.begin(), step_sq.end());
    torch::Tensor t = host_tensor(values);
    transport->all_reduce_sum(t);
    const double* sums = host_doubles(t);
    for (std::size_t k = 0; k < K; ++k) {
      step_loss[k] = sums[k];
      step_sq[k] = sums[K + k];
    }
    // The call's losses and norms, the same on every rank: a non-finite one stops every rank here
    // (a stage's own non-finite norm already stopped the call at its Step).
    for (std::size_t k = 0; k < K && options.optimizer.nonfinite == "stop"; ++k)
      if (!std::isfinite(step_loss[k]) || !std::isfinite(step_sq[k]))
        throw NonFiniteError(fmt::format("training diverged at step {}: the loss is {} and the gradient norm {}. "
                                         "Lower the learning rate, clip gradients (--clip), or resume from the last "
                                         "checkpoint", step + static_cast<int>(k) + 1, number_text(step_loss[k]),
                                         number_text(std::sqrt(step_sq[k]))));
    for (const auto& [s, w] : weights)
      stats.weight_memory.push_back(WeightMemory{s, w.peak_extra_sets(), w.set_bytes()});
  }
  double weighted = 0;
  int64_t total = 0;
  for (std::size_t k = 0; k < K; ++k) {
    stats.losses.push_back(step_loss[k]);
    stats.grad_norms.push_back(std::sqrt(step_sq[k]));
    weighted += step_loss[k] * static_cast<double>(step_sizes[k]);
    total += step_sizes[k];
  }
  stats.loss = K == 1 ? step_loss[0] : weighted / static_cast<double>(std::max<int64_t>(total, 1));
  stats.grad_norm = stats.grad_norms.empty() ? 0.0 : stats.grad_norms.back();
}

Schedule PipelineRank::Impl::make_plain(int steps) const {
  Schedule s;
  if (!options.replication.empty()) {
    s = round_robin(options.schedule, options.replication, generator.microbatches, steps);
  } else {
    GeneratorOptions g = generator;
    g.steps = steps;
    s = generate(options.schedule, g);
  }
  s.skips = skip_edges(skips);
  return s;
}

const Schedule& PipelineRank::Impl::schedule_for(int steps) {
  if (steps == 1) return schedule;
  auto it = by_steps.find(steps);
  if (it != by_steps.end()) return it->second;
  Schedule plain = make_plain(steps);
  validate(plain);
  Schedule lowered = insert_communication(plain, options.costs);
  validate(lowered);
  return by_steps.emplace(steps, std::move(lowered)).first->second;
}

const WeightPlan& PipelineRank::Impl::plan_for(int steps) {
  auto it = plans.find(steps);
  if (it != plans.end()) return it->second;
  return plans.emplace(steps, plan_weights(schedule_for(steps), policy, options.costs)).first->second;
}

const Schedule& PipelineRank::Impl::forward_schedule(int m) {
  auto it = forward_schedules.find(m);
  if (it != forward_schedules.end()) return it->second;
  Schedule plain;
  plain.name = "forward";
  plain.ranks = schedule.ranks;
  plain.stages = schedule.stages;
  plain.microbatches = m;
  plain.microbatches_per_step = m;
  plain.stage_rank = schedule.stage_rank;
  plain.skips = schedule.skips;
  plain.actions.resize(static_cast<std::size_t>(schedule.ranks));
  for (int s = 0; s < schedule.stages; ++s)
    for (int i = 0; i < m; ++i)
      plain.actions[static_cast<std::size_t>(schedule.rank_of(s))].push_back(Action{ActionKind::F, s, i});
  return forward_schedules.emplace(m, insert_communication(plain, options.costs)).first->second;
}

int PipelineRank::Impl::stage_of_layer(int layer) const {
  for (const auto& [s, st] : stages)
    if (layer >= st.first_layer() && layer < st.first_layer() + st.num_layers()) return s;
  throw std::invalid_argument("layer " + std::to_string(layer) + " is not held by rank " + std::to_string(rank()));
}

}  // namespace pipetrain

#include "pipetrain/runtime/weights.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <stdexcept>

#include "pipetrain/core/simulate.h"
#include "torch_compat.h"

namespace pipetrain {

std::string to_string(WeightPolicy p) {
  switch (p) {
    case WeightPolicy::Current: return "current";
    case WeightPolicy::Stash: return "stash";
    case WeightPolicy::VerticalSync: return "vertical-sync";
    case WeightPolicy::TwoBuffered: return "2bw";
    case WeightPolicy::SpecTrain: return "spectrain";
    case WeightPolicy::PipeOptim: return "pipeoptim";
  }
  return "?";
}

bool WeightPlan::versioned() const {
  return policy == WeightPolicy::Stash || policy == WeightPolicy::VerticalSync || policy == WeightPolicy::TwoBuffered;
}

bool WeightPlan::predicted() const { return policy == WeightPolicy::SpecTrain || policy == WeightPolicy::PipeOptim; }

const PassWeights& WeightPlan::of(int stage, int micro, bool is_forward) const {
  static const PassWeights current;
  const auto& map = is_forward ? forward : backward;
  auto it = map.find({stage, micro});
  return it == map.end() ? current : it->second;
}

namespace {

using Key = std::pair<int, int>;

// Steps of each stage before each of its F and BW, in its rank's list order (the versions a stage has
// when the pass runs, counted within the call).
void own_steps_before(const Schedule& s, std::map<Key, int>& before_f, std::map<Key, int>& before_bw) {
  for (const auto& row : s.actions) {
    std::map<int, int> steps;  // stage -> Step actions so far
    for (const Action& a : row) {
      if (a.kind == ActionKind::Step) ++steps[a.stage];
      if (a.kind == ActionKind::F) before_f[{a.stage, a.index}] = steps[a.stage];
      if (a.kind == ActionKind::BW || a.kind == ActionKind::B) before_bw[{a.stage, a.index}] = steps[a.stage];
    }
  }
}

}  // namespace

StepCounts count_spectrain_steps(const Schedule& schedule, const CostModel& costs) {
  CostModel c = costs;
  if (c.stage.empty()) c = CostModel::uniform(schedule.stages, StageCost{}, schedule.virtual_stages_per_rank());
  const SimResult sim = simulate(schedule, c);
  std::map<Key, double> start, bw_start;       // (stage, micro-batch) -> start of its F, of its BW
  std::map<int, std::vector<double>> step_at;  // stage -> completion times of its Steps
  for (const TimedAction& e : sim.timeline.events) {
    const Action& a = e.action;
    if (a.kind == ActionKind::F) start[{a.stage, a.index}] = e.start;
    if (a.kind == ActionKind::BW || a.kind == ActionKind::B) bw_start[{a.stage, a.index}] = e.start;
    if (a.kind == ActionKind::Step) step_at[a.stage].push_back(e.end);
  }
  auto count = [&](int stage, double from, double to) {
    int n = 0;
    for (double t : step_at[stage]) n += t > from && t <= to;
    return n;
  };
  StepCounts out;
  for (const auto& [key, t] : start) {
    const auto target = bw_start.find({0, key.second});
    if (target == bw_start.end()) continue;
    out.forward[key] = count(key.first, t, target->second);
    const auto b = bw_start.find(key);
    if (b != bw_start.end()) out.backward[key] = count(key.first, b->second, target->second);
  }
  return out;
}

WeightPlan plan_weights(const Schedule& s, WeightPolicy policy, const CostModel& costs) {
  WeightPlan plan;
  plan.policy = policy;
  if (policy == WeightPolicy::Current) return plan;
  std::map<Key, int> before_f, before_bw;
  own_steps_before(s, before_f, before_bw);
  switch (policy) {
    case WeightPolicy::Current: break;
    case WeightPolicy::Stash:
      for (const auto& [key, v] : before_f) plan.forward[key] = plan.backward[key] = PassWeights{v, -1};
      break;
    case WeightPolicy::VerticalSync:
      // The tag: the version stage 0 had at the micro-batch's first forward.
      for (const auto& [key, v] : before_f) {
        const int tag = before_f.at({0, key.second});
        if (tag > v)
          throw std::logic_error("vertical sync: stage " + std::to_string(key.first) + " runs F" +
                                 std::to_string(key.second) + " before making version " + std::to_string(tag));
        plan.forward[key] = plan.backward[key] = PassWeights{tag, -1};
      }
      break;
    case WeightPolicy::TwoBuffered:
      for (const auto& [key, v] : before_f) {
        const int version = std::max(0, s.step_of(key.second) - 1);
        if (version > v)
          throw std::logic_error("2bw: stage " + std::to_string(key.first) + " runs F" + std::to_string(key.second) +
                                 " before making version " + std::to_string(version));
        plan.forward[key] = plan.backward[key] = PassWeights{version, -1};
      }
      break;
    case WeightPolicy::SpecTrain: {
      const StepCounts n = count_spectrain_steps(s, costs);
      for (const auto& [key, k] : n.forward) plan.forward[key] = PassWeights{-1, k};
      for (const auto& [key, k] : n.backward) plan.backward[key] = PassWeights{-1, k};
      break;
    }
    case WeightPolicy::PipeOptim:
      // s = the stage's own steps between the forward and its backward: the version gap the forward's
      // weights should anticipate (p-1-stage for PipeDream once the pipeline is full). The backward uses
      // the current weights.
      for (const auto& [key, v] : before_f) {
        auto b = before_bw.find(key);
        plan.forward[key] = PassWeights{-1, b == before_bw.end() ? 0 : b->second - v};
        plan.backward[key] = PassWeights{-1, 0};
      }
      break;
  }
  return plan;
}

torch::Tensor update_direction(torch::optim::Optimizer& optimizer, const torch::Tensor& p) {
  auto& state = optimizer.state();
  auto it = state.find(compat::optimizer_state_key(p));
  if (it == state.end()) return torch::Tensor();
  torch::NoGradGuard no_grad;
  const torch::Tensor w = p.variable_data();
  if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) return g->momentum_buffer();
  auto adam = [&](int64_t step, const torch::Tensor& m1, const torch::Tensor& m2, double beta1, double beta2,
                  double eps) {
    const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
    // LibTorch's Adam: p -= (lr / bc1) * m1 / (sqrt(m2) / sqrt(bc2) + eps).
    return (m1 / bc1) / (m2.sqrt() / std::sqrt(bc2) + eps);
  };
  for (auto& group : optimizer.param_groups()) {
    bool here = false;
    for (const auto& q : group.params()) here = here || q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
    if (!here) continue;
    if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
      const auto& o = static_cast<const torch::optim::AdamOptions&>(group.options());
      return adam(a->step(), a->exp_avg(), a->exp_avg_sq(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps());
    }
    if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
      torch::Tensor d =
          adam(a->step(), a->exp_avg(), a->exp_avg_sq(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps());
      return o.weight_decay() != 0 ? d + o.weight_decay() * w : d;
    }
  }
  return torch::Tensor();
}

torch::Tensor predict_weight(const torch::Tensor& w, const torch::Tensor& v, int s, double lr) {
  torch::NoGradGuard no_grad;
  const torch::Tensor data = w.variable_data();
  if (s == 0 || !v.defined()) return data.clone();
  return data.add(v, -static_cast<double>(s) * lr);
}

StageWeights::StageWeights(std::vector<torch::Tensor> params, torch::optim::Optimizer* optimizer)
    : params_(std::move(params)), optimizer_(optimizer) {}

double StageWeights::set_bytes() const {
  double bytes = 0;
  for (const auto& p : params_) bytes += static_cast<double>(p.numel() * p.element_size());
  return bytes;
}

void StageWeights::note_peak() { peak_extra_ = std::max(peak_extra_, extra_sets()); }

void StageWeights::begin_call(const WeightPlan& plan, int stage) {
  policy_ = plan.policy;
  stash_.clear();
  needs_.clear();
  newest_.clear();
  latest_ = 0;
  scratch_live_ = 0;
  peak_extra_ = 0;
  if (!plan.versioned()) return;
  for (const auto* map : {&plan.forward, &plan.backward})
    for (const auto& [key, w] : *map)
      if (key.first == stage && w.version >= 0) ++needs_[w.version];
}

int StageWeights::enter(const PassWeights& w, bool is_forward, std::vector<torch::Tensor>& scratch) {
  if (!newest_.empty()) throw std::logic_error("StageWeights::enter: a pass is already in progress");
  torch::NoGradGuard no_grad;
  if (w.predict >= 0) {
    // Predicted weights live in the micro-batch's scratch buffer; the forward's graph keeps views of it,
    // so the backward writes its own prediction into the same storage (through the buffer's own handle,
    // which no graph holds) and every saved reference then reads the backward's weights.
    const double lr = optimizer_ && !optimizer_->param_groups().empty()
                          ? optimizer_->param_groups().front().options().get_lr()
                          : 0.0;
    if (is_forward) {
      if (!scratch.empty()) throw std::logic_error("StageWeights::enter: forward with a live prediction buffer");
      ++scratch_live_;
      note_peak();
    }
    for (std::size_t k = 0; k < params_.size(); ++k) {
      const torch::Tensor v = optimizer_ ? update_direction(*optimizer_, params_[k]) : torch::Tensor();
      torch::Tensor predicted = predict_weight(params_[k], v, w.predict, lr);
      if (is_forward)
        scratch.push_back(predicted);
      else
        scratch.at(k).copy_(predicted);
    }
    for (std::size_t k = 0; k < params_.size(); ++k) {
      newest_.push_back(params_[k].variable_data());
      params_[k].set_data(scratch[k]);
    }
    return latest_;
  }
  if (w.version < 0 || w.version == latest_) return latest_;
  auto it = stash_.find(w.version);
  if (it == stash_.end())
    throw std::logic_error("weight version " + std::to_string(w.version) + " is needed but " +
                           (w.version > latest_ ? "not made yet (newest " + std::to_string(latest_) + ")"
                                                : std::string("was not stashed")));
  for (std::size_t k = 0; k < params_.size(); ++k) {
    newest_.push_back(params_[k].variable_data());
    params_[k].set_data(it->second[k]);
  }
  return w.version;
}

void StageWeights::leave() {
  for (std::size_t k = 0; k < newest_.size(); ++k) params_[k].set_data(newest_[k]);
  newest_.clear();
}

void StageWeights::finish(const PassWeights& w, bool is_forward, std::vector<torch::Tensor>& scratch) {
  if (w.predict >= 0 && !is_forward && !scratch.empty()) {
    scratch.clear();
    --scratch_live_;
  }
  if (w.version < 0) return;
  auto it = needs_.find(w.version);
  if (it == needs_.end() || it->second <= 0) throw std::logic_error("weight version use not planned");
  if (--it->second == 0) {
    needs_.erase(it);
    if (w.version != latest_) stash_.erase(w.version);
  }
}

void StageWeights::step(const std::function<void()>& apply, bool in_flight) {
  if (!in_flight) {
    apply();
    ++latest_;
    return;
  }
  if (!newest_.empty()) throw std::logic_error("StageWeights::step during a pass");
  torch::NoGradGuard no_grad;
  auto need = needs_.find(latest_);
  if (need != needs_.end() && need->second > 0) {
    // Copy-on-write: the current storage becomes the stash entry (in-flight graphs already point at it)
    // and the optimizer steps a copy.
    std::vector<torch::Tensor> kept;
    for (auto& p : params_) {
      kept.push_back(p.variable_data());
      p.set_data(p.variable_data().clone());
    }
    stash_[latest_] = std::move(kept);
    note_peak();
  }
  // Fresh version counters: views saved by in-flight graphs keep the old counter, which the step does
  // not bump; the parameter's own counter is set back to the value the graphs saved.
  std::vector<uint32_t> versions;
  for (auto& p : params_) {
    versions.push_back(p._version());
    torch::autograd::impl::set_version_counter(p, c10::VariableVersion(versions.back()));
  }
  apply();
  for (std::size_t k = 0; k < params_.size(); ++k)
    torch::autograd::impl::set_version_counter(params_[k], c10::VariableVersion(versions[k]));
  ++latest_;
}

}  // namespace pipetrain

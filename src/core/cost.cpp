#include "pipetrain/core/cost.h"

#include "pipetrain/core/schedule.h"

#include <cmath>
#include <sstream>
#include <utility>

#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"

namespace pipetrain {

CostModel CostModel::uniform(int stages, StageCost per_stage, int virtual_per_rank, double comm) {
  const double v = virtual_per_rank > 0 ? virtual_per_rank : 1;
  // A chunk holds 1/v of the layers and so of their gradients; its output is as large as the stage's.
  StageCost chunk{per_stage.f / v,          per_stage.b / v,          per_stage.w / v, per_stage.activation / v,
                  per_stage.gradient_b / v, per_stage.gradient_w / v, per_stage.message};
  CostModel m;
  m.stage.assign(static_cast<std::size_t>(stages), chunk);
  m.comm = comm;
  return m;
}

double CostModel::duration(const Action& a) const {
  switch (a.kind) {
    case ActionKind::F: return stage.at(static_cast<std::size_t>(a.stage)).f + overhead;
    case ActionKind::B: return stage.at(static_cast<std::size_t>(a.stage)).b + overhead;
    case ActionKind::W: return stage.at(static_cast<std::size_t>(a.stage)).w + overhead;
    case ActionKind::BW: {
      const StageCost& c = stage.at(static_cast<std::size_t>(a.stage));
      return c.b + c.w + overhead;
    }
    case ActionKind::Step: return step + (stage_step.empty() ? 0.0 : stage_step.at(static_cast<std::size_t>(a.stage)));
    default: return comm;
  }
}

double CostModel::memory_delta(const Action& a) const {
  if (!is_compute(a.kind)) return 0.0;
  const double act = stage.at(static_cast<std::size_t>(a.stage)).activation;
  switch (a.kind) {
    case ActionKind::F: return act;
    case ActionKind::B: return -act * b_release_fraction;
    case ActionKind::W: return -act * (1.0 - b_release_fraction);
    default: return -act;  // BW
  }
}

void CostModel::check(int stages) const {
  if (static_cast<int>(stage.size()) != stages)
    throw UsageError("the cost model has " + std::to_string(stage.size()) + " stage entries but the schedule has " +
                     std::to_string(stages) + " stages: give one F:B:W triple, or one per stage");
  auto bad = [](double x) { return !std::isfinite(x) || x < 0 || x > kMaxActionCost; };
  auto num = [](double x) {  // %g: std::to_string printed 1e308 as 309 digits
    std::ostringstream o;
    o << x;
    return o.str();
  };
  for (std::size_t s = 0; s < stage.size(); ++s) {
    const StageCost& c = stage[s];
    if (bad(c.f) || bad(c.b) || bad(c.w) || !std::isfinite(c.activation) || c.activation < 0) {
      std::ostringstream msg;
      msg << "stage " << s << " has a negative or non-finite cost (F=" << c.f << ", B=" << c.b << ", W=" << c.w
          << ", activation=" << c.activation << "): costs must be finite, >= 0 and at most 1e12";
      throw UsageError(msg.str());
    }
    for (const auto& [name, x] : {std::pair<const char*, double>{"gradient_b", c.gradient_b}, {"gradient_w", c.gradient_w},
                                  {"message", c.message}})
      if (!std::isfinite(x) || x < 0) {
        std::ostringstream msg;
        msg << "stage " << s << " has " << name << " = " << x << ": memory amounts must be finite and >= 0";
        throw UsageError(msg.str());
      }
    if (!std::isfinite(c.w_held)) {
      std::ostringstream msg;
      msg << "stage " << s << " has w_held = " << c.w_held << ": give a finite amount (< 0: not measured)";
      throw UsageError(msg.str());
    }
  }
  if (bad(comm)) throw UsageError("communication cost " + num(comm) + " must be finite, >= 0 and at most 1e12");
  if (!boundary_comm.empty() && static_cast<int>(boundary_comm.size()) != stages - 1)
    throw UsageError("the cost model has " + std::to_string(boundary_comm.size()) + " per-boundary transfer times but "
                     "the schedule has " + std::to_string(stages) + " stages: give one per boundary (" +
                     std::to_string(stages - 1) + "), or none");
  for (std::size_t s = 0; s < boundary_comm.size(); ++s)
    if (bad(boundary_comm[s]))
      throw UsageError("the transfer time across boundary " + std::to_string(s) + " (stage " + std::to_string(s) +
                       " to " + std::to_string(s + 1) + "), " + num(boundary_comm[s]) +
                       ", must be finite and >= 0");
  if (bad(bandwidth))
    throw UsageError("skip bandwidth " + num(bandwidth) + " must be finite and >= 0 (0: unlimited)");
  if (bad(overhead))
    throw UsageError("per-action overhead " + num(overhead) + " must be finite, >= 0 and at most 1e12");
  if (bad(step)) throw UsageError("step cost " + num(step) + " must be finite, >= 0 and at most 1e12");
  if (!stage_step.empty() && static_cast<int>(stage_step.size()) != stages)
    throw UsageError("the cost model has " + std::to_string(stage_step.size()) + " per-stage step costs but the "
                     "schedule has " + std::to_string(stages) + " stages");
  for (std::size_t s = 0; s < stage_step.size(); ++s)
    if (bad(stage_step[s]))
      throw UsageError("stage " + std::to_string(s) + "'s step cost " + num(stage_step[s]) +
                       " must be finite and >= 0");
  if (!(b_release_fraction >= 0 && b_release_fraction <= 1))
    throw UsageError("b_release_fraction " + num(b_release_fraction) + " must lie in [0, 1]");
}

namespace {

double parse_cost_number(const std::string& item, const std::string& whole) {
  try {
    std::size_t used = 0;
    const double v = std::stod(item, &used);
    if (used != item.size()) throw std::invalid_argument(item);
    if (!std::isfinite(v) || v < 0)
      throw UsageError("cost '" + excerpt(item) + "' in '" + excerpt(whole) + "' must be a finite number >= 0");
    // A schedule's makespan sums many costs: 1e308 overflowed to infinity and the simulator then
    // reported a deadlock. 1e12 time units per action is far past any real cost.
    if (v > kMaxActionCost)
      throw UsageError("cost '" + excerpt(item) + "' in '" + excerpt(whole) + "' is over the limit of 1e12 time units per action (sums "
                       "of such costs overflow): rescale the costs, e.g. to milliseconds");
    return v;
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception&) {
    throw UsageError("cost '" + excerpt(item) + "' in '" + excerpt(whole) + "' is not a number: expected F:B:W such as 1:1:1 or 1:2:0");
  }
}

}  // namespace

std::vector<StageCost> parse_stage_costs(const std::string& text) {
  std::vector<StageCost> out;
  std::stringstream per_stage(text);
  std::string triple;
  while (std::getline(per_stage, triple, ',')) {
    std::vector<double> v;
    std::stringstream parts(triple);
    std::string item;
    while (std::getline(parts, item, ':')) v.push_back(parse_cost_number(item, text));
    if (v.size() != 3)
      throw UsageError("cost '" + excerpt(triple) + "' in '" + excerpt(text) +
                       "' must have three parts F:B:W (forward, input-gradient backward, weight-gradient "
                       "backward), e.g. 1:1:1; for a fused backward of 2 write 1:2:0");
    out.push_back(StageCost{v[0], v[1], v[2], 1.0});
  }
  if (out.empty()) throw UsageError("empty cost '" + excerpt(text) + "': expected F:B:W such as 1:1:1");
  return out;
}

CostModel costs_from_triples(const Schedule& s, const std::vector<StageCost>& given, double comm,
                             const std::string& what) {
  const int v = s.virtual_stages_per_rank();
  CostModel c;
  c.comm = comm;
  if (given.size() == 1) {
    c = CostModel::uniform(s.stages, given[0], v, comm);
  } else if (static_cast<int>(given.size()) == s.stages) {
    c.stage = given;
  } else if (static_cast<int>(given.size()) == s.ranks && s.replicated()) {
    throw UsageError(what + " lists " + std::to_string(given.size()) + " triples, one per rank, but the stages are "
                     "replicated and a stage's replicas share its cost: give one triple per stage (" +
                     std::to_string(s.stages) + ") or one for all");
  } else if (static_cast<int>(given.size()) == s.ranks) {
    // One triple per rank: each of its v chunks costs 1/v of it.
    for (int st = 0; st < s.stages; ++st) {
      StageCost r = given[static_cast<std::size_t>(s.rank_of(st))];
      c.stage.push_back(StageCost{r.f / v, r.b / v, r.w / v, r.activation / v});
    }
  } else {
    throw UsageError(what + " lists " + std::to_string(given.size()) + " triples but the schedule has " +
                     std::to_string(s.ranks) + " ranks and " + std::to_string(s.stages) +
                     " stages: give one triple, one per rank or one per stage");
  }
  c.check(s.stages);
  return c;
}

}  // namespace pipetrain

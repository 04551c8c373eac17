#include "pipetrain/core/skip.h"

#include <cmath>
#include <sstream>

#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"

namespace pipetrain {
namespace {

std::string route_text(const SkipEdge& r) {
  std::ostringstream out;
  out << r.from_stage << ":" << r.to_stage << ":" << r.size;
  return out.str();
}

int route_of(const Schedule& s, int from, int to) {
  for (std::size_t k = 0; k < s.skips.size(); ++k)
    if (s.skips[k].from_stage == from && s.skips[k].to_stage == to) return static_cast<int>(k);
  return -1;
}

}  // namespace

SkipEdge parse_skip_route(const std::string& text) {
  auto fail = [&]() -> SkipEdge {
    throw UsageError("malformed skip route '" + excerpt(text) +
                     "': expected FROM:TO or FROM:TO:SIZE, stage numbers with TO >= FROM + 2 and SIZE >= 0 in the "
                     "cost model's memory units (e.g. 0:3 or 0:3:0.5)");
  };
  std::vector<std::string> parts;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ':')) parts.push_back(part);
  if (parts.size() < 2 || parts.size() > 3) return fail();
  SkipEdge r;
  r.size = 1.0;
  try {
    std::size_t used = 0;
    r.from_stage = std::stoi(parts[0], &used);
    if (used != parts[0].size()) return fail();
    r.to_stage = std::stoi(parts[1], &used);
    if (used != parts[1].size()) return fail();
    if (parts.size() == 3) {
      r.size = std::stod(parts[2], &used);
      if (used != parts[2].size()) return fail();
    }
  } catch (const std::logic_error&) {
    return fail();
  }
  return r;
}

void check_skip_routes(const Schedule& s) {
  for (std::size_t k = 0; k < s.skips.size(); ++k) {
    const SkipEdge& r = s.skips[k];
    const std::string what = "skip route " + route_text(r) + " of schedule '" + s.name + "'";
    if (r.from_stage < 0 || r.to_stage < 0 || r.from_stage >= s.stages || r.to_stage >= s.stages)
      throw UsageError(what + " names a stage outside 0.." + std::to_string(s.stages - 1) +
                       ": use stages of the schedule");
    if (r.to_stage <= r.from_stage)
      throw UsageError(what + " goes from stage " + std::to_string(r.from_stage) + " to stage " +
                       std::to_string(r.to_stage) + ": a skip goes forward, to a later stage (TO > FROM)");
    if (r.to_stage == r.from_stage + 1)
      throw UsageError(what + " joins neighbouring stages: such a skip travels with the boundary transfer; count "
                              "its size in the stage's activation instead, or route it over two or more stages");
    if (!std::isfinite(r.size) || r.size < 0)
      throw UsageError(what + " has size " + std::to_string(r.size) + ": give a finite size >= 0");
    if (route_of(s, r.from_stage, r.to_stage) != static_cast<int>(k))
      throw UsageError(what + " repeats stages " + std::to_string(r.from_stage) + " -> " +
                       std::to_string(r.to_stage) + ": give one route per stage pair with the sizes summed");
  }
}

namespace {
// An F needs the activations of the routes that end at its stage and makes those of the routes that
// start there; a backward (B or BW) needs the gradients of the routes that start at its stage and makes
// those of the routes that end there. `needs` picks the side.
std::vector<SkipToken> skip_tokens(const Schedule& s, const Action& a, bool needs) {
  std::vector<SkipToken> out;
  const bool backward = a.kind == ActionKind::B || a.kind == ActionKind::BW;
  if (a.kind != ActionKind::F && !backward) return out;
  for (std::size_t k = 0; k < s.skips.size(); ++k) {
    const SkipEdge& r = s.skips[k];
    const bool at_start = r.from_stage == a.stage, at_end = r.to_stage == a.stage;
    if (backward ? (needs ? at_start : at_end) : (needs ? at_end : at_start))
      out.push_back({static_cast<int>(k), backward, a.index});
  }
  return out;
}
}  // namespace

std::vector<SkipToken> skip_needs(const Schedule& s, const Action& a) { return skip_tokens(s, a, true); }
std::vector<SkipToken> skip_makes(const Schedule& s, const Action& a) { return skip_tokens(s, a, false); }

int skip_maker_stage(const Schedule& s, const SkipToken& t) {
  const SkipEdge& r = s.skips.at(static_cast<std::size_t>(t.route));
  return t.grad ? r.to_stage : r.from_stage;
}

int skip_user_stage(const Schedule& s, const SkipToken& t) {
  const SkipEdge& r = s.skips.at(static_cast<std::size_t>(t.route));
  return t.grad ? r.from_stage : r.to_stage;
}

std::optional<SkipToken> skip_carried(const Schedule& s, const Action& a) {
  if (!is_comm(a.kind) || a.peer < 0) return std::nullopt;
  // Activations go forward (from = the sender of SF, the peer of RF); gradients go back.
  const bool grad = a.kind == ActionKind::SendGrad || a.kind == ActionKind::RecvGrad;
  const bool at_from = a.kind == ActionKind::SendAct || a.kind == ActionKind::RecvGrad;
  const int from = at_from ? a.stage : a.peer, to = at_from ? a.peer : a.stage;
  const int k = route_of(s, from, to);
  if (k < 0)
    throw UsageError("skip transfer " + to_string(a) + " names no skip route of schedule '" + s.name +
                     "' from stage " + std::to_string(from) + " to stage " + std::to_string(to) +
                     ": declare the route (skips=" + std::to_string(from) + ":" + std::to_string(to) +
                     ":SIZE, or --skip) or remove the transfer");
  return SkipToken{k, grad, a.index};
}

Action skip_send(const Schedule& s, const SkipToken& t) {
  const SkipEdge& r = s.skips.at(static_cast<std::size_t>(t.route));
  Action a = t.grad ? Action{ActionKind::SendGrad, r.to_stage, t.micro} : Action{ActionKind::SendAct, r.from_stage, t.micro};
  a.peer = t.grad ? r.from_stage : r.to_stage;
  return a;
}

double skip_transfer_time(const CostModel& costs, const SkipEdge& route) {
  return costs.comm + (costs.bandwidth > 0 ? route.size / costs.bandwidth : 0.0);
}

}  // namespace pipetrain

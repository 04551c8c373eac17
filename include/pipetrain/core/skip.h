// Skip transfers (docs/ALGORITHMS.md §1.10): the data dependencies a schedule's skip routes add, shared by
// lowering, the validator and the simulator so that all three agree.
//
// A route k = (from, to) adds, for every micro-batch i, two pieces of data:
//   the skip activation SkipAct(k, i): made by F(from, i), needed by F(to, i);
//   the skip gradient  SkipGrad(k, i): made by the consumer's input-gradient pass (B or BW of (to, i)),
//                                      needed by the producer's (B or BW of (from, i)).
// When producer and consumer run on different ranks, a lowered schedule moves them with
//   SkipAct:  <from>SF<i>@<to>  ->  <to>RF<i>@<from>
//   SkipGrad: <to>SB<i>@<from>  ->  <from>RB<i>@<to>
// and each transfer costs comm + size / bandwidth (CostModel) in the simulator.
// Pure functions; any thread may call them.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "pipetrain/core/cost.h"
#include "pipetrain/core/schedule.h"

namespace pipetrain {

struct SkipToken {
  int route = 0;      // index into Schedule::skips
  bool grad = false;  // false: the skip activation; true: its gradient
  int micro = 0;
};

// Parses one route, "FROM:TO" or "FROM:TO:SIZE" (SIZE defaults to 1, one stage activation's units).
// Throws UsageError naming the text and the form.
SkipEdge parse_skip_route(const std::string& text);

// Throws UsageError naming the route and the fix unless every route has 0 <= from, to < stages,
// to >= from + 2, a finite size >= 0, and no two routes share (from, to).
void check_skip_routes(const Schedule& s);

// The skip data a compute action needs before it can start, and the skip data it makes.
std::vector<SkipToken> skip_needs(const Schedule& s, const Action& a);
std::vector<SkipToken> skip_makes(const Schedule& s, const Action& a);

// The stage that needs a skip token (the consumer's for an activation, the producer's for a gradient)
// and the stage that makes it.
int skip_maker_stage(const Schedule& s, const SkipToken& t);
int skip_user_stage(const Schedule& s, const SkipToken& t);

// The skip token a skip transfer (a send or receive with a peer) carries; nullopt for other actions.
// Throws UsageError if the transfer names no route of the schedule.
std::optional<SkipToken> skip_carried(const Schedule& s, const Action& a);

// The send on the maker's rank that moves `t` (its receive is matching_comm of it).
Action skip_send(const Schedule& s, const SkipToken& t);

// Dense index of a skip token: (route, grad, micro) over the schedule's routes and micro-batches.
inline std::size_t skip_index(const SkipToken& t, int micros) {
  return (static_cast<std::size_t>(t.route) * 2u + (t.grad ? 1u : 0u)) * static_cast<std::size_t>(micros) +
         static_cast<std::size_t>(t.micro);
}
inline std::size_t skip_token_count(const Schedule& s) {
  return s.skips.size() * 2u * static_cast<std::size_t>(s.microbatches);
}

// Time one skip transfer of `route` takes between two ranks: costs.comm + size / costs.bandwidth
// (the size costs nothing when bandwidth is 0, unlimited).
double skip_transfer_time(const CostModel& costs, const SkipEdge& route);

}  // namespace pipetrain

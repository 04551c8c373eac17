#include "pipetrain/core/lower.h"

#include <algorithm>
#include <tuple>

#include "pipetrain/core/dependencies.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/skip.h"
#include "pipetrain/core/validate.h"

namespace pipetrain {

Schedule strip_communication(const Schedule& schedule) {
  Schedule out = schedule;
  for (auto& row : out.actions)
    row.erase(std::remove_if(row.begin(), row.end(), [](const Action& a) { return is_comm(a.kind); }), row.end());
  return out;
}

Schedule insert_communication(const Schedule& schedule, const CostModel& costs_in) {
  check_ranges(schedule);
  for (const auto& row : schedule.actions)
    for (const Action& a : row)
      if (is_comm(a.kind))
        throw UsageError("schedule '" + schedule.name + "' already holds transfers (" + to_string(a) +
                         "): lower a schedule without send/receive actions");
  const CostModel costs = costs_in.stage.empty()
                              ? CostModel::uniform(schedule.stages, StageCost{}, schedule.virtual_stages_per_rank())
                              : costs_in;
  const SimResult sim = simulate(schedule, costs);

  // Sort key: (time, tie, kind-order). Compute actions use their start time and their index g in the
  // simulator's execution order (a topological order). A transfer uses the time its data was made and
  // g_maker + 0.5, so it sorts right after its maker, before the consumer, and identically on both ranks.
  struct Item {
    double time;
    double tie;
    Action action;
  };
  std::vector<std::vector<Item>> items(static_cast<std::size_t>(schedule.ranks));
  for (std::size_t g = 0; g < sim.timeline.events.size(); ++g) {
    const TimedAction& e = sim.timeline.events[g];
    items[static_cast<std::size_t>(e.rank)].push_back({e.start, static_cast<double>(g), e.action});
    // Skip transfers sort like the boundary ones: at the time their data is made, right after the maker,
    // in the same order on both ranks (a stable sort keeps this loop's order among equal keys).
    for (const SkipToken& t : skip_makes(schedule, e.action)) {
      const int user_rank = schedule.rank_of(skip_user_stage(schedule, t), t.micro);
      if (user_rank == e.rank) continue;
      const Action send = skip_send(schedule, t);
      const double tie = static_cast<double>(g) + 0.5;
      items[static_cast<std::size_t>(e.rank)].push_back({e.end, tie, send});
      items[static_cast<std::size_t>(user_rank)].push_back({e.end, tie, matching_comm(send)});
    }
    const auto token = produced_token(e.action);
    if (!token) continue;
    // The single consumer stage of this token on another rank, if any.
    const int consumer_stage = token->kind == Token::Act ? token->stage + 1 : token->stage - 1;
    if (consumer_stage < 0 || consumer_stage >= schedule.stages) continue;
    const int consumer_rank = schedule.rank_of(consumer_stage, token->micro);
    if (consumer_rank == e.rank) continue;
    const Action send = token->kind == Token::Act ? Action{ActionKind::SendAct, token->stage, token->micro}
                                                  : Action{ActionKind::SendGrad, token->stage, token->micro};
    const double tie = static_cast<double>(g) + 0.5;
    items[static_cast<std::size_t>(e.rank)].push_back({e.end, tie, send});
    items[static_cast<std::size_t>(consumer_rank)].push_back({e.end, tie, matching_comm(send)});
  }
  Schedule out = schedule;
  for (int r = 0; r < schedule.ranks; ++r) {
    auto& list = items[static_cast<std::size_t>(r)];
    std::stable_sort(list.begin(), list.end(),
                     [](const Item& a, const Item& b) { return std::tie(a.time, a.tie) < std::tie(b.time, b.tie); });
    auto& row = out.actions[static_cast<std::size_t>(r)];
    row.clear();
    for (const Item& it : list) row.push_back(it.action);
  }
  return out;
}

}  // namespace pipetrain

#include "pipetrain/core/simulate.h"

#include <algorithm>
#include <limits>
#include <sstream>

#include "pipetrain/core/dependencies.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/skip.h"
#include "pipetrain/core/validate.h"

namespace pipetrain {
namespace {

// Per-rank peak memory when the schedule has skip routes (docs/ALGORITHMS.md §1.10, P-BUNDLE-2): the
// compute actions' deltas in the rank's order, plus on the consumer's rank each skip activation from its
// arrival (counted before the first action that starts at or after it) until the end of the backward
// that finishes the consumer's micro-batch (W, or BW). The producer holds nothing extra: the stashed
// tensor is part of its own activation.
std::vector<double> peak_memory_with_skips(const Schedule& s, const CostModel& costs, const Timeline& t,
                                           const std::vector<double>& skip_at) {
  std::vector<std::vector<std::pair<double, double>>> arrivals(static_cast<std::size_t>(s.ranks));
  for (std::size_t k = 0; k < s.skips.size(); ++k)
    for (int i = 0; i < s.microbatches; ++i) {
      const SkipToken tok{static_cast<int>(k), false, i};
      const int r = s.rank_of(s.skips[k].to_stage, i);
      arrivals[static_cast<std::size_t>(r)].push_back({skip_at[skip_index(tok, s.microbatches)], s.skips[k].size});
    }
  for (auto& list : arrivals) std::sort(list.begin(), list.end());
  std::vector<double> mem(static_cast<std::size_t>(s.ranks), 0.0), peak(mem);
  std::vector<std::size_t> next(static_cast<std::size_t>(s.ranks), 0);
  for (const TimedAction& e : t.events) {  // each rank's events in its own order
    const auto ur = static_cast<std::size_t>(e.rank);
    const auto& list = arrivals[ur];
    for (; next[ur] < list.size() && list[next[ur]].first <= e.start; ++next[ur]) {
      mem[ur] += list[next[ur]].second;
      peak[ur] = std::max(peak[ur], mem[ur]);
    }
    mem[ur] += costs.memory_delta(e.action);
    peak[ur] = std::max(peak[ur], mem[ur]);
    if (e.action.kind == ActionKind::W || e.action.kind == ActionKind::BW)
      for (const SkipEdge& route : s.skips)
        if (route.to_stage == e.action.stage) mem[ur] -= route.size;
  }
  return peak;
}

}  // namespace

SimResult simulate(const Schedule& s, const CostModel& costs) {
  costs.check(s.stages);
  check_skip_routes(s);
  // skip_at[k] = time skip token k is usable at the rank that needs it (made + transfer when ranks differ).
  std::vector<double> skip_at(skip_token_count(s), std::numeric_limits<double>::infinity());
  const double never = std::numeric_limits<double>::infinity();
  // ready[token] = time the token was made; maker[token] = rank that made it.
  const std::size_t ntok = 2 * static_cast<std::size_t>(s.stages) * static_cast<std::size_t>(s.microbatches);
  std::vector<double> made(ntok, never);
  std::vector<int> maker(ntok, -1);
  std::vector<std::size_t> ptr(static_cast<std::size_t>(s.ranks), 0);
  std::vector<double> free_at(static_cast<std::size_t>(s.ranks), 0.0);
  std::vector<double> mem(static_cast<std::size_t>(s.ranks), 0.0), peak_mem(mem);

  SimResult out;
  out.timeline.schedule = s.name;
  out.timeline.ranks = s.ranks;
  out.timeline.microbatches = s.microbatches_per_step;
  out.timeline.total_microbatches = s.microbatches;
  out.timeline.virtual_stages = s.virtual_stages_per_rank();
  out.timeline.unit = "units";

  std::size_t remaining = 0;
  for (const auto& row : s.actions) remaining += row.size();
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < s.ranks; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      const auto& row = s.actions[ur];
      while (ptr[ur] < row.size()) {
        const Action& a = row[ptr[ur]];
        if (is_comm(a.kind)) {  // transfers are modelled as latency on the data edges
          ++ptr[ur];
          --remaining;
          progressed = true;
          continue;
        }
        double start = free_at[ur];
        bool ready = true;
        for (const Token& t : required_tokens(a, s.stages)) {
          const std::size_t ti = token_index(t, s.stages, s.microbatches);
          if (made[ti] == never) {
            ready = false;
            break;
          }
          start = std::max(start, made[ti] + (maker[ti] != r ? costs.comm : 0.0));
        }
        for (const SkipToken& t : skip_needs(s, a)) {
          if (!ready) break;
          const double at = skip_at[skip_index(t, s.microbatches)];
          if (at == never) ready = false;
          else start = std::max(start, at);
        }
        if (!ready) break;
        const double end = start + costs.duration(a);
        for (const SkipToken& t : skip_makes(s, a)) {
          const bool remote = s.rank_of(skip_user_stage(s, t), t.micro) != r;
          skip_at[skip_index(t, s.microbatches)] =
              end + (remote ? skip_transfer_time(costs, s.skips[static_cast<std::size_t>(t.route)]) : 0.0);
        }
        if (auto t = produced_token(a)) {
          const std::size_t ti = token_index(*t, s.stages, s.microbatches);
          made[ti] = end;
          maker[ti] = r;
        }
        mem[ur] += costs.memory_delta(a);
        peak_mem[ur] = std::max(peak_mem[ur], mem[ur]);
        out.timeline.events.push_back(TimedAction{r, a, start, end});
        free_at[ur] = end;
        ++ptr[ur];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed) {
      std::vector<GridCell> heads;
      std::ostringstream why;
      why << "schedule '" << s.name << "' deadlocks in simulation: no rank can proceed.\n";
      for (int r = 0; r < s.ranks; ++r) {
        const auto ur = static_cast<std::size_t>(r);
        if (ptr[ur] >= s.actions[ur].size()) continue;
        heads.push_back({r, static_cast<int>(ptr[ur])});
        why << "  rank " << r << " waits at " << to_string(s.actions[ur][ptr[ur]]) << "\n";
      }
      throw ScheduleError(why.str() + render_grid(s, heads));
    }
  }
  out.metrics = compute_metrics(out.timeline);
  if (!s.skips.empty()) peak_mem = peak_memory_with_skips(s, costs, out.timeline, skip_at);
  for (int r = 0; r < s.ranks; ++r)
    out.metrics.per_rank[static_cast<std::size_t>(r)].peak_memory = peak_mem[static_cast<std::size_t>(r)];
  return out;
}

}  // namespace pipetrain

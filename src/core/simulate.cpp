#include "pipetrain/core/simulate.h"

#include <algorithm>
#include <limits>
#include <sstream>

#include "pipetrain/core/dependencies.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/validate.h"

namespace pipetrain {

SimResult simulate(const Schedule& s, const CostModel& costs) {
  costs.check(s.stages);
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
        if (!ready) break;
        const double end = start + costs.duration(a);
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
  for (int r = 0; r < s.ranks; ++r)
    out.metrics.per_rank[static_cast<std::size_t>(r)].peak_memory = peak_mem[static_cast<std::size_t>(r)];
  return out;
}

}  // namespace pipetrain

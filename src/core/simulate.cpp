#include "pipetrain/core/simulate.h"

#include <algorithm>
#include <cstdint>
#include <queue>
#include <limits>
#include <sstream>
#include <stdexcept>

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
// `for_each(visit)` calls visit(rank, action, start) for every event, each rank's in its own order.
template <class ForEach>
std::vector<double> peak_memory_with_skips(const Schedule& s, const CostModel& costs, ForEach&& for_each,
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
  for_each([&](int rank, const Action& action, double start) {  // each rank's events in its own order
    const auto ur = static_cast<std::size_t>(rank);
    const auto& list = arrivals[ur];
    for (; next[ur] < list.size() && list[next[ur]].first <= start; ++next[ur]) {
      mem[ur] += list[next[ur]].second;
      peak[ur] = std::max(peak[ur], mem[ur]);
    }
    mem[ur] += costs.memory_delta(action);
    peak[ur] = std::max(peak[ur], mem[ur]);
    if (action.kind == ActionKind::W || action.kind == ActionKind::BW)
      for (const SkipEdge& route : s.skips)
        if (route.to_stage == action.stage) mem[ur] -= route.size;
  });
  return peak;
}

}  // namespace

namespace {

// The tokens a compute action needs (dependencies.h's required_tokens, without allocating): at most two.
int needed_tokens(const Action& a, int stages, Token (&out)[2]) {
  switch (a.kind) {
    case ActionKind::F:
      if (a.stage == 0) return 0;
      out[0] = Token{Token::Act, a.stage - 1, a.index};
      return 1;
    case ActionKind::B:
    case ActionKind::BW:
      out[0] = Token{Token::Act, a.stage, a.index};
      if (a.stage + 1 >= stages) return 1;
      out[1] = Token{Token::Grad, a.stage + 1, a.index};
      return 2;
    case ActionKind::W: out[0] = Token{Token::Grad, a.stage, a.index}; return 1;
    default: return 0;
  }
}

// Per-rank metrics gathered while the simulation runs, so that no timeline is needed for them (the same
// definitions as compute_metrics, timeline.h). In flight: a (stage, micro) pair enters on F and leaves on
// its last backward (BW, or W when the rank runs a W for it; else B). Per-rank event order is start order.
class MetricsSink {
 public:
  MetricsSink(const Schedule& s, const CostModel& costs)
      : s_(s), costs_(costs), n_(static_cast<std::size_t>(s.ranks)), first_(n_, kInf), last_(n_, -kInf),
        mem_(n_, 0.0), live_(n_, 0), state_(static_cast<std::size_t>(s.stages) * static_cast<std::size_t>(s.microbatches), 0) {
    metrics_.per_rank.resize(n_);
    for (std::size_t r = 0; r < n_; ++r) metrics_.per_rank[r].rank = static_cast<int>(r);
    for (const auto& row : s.actions)  // which pairs have a W (they leave on it, not on B)
      for (const Action& a : row)
        if (a.kind == ActionKind::W && valid(a)) state_[pair(a)] |= kHasW;
  }
  void operator()(int rank, const Action& a, double start, double end) {
    t0_ = std::min(t0_, start);
    t1_ = std::max(t1_, end);
    if (!is_compute(a.kind)) return;
    const auto r = static_cast<std::size_t>(rank);
    RankMetrics& m = metrics_.per_rank[r];
    m.busy += end - start;
    first_[r] = std::min(first_[r], start);
    last_[r] = std::max(last_[r], end);
    mem_[r] += costs_.memory_delta(a);
    m.peak_memory = std::max(m.peak_memory, mem_[r]);
    if (!valid(a)) return;
    std::uint8_t& st = state_[pair(a)];
    const bool leaves = a.kind == ActionKind::BW || a.kind == ActionKind::W || (a.kind == ActionKind::B && !(st & kHasW));
    if (a.kind == ActionKind::F) {
      if (!(st & kLive)) ++live_[r];
      st |= kLive;
      m.peak_inflight = std::max(m.peak_inflight, live_[r]);
    } else if (leaves && (st & kLive)) {
      st &= static_cast<std::uint8_t>(~kLive);
      --live_[r];
    }
  }
  Metrics finish() {
    if (t1_ < t0_) return std::move(metrics_);
    metrics_.makespan = t1_ - t0_;
    double busy = 0.0;
    for (std::size_t r = 0; r < n_; ++r) {
      RankMetrics& rm = metrics_.per_rank[r];
      if (last_[r] >= first_[r]) rm.span = last_[r] - first_[r];
      rm.bubble = rm.span - rm.busy;
      busy += rm.busy;
    }
    if (metrics_.makespan > 0.0 && s_.ranks > 0) metrics_.bubble_fraction = 1.0 - busy / (s_.ranks * metrics_.makespan);
    return std::move(metrics_);
  }

 private:
  static constexpr double kInf = std::numeric_limits<double>::infinity();
  static constexpr std::uint8_t kLive = 1, kHasW = 2;
  bool valid(const Action& a) const {
    return a.stage >= 0 && a.stage < s_.stages && a.index >= 0 && a.index < s_.microbatches;
  }
  std::size_t pair(const Action& a) const {
    return static_cast<std::size_t>(a.stage) * static_cast<std::size_t>(s_.microbatches) + static_cast<std::size_t>(a.index);
  }
  const Schedule& s_;
  const CostModel& costs_;
  std::size_t n_;
  Metrics metrics_;
  double t0_ = kInf, t1_ = -kInf;
  std::vector<double> first_, last_, mem_;
  std::vector<int> live_;
  std::vector<std::uint8_t> state_;  // per (stage, micro): kLive | kHasW
};

// Whether every action that makes a token (F, B, BW) is on the rank rank_of names for its stage and
// micro-batch, so that the rank that made a token need not be kept per token.
bool makers_are_owners(const Schedule& s) {
  for (int r = 0; r < s.ranks; ++r)
    for (const Action& a : s.actions[static_cast<std::size_t>(r)]) {
      if (a.kind != ActionKind::F && a.kind != ActionKind::B && a.kind != ActionKind::BW) continue;
      if (a.stage < 0 || a.stage >= s.stages || a.index < 0 || a.index >= s.microbatches) return false;
      const auto st = static_cast<std::size_t>(a.stage);
      if (s.stage_replicas.empty() ? st >= s.stage_rank.size() : st >= s.stage_replicas.size() || s.stage_replicas[st].empty())
        return false;
      if (s.rank_of(a.stage, a.index) != r) return false;
    }
  return true;
}

// A synchronous step is a barrier: the runtime's first Step k on each rank all-reduces the step's loss and
// gradient norm over every rank (reduce_and_clip), so no rank's Step k starts before every rank that steps
// in step k has finished what precedes it. (Modelled as "Step needs nothing", rank 0 ran step 2's forwards
// while rank 3 was still in step 1: zb-h2's two steps came out 5.6% shorter than two of its steps.)
class StepBarrier {
 public:
  explicit StepBarrier(const Schedule& s) : on_(s.synchronous), arrived_at_(static_cast<std::size_t>(s.ranks), -1) {
    if (!on_) return;
    for (const auto& row : s.actions) {
      int last = -1;  // a rank's Step actions of one step (one per chunk) count it once
      for (const Action& a : row)
        if (a.kind == ActionKind::Step && a.index > last) {
          last = a.index;
          const auto k = static_cast<std::size_t>(a.index);
          if (k >= expected_.size()) expected_.resize(k + 1, 0);
          ++expected_[k];
        }
    }
    arrived_.assign(expected_.size(), 0);
    open_at_.assign(expected_.size(), 0.0);
  }
  bool on() const { return on_; }
  // Rank r is at Step `a`, ready for the step's all-reduce at `arrive`: whether every rank of its step
  // has arrived; `open` is when the last did.
  bool pass(int r, const Action& a, double arrive, double& open) {
    const auto k = static_cast<std::size_t>(a.index);
    int& at = arrived_at_[static_cast<std::size_t>(r)];
    if (at < a.index) {
      at = a.index;
      ++arrived_[k];
      open_at_[k] = std::max(open_at_[k], arrive);
    }
    open = open_at_[k];
    return arrived_[k] >= expected_[k];
  }

 private:
  bool on_;
  std::vector<int> arrived_at_;  // per rank: the last step it arrived at (-1: none)
  std::vector<int> expected_, arrived_;  // per step: ranks that step in it, ranks arrived
  std::vector<double> open_at_;  // per step: when the last rank arrived
};

// The event simulation (docs/ALGORITHMS.md §1.6): calls on_event(rank, action, start, end) for every
// action in execution order (per rank, its own order); fills skip_at. Memory: one time and one rank per
// token, nothing per action beyond what on_event keeps.
template <class OnEvent>
void run_simulation(const Schedule& s, const CostModel& costs, std::vector<double>& skip_at, OnEvent&& on_event) {
  check_ranges(s);  // sizes, owners, every action's indices and the skip routes: no read out of bounds
  costs.check(s.stages);
  const double never = std::numeric_limits<double>::infinity();
  skip_at.assign(skip_token_count(s), never);
  const bool with_skips = !s.skips.empty();
  // made[token] = time the token was made; maker[token] = rank that made it, kept only when some action
  // that makes a token is not on the rank the schedule names for it (never after validate()).
  const bool owners = makers_are_owners(s);
  const std::size_t ntok = 2 * static_cast<std::size_t>(s.stages) * static_cast<std::size_t>(s.microbatches);
  std::vector<double> made(ntok, never);
  std::vector<int> maker(owners ? 0 : ntok, -1);
  std::vector<std::size_t> ptr(static_cast<std::size_t>(s.ranks), 0);
  std::vector<double> free_at(static_cast<std::size_t>(s.ranks), 0.0);

  std::size_t remaining = 0;
  for (const auto& row : s.actions) remaining += row.size();
  StepBarrier barrier(s);
  Token need[2];
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
        if (a.kind == ActionKind::Step && barrier.on()) {
          // A stage's own part of the Step (its replicas' all-reduce, CostModel::stage_step) comes before
          // the global all-reduce; the optimizer step (CostModel::step) after it.
          const double own = costs.stage_step.empty() ? 0.0 : costs.stage_step[static_cast<std::size_t>(a.stage)];
          double open = 0;
          if (!barrier.pass(r, a, free_at[ur] + own, open)) break;
          start = std::max(start, open - own);
        }
        bool ready = true;
        const int n = needed_tokens(a, s.stages, need);
        for (int k = 0; k < n; ++k) {
          const std::size_t ti = token_index(need[k], s.stages, s.microbatches);
          if (made[ti] == never) {
            ready = false;
            break;
          }
          const int by = owners ? s.rank_of(need[k].stage, need[k].micro) : maker[ti];
          start = std::max(start, made[ti] + (by != r ? costs.transfer(need[k].stage, a.stage) : 0.0));
        }
        if (ready && with_skips)
          for (const SkipToken& t : skip_needs(s, a)) {
            const double at = skip_at[skip_index(t, s.microbatches)];
            if (at == never) {
              ready = false;
              break;
            }
            start = std::max(start, at);
          }
        if (!ready) break;
        const double end = start + costs.duration(a);
        if (with_skips)
          for (const SkipToken& t : skip_makes(s, a)) {
            const bool remote = s.rank_of(skip_user_stage(s, t), t.micro) != r;
            skip_at[skip_index(t, s.microbatches)] =
                end + (remote ? skip_transfer_time(costs, s.skips[static_cast<std::size_t>(t.route)]) : 0.0);
          }
        if (a.kind == ActionKind::F || a.kind == ActionKind::B || a.kind == ActionKind::BW) {
          const std::size_t ti = token_index(Token{a.kind == ActionKind::F ? Token::Act : Token::Grad, a.stage, a.index},
                                             s.stages, s.microbatches);
          made[ti] = end;
          if (!owners) maker[ti] = r;
        }
        on_event(r, a, start, end);
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
}

// The order in which run_simulation runs the actions, without their times: calls on_event(rank, position
// in the rank's list) for every action that is not a transfer, in run_simulation's order. Readiness there
// depends only on which tokens exist, never on their times, so one byte per token suffices here. Must
// follow run_simulation's loop step for step (tests/core/test_streamed_output.cpp compares the orders).
template <class OnEvent>
void replay_run(const Schedule& s, OnEvent&& on_event) {
  const bool with_skips = !s.skips.empty();
  std::vector<std::uint8_t> made(2 * static_cast<std::size_t>(s.stages) * static_cast<std::size_t>(s.microbatches), 0);
  std::vector<std::uint8_t> skip_made(with_skips ? skip_token_count(s) : 0, 0);
  std::vector<std::size_t> ptr(static_cast<std::size_t>(s.ranks), 0);
  std::size_t remaining = 0;
  for (const auto& row : s.actions) remaining += row.size();
  StepBarrier barrier(s);  // its readiness needs only which ranks arrived, not when
  double unused = 0;
  Token need[2];
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < s.ranks; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      const auto& row = s.actions[ur];
      while (ptr[ur] < row.size()) {
        const Action& a = row[ptr[ur]];
        if (!is_comm(a.kind)) {
          if (a.kind == ActionKind::Step && barrier.on() && !barrier.pass(r, a, 0.0, unused)) break;
          bool ready = true;
          const int n = needed_tokens(a, s.stages, need);
          for (int k = 0; k < n && ready; ++k) ready = made[token_index(need[k], s.stages, s.microbatches)] != 0;
          if (ready && with_skips)
            for (const SkipToken& t : skip_needs(s, a))
              if (!skip_made[skip_index(t, s.microbatches)]) {
                ready = false;
                break;
              }
          if (!ready) break;
          if (with_skips)
            for (const SkipToken& t : skip_makes(s, a)) skip_made[skip_index(t, s.microbatches)] = 1;
          if (a.kind == ActionKind::F || a.kind == ActionKind::B || a.kind == ActionKind::BW)
            made[token_index(Token{a.kind == ActionKind::F ? Token::Act : Token::Grad, a.stage, a.index}, s.stages,
                             s.microbatches)] = 1;
          on_event(r, ptr[ur]);
        }
        ++ptr[ur];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed)  // run_simulation ran this schedule to the end
      throw std::logic_error("schedule '" + s.name + "': replaying the simulation deadlocked where it had not");
  }
}

}  // namespace

SimResult simulate(const Schedule& s, const CostModel& costs) {
  SimResult out;
  out.timeline.schedule = s.name;
  out.timeline.ranks = s.ranks;
  out.timeline.microbatches = s.microbatches_per_step;
  out.timeline.total_microbatches = s.microbatches;
  out.timeline.virtual_stages = s.virtual_stages_per_rank();
  out.timeline.unit = "units";
  std::size_t total = 0;
  for (const auto& row : s.actions) total += row.size();
  out.timeline.events.reserve(total);
  std::vector<double> skip_at;
  costs.check(s.stages);
  MetricsSink sink(s, costs);
  run_simulation(s, costs, skip_at, [&](int r, const Action& a, double start, double end) {
    out.timeline.events.push_back(TimedAction{r, a, start, end});
    sink(r, a, start, end);
  });
  out.metrics = sink.finish();
  if (!s.skips.empty()) {
    const std::vector<double> peak = peak_memory_with_skips(
        s, costs,
        [&](auto&& visit) {
          for (const TimedAction& e : out.timeline.events) visit(e.rank, e.action, e.start);
        },
        skip_at);
    for (int r = 0; r < s.ranks; ++r)
      out.metrics.per_rank[static_cast<std::size_t>(r)].peak_memory = peak[static_cast<std::size_t>(r)];
  }
  return out;
}

Metrics simulate_metrics(const Schedule& s, const CostModel& costs) {
  if (!s.skips.empty()) return simulate(s, costs).metrics;  // the skips' memory needs the timeline
  std::vector<double> skip_at;
  costs.check(s.stages);
  MetricsSink sink(s, costs);
  run_simulation(s, costs, skip_at, [&](int r, const Action& a, double start, double end) { sink(r, a, start, end); });
  return sink.finish();
}

SimTimeline::SimTimeline(const Schedule& schedule, const CostModel& costs)
    : schedule_(&schedule), costs_(costs) {
  header_.schedule = schedule.name;
  header_.ranks = schedule.ranks;
  header_.microbatches = schedule.microbatches_per_step;
  header_.total_microbatches = schedule.microbatches;
  header_.virtual_stages = schedule.virtual_stages_per_rank();
  header_.unit = "units";
  start_.resize(static_cast<std::size_t>(schedule.ranks));
}

void SimTimeline::by_rank(const Visit& visit) const {
  // A rank's events are in start order in its own order: each starts when the one before it ended.
  for (std::size_t r = 0; r < start_.size(); ++r) {
    std::size_t k = 0;
    for (const Action& a : schedule_->actions[r]) {
      if (is_comm(a.kind)) continue;
      const double start = start_[r][k++];
      visit(TimedAction{static_cast<int>(r), a, start, start + costs_.duration(a)});
    }
  }
}

void SimTimeline::by_start(const Visit& visit) const {
  // The stable sort of the run's events by start and end, without an index per event: the run is
  // replayed (replay_run), its events (in the order it runs them) go into a heap on (start, end, run order), and the
  // heap gives up its first while no event still to come can precede it. Every event still to come on a
  // rank starts at or after that rank's next stored start (its events are in start order, by_rank), so
  // one that starts before the least of those (`low`), or at it and ends there too, is final.
  struct Event {
    double start, end;
    std::uint64_t order;
    int rank;
    std::uint32_t pos;  // in the rank's list
  };
  const auto later = [](const Event& a, const Event& b) {
    if (a.start != b.start) return a.start > b.start;
    if (a.end != b.end) return a.end > b.end;
    return a.order > b.order;
  };
  std::priority_queue<Event, std::vector<Event>, decltype(later)> pending(later);
  // A tournament tree over the ranks' next starts (infinity once a rank is done); tree[1] is the least.
  const std::size_t n = start_.size();
  std::size_t leaves = 1;
  while (leaves < std::max<std::size_t>(n, 1)) leaves *= 2;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> tree(2 * leaves, inf);
  std::vector<std::size_t> next(n, 0);  // per rank: its events run so far
  const auto set_leaf = [&](std::size_t r) {
    std::size_t i = leaves + r;
    tree[i] = next[r] < start_[r].size() ? start_[r][next[r]] : inf;
    for (i /= 2; i >= 1; i /= 2) tree[i] = std::min(tree[2 * i], tree[2 * i + 1]);
  };
  for (std::size_t r = 0; r < n; ++r) set_leaf(r);
  const auto emit = [&](const Event& e) {
    visit(TimedAction{e.rank, schedule_->actions[static_cast<std::size_t>(e.rank)][e.pos], e.start, e.end});
  };
  std::uint64_t ran = 0;
  replay_run(*schedule_, [&](int r, std::size_t at) {
    const auto ur = static_cast<std::size_t>(r);
    const double start = start_[ur][next[ur]];
    pending.push(Event{start, start + costs_.duration(schedule_->actions[ur][at]), ran++, r,
                       static_cast<std::uint32_t>(at)});
    ++next[ur];
    set_leaf(ur);
    const double low = tree[1];
    while (!pending.empty() && (pending.top().start < low || (pending.top().start == low && pending.top().end <= low))) {
      emit(pending.top());
      pending.pop();
    }
  });
  for (; !pending.empty(); pending.pop()) emit(pending.top());
}

CompactSimResult simulate_compact(const Schedule& s, const CostModel& costs) {
  CompactSimResult out{SimTimeline(s, costs), Metrics{}};
  for (int r = 0; r < s.ranks; ++r) {
    std::size_t n = 0;
    for (const Action& a : s.actions[static_cast<std::size_t>(r)]) n += is_comm(a.kind) ? 0 : 1;
    out.timeline.start_[static_cast<std::size_t>(r)].reserve(n);
  }
  std::vector<double> skip_at;
  costs.check(s.stages);
  MetricsSink sink(s, costs);
  run_simulation(s, costs, skip_at, [&](int r, const Action& a, double start, double end) {
    out.timeline.start_[static_cast<std::size_t>(r)].push_back(start);
    sink(r, a, start, end);
  });
  out.metrics = sink.finish();
  if (!s.skips.empty()) {
    const std::vector<double> peak = peak_memory_with_skips(
        s, costs,
        [&](auto&& visit) {
          out.timeline.by_rank([&](const TimedAction& e) { visit(e.rank, e.action, e.start); });
        },
        skip_at);
    for (int r = 0; r < s.ranks; ++r)
      out.metrics.per_rank[static_cast<std::size_t>(r)].peak_memory = peak[static_cast<std::size_t>(r)];
  }
  return out;
}

}  // namespace pipetrain

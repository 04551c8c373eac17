#include "pipetrain/core/generators.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <queue>
#include <sstream>

#include "pipetrain/core/config.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/simulate.h"

namespace pipetrain {
namespace {

constexpr long long kMaxActions = 20'000'000;  // guards against sizes that would exhaust memory

std::string fmt_int(long long v) { return std::to_string(v); }

void check_sizes(const char* name, int p, int m, int v, int steps) {
  if (p < 1)
    throw UsageError(std::string(name) + ": stages must be >= 1, got " + fmt_int(p) + ": use --stages 1 or more");
  if (m < 1)
    throw UsageError(std::string(name) + ": micro-batches must be >= 1, got " + fmt_int(m) +
                     ": use --microbatches 1 or more");
  if (v < 1)
    throw UsageError(std::string(name) + ": virtual stages must be >= 1, got " + fmt_int(v) +
                     ": use --virtual 1 or more");
  if (steps < 1)
    throw UsageError(std::string(name) + ": steps must be >= 1, got " + fmt_int(steps) + ": use --steps 1 or more");
  const long long total = 3LL * p * v * m * steps;
  if (total > kMaxActions)
    throw UsageError(std::string(name) + ": " + fmt_int(p) + " stages x " + fmt_int(v) + " virtual x " + fmt_int(m) +
                     " micro-batches x " + fmt_int(steps) + " steps would need about " + fmt_int(total) +
                     " actions, more than the " + fmt_int(kMaxActions) + " supported: use fewer");
}

Schedule skeleton(const char* name, int p, int m, int v, int steps) {
  Schedule s;
  s.name = name;
  s.ranks = p;
  s.stages = p * v;
  s.microbatches = m * steps;
  s.microbatches_per_step = m;
  s.synchronous = true;
  s.stage_rank.resize(static_cast<std::size_t>(p * v));
  for (int st = 0; st < p * v; ++st) s.stage_rank[static_cast<std::size_t>(st)] = st % p;
  s.actions.resize(static_cast<std::size_t>(p));
  return s;
}

Action F(int stage, int micro) { return {ActionKind::F, stage, micro}; }
Action B(int stage, int micro) { return {ActionKind::B, stage, micro}; }
Action W(int stage, int micro) { return {ActionKind::W, stage, micro}; }
Action BW(int stage, int micro) { return {ActionKind::BW, stage, micro}; }
Action Step(int stage, int k) { return {ActionKind::Step, stage, k}; }

// 1F1B order of one stage over micro-batches [base, base + count) with `warmup` warm-up forwards; when
// `step_every` > 0 a Step follows the backward of every `step_every`-th micro-batch.
void one_f_one_b_rank(std::vector<Action>& out, int stage, int base, int count, int warmup, int step_every) {
  auto backward = [&](int i) {
    out.push_back(BW(stage, base + i));
    if (step_every > 0 && (base + i + 1) % step_every == 0) out.push_back(Step(stage, (base + i) / step_every));
  };
  for (int i = 0; i < warmup; ++i) out.push_back(F(stage, base + i));
  for (int k = 0; k < count - warmup; ++k) {
    out.push_back(F(stage, base + warmup + k));
    backward(k);
  }
  for (int k = count - warmup; k < count; ++k) backward(k);
}

// ---------------------------------------------------------------------------------------------------
// Greedy list scheduler for the zero-bubble family. Time advances by events; whenever a rank is free it
// picks, by the policy's priority, among the actions whose inputs have arrived:
//   B  of the oldest micro-batch whose output gradient has arrived,
//   F  of the next micro-batch, if its input has arrived and the memory limit allows one more,
//   W  of a micro-batch whose B is done (FIFO or LIFO).
// A rank with nothing ready sleeps until a token it waits for arrives.
struct GreedyPolicy {
  bool forward_first = false;  // F before B when both are ready
  bool w_lifo = false;         // pop the newest pending W first
  bool w_before_f = false;     // W before F (keeps memory low at the price of latency)
};

std::vector<std::vector<Action>> greedy_zero_bubble(int p, int m, const CostModel& costs, double memory_limit,
                                                    const GreedyPolicy& policy) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> act_ready(static_cast<std::size_t>(p), std::vector<double>(static_cast<std::size_t>(m), inf));
  std::vector<std::vector<double>> grad_ready = act_ready;  // Grad(s,i) available to stage s-1 at this time
  std::vector<std::vector<Action>> order(static_cast<std::size_t>(p));
  std::vector<int> next_f(static_cast<std::size_t>(p), 0), next_b(static_cast<std::size_t>(p), 0);
  std::vector<std::deque<int>> pending_w(static_cast<std::size_t>(p));
  std::vector<double> mem(static_cast<std::size_t>(p), 0.0), free_at(static_cast<std::size_t>(p), 0.0);
  std::vector<int> done(static_cast<std::size_t>(p), 0);
  const double eps = 1e-9;

  using Event = std::pair<double, int>;  // (time, rank) decision point
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events;
  for (int r = 0; r < p; ++r) events.push({0.0, r});
  const int total_per_rank = 3 * m;
  int finished_ranks = 0;

  while (!events.empty() && finished_ranks < p) {
    const double t = events.top().first;  // not a structured binding: the lambdas below capture r, which
    const int r = events.top().second;     // C++17 (and clang) allow only for plain variables
    events.pop();
    const auto ur = static_cast<std::size_t>(r);
    if (free_at[ur] > t + eps || done[ur] == total_per_rank) continue;
    const StageCost& c = costs.stage[ur];
    const double comm_in = costs.comm;
    // Which candidates are ready at time t?
    const int fi = next_f[ur];
    const bool f_ready = fi < m && (r == 0 || act_ready[ur - 1][static_cast<std::size_t>(fi)] + comm_in <= t + eps) &&
                         mem[ur] + c.activation <= memory_limit + eps;
    const int bi = next_b[ur];
    const bool b_ready = bi < fi && (r == p - 1 || grad_ready[ur + 1][static_cast<std::size_t>(bi)] + comm_in <= t + eps);
    const bool w_ready = !pending_w[ur].empty();
    Action chosen;
    bool have = false;
    auto take_f = [&] { chosen = F(r, fi); have = true; };
    auto take_b = [&] { chosen = B(r, bi); have = true; };
    auto take_w = [&] {
      const int wi = policy.w_lifo ? pending_w[ur].back() : pending_w[ur].front();
      chosen = W(r, wi);
      have = true;
    };
    if (policy.forward_first) {
      if (f_ready) take_f(); else if (b_ready) take_b(); else if (w_ready) take_w();
    } else if (policy.w_before_f) {
      if (b_ready) take_b(); else if (w_ready) take_w(); else if (f_ready) take_f();
    } else {
      if (b_ready) take_b(); else if (f_ready) take_f(); else if (w_ready) take_w();
    }
    if (!have) {
      if (fi < m && mem[ur] + c.activation > memory_limit + eps && bi >= fi && pending_w[ur].empty())
        throw UsageError("memory limit " + std::to_string(memory_limit) +
                         " is below one micro-batch's activation memory on stage " + std::to_string(r) + " (" +
                         std::to_string(c.activation) + "): raise --memory-limit");
      continue;  // sleep until a token arrives (pushed by its producer)
    }
    const double end = t + costs.duration(chosen);
    order[ur].push_back(chosen);
    free_at[ur] = end;
    ++done[ur];
    if (done[ur] == total_per_rank) ++finished_ranks;
    mem[ur] += costs.memory_delta(chosen);
    events.push({end, r});
    if (chosen.kind == ActionKind::F) {
      act_ready[ur][static_cast<std::size_t>(fi)] = end;
      ++next_f[ur];
      if (r + 1 < p) events.push({end + comm_in, r + 1});
    } else if (chosen.kind == ActionKind::B) {
      grad_ready[ur][static_cast<std::size_t>(bi)] = end;
      ++next_b[ur];
      pending_w[ur].push_back(bi);
      if (r > 0) events.push({end + comm_in, r - 1});
    } else {
      if (policy.w_lifo) pending_w[ur].pop_back(); else pending_w[ur].pop_front();
    }
  }
  if (finished_ranks < p) throw std::logic_error("greedy zero-bubble scheduler stalled (a bug): please report");
  return order;
}

Schedule greedy_schedule(const char* name, int p, int m, const CostModel& costs, double memory_limit,
                         const std::vector<GreedyPolicy>& policies, int steps) {
  Schedule best;
  double best_span = std::numeric_limits<double>::infinity(), best_makespan = best_span;
  for (const GreedyPolicy& policy : policies) {
    auto one_step = greedy_zero_bubble(p, m, costs, memory_limit, policy);
    Schedule s = skeleton(name, p, m, 1, steps);
    for (int k = 0; k < steps; ++k)
      for (int r = 0; r < p; ++r) {
        for (Action a : one_step[static_cast<std::size_t>(r)]) {
          a.index += k * m;
          s.actions[static_cast<std::size_t>(r)].push_back(a);
        }
        s.actions[static_cast<std::size_t>(r)].push_back(Step(r, k));
      }
    const SimResult sim = simulate(s, costs);
    const double span = sim.metrics.max_bubble();
    if (span < best_span - 1e-9 || (span < best_span + 1e-9 && sim.metrics.makespan < best_makespan - 1e-9)) {
      best_span = span;
      best_makespan = sim.metrics.makespan;
      best = std::move(s);
    }
  }
  return best;
}

CostModel costs_or_unit(const CostModel& costs, int p) {
  if (costs.stage.empty()) return CostModel::uniform(p, StageCost{});
  CostModel c = costs;
  if (c.stage.size() == 1) c.stage.assign(static_cast<std::size_t>(p), c.stage[0]);
  c.check(p);
  return c;
}

}  // namespace

Schedule gpipe(int p, int m, int steps) {
  check_sizes("gpipe", p, m, 1, steps);
  Schedule s = skeleton("gpipe", p, m, 1, steps);
  for (int k = 0; k < steps; ++k)
    for (int r = 0; r < p; ++r) {
      auto& out = s.actions[static_cast<std::size_t>(r)];
      for (int i = 0; i < m; ++i) out.push_back(F(r, k * m + i));
      for (int i = m - 1; i >= 0; --i) out.push_back(BW(r, k * m + i));
      out.push_back(Step(r, k));
    }
  return s;
}

Schedule one_f_one_b(int p, int m, int steps) {
  check_sizes("1f1b", p, m, 1, steps);
  Schedule s = skeleton("1f1b", p, m, 1, steps);
  for (int k = 0; k < steps; ++k)
    for (int r = 0; r < p; ++r) {
      auto& out = s.actions[static_cast<std::size_t>(r)];
      one_f_one_b_rank(out, r, k * m, m, std::min(p - 1 - r, m), 0);
      out.push_back(Step(r, k));
    }
  return s;
}

Schedule interleaved(int p, int m, int v, int steps) {
  check_sizes("interleaved", p, m, v, steps);
  if (m % p != 0) {
    const int lo = std::max(p, m / p * p), hi = (m / p + 1) * p;
    throw UsageError("interleaved needs the micro-batches to be a multiple of the stages: m=" + fmt_int(m) +
                     " is not divisible by p=" + fmt_int(p) + ": use --microbatches " + fmt_int(lo) +
                     (lo != hi ? " or " + fmt_int(hi) : std::string()));
  }
  Schedule s = skeleton("interleaved", p, m, v, steps);
  const int tasks = m * v;  // chunk-tasks per rank per step, each direction
  for (int k = 0; k < steps; ++k)
    for (int r = 0; r < p; ++r) {
      auto& out = s.actions[static_cast<std::size_t>(r)];
      auto chunk_fwd = [&](int j) { return (j % (p * v)) / p; };
      auto micro = [&](int j) { return k * m + (j / (p * v)) * p + (j % p); };
      auto fwd = [&](int j) { return F(chunk_fwd(j) * p + r, micro(j)); };
      auto bwd = [&](int j) { return BW((v - 1 - chunk_fwd(j)) * p + r, micro(j)); };
      const int warmup = m == p ? tasks : std::min(2 * (p - 1 - r) + (v - 1) * p, tasks);
      for (int j = 0; j < warmup; ++j) out.push_back(fwd(j));
      for (int j = 0; j < tasks - warmup; ++j) {
        out.push_back(fwd(j + warmup));
        out.push_back(bwd(j));
      }
      for (int j = tasks - warmup; j < tasks; ++j) out.push_back(bwd(j));
      for (int c = 0; c < v; ++c) out.push_back(Step(c * p + r, k));
    }
  return s;
}

Schedule zb_h1(int p, int m, int steps) {
  check_sizes("zb-h1", p, m, 1, steps);
  Schedule s = skeleton("zb-h1", p, m, 1, steps);
  for (int k = 0; k < steps; ++k)
    for (int r = 0; r < p; ++r) {
      auto& out = s.actions[static_cast<std::size_t>(r)];
      const int base = k * m, w = std::min(p - 1 - r, m), rem = m - w;
      std::vector<int> wq;  // pending W passes, popped newest first as in the reference
      int next_b = 0;
      auto b_then_maybe_w = [&](bool run_w) {
        out.push_back(B(r, base + next_b));
        wq.push_back(next_b++);
        if (run_w) {
          out.push_back(W(r, base + wq.back()));
          wq.pop_back();
        }
      };
      for (int i = 0; i < w; ++i) out.push_back(F(r, base + i));
      for (int j = 0; j < rem; ++j) {
        out.push_back(F(r, base + w + j));
        b_then_maybe_w(j >= r);
      }
      for (int j = 0; j < w; ++j) b_then_maybe_w(rem + j >= r);
      while (!wq.empty()) {
        out.push_back(W(r, base + wq.back()));
        wq.pop_back();
      }
      out.push_back(Step(r, k));
    }
  return s;
}

Schedule zb_h2(int p, int m, const CostModel& costs, int steps) {
  check_sizes("zb-h2", p, m, 1, steps);
  // The limit counts whole micro-batches in flight (F done, W not done): a micro-batch keeps all its
  // memory until W, so at most 2p-1 of them live on any rank.
  CostModel c = costs_or_unit(costs, p);
  c.b_release_fraction = 0.0;
  double unit = 0;
  for (const StageCost& sc : c.stage) unit = std::max(unit, sc.activation);
  return greedy_schedule("zb-h2", p, m, c, (2 * p - 1) * unit, {GreedyPolicy{}}, steps);
}

Schedule zb_auto(int p, int m, const CostModel& costs, double memory_limit, int steps) {
  check_sizes("zb-auto", p, m, 1, steps);
  const CostModel c = costs_or_unit(costs, p);
  if (memory_limit < 0)
    throw UsageError("memory limit " + std::to_string(memory_limit) + " must be >= 0 (0 means p micro-batches)");
  double unit = 0;
  for (const StageCost& sc : c.stage) unit = std::max(unit, sc.activation);
  const double limit = memory_limit > 0 ? memory_limit * unit : p * unit;
  std::vector<GreedyPolicy> policies;
  for (int ff = 0; ff < 2; ++ff)
    for (int lifo = 0; lifo < 2; ++lifo)
      for (int wf = 0; wf < 2; ++wf)
        if (!(ff && wf)) policies.push_back(GreedyPolicy{ff == 1, lifo == 1, wf == 1});
  return greedy_schedule("zb-auto", p, m, c, limit, policies, steps);
}

Schedule pipedream(int p, int m, int steps) {
  check_sizes("pipedream", p, m, 1, steps);
  Schedule s = skeleton("pipedream", p, m, 1, steps);
  s.microbatches_per_step = 1;
  s.synchronous = false;
  const int total = m * steps;
  for (int r = 0; r < p; ++r)
    one_f_one_b_rank(s.actions[static_cast<std::size_t>(r)], r, 0, total, std::min(p - 1 - r, total), 1);
  return s;
}

Schedule two_bw(int p, int m, int steps) {
  check_sizes("2bw", p, m, 1, steps);
  if (m < p)
    throw UsageError("2bw needs at least as many micro-batches per step as stages so that two weight versions "
                     "suffice: m=" + fmt_int(m) + " < p=" + fmt_int(p) + ": use --microbatches " + fmt_int(p) +
                     " or more");
  Schedule s = skeleton("2bw", p, m, 1, steps);
  s.synchronous = false;
  const int total = m * steps;
  for (int r = 0; r < p; ++r)
    one_f_one_b_rank(s.actions[static_cast<std::size_t>(r)], r, 0, total, std::min(p - 1 - r, total), m);
  return s;
}

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names{"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2",
                                              "zb-auto", "pipedream", "2bw", "spectrain"};
  return names;
}

ScheduleTraits schedule_traits(const std::string& name) {
  ScheduleTraits t;
  if (name == "pipedream" || name == "spectrain") {
    t.synchronous = false;
    t.one_microbatch_per_step = true;
  } else if (name == "2bw") {
    t.synchronous = false;
  } else if (name == "interleaved") {
    t.virtual_stages = true;
  } else if (name == "zb-h1" || name == "zb-h2" || name == "zb-auto") {
    t.split_backward = true;
  } else if (name != "gpipe" && name != "1f1b") {
    generate(name, GeneratorOptions{});  // throws the list of valid names
    throw UsageError("schedule '" + name + "' has no traits defined (core/generators.cpp schedule_traits)");
  }
  return t;
}

Schedule round_robin(const std::string& base, const std::vector<int>& replication, int m, int steps) {
  if (base != "gpipe" && base != "1f1b")
    throw UsageError("stage replication runs with --schedule gpipe or 1f1b (round robin over the replicas), not '" +
                     base + "'");
  if (replication.empty()) throw UsageError("stage replication needs one count per stage, got none");
  const int stages = static_cast<int>(replication.size());
  int ranks = 0;
  for (int st = 0; st < stages; ++st) {
    const int r = replication[static_cast<std::size_t>(st)];
    if (r < 1)
      throw UsageError("stage " + fmt_int(st) + " has replication " + fmt_int(r) + ": every stage needs >= 1 replica");
    ranks += r;
  }
  check_sizes(base.c_str(), stages, m, 1, steps);
  Schedule s = skeleton(base == "gpipe" ? "gpipe-rr" : "1f1b-rr", stages, m, 1, steps);
  s.ranks = ranks;
  s.actions.assign(static_cast<std::size_t>(ranks), {});
  s.stage_replicas.resize(static_cast<std::size_t>(stages));
  int next = 0, downstream = ranks;  // downstream: the ranks of stages st..S-1
  for (int st = 0; st < stages; ++st) {
    const int r = replication[static_cast<std::size_t>(st)];
    for (int q = 0; q < r; ++q) s.stage_replicas[static_cast<std::size_t>(st)].push_back(next + q);
    s.stage_rank[static_cast<std::size_t>(st)] = next;
    const int in_flight = (downstream + r - 1) / r;
    for (int q = 0; q < r; ++q) {
      auto& row = s.actions[static_cast<std::size_t>(next + q)];
      for (int k = 0; k < steps; ++k) {
        std::vector<int> mine;
        for (int i = k * m; i < (k + 1) * m; ++i)
          if (i % r == q) mine.push_back(i);
        const int n = static_cast<int>(mine.size());
        const int warm = base == "gpipe" ? n : std::min(in_flight - 1, n);
        for (int j = 0; j < warm; ++j) row.push_back(F(st, mine[static_cast<std::size_t>(j)]));
        for (int j = warm; j < n; ++j) {
          row.push_back(F(st, mine[static_cast<std::size_t>(j)]));
          row.push_back(BW(st, mine[static_cast<std::size_t>(j - warm)]));
        }
        if (base == "gpipe")  // GPipe's drain: the newest micro-batch first, as the next stage returns them
          for (int j = n - 1; j >= 0; --j) row.push_back(BW(st, mine[static_cast<std::size_t>(j)]));
        else
          for (int j = std::max(0, n - warm); j < n; ++j) row.push_back(BW(st, mine[static_cast<std::size_t>(j)]));
        row.push_back(Step(st, k));
      }
    }
    next += r;
    downstream -= r;
  }
  return s;
}

Schedule generate(const std::string& name, const GeneratorOptions& o) {
  if (o.virtual_stages != 1 && name != "interleaved")
    throw UsageError("--virtual " + fmt_int(o.virtual_stages) + " applies only to --schedule interleaved, not '" +
                     name + "': drop --virtual or use interleaved");
  if (name == "gpipe") return gpipe(o.ranks, o.microbatches, o.steps);
  if (name == "1f1b") return one_f_one_b(o.ranks, o.microbatches, o.steps);
  if (name == "interleaved") return interleaved(o.ranks, o.microbatches, o.virtual_stages, o.steps);
  if (name == "zb-h1") return zb_h1(o.ranks, o.microbatches, o.steps);
  if (name == "zb-h2") return zb_h2(o.ranks, o.microbatches, o.costs, o.steps);
  if (name == "zb-auto") return zb_auto(o.ranks, o.microbatches, o.costs, o.memory_limit, o.steps);
  if (name == "pipedream") return pipedream(o.ranks, o.microbatches, o.steps);
  if (name == "2bw") return two_bw(o.ranks, o.microbatches, o.steps);
  if (name == "spectrain") {  // PipeDream's action list; the runtime predicts weights instead of stashing
    check_sizes("spectrain", o.ranks, o.microbatches, 1, o.steps);
    Schedule s = pipedream(o.ranks, o.microbatches, o.steps);
    s.name = "spectrain";
    return s;
  }
  std::string list;
  for (const auto& n : schedule_names()) list += (list.empty() ? "" : ", ") + n;
  throw UsageError("unknown schedule '" + name + "'" + did_you_mean(name, schedule_names()) + ": valid schedules are " +
                   list + " (UMPIPE is not a schedule but a plan: pipetrain plan --planner umpipe, then train --plan FILE)");
}

}  // namespace pipetrain

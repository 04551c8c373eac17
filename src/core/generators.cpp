#include "pipetrain/core/generators.h"
#include "pipetrain/core/looped.h"

#include <algorithm>
#include <array>
#include <deque>
#include <limits>
#include <queue>
#include <sstream>

#include "pipetrain/core/config.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/simulate.h"
#include "generators_detail.h"
#include "v_squeeze.h"

namespace pipetrain {
namespace {

constexpr long long kMaxActions = 20'000'000;  // guards against sizes that would exhaust memory

std::string fmt_int(long long v) { return std::to_string(v); }
std::string fmt_num(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

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

Schedule skeleton(const char* name, int p, int m, int v, int steps, std::vector<int> placement = {}) {
  Schedule s;
  s.name = name;
  s.ranks = p;
  s.stages = p * v;
  s.microbatches = m * steps;
  s.microbatches_per_step = m;
  s.synchronous = true;
  s.stage_rank = placement.empty() ? looped_placement(p, v) : std::move(placement);
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

// `memory_limit` is per rank, in the cost model's memory units (a count of micro-batches times the rank's
// own activation: a limit in the largest stage's units let a lighter stage hold more micro-batches than
// the count asked for, which the validator then refused).
std::vector<std::vector<Action>> greedy_zero_bubble(int p, int m, const CostModel& costs,
                                                    const std::vector<double>& memory_limit, const GreedyPolicy& policy) {
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
                         mem[ur] + c.activation <= memory_limit[ur] + eps;
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
      if (fi < m && mem[ur] + c.activation > memory_limit[ur] + eps && bi >= fi && pending_w[ur].empty())
        throw UsageError("memory limit " + fmt_num(memory_limit[ur] / c.activation) +
                         " micro-batches is below one micro-batch's activation memory on stage " + std::to_string(r) +
                         ": raise --memory-limit to 1 or more");
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

Schedule greedy_schedule(const char* name, int p, int m, const CostModel& costs,
                         const std::vector<double>& memory_limit, const std::vector<GreedyPolicy>& policies,
                         int steps) {
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

// The interleaved schedules walk the micro-batches in rounds of p.
void check_rounds(const char* name, int p, int m) {
  if (m % p == 0) return;
  const int lo = std::max(p, m / p * p), hi = (m / p + 1) * p;
  throw UsageError(std::string(name) + " needs the micro-batches to be a multiple of the stages: m=" + fmt_int(m) +
                   " is not divisible by p=" + fmt_int(p) + ": use --microbatches " + fmt_int(lo) +
                   (lo != hi ? " or " + fmt_int(hi) : std::string()));
}

// Appends one step's actions of `ops` (micro-batches numbered from 0) to `out`, keeping those below m and
// shifting them to the step's first micro-batch `base`.
void append_step(std::vector<Action>& out, const std::vector<Action>& ops, int m, int base) {
  for (Action a : ops)
    if (a.index < m) {
      a.index += base;
      out.push_back(a);
    }
}

}  // namespace

CostModel detail::costs_or_unit(const CostModel& costs, int p) {
  if (costs.stage.empty()) return CostModel::uniform(p, StageCost{});
  CostModel c = costs;
  if (c.stage.size() == 1) c.stage.assign(static_cast<std::size_t>(p), c.stage[0]);
  c.check(p);
  return c;
}

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
  check_rounds("interleaved", p, m);
  Schedule s = skeleton("interleaved", p, m, v, steps);
  const int tasks = m * v;  // chunk-tasks per rank per step, each direction
  for (int k = 0; k < steps; ++k)
    for (int r = 0; r < p; ++r) {
      auto& out = s.actions[static_cast<std::size_t>(r)];
      auto chunk_fwd = [&](int j) { return (j % (p * v)) / p; };
      auto micro = [&](int j) { return k * m + (j / (p * v)) * p + (j % p); };
      auto fwd = [&](int j) { return F(chunk_fwd(j) * p + r, micro(j)); };
      auto bwd = [&](int j) { return BW((v - 1 - chunk_fwd(j)) * p + r, micro(j)); };
      // Megatron's warm-up; with one chunk per rank (v = 1) its plain 1F1B's (2(p-1-r) held up to 2p-1
      // micro-batches in flight for 1F1B's timing).
      const int warmup = v == 1 ? std::min(p - 1 - r, tasks)
                                : m == p ? tasks : std::min(2 * (p - 1 - r) + (v - 1) * p, tasks);
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
  CostModel c = detail::costs_or_unit(costs, p);
  c.b_release_fraction = 0.0;
  std::vector<double> limit;
  for (const StageCost& sc : c.stage) limit.push_back((2 * p - 1) * sc.activation);
  return greedy_schedule("zb-h2", p, m, c, limit, {GreedyPolicy{}}, steps);
}

Schedule zb_auto(int p, int m, const CostModel& costs, double memory_limit, int steps) {
  check_sizes("zb-auto", p, m, 1, steps);
  const CostModel c = detail::costs_or_unit(costs, p);
  if (memory_limit < 0)
    throw UsageError("memory limit " + std::to_string(memory_limit) + " must be >= 0 (0 means p micro-batches)");
  std::vector<double> limit;  // per rank: the count of micro-batches times its own activation
  for (const StageCost& sc : c.stage) limit.push_back((memory_limit > 0 ? memory_limit : p) * sc.activation);
  std::vector<GreedyPolicy> policies;
  for (int ff = 0; ff < 2; ++ff)
    for (int lifo = 0; lifo < 2; ++lifo)
      for (int wf = 0; wf < 2; ++wf)
        if (!(ff && wf)) policies.push_back(GreedyPolicy{ff == 1, lifo == 1, wf == 1});
  Schedule best = greedy_schedule("zb-auto", p, m, c, limit, policies, steps);
  // ZB-H1's handcrafted order is a candidate too wherever it fits the limit: none of the greedy's policies
  // finds it when m - p is odd, and it then beat them by one pass per step (p=3, m=6: 20 against 21).
  Schedule h1 = zb_h1(p, m, steps);
  h1.name = "zb-auto";
  const SimResult g = simulate(best, c), z = simulate(h1, c);
  bool fits = true;
  for (const RankMetrics& r : z.metrics.per_rank) {
    const double l = limit[static_cast<std::size_t>(r.rank)];
    fits = fits && r.peak_memory <= l + 1e-9 * std::max(1.0, l);
  }
  const double gs = g.metrics.max_bubble(), zs = z.metrics.max_bubble();
  if (fits && (zs < gs - 1e-9 || (zs < gs + 1e-9 && z.metrics.makespan < g.metrics.makespan - 1e-9))) return h1;
  return best;
}

std::vector<int> looped_placement(int p, int v) {
  if (p < 1 || v < 1)
    throw UsageError("a looped placement needs p >= 1 ranks and v >= 1 stages per rank, got p=" + fmt_int(p) +
                     " v=" + fmt_int(v));
  std::vector<int> out(static_cast<std::size_t>(p) * static_cast<std::size_t>(v));
  for (std::size_t st = 0; st < out.size(); ++st) out[st] = static_cast<int>(st % static_cast<std::size_t>(p));
  return out;
}

std::vector<int> v_placement(int p) {
  if (p < 1) throw UsageError("a V-shaped placement needs p >= 1 ranks, got p=" + fmt_int(p));
  std::vector<int> out(2 * static_cast<std::size_t>(p));
  for (int st = 0; st < 2 * p; ++st) out[static_cast<std::size_t>(st)] = st < p ? st : 2 * p - 1 - st;
  return out;
}

Schedule zb_v(int p, int m, int steps) {
  check_sizes("zb-v", p, m, 2, steps);
  Schedule s = skeleton("zb-v", p, m, 2, steps, v_placement(p));
  // The phases below need at least 2p-1 micro-batches to fill the V; with fewer, the order is laid out for
  // 2p-1 and the passes of the missing micro-batches are dropped (the rest keep a valid order).
  const int n = std::max(2 * p - 1, m);
  for (int r = 0; r < p; ++r) {
    const int c0 = r, c1 = 2 * p - 1 - r;  // the rank's two stages: going down, coming back up
    std::vector<Action> ops;
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    auto fbw = [&](int stage, int& f, int& b, bool forward) {
      if (forward) ops.push_back(F(stage, f++));
      ops.push_back(B(stage, b));
      ops.push_back(W(stage, b++));
    };
    for (int k = 0; k < 2 * (p - r) - 1; ++k) ops.push_back(F(c0, f0++));
    for (int k = 0; k < r; ++k) {
      ops.push_back(F(c1, f1++));
      ops.push_back(F(c0, f0++));
    }
    for (int k = 0; k < p - r; ++k) fbw(c1, f1, b1, true);
    while (f1 < f0 || f0 < n) {
      fbw(c0, f0, b0, f0 < n);
      fbw(c1, f1, b1, true);
    }
    int w0 = b0, w1 = b1;
    for (int k = 0; k < r; ++k) {
      ops.push_back(B(c0, b0++));
      ops.push_back(B(c1, b1++));
    }
    for (int k = 0; k < p - r; ++k) {
      ops.push_back(B(c0, b0++));
      ops.push_back(W(c0, w0++));
    }
    while (w1 < b1) ops.push_back(W(c1, w1++));
    while (w0 < b0) ops.push_back(W(c0, w0++));
    auto& out = s.actions[static_cast<std::size_t>(r)];
    for (int k = 0; k < steps; ++k) {
      append_step(out, ops, m, k * m);
      out.push_back(Step(c0, k));
      out.push_back(Step(c1, k));
    }
  }
  return s;
}

namespace {

// A V schedule built from one building block: `slot(r)` gives rank r's slots of micro-batch 0's passes
// {F chunk 0, F chunk 1, B chunk 1, B chunk 0}; micro-batch i runs 6 slots later than i-1. With `squeeze`
// the plan is then squeezed (v_squeeze.h). Each W takes the first free slot after its B, oldest first; the
// slot order is the rank's order.
using detail::VItem;
using detail::VPlan;

template <class SlotFn>
Schedule v_building_block(const char* name, int p, int m, int steps, SlotFn slot, bool squeeze) {
  check_sizes(name, p, m, 2, steps);
  Schedule s = skeleton(name, p, m, 2, steps, v_placement(p));
  VPlan plan(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    const std::array<int, 4> t = slot(r);
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < m; ++i)
        plan[static_cast<std::size_t>(r)][static_cast<std::size_t>(k)].push_back(6 * i + t[static_cast<std::size_t>(k)]);
  }
  if (squeeze) detail::v_squeeze(plan);
  for (int r = 0; r < p; ++r) {
    const int c0 = r, c1 = 2 * p - 1 - r;
    const std::array<Action, 4> pass{F(c0, 0), F(c1, 0), B(c1, 0), B(c0, 0)};
    std::vector<VItem> items;
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < m; ++i)
        items.push_back({plan[static_cast<std::size_t>(r)][static_cast<std::size_t>(k)][static_cast<std::size_t>(i)], r, k, i});
    std::sort(items.begin(), items.end());
    for (std::size_t k = 1; k < items.size(); ++k)
      if (items[k].slot == items[k - 1].slot)
        throw std::logic_error(std::string(name) + ": two passes share a slot on rank " + fmt_int(r) + " (a bug)");
    std::vector<Action> ops;
    std::deque<Action> pending_w;  // oldest first
    auto take_w = [&] {
      ops.push_back(pending_w.front());
      pending_w.pop_front();
    };
    int next_slot = 0;
    for (const VItem& it : items) {
      for (; next_slot < it.slot && !pending_w.empty(); ++next_slot) take_w();
      next_slot = it.slot + 1;
      Action a = pass[static_cast<std::size_t>(it.kind)];
      a.index = it.index;
      ops.push_back(a);
      if (a.kind == ActionKind::B) pending_w.push_back(W(a.stage, a.index));
    }
    while (!pending_w.empty()) take_w();
    auto& out = s.actions[static_cast<std::size_t>(r)];
    for (int k = 0; k < steps; ++k) {
      append_step(out, ops, m, k * m);
      out.push_back(Step(c0, k));
      out.push_back(Step(c1, k));
    }
  }
  return s;
}

}  // namespace

namespace {

// A building-block V schedule, squeezed where that helps: the squeeze shortens the step once the steady
// state exists (m >= 2p); with fewer micro-batches it can lengthen it, so the squeezed order is kept only
// where its unit-time step idles less (or as little and ends no later) than the building block's. Both
// keep the memory count of §4.6.2.
template <class SlotFn>
Schedule v_squeezed_if_better(const char* name, int p, int m, int steps, SlotFn block) {
  check_sizes(name, p, m, 2, steps);
  const CostModel unit = CostModel::uniform(2 * p, StageCost{}, 2);
  const Metrics a = simulate(v_building_block(name, p, m, 1, block, true), unit).metrics;
  const Metrics b = simulate(v_building_block(name, p, m, 1, block, false), unit).metrics;
  const bool squeeze = a.max_bubble() < b.max_bubble() - 1e-9 ||
                       (a.max_bubble() < b.max_bubble() + 1e-9 && a.makespan <= b.makespan + 1e-9);
  return v_building_block(name, p, m, steps, block, squeeze);
}

}  // namespace

Schedule v_half(int p, int m, int steps) {
  const int g = p % 2 == 0 ? 3 : 0;
  return v_squeezed_if_better("v-half", p, m, steps, [&](int r) {
    return std::array<int, 4>{2 * r, 3 * p - r - 2, 3 * p + g + 2 * r - 1, 6 * p + g - r - 2};
  });
}

Schedule v_min(int p, int m, int steps) {
  const int g = p % 3 == 0 ? 2 : 0;
  return v_squeezed_if_better("v-min", p, m, steps, [&](int r) {
    return std::array<int, 4>{r, 2 * p - 1 - r, 2 * p + g + r, 4 * p + g - r - 1};
  });
}

Schedule dualpipev(int p, int m, int steps) {
  check_sizes("dualpipev", p, m, 2, steps);
  if (m < 2 * p)
    throw UsageError("dualpipev needs at least two micro-batches per rank and V leg: m=" + fmt_int(m) + " < 2p=" +
                     fmt_int(2 * p) + ": use --microbatches " + fmt_int(2 * p) + " or more");
  Schedule s = skeleton("dualpipev", p, m, 2, steps, v_placement(p));
  for (int r = 0; r < p; ++r) {
    const int c0 = r, c1 = 2 * p - 1 - r;
    std::vector<Action> ops;
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    std::deque<Action> pending_w;  // split backwards whose W has not run, oldest first
    auto fwd = [&](int stage) { ops.push_back(F(stage, stage == c0 ? f0++ : f1++)); };
    auto bwd = [&](int stage, bool split) {  // split: B now, its W queued (zero-bubble style)
      const int i = stage == c0 ? b0++ : b1++;
      if (!split) {
        ops.push_back(BW(stage, i));
        return;
      }
      ops.push_back(B(stage, i));
      pending_w.push_back(W(stage, i));
    };
    auto weight = [&] {
      ops.push_back(pending_w.front());
      pending_w.pop_front();
    };
    for (int k = 0; k < 2 * (p - r - 1); ++k) fwd(c0);
    for (int k = 0; k < r + 1; ++k) {
      fwd(c0);
      fwd(c1);
    }
    for (int k = 0; k < p - r - 1; ++k) {
      bwd(c1, true);
      weight();
      fwd(c1);
    }
    // The steady state pairs a forward with a backward of the other leg: one paired slot (action.h).
    auto pair = [&](int f_stage, int b_stage, bool paired) {
      fwd(f_stage);
      ops.back().paired = paired;
      bwd(b_stage, false);
    };
    for (int k = 0; k < m - 2 * p + r + 1; ++k) {
      pair(c0, c1, !(k == 0 && r == p - 1));  // the turn's first round runs unpaired, as DeepSeek's does
      pair(c1, c0, true);
    }
    for (int k = 0; k < p - r - 1; ++k) {
      bwd(c1, false);
      pair(c1, c0, true);
    }
    bool split = false;  // the second half of these backwards defer their W
    for (int k = 0; k < r + 1; ++k) {
      if (k == (r + 1) / 2 && r % 2 == 1) split = true;
      bwd(c1, split);
      if (k == (r + 1) / 2 && r % 2 == 0) split = true;
      bwd(c0, split);
    }
    for (int k = 0; k < p - r - 1; ++k) {
      weight();
      bwd(c0, true);
    }
    while (!pending_w.empty()) weight();
    auto& out = s.actions[static_cast<std::size_t>(r)];
    for (int k = 0; k < steps; ++k) {
      append_step(out, ops, m, k * m);
      out.push_back(Step(c0, k));
      out.push_back(Step(c1, k));
    }
  }
  return s;
}

Schedule interleaved_zb(int p, int m, int v, int steps) {
  check_sizes("interleaved-zb", p, m, v, steps);
  check_rounds("interleaved-zb", p, m);
  Schedule s = skeleton("interleaved-zb", p, m, v, steps);
  const int tasks = m * v;
  for (int k = 0; k < steps; ++k)
    for (int r = 0; r < p; ++r) {
      auto& out = s.actions[static_cast<std::size_t>(r)];
      auto chunk_fwd = [&](int j) { return (j % (p * v)) / p; };
      auto micro = [&](int j) { return k * m + (j / (p * v)) * p + (j % p); };
      auto bwd_stage = [&](int j) { return (v - 1 - chunk_fwd(j)) * p + r; };
      const int warmup = std::min((v - 1) * p + (p - 1 - r), tasks);
      std::deque<int> pending_w;  // backward tasks whose W has not run, oldest first
      auto backward = [&](int j) {
        out.push_back(B(bwd_stage(j), micro(j)));
        pending_w.push_back(j);
        if (j >= r) {  // the first r W passes wait for the cool-down
          out.push_back(W(bwd_stage(pending_w.front()), micro(pending_w.front())));
          pending_w.pop_front();
        }
      };
      for (int j = 0; j < warmup; ++j) out.push_back(F(chunk_fwd(j) * p + r, micro(j)));
      for (int j = 0; j < tasks - warmup; ++j) {
        const int jf = j + warmup;
        out.push_back(F(chunk_fwd(jf) * p + r, micro(jf)));
        backward(j);
      }
      for (int j = tasks - warmup; j < tasks; ++j) backward(j);
      for (int j : pending_w) out.push_back(W(bwd_stage(j), micro(j)));
      for (int c = 0; c < v; ++c) out.push_back(Step(c * p + r, k));
    }
  return s;
}

Schedule looped_bfs(int p, int m, int v, int steps) {
  check_sizes("looped-bfs", p, m, v, steps);
  Schedule s = skeleton("looped-bfs", p, m, v, steps);
  for (int k = 0; k < steps; ++k)
    for (int r = 0; r < p; ++r) {
      auto& out = s.actions[static_cast<std::size_t>(r)];
      for (int c = 0; c < v; ++c)
        for (int i = 0; i < m; ++i) out.push_back(F(c * p + r, k * m + i));
      for (int c = v - 1; c >= 0; --c)
        for (int i = m - 1; i >= 0; --i) out.push_back(BW(c * p + r, k * m + i));
      for (int c = 0; c < v; ++c) out.push_back(Step(c * p + r, k));
    }
  return s;
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
  static const std::vector<std::string> names{"gpipe",  "1f1b",   "interleaved", "zb-h1",          "zb-h2",
                                              "zb-auto", "zb-v",  "v-half",      "v-min",          "dualpipev", "interleaved-zb",
                                              "looped-bfs", "pipedream", "2bw", "spectrain"};
  return names;
}

void refuse_looped_without_loops(const std::string& schedule, int virtual_stages, const std::string& virtual_name,
                                 const std::string& note) {
  if (virtual_stages != 1 || !schedule_traits(schedule).virtual_stages) return;
  const bool interleaved = schedule == "interleaved";
  throw UsageError("schedule '" + schedule + "' loops several stages over each rank, but " + virtual_name + " is 1" +
                   note + ", which gives " + (interleaved ? "plain 1F1B's order" : "it without a loop") + ": give " +
                   virtual_name + " 2 or more" + (interleaved ? ", or ask for 1f1b" : ""));
}

ScheduleTraits schedule_traits(const std::string& name) {
  ScheduleTraits t;
  if (name == "pipedream" || name == "spectrain") {
    t.synchronous = false;
    t.one_microbatch_per_step = true;
  } else if (name == "2bw") {
    t.synchronous = false;
  } else if (name == "interleaved" || name == "looped-bfs") {
    t.virtual_stages = true;
  } else if (name == "interleaved-zb") {
    t.virtual_stages = true;
    t.split_backward = true;
  } else if (name == "zb-h1" || name == "zb-h2" || name == "zb-auto") {
    t.split_backward = true;
  } else if (name == "zb-v" || name == "v-half" || name == "v-min" || name == "dualpipev") {
    t.split_backward = true;
    t.v_shape = true;
  } else if (name != "gpipe" && name != "1f1b") {
    generate(name, GeneratorOptions{});  // throws the list of valid names
    throw UsageError("schedule '" + name + "' has no traits defined (core/generators.cpp schedule_traits)");
  }
  return t;
}

int stages_per_rank(const std::string& name, int virtual_stages) {
  const ScheduleTraits t = schedule_traits(name);
  if (t.v_shape) {
    if (virtual_stages != 1 && virtual_stages != 2)
      throw UsageError("--schedule " + name + " holds two stages per rank (a V), not --virtual " +
                       fmt_int(virtual_stages) + ": drop --virtual (or give 2)");
    return 2;
  }
  if (t.virtual_stages) return virtual_stages;
  if (virtual_stages != 1) {
    std::string list;
    for (const auto& n : schedule_names())
      if (schedule_traits(n).virtual_stages) list += (list.empty() ? "" : ", ") + n;
    throw UsageError("--virtual " + fmt_int(virtual_stages) + " applies only to --schedule " + list + ", not '" + name +
                     "': drop --virtual or use one of those");
  }
  return 1;
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
        std::vector<int> mine;  // the step's micro-batches i with i mod r == q, in order (O(m / r), not O(m))
        for (int i = k * m + ((q - (k * m) % r) % r + r) % r; i < (k + 1) * m; i += r) mine.push_back(i);
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

void check_generator_options(const std::string& name, const GeneratorOptions& o) {
  if (name == "v-half" || name == "v-min") {  // generate's checks, then v_squeezed_if_better's
    if (o.virtual_stages != 1) stages_per_rank(name, o.virtual_stages);
    check_sizes(name.c_str(), o.ranks, o.microbatches, 2, o.steps);
    return;
  }
  (void)generate(name, o);
}

Schedule generate(const std::string& name, const GeneratorOptions& o) {
  if (o.virtual_stages != 1 && std::find(schedule_names().begin(), schedule_names().end(), name) != schedule_names().end())
    stages_per_rank(name, o.virtual_stages);  // throws for --virtual on a schedule without virtual stages
  if (name == "gpipe") return gpipe(o.ranks, o.microbatches, o.steps);
  if (name == "1f1b") return one_f_one_b(o.ranks, o.microbatches, o.steps);
  if (name == "interleaved") return interleaved(o.ranks, o.microbatches, o.virtual_stages, o.steps);
  if (name == "zb-h1") return zb_h1(o.ranks, o.microbatches, o.steps);
  if (name == "zb-h2") return zb_h2(o.ranks, o.microbatches, o.costs, o.steps);
  if (name == "zb-auto") return zb_auto(o.ranks, o.microbatches, o.costs, o.memory_limit, o.steps);
  if (name == "zb-v") return zb_v(o.ranks, o.microbatches, o.steps);
  if (name == "v-half") return v_half(o.ranks, o.microbatches, o.steps);
  if (name == "v-min") return v_min(o.ranks, o.microbatches, o.steps);
  if (name == "dualpipev") return dualpipev(o.ranks, o.microbatches, o.steps);
  if (name == "interleaved-zb") return interleaved_zb(o.ranks, o.microbatches, o.virtual_stages, o.steps);
  if (name == "looped-bfs") return looped_bfs(o.ranks, o.microbatches, o.virtual_stages, o.steps);
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

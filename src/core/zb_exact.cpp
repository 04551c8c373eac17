// Branch and bound for zero-bubble schedules of one step (docs/ALGORITHMS.md §4.4.5).
//
// A node is a prefix of the schedule in the order of start times: every rank has run its first nf
// forwards, nb input-gradient backwards and nw weight-gradient passes, each at the earliest time its
// inputs and its rank allowed (as the simulator runs it). A child appends one pass to one rank. To reach
// every set of per-rank orders once, passes are appended in non-decreasing (start, rank): a pass that
// would start before the last appended one (or at the same time on a lower rank) is not a child here, it
// belongs to the branch that placed it earlier. Each child is bounded from below (earliest starts from
// the dependency chains, then per rank the work still to do after each release time plus the shortest
// chain that must follow it) and cut when it cannot beat the best schedule found.
#include "pipetrain/core/zb_exact.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <sstream>

#include <fmt/format.h>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/simulate.h"
#include "generators_detail.h"

namespace pipetrain {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
enum Kind : int { kF = 0, kB = 1, kW = 2 };

struct Move {
  int rank;
  int kind;
};

struct Candidate {
  double start;
  int pref;  // B before F before W at equal starts: the order that finds good schedules early
  int rank;
  int kind;
};

class Search {
 public:
  // `limit`: micro-batches of activations each rank may hold (each rank in its own stage's units).
  Search(int p, int m, const CostModel& c, double limit, long long budget) : p_(p), m_(m), budget_(budget) {
    const auto up = static_cast<std::size_t>(p);
    f_.resize(up);
    b_.resize(up);
    w_.resize(up);
    act_.resize(up);
    step_.resize(up);
    double total = 0;
    for (std::size_t r = 0; r < up; ++r) {
      const StageCost& sc = c.stage[r];
      f_[r] = sc.f;
      b_[r] = sc.b;
      w_[r] = sc.w;
      act_[r] = sc.activation;
      step_[r] = c.step + (c.stage_step.empty() ? 0.0 : c.stage_step[r]);
      total += m * (sc.f + sc.b + sc.w) + step_[r];
    }
    comm_ = c.comm;
    release_b_ = c.b_release_fraction;
    limit_.resize(up);
    double largest = 0;
    for (std::size_t r = 0; r < up; ++r) {
      limit_[r] = limit * act_[r];
      largest = std::max(largest, limit_[r]);
    }
    eps_ = 1e-9 * std::max(1.0, total + 2.0 * p * m * comm_);
    mem_eps_ = 1e-9 * std::max(1.0, largest);
    nf_.assign(up, 0);
    nb_.assign(up, 0);
    nw_.assign(up, 0);
    free_.assign(up, 0.0);
    mem_.assign(up, 0.0);
    fend_.assign(up * static_cast<std::size_t>(m), 0.0);
    bend_ = fend_;
    wend_ = fend_;
    est_f_ = fend_;
    est_b_ = fend_;
    est_w_ = fend_;
    // Shortest chain of work that must follow a pass once it ends: a B's gradient still travels to stage
    // 0, whose W and step follow; a F's activation still travels to the last stage and back.
    tail_b_.resize(up);
    tail_f_.resize(up);
    for (int r = 0; r < p; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      tail_b_[ur] = std::max(w_[ur] + step_[ur], r > 0 ? comm_ + b_[ur - 1] + tail_b_[ur - 1] : 0.0);
    }
    for (int r = p - 1; r >= 0; --r) {
      const auto ur = static_cast<std::size_t>(r);
      tail_f_[ur] = std::max(b_[ur] + tail_b_[ur], r < p - 1 ? comm_ + f_[ur + 1] + tail_f_[ur + 1] : 0.0);
    }
  }

  void run(double incumbent) {
    best_ = incumbent;
    root_bound_ = bound();
    if (root_bound_ < best_ - eps_) dfs();
  }

  double best() const { return best_; }
  bool improved() const { return !best_path_.empty(); }
  const std::vector<Move>& best_path() const { return best_path_; }
  long long nodes() const { return nodes_; }
  bool proven() const { return !out_of_budget_; }
  // The smallest makespan any schedule could still have: the best found, or less where the budget left
  // subtrees unexplored.
  double lower_bound() const { return std::max(root_bound_, std::min(best_, open_bound_)); }

 private:
  static std::size_t z(int i) { return static_cast<std::size_t>(i); }
  std::size_t at(int r, int i) const { return z(r) * z(m_) + z(i); }

  // Start of rank r's next pass of `kind`, or -1 if its inputs or memory do not allow it yet.
  double start_of(int r, int kind) const {
    const auto ur = static_cast<std::size_t>(r);
    if (kind == kF) {
      const int i = nf_[ur];
      if (i >= m_ || (r > 0 && nf_[ur - 1] <= i) || mem_[ur] + act_[ur] > limit_[ur] + mem_eps_) return -1;
      return std::max(free_[ur], r > 0 ? fend_[at(r - 1, i)] + comm_ : 0.0);
    }
    if (kind == kB) {
      const int i = nb_[ur];
      if (i >= nf_[ur] || (r < p_ - 1 && nb_[ur + 1] <= i)) return -1;
      return std::max(free_[ur], r < p_ - 1 ? bend_[at(r + 1, i)] + comm_ : 0.0);
    }
    return nw_[ur] < nb_[ur] ? free_[ur] : -1;
  }

  struct Undo {
    double free, last_start;
    int last_rank;
  };

  Undo apply(int r, int kind, double start) {
    const auto ur = static_cast<std::size_t>(r);
    const Undo u{free_[ur], last_start_, last_rank_};
    double end = start;
    if (kind == kF) {
      end += f_[ur];
      fend_[at(r, nf_[ur]++)] = end;
      mem_[ur] += act_[ur];
    } else if (kind == kB) {
      end += b_[ur];
      bend_[at(r, nb_[ur]++)] = end;
      mem_[ur] -= act_[ur] * release_b_;
    } else {
      end += w_[ur];
      wend_[at(r, nw_[ur]++)] = end;
      mem_[ur] -= act_[ur] * (1.0 - release_b_);
    }
    free_[ur] = end;
    last_start_ = start;
    last_rank_ = r;
    ++placed_;
    path_.push_back({r, kind});
    return u;
  }

  void undo(int r, int kind, const Undo& u) {
    const auto ur = static_cast<std::size_t>(r);
    if (kind == kF) {
      --nf_[ur];
      mem_[ur] -= act_[ur];
    } else if (kind == kB) {
      --nb_[ur];
      mem_[ur] += act_[ur] * release_b_;
    } else {
      --nw_[ur];
      mem_[ur] += act_[ur] * (1.0 - release_b_);
    }
    free_[ur] = u.free;
    last_start_ = u.last_start;
    last_rank_ = u.last_rank;
    --placed_;
    path_.pop_back();
  }

  // Lower bound on the makespan of every completion of the current prefix. Earliest starts follow the
  // dependency chains, each rank's own order per kind and the memory limit, but ignore that a rank runs
  // one pass at a time across kinds; every pass not yet placed starts no earlier than the last placed
  // one (the order of the search). Then per rank: after any release time t, the passes released at or
  // after t still take their summed time, and the last of them is followed by its shortest tail.
  double bound() {
    double lb = 0;
    // End of pass i of a kind on rank r: its time if placed, else its earliest start plus its cost.
    auto end_f = [&](int r, int i) { return i < nf_[z(r)] ? fend_[at(r, i)] : est_f_[at(r, i)] + f_[z(r)]; };
    auto end_b = [&](int r, int i) { return i < nb_[z(r)] ? bend_[at(r, i)] : est_b_[at(r, i)] + b_[z(r)]; };
    auto end_w = [&](int r, int i) { return i < nw_[z(r)] ? wend_[at(r, i)] : est_w_[at(r, i)] + w_[z(r)]; };
    for (int i = 0; i < m_; ++i) {
      for (int r = 0; r < p_; ++r) {
        const auto ur = static_cast<std::size_t>(r);
        if (i < nf_[ur]) continue;
        double e = std::max(free_[ur], last_start_);
        if (i > nf_[ur]) e = std::max(e, end_f(r, i - 1));
        if (r > 0) e = std::max(e, end_f(r - 1, i) + comm_);
        // Memory: before F(i) the rank holds i micro-batches less what their B and W passes released, and
        // one more must fit; so enough of the oldest B (and W) passes must have ended.
        if (act_[ur] > 0) {
          const double over = i + 1 - limit_[ur] / act_[ur];
          const int need_b = static_cast<int>(std::ceil(over - 1e-9));
          if (need_b >= 1) e = std::max(e, end_b(r, need_b - 1));
          if (release_b_ < 1) {
            const int need_w = static_cast<int>(std::ceil((over - release_b_ * i) / (1 - release_b_) - 1e-9));
            if (need_w >= 1) e = std::max(e, end_w(r, need_w - 1));
          }
        }
        est_f_[at(r, i)] = e;
      }
      for (int r = p_ - 1; r >= 0; --r) {
        const auto ur = static_cast<std::size_t>(r);
        if (i < nb_[ur]) continue;
        double e = std::max({free_[ur], last_start_, end_f(r, i)});
        if (i > nb_[ur]) e = std::max(e, end_b(r, i - 1));
        if (r < p_ - 1) e = std::max(e, end_b(r + 1, i) + comm_);
        est_b_[at(r, i)] = e;
      }
      for (int r = 0; r < p_; ++r) {
        const auto ur = static_cast<std::size_t>(r);
        if (i < nw_[ur]) continue;
        double e = std::max({free_[ur], last_start_, end_b(r, i)});
        if (i > nw_[ur]) e = std::max(e, end_w(r, i - 1));
        est_w_[at(r, i)] = e;
      }
    }
    for (int r = 0; r < p_; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      lb = std::max(lb, free_[ur] + step_[ur]);
      items_.clear();
      for (int i = nf_[ur]; i < m_; ++i) items_.push_back({est_f_[at(r, i)], f_[ur], tail_f_[ur]});
      for (int i = nb_[ur]; i < m_; ++i) items_.push_back({est_b_[at(r, i)], b_[ur], tail_b_[ur]});
      for (int i = nw_[ur]; i < m_; ++i) items_.push_back({est_w_[at(r, i)], w_[ur], step_[ur]});
      if (items_.empty()) continue;
      std::sort(items_.begin(), items_.end(), [](const Item& a, const Item& b) { return a.est > b.est; });
      double work = 0, tail = kInf;
      for (const Item& it : items_) {
        work += it.dur;
        tail = std::min(tail, it.tail);
        lb = std::max({lb, it.est + work + tail, it.est + it.dur + it.tail});
      }
    }
    return lb;
  }

  void dfs() {
    ++nodes_;
    if ((nodes_ & 4095) == 0 && interrupt_) interrupt_();  // may throw: the search is abandoned
    if (placed_ == 3 * p_ * m_) {
      double span = 0;
      for (int r = 0; r < p_; ++r) span = std::max(span, free_[z(r)] + step_[z(r)]);
      if (span < best_ - eps_) {
        best_ = span;
        best_path_ = path_;
      }
      return;
    }
    std::vector<Candidate> cands;
    for (int r = 0; r < p_; ++r)
      for (int kind : {kB, kF, kW}) {
        const double s = start_of(r, kind);
        if (s < 0) continue;
        if (s < last_start_ - eps_ || (s <= last_start_ + eps_ && r < last_rank_)) continue;  // another branch's
        cands.push_back({s, kind == kB ? 0 : kind == kF ? 1 : 2, r, kind});
      }
    std::sort(cands.begin(), cands.end(), [](const Candidate& a, const Candidate& b) {
      if (a.start != b.start) return a.start < b.start;
      if (a.pref != b.pref) return a.pref < b.pref;
      return a.rank < b.rank;
    });
    for (const Candidate& c : cands) {
      const Undo u = apply(c.rank, c.kind, c.start);
      const double lb = bound();
      if (lb < best_ - eps_) {
        if (out_of_budget_) {
          open_bound_ = std::min(open_bound_, lb);  // left unexplored: its bound limits what we can claim
        } else if (nodes_ >= budget_) {
          out_of_budget_ = true;
          open_bound_ = std::min(open_bound_, lb);
        } else {
          dfs();
        }
      }
      undo(c.rank, c.kind, u);
    }
  }

  struct Item {
    double est, dur, tail;
  };

  int p_, m_;
  long long budget_;
  std::vector<double> f_, b_, w_, act_, step_, tail_f_, tail_b_;
  double comm_ = 0, release_b_ = 0, eps_ = 0, mem_eps_ = 0;
  std::vector<double> limit_;  // per rank, in the cost model's memory units
  std::vector<int> nf_, nb_, nw_;
  std::vector<double> free_, mem_, fend_, bend_, wend_, est_f_, est_b_, est_w_;
  double last_start_ = 0;
  int last_rank_ = 0, placed_ = 0;
  std::vector<Move> path_, best_path_;
  std::vector<Item> items_;
  double best_ = kInf, root_bound_ = 0, open_bound_ = kInf;
  long long nodes_ = 0;
  bool out_of_budget_ = false;

 public:
  std::function<void()> interrupt_;
};

// The generators' costs for p stages with the per-action overhead folded into F, B and W (the search
// times passes by those; the simulator adds the overhead to each of them, so both agree).
CostModel per_rank_costs(const CostModel& costs, int p) {
  CostModel c = detail::costs_or_unit(costs, p);
  for (StageCost& sc : c.stage) {
    sc.f += c.overhead;
    sc.b += c.overhead;
    sc.w += c.overhead;
  }
  c.overhead = 0;
  return c;
}

// One step's per-rank passes from a sequence of (rank, kind): the k-th forward of a rank is micro-batch
// k, and so for B and W.
std::vector<std::vector<Action>> orders_from(const std::vector<Move>& path, int p) {
  std::vector<std::vector<Action>> out(static_cast<std::size_t>(p));
  std::vector<std::array<int, 3>> count(static_cast<std::size_t>(p), {0, 0, 0});
  for (const Move& mv : path) {
    const auto ur = static_cast<std::size_t>(mv.rank);
    const ActionKind kind = mv.kind == kF ? ActionKind::F : mv.kind == kB ? ActionKind::B : ActionKind::W;
    out[ur].push_back({kind, mv.rank, count[ur][static_cast<std::size_t>(mv.kind)]++});
  }
  return out;
}

// The same passes as `s` (one step), with each rank's weight-gradient passes renumbered oldest first; W
// passes of one stage cost the same and release the same memory, so the timeline is unchanged.
std::vector<std::vector<Action>> orders_of(const Schedule& s) {
  std::vector<std::vector<Action>> out(static_cast<std::size_t>(s.ranks));
  for (int r = 0; r < s.ranks; ++r) {
    int w = 0;
    for (Action a : s.actions[static_cast<std::size_t>(r)]) {
      if (a.kind == ActionKind::Step) continue;
      if (a.kind == ActionKind::W) a.index = w++;
      out[static_cast<std::size_t>(r)].push_back(a);
    }
  }
  return out;
}

Schedule lay_out(const Schedule& like, const std::vector<std::vector<Action>>& one_step, int m, int steps) {
  Schedule s = like;
  s.microbatches = m * steps;
  for (auto& row : s.actions) row.clear();
  for (int k = 0; k < steps; ++k)
    for (int r = 0; r < s.ranks; ++r) {
      auto& row = s.actions[static_cast<std::size_t>(r)];
      for (Action a : one_step[static_cast<std::size_t>(r)]) {
        a.index += k * m;
        row.push_back(a);
      }
      row.push_back({ActionKind::Step, r, k});
    }
  return s;
}

}  // namespace

double ZbExactResult::gap_percent() const {
  if (makespan <= 0) return 0.0;
  return std::max(0.0, (greedy_makespan - makespan) / makespan * 100.0);
}

std::string ZbExactResult::summary() const {
  std::string status = proven ? "optimal" : fmt::format("not proven: the optimum is >= {:.3f}", lower_bound);
  return fmt::format("zb-auto greedy {:.3f}, exact {:.3f} ({}, {} nodes): the greedy is {:.2f}% longer", greedy_makespan,
                     makespan, status, nodes, gap_percent());
}

ZbExactResult zb_exact(int p, int m, const CostModel& costs, const ZbExactOptions& o) {
  if (p < 1) throw UsageError("zb-auto --exact: stages must be >= 1, got " + std::to_string(p) + ": use --stages 1 or more");
  if (m < 1)
    throw UsageError("zb-auto --exact: micro-batches must be >= 1, got " + std::to_string(m) +
                     ": use --microbatches 1 or more");
  if (static_cast<long long>(p) * m > kZbExactMaxRanksTimesMicrobatches)
    throw UsageError("zb-auto --exact searches small cases only: p=" + std::to_string(p) + " x m=" + std::to_string(m) +
                     " = " + std::to_string(static_cast<long long>(p) * m) + " passes of each kind per step, more than the " +
                     std::to_string(kZbExactMaxRanksTimesMicrobatches) + " supported: use fewer stages or micro-batches, "
                     "or zb-auto without --exact");
  if (o.steps < 1)
    throw UsageError("zb-auto --exact: steps must be >= 1, got " + std::to_string(o.steps) + ": use --steps 1 or more");
  if (o.node_budget < 1)
    throw UsageError("zb-auto --exact: the node budget must be >= 1, got " + std::to_string(o.node_budget) +
                     ": use --exact-nodes 1 or more");
  if (o.node_budget > kZbExactMaxNodes)
    throw UsageError("zb-auto --exact: the node budget " + std::to_string(o.node_budget) + " is over the maximum of " +
                     std::to_string(kZbExactMaxNodes) + " (tens of minutes of search): use --exact-nodes " +
                     std::to_string(kZbExactMaxNodes) + " or less; a search that stops at its budget still reports "
                     "the best schedule found and a lower bound");
  const CostModel c = per_rank_costs(costs, p);
  if (o.memory_limit < 0)
    throw UsageError("memory limit " + std::to_string(o.memory_limit) +
                     " must be >= 0 (0 means p micro-batches): use --memory-limit 0 or more");
  for (int r = 1; r < p; ++r)
    if (c.stage[static_cast<std::size_t>(r)].b + c.comm <= 0)
      throw UsageError("zb-auto --exact needs every input-gradient backward after stage 0 to take time, or transfers "
                       "to cost time: stage " + std::to_string(r) + " has B = 0 and --comm 0: give B > 0 or --comm > 0");
  // Micro-batches per rank, each rank in its own stage's activation (as zb_auto and the validator count).
  const double limit = o.memory_limit > 0 ? o.memory_limit : p;
  if (limit < 1)
    throw UsageError("memory limit " + std::to_string(o.memory_limit) + " is below one micro-batch's activation "
                     "memory: raise --memory-limit to 1 or more");

  const Schedule greedy = zb_auto(p, m, c, o.memory_limit, 1);
  const double greedy_makespan = simulate(greedy, c).metrics.makespan;
  Search search(p, m, c, limit, o.node_budget);
  search.interrupt_ = o.interrupt;
  search.run(o.start_from_greedy ? greedy_makespan : kInf);

  ZbExactResult out;
  const bool found = search.improved() && search.best() <= greedy_makespan;
  const auto one_step = found ? orders_from(search.best_path(), p) : orders_of(greedy);
  out.schedule = lay_out(greedy, one_step, m, o.steps);
  out.makespan = simulate(lay_out(greedy, one_step, m, 1), c).metrics.makespan;
  const double expected = found ? search.best() : greedy_makespan;
  if (std::abs(out.makespan - expected) > 1e-6 * std::max(1.0, out.makespan))
    throw std::logic_error(fmt::format("zb-auto --exact: the search's makespan {} differs from the simulator's {} (a bug)",
                                       expected, out.makespan));
  out.proven = search.proven();
  out.lower_bound = out.proven ? out.makespan : std::min(out.makespan, search.lower_bound());
  out.nodes = search.nodes();
  out.greedy_makespan = greedy_makespan;
  return out;
}

}  // namespace pipetrain

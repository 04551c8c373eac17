// The plan search and the plan file (plan/search.h).
#include "pipetrain/plan/search.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <unordered_map>

#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/read_file.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/costs.h"

namespace pipetrain {

bool better_candidate(const PlanCandidate& a, const PlanCandidate& b) {
  if (a.fits != b.fits) return a.fits;
  return a.makespan < b.makespan - 1e-9 || (std::abs(a.makespan - b.makespan) <= 1e-9 && a.m < b.m);
}

PlanCandidate simulate_candidate(const Profile& profile, const std::vector<int>& balance, const std::string& schedule,
                                 int m, double micro_batch, double bandwidth_bytes_per_ms, double latency_ms,
                                 double memory_limit_bytes, const std::vector<int>& replication,
                                 const MeasuredAllReduce* measured) {
  PlanCandidate c;
  c.schedule = schedule;
  c.m = m;
  c.balance = balance;
  c.replication = replication;
  StageCostOptions so;
  so.micro_batch = micro_batch;
  so.bandwidth_bytes_per_ms = bandwidth_bytes_per_ms;
  so.latency_ms = latency_ms;
  CostModel costs = stage_costs(profile, balance, so);  // each cut's transfer carries that cut's bytes
  const std::vector<double> static_bytes = stage_static_bytes(profile, balance);
  Schedule sch;
  if (replication.empty()) {
    GeneratorOptions g;
    g.ranks = static_cast<int>(balance.size());
    g.microbatches = m;
    g.costs = costs;
    sch = generate(schedule, g);
  } else {
    sch = round_robin(schedule, replication, m);
    std::vector<double> allreduce = replica_allreduce_ms(profile, balance, replication, bandwidth_bytes_per_ms, latency_ms);
    if (measured)
      for (std::size_t s = 0, layer = 0; s < balance.size(); ++s) {
        double params = 0;
        for (int k = 0; k < balance[s]; ++k, ++layer) params += profile.layers[layer].parameter_bytes;
        allreduce[s] = replication[s] > 1 ? measured->ms(params, replication[s]) : 0.0;
      }
    add_stage_step(costs, allreduce);
  }
  const Metrics metrics = simulate_metrics(sch, costs);  // the full simulation's metrics, without its timeline
  c.makespan = metrics.makespan;
  c.bubble = metrics.bubble_fraction;
  c.stage_peak_bytes.assign(balance.size(), 0.0);
  for (int rank = 0; rank < sch.ranks; ++rank) {
    const int stage = sch.first_stage_of(rank);
    const double bytes =
        static_bytes[static_cast<std::size_t>(stage)] + metrics.per_rank[static_cast<std::size_t>(rank)].peak_memory;
    c.peak_bytes = std::max(c.peak_bytes, bytes);
    double& at = c.stage_peak_bytes[static_cast<std::size_t>(stage)];
    at = std::max(at, bytes);
  }
  c.fits = memory_limit_bytes <= 0 || c.peak_bytes <= memory_limit_bytes;
  return c;
}

namespace {

bool is_balance_list(const std::string& kind) { return !kind.empty() && std::isdigit(static_cast<unsigned char>(kind[0])); }

// A balance given as a list must fit the profile and a stage count the search lays out: with
// --no-hybrid, min(ranks, layers) x a virtual count (1, --virtual-counts, 2 for the V shapes); else any
// count up to min(ranks, layers) x that.
void check_balance_lists(const Profile& profile, const PlanSearchOptions& o) {
  const int layers = static_cast<int>(profile.layers.size()), straight = std::min(o.ranks, layers);
  for (const std::string& kind : o.balance_kinds) {
    if (!is_balance_list(kind)) continue;
    const std::vector<int> balance = parse_balance(kind);
    check_balance(balance, layers);
    const int n = static_cast<int>(balance.size());
    std::vector<int> vs{1, 2};
    vs.insert(vs.end(), o.virtual_counts.begin(), o.virtual_counts.end());
    bool fits = false;
    std::string counts;
    for (int v : vs) {
      if (v < 1 || static_cast<long long>(straight) * v > layers) continue;
      if (counts.find(std::to_string(straight * v)) == std::string::npos)
        counts += (counts.empty() ? "" : ", ") + std::to_string(straight * v);
      fits = fits || (o.hybrid ? n % v == 0 && n / v <= straight : n == straight * v);
    }
    if (!fits)
      throw UsageError(fmt::format(
          "--balances {} lists {} stages, but {} plans for {} ranks have {} stages{}: give one layer count per stage "
          "of those{}", excerpt(kind), n, o.hybrid ? "the" : "--no-hybrid's", o.ranks,
          o.hybrid ? fmt::format("at most {}", straight) : counts,
          o.hybrid ? " (x the virtual counts)" : "",
          o.hybrid ? "" : ", or drop --no-hybrid (shorter pipelines, with replicas, may use it)"));
  }
}

void check_search_options(const Profile& profile, const PlanSearchOptions& o) {
  if (o.ranks < 1 || o.ranks > kMaxPlanRanks)
    throw UsageError(fmt::format("--ranks must be in 1..{}, got {}: give the number of devices to plan for", kMaxPlanRanks,
                                 o.ranks));
  if (profile.layers.empty())
    throw UsageError("the profile of " + excerpt(profile.model) + " has no layers: measure the model with pipetrain "
                     "profile, or list its layers");
  if (!(o.bandwidth_bytes_per_ms > 0))  // infinite: the bytes cost nothing (a latency-only profile)
    throw UsageError(fmt::format("the bandwidth must be > 0, got {} bytes/ms", o.bandwidth_bytes_per_ms));
  if (!(o.latency_ms >= 0)) throw UsageError(fmt::format("the latency must be >= 0, got {} ms", o.latency_ms));
  if (!o.allreduce.empty()) MeasuredAllReduce(o.allreduce, o.allreduce_ranks);  // refuses bad samples
  if (!(o.memory_limit_bytes >= 0)) throw UsageError(fmt::format("the memory limit must be >= 0, got {}", o.memory_limit_bytes));
  for (int m : o.microbatch_counts)
    if (m < 1) throw UsageError(fmt::format("micro-batch counts must be >= 1, got {}", m));
  for (int v : o.virtual_counts)
    if (v < 1) throw UsageError(fmt::format("virtual stage counts must be >= 1, got {}", v));
  if (o.schedules.empty()) throw UsageError("no schedule to consider: give --schedules, e.g. --schedules 1f1b");
  for (const std::string& name : o.schedules) schedule_traits(name);  // unknown names: UsageError listing them
  check_balance_lists(profile, o);
  const int layers = static_cast<int>(profile.layers.size());
  if (!o.hybrid && o.ranks > layers)
    throw UsageError(fmt::format("{} ranks but the profile has {} layers: a straight pipeline needs --ranks <= {} "
                                 "(or drop --no-hybrid: replicas of a shorter pipeline use the other ranks)",
                                 o.ranks, layers, layers));
}

// The network as contiguous groups of ranks, innermost first: ranks a and b talk over the links of the
// first level whose groups hold both.
struct Links {
  std::vector<long long> group;  // ranks per group at level k (M_0 x ... x M_k)
  std::vector<double> bw;        // bytes per ms over level k's links
  int level(long long a, long long b) const {
    for (std::size_t k = 0; k < group.size(); ++k)
      if (a / group[k] == b / group[k]) return static_cast<int>(k);
    return static_cast<int>(group.size()) - 1;
  }
  double fastest() const { return *std::max_element(bw.begin(), bw.end()); }
};

// How a schedule puts its S = p x v stages on its p ranks.
enum class Shape : std::uint8_t { straight, looped, v };
int rank_in_pipeline(Shape shape, int p, int stage) {
  switch (shape) {
    case Shape::looped: return stage % p;
    case Shape::v: return stage < p ? stage : 2 * p - 1 - stage;
    default: return stage;
  }
}
// The rank of replica j's copy of pipeline rank r: a replica's ranks side by side (pipeline-inner), or a
// pipeline rank's replicas side by side (replicas-inner).
long long global_rank(bool replicas_inner, int p, int d, int r, int j) {
  return replicas_inner ? static_cast<long long>(r) * d + j : static_cast<long long>(j) * p + r;
}

// Per-layer quantities at one micro-batch size, as prefix sums (stage sums in O(1)).
struct LayerSums {
  std::vector<double> f, bw, b, w, act;  // prefix sums over layers: forward, backward, its B and W shares, held bytes
};

// A (schedule, p, v, m) the search lays out; the Schedule is generated when a candidate is simulated.
struct Layout {
  std::string name;
  int p = 1, v = 1, m = 1, stages = 1;
  Shape shape = Shape::straight;
  bool cost_aware = false;  // zb-h2, zb-auto: generated per candidate from its costs
};

struct Cand {
  double lb = 0;        // lower bound on the makespan
  double mem_lb = 0;    // lower bound on the peak bytes per rank
  int layout = 0;       // index into layouts
  int balance = 0;      // index into the balances of the layout's stage count
  int d = 1;            // replicas
  int n = 1;            // samples per replica
  bool replicas_inner = false;
};

struct BalanceEntry {
  std::string kind, solver;
  std::vector<int> balance;
  std::vector<int> end;  // end[s]: one past the last layer of stage s
};

class Search {
 public:
  Search(const Profile& prof, const PlanSearchOptions& o, int64_t batch, const Links& links)
      : prof_(prof), o_(o), batch_(batch), links_(links), L_(static_cast<int>(prof.layers.size())) {
    static_bytes_.push_back(0);
    params_.push_back(0);
    optimizer_ms_.push_back(0);
    for (const LayerProfile& l : prof.layers) {
      static_bytes_.push_back(static_bytes_.back() + 2 * l.parameter_bytes + l.optimizer_bytes);
      params_.push_back(params_.back() + l.parameter_bytes);
      optimizer_ms_.push_back(optimizer_ms_.back() + l.optimizer_ms);
    }
    overhead_ = prof.runtime ? prof.runtime->overhead_ms : 0.0;
    if (!o.allreduce.empty()) measured_.emplace(o.allreduce, o.allreduce_ranks);
  }

  // Balances for S stages (kinds x solvers, duplicates dropped).
  const std::vector<BalanceEntry>& balances(int S) {
    auto it = balances_.find(S);
    if (it != balances_.end()) return it->second;
    std::vector<BalanceEntry> out;
    for (const std::string& kind : o_.balance_kinds)
      for (const char* solver : {"min-max", "block-partition"}) {
        if (kind == "uniform" && solver != std::string("min-max")) continue;
        // A balance given as a list (--balances 5,7,7,20) is for its own stage count only (checked once,
        // check_search_options): the plans with other stage counts do without it.
        if (is_balance_list(kind) && (solver != std::string("min-max") || parse_balance(kind).size() != std::size_t(S)))
          continue;
        BalanceEntry e{kind, solver, {}, {}};
        try {
          e.balance = plan_balance(prof_, S, kind, parse_balance_solver(solver));
        } catch (const UsageError&) {
          if (solver == std::string("block-partition")) continue;  // torchgpipe's heuristic may find none
          throw;
        }
        if (std::any_of(out.begin(), out.end(), [&](const BalanceEntry& x) { return x.balance == e.balance; })) continue;
        int at = 0;
        for (int n : e.balance) e.end.push_back(at += n);
        out.push_back(std::move(e));
      }
    return balances_[S] = std::move(out);
  }

  const LayerSums& sums(double b) {
    auto it = sums_.find(b);
    if (it != sums_.end()) return it->second;
    LayerSums ls;
    for (auto* v : {&ls.f, &ls.bw, &ls.b, &ls.w, &ls.act}) v->assign(1, 0.0);
    const double scale = b / prof_.micro_batch_size;
    for (const LayerProfile& l : prof_.layers) {
      const double bw = layer_time_at(l, prof_.micro_batch_size, b, false);
      const double share_w = l.bw_split && l.b_ms() + l.w_ms() > 0 ? l.w_ms() / (l.b_ms() + l.w_ms()) : 0.0;
      ls.f.push_back(ls.f.back() + layer_time_at(l, prof_.micro_batch_size, b, true));
      ls.bw.push_back(ls.bw.back() + bw);
      ls.b.push_back(ls.b.back() + bw * (1 - share_w));
      ls.w.push_back(ls.w.back() + bw * share_w);
      ls.act.push_back(ls.act.back() + l.held_bytes() * scale);
    }
    if (sums_.size() > 4096) sums_.clear();
    return sums_[b] = std::move(ls);
  }

  // The group all-reduce of `bytes` over `d` replicas whose slowest link is `level`: on the innermost
  // level as the profile measured it, where given (PlanSearchOptions::allreduce), else over the links.
  double replica_ms(double bytes, int d, int level) const {
    if (level == 0 && measured_) return measured_->ms(bytes, d);
    return group_allreduce_ms(bytes, d, links_.bw[static_cast<std::size_t>(level)], o_.latency_ms);
  }

  // Lower bounds on a candidate's makespan and peak bytes per rank (see search.h).
  void bound(Cand& c, const Layout& lay, const BalanceEntry& be) {
    const double b = static_cast<double>(c.n) / lay.m;
    const LayerSums& ls = sums(b);
    const int S = lay.stages, p = lay.p;
    const double scale = b / prof_.micro_batch_size, fast = links_.fastest();
    auto lo = [&](int s) { return s == 0 ? 0 : be.end[static_cast<std::size_t>(s - 1)]; };
    auto hi = [&](int s) { return be.end[static_cast<std::size_t>(s)]; };
    // busy and static bytes per pipeline rank; arrival at pipeline rank r (its lowest stage is r).
    rank_busy_.assign(static_cast<std::size_t>(p), 0.0);
    rank_step_.assign(static_cast<std::size_t>(p), 0.0);
    loss_charged_.assign(static_cast<std::size_t>(p), 0);
    rank_static_.assign(static_cast<std::size_t>(p), 0.0);
    rank_act_.assign(static_cast<std::size_t>(p), std::numeric_limits<double>::infinity());
    double path = 0;
    for (int s = 0; s < S; ++s) {
      const int r = rank_in_pipeline(lay.shape, p, s);
      const auto ur = static_cast<std::size_t>(r);
      const double F = ls.f[hi(s)] - ls.f[lo(s)], BW = ls.bw[hi(s)] - ls.bw[lo(s)], B = ls.b[hi(s)] - ls.b[lo(s)];
      rank_busy_[ur] += lay.m * (F + BW + 2 * overhead_);
      rank_static_[ur] += static_bytes_[hi(s)] - static_bytes_[lo(s)];
      rank_step_[ur] += optimizer_ms_[hi(s)] - optimizer_ms_[lo(s)];
      rank_act_[ur] = std::min(rank_act_[ur], ls.act[hi(s)] - ls.act[lo(s)]);
      if (c.d > 1) {
        const long long a0 = global_rank(c.replicas_inner, p, c.d, r, 0), a1 = global_rank(c.replicas_inner, p, c.d, r, c.d - 1);
        const int level = links_.level(a0, a1);
        // the rank's loss and count (once per rank, with its first stage), then each stage's gradients
        if (!loss_charged_[ur]) {
          loss_charged_[ur] = 1;
          rank_step_[ur] += replica_ms(kReplicaLossBytes, c.d, level);
        }
        rank_step_[ur] += replica_ms(params_[hi(s)] - params_[lo(s)], c.d, level);
      }
      path += F + B + 2 * overhead_;
      if (s + 1 < S && rank_in_pipeline(lay.shape, p, s + 1) != r) {
        const double bytes = prof_.layers[static_cast<std::size_t>(hi(s) - 1)].activation_bytes * scale;
        path += 2 * (o_.latency_ms + (std::isinf(fast) ? 0.0 : bytes / fast));
      }
    }
    double arrival = 0, best = path, mem = 0;
    for (int r = 0; r < p; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      best = std::max(best, arrival + rank_busy_[ur] + rank_step_[ur]);
      mem = std::max(mem, rank_static_[ur] + rank_act_[ur]);
      // the next rank's lowest stage is r + 1: its first input passes stage r (forward and transfer)
      if (r + 1 < p) {
        const double bytes = prof_.layers[static_cast<std::size_t>(hi(r) - 1)].activation_bytes * scale;
        arrival += ls.f[hi(r)] - ls.f[lo(r)] + overhead_ + o_.latency_ms + (std::isinf(fast) ? 0.0 : bytes / fast);
      }
    }
    c.lb = best;
    c.mem_lb = mem;
  }

  // The simulation of one candidate.
  PlanCandidate simulate(const Cand& c, const Layout& lay, const BalanceEntry& be) {
    const double b = static_cast<double>(c.n) / lay.m;
    const int S = lay.stages, p = lay.p;
    StageCostOptions so;
    so.micro_batch = b;
    so.bandwidth_bytes_per_ms = links_.fastest();
    so.latency_ms = o_.latency_ms;
    CostModel costs = stage_costs(prof_, be.balance, so);
    const double scale = b / prof_.micro_batch_size;
    costs.boundary_comm.assign(static_cast<std::size_t>(S > 0 ? S - 1 : 0), 0.0);
    for (int s = 0; s + 1 < S; ++s) {
      const int r0 = rank_in_pipeline(lay.shape, p, s), r1 = rank_in_pipeline(lay.shape, p, s + 1);
      if (r0 == r1) continue;
      int level = 0;  // the slowest link this boundary crosses in any replica
      if (links_.group.size() > 1)
        for (int j = 0; j < c.d && level + 1 < static_cast<int>(links_.group.size()); ++j)
          level = std::max(level, links_.level(global_rank(c.replicas_inner, p, c.d, r0, j),
                                               global_rank(c.replicas_inner, p, c.d, r1, j)));
      const double bytes = prof_.layers[static_cast<std::size_t>(be.end[static_cast<std::size_t>(s)] - 1)].activation_bytes * scale;
      const double bw = links_.bw[static_cast<std::size_t>(level)];
      costs.boundary_comm[static_cast<std::size_t>(s)] = transfer_ms(bytes, bw, o_.latency_ms);  // as stage_costs
    }
    std::vector<double> allreduce;  // per stage; empty for one replica
    if (c.d > 1) {
      // The runtime's step on each rank: one group all-reduce of all its stages' gradients (as they are:
      // the profile's parameter bytes), one of the step's loss and count (charged to the rank's first
      // stage).
      allreduce.assign(static_cast<std::size_t>(S), 0.0);
      std::vector<char> charged(static_cast<std::size_t>(p), 0);
      for (int s = 0; s < S; ++s) {
        const int r = rank_in_pipeline(lay.shape, p, s);
        const long long a0 = global_rank(c.replicas_inner, p, c.d, r, 0), a1 = global_rank(c.replicas_inner, p, c.d, r, c.d - 1);
        const int lo = s == 0 ? 0 : be.end[static_cast<std::size_t>(s - 1)], hi = be.end[static_cast<std::size_t>(s)];
        const int level = links_.level(a0, a1);
        double& step = allreduce[static_cast<std::size_t>(s)];
        step = replica_ms(params_[hi] - params_[lo], c.d, level);
        if (!charged[static_cast<std::size_t>(r)]) {
          charged[static_cast<std::size_t>(r)] = 1;
          step += replica_ms(kReplicaLossBytes, c.d, level);
        }
      }
      add_stage_step(costs, allreduce);  // after the optimizer's own time, where the profile has it
    }
    const Schedule& sch = schedule(lay, costs);
    const Metrics m = simulate_metrics(sch, costs);
    PlanCandidate out;
    out.kind = be.kind;
    out.solver = be.solver;
    out.schedule = lay.name;
    out.m = lay.m;
    out.balance = be.balance;
    out.makespan = m.makespan;
    out.bubble = m.bubble_fraction;
    out.stages = p;
    out.virtual_stages = lay.v;
    out.replicas = c.d;
    out.ranks_used = p * c.d;
    out.samples = c.n;
    if (links_.group.size() > 1) out.placement = c.replicas_inner ? "replicas-inner" : "pipeline-inner";
    std::vector<double> rank_static(static_cast<std::size_t>(p), 0.0), rank_step(static_cast<std::size_t>(p), 0.0);
    for (int s = 0; s < S; ++s) {
      const auto r = static_cast<std::size_t>(rank_in_pipeline(lay.shape, p, s));
      const int lo = s == 0 ? 0 : be.end[static_cast<std::size_t>(s - 1)], hi = be.end[static_cast<std::size_t>(s)];
      rank_static[r] += static_bytes_[hi] - static_bytes_[lo];
      if (!allreduce.empty()) rank_step[r] += allreduce[static_cast<std::size_t>(s)];
    }
    for (int r = 0; r < p; ++r) {
      out.peak_bytes = std::max(out.peak_bytes, rank_static[static_cast<std::size_t>(r)] +
                                                    m.per_rank[static_cast<std::size_t>(r)].peak_memory);
      out.allreduce_ms = std::max(out.allreduce_ms, rank_step[static_cast<std::size_t>(r)]);
    }
    for (int s = 0; s < S; ++s) {
      const auto r = static_cast<std::size_t>(rank_in_pipeline(lay.shape, p, s));
      out.stage_peak_bytes.push_back(rank_static[r] + m.per_rank[r].peak_memory);
    }
    out.fits = o_.memory_limit_bytes <= 0 || out.peak_bytes <= o_.memory_limit_bytes;
    return out;
  }

  // Whether the generator lays out this (schedule, p, v, m); cached.
  bool valid(const Layout& lay) {
    const std::string key = fmt::format("{}/{}/{}/{}", lay.name, lay.p, lay.v, lay.m);
    auto it = valid_.find(key);
    if (it != valid_.end()) return it->second;
    bool ok = true;
    try {
      if (!lay.cost_aware) {
        GeneratorOptions g;
        g.ranks = lay.p;
        g.microbatches = lay.m;
        g.virtual_stages = lay.v;
        check_generator_options(lay.name, g);  // the V blocks: without generating (they cost two simulations)
      }
    } catch (const UsageError&) {
      ok = false;
    }
    return valid_[key] = ok;
  }

 private:
  const Schedule& schedule(const Layout& lay, const CostModel& costs) {
    GeneratorOptions g;
    g.ranks = lay.p;
    g.microbatches = lay.m;
    g.virtual_stages = lay.v;
    if (lay.cost_aware) {
      g.costs = costs;
      scratch_ = generate(lay.name, g);
      return scratch_;
    }
    const std::string key = fmt::format("{}/{}/{}/{}", lay.name, lay.p, lay.v, lay.m);
    auto it = schedules_.find(key);
    if (it != schedules_.end()) return it->second;
    Schedule sch = generate(lay.name, g);
    std::size_t n = 0;
    for (const auto& row : sch.actions) n += row.size();
    if (cached_actions_ + n > (std::size_t{1} << 23)) {  // keep the cache to ~170 MB of actions
      schedules_.clear();
      cached_actions_ = 0;
    }
    cached_actions_ += n;
    return schedules_[key] = std::move(sch);
  }

  const Profile& prof_;
  const PlanSearchOptions& o_;
  int64_t batch_;
  const Links& links_;
  int L_;
  double overhead_ = 0;
  std::vector<double> static_bytes_, params_, optimizer_ms_;  // prefix sums over layers
  std::optional<MeasuredAllReduce> measured_;  // PlanSearchOptions::allreduce, sorted and fitted
  std::map<int, std::vector<BalanceEntry>> balances_;
  std::map<double, LayerSums> sums_;
  std::map<std::string, Schedule> schedules_;
  std::map<std::string, bool> valid_;
  std::size_t cached_actions_ = 0;
  Schedule scratch_;
  std::vector<double> rank_busy_, rank_step_, rank_static_, rank_act_;
  std::vector<char> loss_charged_;
};

Links make_links(const PlanSearchOptions& o, const PlannerOptions& po) {
  Links links;
  if (po.levels.empty()) {
    links.group.push_back(o.ranks);
    links.bw.push_back(o.bandwidth_bytes_per_ms);
    return links;
  }
  long long g = 1;
  for (const NetworkLevel& l : po.levels) {
    g *= l.machines;
    links.group.push_back(g);
    links.bw.push_back(l.bandwidth / 1e3);
  }
  return links;
}

}  // namespace

PlanSearchResult search_plans(const Profile& prof, const PlanSearchOptions& o) {
  check_search_options(prof, o);
  // Every plan is compared by time, and the report divides by it: a profile without compute time made
  // every candidate 0 ms and the speed-ups "infx".
  double total_ms = 0;
  for (const LayerProfile& l : prof.layers) total_ms += l.forward_ms + l.backward_ms;
  if (!(total_ms > 0))
    throw UsageError("the profile of " + excerpt(prof.model) + " has no compute time (every layer's forward_ms and "
                     "backward_ms is 0), so every plan would take 0 ms: measure the model with pipetrain profile, or "
                     "give the layers their times");
  PlanSearchResult res;
  const int R = o.ranks, L = static_cast<int>(prof.layers.size());
  res.hybrid = o.hybrid;
  res.replicated_may_win = o.replicated_may_win;
  res.rr_schedule = std::find(o.schedules.begin(), o.schedules.end(), "1f1b") != o.schedules.end();
  res.straight_stages = std::min(R, L);
  res.memory_limit_bytes = o.memory_limit_bytes;
  const int64_t batch = o.batch_size > 0 ? o.batch_size : static_cast<int64_t>(std::max(8, R)) * prof.micro_batch_size;
  res.batch_size = batch;
  const double limit = o.memory_limit_bytes;

  PlannerOptions po = o.pipedream;
  if (!po.levels.empty() && planner_devices(po.levels) != R) {
    std::string product;
    for (const NetworkLevel& l : po.levels) product += (product.empty() ? "" : " x ") + std::to_string(l.machines);
    // The levels describe the devices every plan is placed on; they must be the ranks planned for.
    throw UsageError(fmt::format("--level describes {} = {} devices but --ranks is {}: give --ranks {} (the product "
                                 "of the levels' MACHINES) or levels whose MACHINES multiply to {}",
                                 product, planner_devices(po.levels), R, planner_devices(po.levels), R));
  }
  const Links links = make_links(o, po);
  Search search(prof, o, batch, links);

  // The search space: layouts (schedule, p, v, m) x balances x replica counts x placements.
  std::vector<Layout> layouts;
  std::vector<Cand> cands;
  const int max_p = o.hybrid ? std::min(R, L) : std::min(R, L);
  const int min_p = o.hybrid ? 1 : max_p;
  std::vector<std::pair<int, int>> replica_counts;  // (d, samples per replica)
  for (int p = min_p; p <= max_p; ++p) {
    replica_counts.clear();
    const long long dmax = o.hybrid && o.replicated_may_win ? std::min<long long>(R / p, batch) : 1;
    // Replica counts that split the mini-batch evenly: the runtime gives every copy the same share
    // (train --replicas refuses a batch it does not divide), and the gradients' mean over the copies is
    // then the mini-batch's mean.
    for (long long d = 1; d <= dmax; ++d)
      if (batch % d == 0) replica_counts.push_back({static_cast<int>(d), static_cast<int>(batch / d)});
    bool one_stage_done = false;  // on one stage every synchronous schedule is the same accumulation loop
    for (const std::string& name : o.schedules) {
      const ScheduleTraits t = schedule_traits(name);
      if (!t.synchronous) continue;  // the asynchronous schedules have no step to compare with
      if (p == 1 && (one_stage_done || t.virtual_stages || t.v_shape || t.split_backward)) continue;
      if (p == 1) one_stage_done = true;
      std::vector<int> vs{1};
      Shape shape = Shape::straight;
      if (t.virtual_stages) {
        vs = o.virtual_counts;
        shape = Shape::looped;
      } else if (t.v_shape) {
        vs = {2};
        shape = Shape::v;
      }
      for (int v : vs) {
        const int S = p * v;
        if (S > L) continue;
        const std::vector<BalanceEntry>& bal = search.balances(S);
        for (int m : o.microbatch_counts) {
          Layout lay{name, p, v, m, S, v > 1 || t.v_shape ? shape : Shape::straight, name == "zb-h2" || name == "zb-auto"};
          if (m > batch || !search.valid(lay)) continue;
          const int li = static_cast<int>(layouts.size());
          layouts.push_back(lay);
          for (const auto& [d, n] : replica_counts) {
            if (m > n) continue;
            for (int placement = 0; placement < (links.group.size() > 1 && d > 1 ? 2 : 1); ++placement)
              for (std::size_t bi = 0; bi < bal.size(); ++bi) {
                Cand c;
                c.layout = li;
                c.balance = static_cast<int>(bi);
                c.d = d;
                c.n = n;
                c.replicas_inner = placement == 1;
                search.bound(c, lay, bal[bi]);
                cands.push_back(c);
              }
          }
        }
      }
    }
  }
  res.considered = static_cast<int64_t>(cands.size());
  if (cands.empty()) {
    // The asynchronous schedules were skipped above: say so when --schedules gave nothing else.
    std::string async_names, given_async;
    for (const std::string& name : schedule_names())
      if (!schedule_traits(name).synchronous) async_names += (async_names.empty() ? "" : ", ") + name;
    bool only_async = true;
    for (const std::string& name : o.schedules) {
      const bool sync = schedule_traits(name).synchronous;
      only_async &= !sync;
      if (!sync) given_async += (given_async.empty() ? "" : " ") + name;
    }
    if (only_async)
      throw UsageError("no candidate: --schedules " + given_async + " names only asynchronous schedules, and the "
                       "asynchronous schedules (" + async_names + ") are not searched (they never flush, so no step "
                       "time compares with the others'); PipeDream's own planner is run for every plan (its section, "
                       "\"PipeDream planner's own estimate\", and its plan as 1F1B-RR): give synchronous schedules, "
                       "e.g. --schedules 1f1b zb-h1, or leave --schedules out");
    std::string lists;  // a balance list is used only by the plans with its number of stages (x virtual)
    for (const std::string& kind : o.balance_kinds)
      if (is_balance_list(kind))
        lists += fmt::format("{}--balances {} lists {} stages, and only plans that cut that many (stages x virtual "
                             "stages: {} x v for an interleaved or V schedule over {} ranks) use it",
                             lists.empty() ? "; " : "; ", excerpt(kind), parse_balance(kind).size(),
                             o.hybrid ? std::string("p") : std::to_string(std::min(R, L)),
                             o.ranks);
    throw UsageError("no candidate: check --schedules, --microbatch-counts and --batch-size (every micro-batch needs "
                     "a sample)" + lists);
  }

  // Simulated candidates, by index.
  std::unordered_map<std::size_t, std::size_t> done;  // candidate -> index in res.candidates
  auto run = [&](std::size_t i) -> const PlanCandidate& {
    auto it = done.find(i);
    if (it != done.end()) return res.candidates[it->second];
    const Cand& c = cands[i];
    const Layout& lay = layouts[static_cast<std::size_t>(c.layout)];
    res.candidates.push_back(search.simulate(c, lay, search.balances(lay.stages)[static_cast<std::size_t>(c.balance)]));
    done[i] = res.candidates.size() - 1;
    return res.candidates.back();
  };
  std::vector<std::size_t> order(cands.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return cands[a].lb < cands[b].lb; });
  // Best-first over the candidates `keep` admits: simulate in order of the lower bound until it passes the
  // best time found (only candidates that fit count, unless none does).
  auto branch_and_bound = [&](const std::function<bool(const Cand&)>& keep) -> std::optional<PlanCandidate> {
    std::optional<PlanCandidate> best;
    for (bool need_fit : {true, false}) {
      for (std::size_t i : order) {
        const Cand& c = cands[i];
        if (!keep(c)) continue;
        if (need_fit && limit > 0 && c.mem_lb > limit) continue;
        if (!o.exhaustive && best && c.lb > best->makespan * (1 + 1e-9) + 1e-12) break;
        const PlanCandidate& pc = run(i);
        if (need_fit && !pc.fits) continue;
        if (!best || better_candidate(pc, *best)) best = pc;
      }
      if (best) break;
    }
    return best;
  };
  const auto all = branch_and_bound([](const Cand&) { return true; });
  const int straight_p = std::min(R, L);
  const auto single = branch_and_bound([&](const Cand& c) {
    const Layout& lay = layouts[static_cast<std::size_t>(c.layout)];
    return c.d == 1 && lay.p == straight_p && lay.stages == lay.p;  // one stage per rank: what UMPIPE cuts
  });
  if (!all) throw UsageError("no candidate could be laid out: check --schedules and --microbatch-counts");
  res.best = *all;
  res.best_straight = single ? *single : *all;  // UMPIPE without one: refused below (nothing eligible)

  // The baselines the output shows, simulated whatever the pruning did.
  {  // uniform balance, 1f1b, one pipeline over min(R, L) ranks, its best m
    const std::vector<int> uniform = balance_uniform(L, straight_p);
    for (std::size_t i = 0; i < cands.size(); ++i) {
      const Cand& c = cands[i];
      const Layout& lay = layouts[static_cast<std::size_t>(c.layout)];
      if (c.d != 1 || lay.p != straight_p || lay.name != "1f1b" || lay.v != 1) continue;
      if (search.balances(lay.stages)[static_cast<std::size_t>(c.balance)].balance != uniform) continue;
      const PlanCandidate& pc = run(i);
      if (!res.uniform_1f1b || better_candidate(pc, *res.uniform_1f1b)) res.uniform_1f1b = pc;
    }
  }
  if (o.hybrid && o.replicated_may_win) {  // data parallelism: p = 1 on the most replicas (<= R) that split the batch
    long long d = std::min<long long>(R, batch);
    while (batch % d != 0) --d;
    const long long n = batch / d;
    const int m1 = *std::min_element(o.microbatch_counts.begin(), o.microbatch_counts.end());
    for (std::size_t i = 0; i < cands.size(); ++i) {
      const Cand& c = cands[i];
      const Layout& lay = layouts[static_cast<std::size_t>(c.layout)];
      if (lay.p != 1 || lay.v != 1 || lay.m != m1 || c.n != n || c.replicas_inner) continue;
      const PlanCandidate& pc = run(i);
      if (!res.data_parallel || better_candidate(pc, *res.data_parallel)) res.data_parallel = pc;
    }
  }
  if (!(o.hybrid && o.replicated_may_win)) {
    // A reference only (--no-hybrid, UMPIPE: outside the space searched): the same data-parallel
    // candidate, simulated on its own; one stage runs every synchronous schedule as the same loop.
    long long d = std::min<long long>(R, batch);
    while (batch % d != 0) --d;
    const int m1 = *std::min_element(o.microbatch_counts.begin(), o.microbatch_counts.end());
    const Layout lay{"gpipe", 1, 1, m1, 1, Shape::straight, false};
    if (m1 <= batch / d && search.valid(lay)) {
      Cand c;
      c.d = static_cast<int>(d);
      c.n = static_cast<int>(batch / d);
      res.data_parallel = search.simulate(c, lay, BalanceEntry{"uniform", "min-max", {L}, {L}});
    }
  }
  {
    if (res.data_parallel) {
      res.data_parallel_ms = res.data_parallel->makespan;
      res.data_parallel_bytes = res.data_parallel->peak_bytes;
      res.data_parallel_fits = res.data_parallel->fits;
    }
  }

  // PipeDream's planner (replication), on the same devices.
  if (po.levels.empty()) po.levels.push_back(NetworkLevel{R, o.bandwidth_bytes_per_ms * 1e3});
  if (limit > 0) po.memory_limit_bytes = limit;
  po.allow_fewer_machines = true;
  res.pipedream_options = po;
  if (R > o.pipedream_max_ranks && o.pipedream.levels.empty()) {
    // Its flat search is O(L^2 R^2): above the cap it runs on two levels of the same links, groups of g
    // ranks, which restricts replication to whole groups at the outer level. Each level then costs about
    // L^3 times its units squared (measured: GPT-96 on 8 x 128 took 6.5 s, on 32 x 32 0.8 s): g is the
    // divisor of R (1 < g < R) that minimises g^2 + (R/g)^2, the one nearest sqrt(R).
    int g = 1;
    double least = std::numeric_limits<double>::infinity();
    for (int k = 2; k < R; ++k)
      if (R % k == 0) {
        const double cost = double(k) * k + (double(R) / k) * (double(R) / k);
        if (cost < least) least = cost, g = k;
      }
    if (g > 1) po.levels = {NetworkLevel{g, o.bandwidth_bytes_per_ms * 1e3}, NetworkLevel{R / g, o.bandwidth_bytes_per_ms * 1e3}};
    res.pipedream_options = po;
  }
  if (R > o.pipedream_max_ranks && po.levels.size() < 2) {
    res.pipedream_error =
        o.pipedream.levels.empty()
            ? fmt::format("not run at {} ranks (its search is O(layers^2 x ranks^2) on one level; the cap is {} ranks, "
                          "and {} is prime, so it cannot be split into two levels)", R, o.pipedream_max_ranks, R)
            : fmt::format("not run on one level of {} ranks (its search is O(layers^2 x ranks^2); the cap is {} ranks): "
                          "give two --levels", R, o.pipedream_max_ranks);
  } else {
    try {
      res.pipedream = plan_pipedream(prof, po);
    } catch (const UsageError& e) {
      res.pipedream_error = e.what();
    }
  }

  // A PipeDream plan x `copies` data-parallel copies, run synchronously as 1F1B-RR (stage replication
  // in the runtime) with every replication times `copies`, simulated like the others: its best over the
  // micro-batch counts, per copy the counts asked for rounded up to a multiple of every replica count
  // (equal shares), so the whole schedule's m is copies x that.
  // The measured all-reduce prices replicas on one level of links, as for the hybrid candidates (their
  // innermost level; PipeDream's replicas here sit anywhere, so only without --level).
  std::optional<MeasuredAllReduce> measured;
  if (!o.allreduce.empty() && links.bw.size() == 1) measured.emplace(o.allreduce, o.allreduce_ranks);
  auto run_replicated = [&](const Plan& plan, int copies) -> std::optional<PlanCandidate> {
    std::vector<int> replication = plan.replication;
    long long lcm = 1;  // of the replica counts; beyond the mini-batch no micro-batch count can have it
    for (int& r : replication) {
      if (lcm <= batch) lcm = std::lcm(lcm, static_cast<long long>(r));
      r *= copies;
    }
    if (lcm > batch) return std::nullopt;
    // Replicated equally (u times), the runtime runs it as u copies of the pipeline (train --plan reads
    // it as --replicas u), which must split the mini-batch evenly.
    const int u = replication.front();
    if (std::all_of(replication.begin(), replication.end(), [&](int r) { return r == u; }) && batch % u != 0)
      return std::nullopt;
    std::vector<int> counts = o.microbatch_counts;
    counts.push_back(1);  // at least one round over the replicas
    std::vector<long long> totals;
    for (int m : counts) {
      const long long mm = (static_cast<long long>(m) + lcm - 1) / lcm * lcm * copies;
      if (mm > batch || mm > (1 << 16) || std::find(totals.begin(), totals.end(), mm) != totals.end()) continue;
      totals.push_back(mm);
    }
    std::optional<PlanCandidate> best;
    for (long long mm : totals) {
      PlanCandidate c = simulate_candidate(prof, plan.balance, "1f1b", static_cast<int>(mm),
                                           static_cast<double>(batch) / static_cast<double>(mm), links.bw.back(),
                                           o.latency_ms, limit, replication, measured ? &*measured : nullptr);
      c.kind = "pipedream";
      c.solver = "planner";
      c.stages = static_cast<int>(plan.balance.size());
      c.copies = copies;
      c.ranks_used = plan.devices_used() * copies;
      c.samples = static_cast<double>(batch);
      if (!best || better_candidate(c, *best)) best = c;
    }
    return best;
  };
  auto replicates = [](const Plan& p) {
    return p.balance.size() > 1 && std::any_of(p.replication.begin(), p.replication.end(), [](int r) { return r > 1; });
  };
  // A candidate that fits wins over one that does not (and the faster among equals): better_candidate.
  auto improves = [](const std::optional<PlanCandidate>& c, const std::optional<PlanCandidate>& than) {
    return c && (!than || better_candidate(*c, *than));
  };
  const auto& pd = res.pipedream;
  if (pd && replicates(*pd)) {
    res.replicated = run_replicated(*pd, 1);
    if (res.replicated) res.replicated_plan = *pd;
  }
  // PipeDream's planner refused plans by its asynchronous memory model (a 20 GiB limit dropped a plan
  // whose 1F1B-RR peaks at 1 GiB, and plan chose one 2.2x slower): its plan without the limit, as 1F1B-RR,
  // is checked against the limit by the simulation like every other row.
  PlannerOptions unlimited = res.pipedream_options;
  unlimited.memory_limit_bytes = std::numeric_limits<double>::infinity();
  if (limit > 0 && (R <= o.pipedream_max_ranks || po.levels.size() >= 2)) {
    try {
      const Plan free_plan = plan_pipedream(prof, unlimited);
      if (replicates(free_plan) && (!pd || free_plan.balance != pd->balance || free_plan.replication != pd->replication))
        if (auto c = run_replicated(free_plan, 1); improves(c, res.replicated)) {
          res.replicated = c;
          res.replicated_plan = free_plan;
          res.replicated_unlimited = true;
        }
    } catch (const UsageError&) {
    }
  }

  // PipeDream's plan for k = R/d ranks x d copies. Its planner runs for each k tried, on one level of k
  // ranks; k <= pipedream_max_ranks, so no run costs more than one flat run at the cap, and at most
  // pipedream_copy_plans values of k.
  if (o.hybrid && o.replicated_may_win && o.pipedream_copy_plans > 0) {
    std::vector<int> ks;
    for (int k = 2; k <= std::min(o.pipedream_max_ranks, R / 2); ++k)
      if (R % k == 0 && R / k <= batch) ks.push_back(k);
    const auto want = static_cast<std::size_t>(o.pipedream_copy_plans);
    if (ks.size() > want) {
      std::vector<int> spread;
      for (std::size_t i = 0; i < want; ++i)
        spread.push_back(ks[want == 1 ? ks.size() - 1 : (i * (ks.size() - 1) + (want - 1) / 2) / (want - 1)]);
      spread.erase(std::unique(spread.begin(), spread.end()), spread.end());
      ks = std::move(spread);
    }
    for (auto it = ks.rbegin(); it != ks.rend(); ++it) {  // by d = R / k, ascending
      const int k = *it, d = R / k;
      // One level of k ranks on the slowest link: round_robin places a stage's d x r_s replicas side by
      // side, so a copy's ranks spread over the groups of any --level, and every hop is priced at the
      // slowest link (simulate_candidate) as the planner then sees it.
      // Without the memory limit first (the planner's asynchronous memory model is not 1F1B-RR's; the
      // simulation checks the limit), with it where that plan does not fit.
      std::optional<PlanCandidate> best;
      Plan best_plan;
      for (const PlannerOptions* base : {&unlimited, &res.pipedream_options}) {
        if (best && best->fits) break;
        if (base == &res.pipedream_options && !(limit > 0)) break;  // the same run
        PlannerOptions sub = *base;
        sub.levels = {NetworkLevel{k, links.bw.back() * 1e3}};
        Plan plan;
        try {
          plan = plan_pipedream(prof, sub);
        } catch (const UsageError&) {
          continue;  // nothing fits k ranks (the memory limit): no copies of it either
        }
        if (plan.balance.size() < 2) continue;  // one stage: data parallelism, a candidate already
        if (auto c = run_replicated(plan, d); improves(c, best)) {
          best = c;
          best_plan = std::move(plan);
        }
      }
      if (best) {
        res.pipedream_copies.push_back(*best);
        res.pipedream_copy_plans.push_back(std::move(best_plan));
      }
    }
  }
  // The chosen plan is the best of every row the output shows (the simulated candidates and every
  // baseline) that the options let be chosen: `train --plan` runs it from the file.
  std::optional<PlanCandidate> chosen;
  auto consider = [&](const PlanCandidate& c) {
    if (res.eligible(c) && (!chosen || better_candidate(c, *chosen))) chosen = c;
  };
  for (const PlanCandidate& c : res.candidates) consider(c);
  for (const std::optional<PlanCandidate>* x : {&res.uniform_1f1b, &res.data_parallel, &res.replicated})
    if (*x) consider(**x);
  for (const PlanCandidate& c : res.pipedream_copies) consider(c);
  if (!chosen)
    throw UsageError(o.replicated_may_win
                         ? "no candidate the options allow could be laid out: check --schedules and --microbatch-counts"
                         : "UMPIPE cuts one straight pipeline (one stage per rank), but no such candidate could be laid "
                           "out: add a schedule without virtual stages to --schedules, e.g. --schedules gpipe");
  res.best = *chosen;
  res.chose_replicated = !res.best.replication.empty();
  for (const std::optional<PlanCandidate>* x : {&res.uniform_1f1b})
    if (*x && better_candidate(**x, res.best_straight)) res.best_straight = **x;
  return res;
}

std::string PlanSearchResult::ineligible(const PlanCandidate& c) const {
  const bool rr = !c.replication.empty();
  if (!replicated_may_win && (rr || c.replicas > 1 || c.stages != straight_stages || c.virtual_stages > 1))
    return fmt::format("UMPIPE cuts one straight pipeline over {} ranks, one stage each", straight_stages);
  if (!hybrid && (rr || c.replicas > 1 || c.stages != straight_stages))
    return fmt::format("--no-hybrid: one pipeline over {} ranks only", straight_stages);
  if (rr && !rr_schedule) return "1F1B-RR runs 1f1b, which --schedules leaves out";
  return {};
}

namespace {

// The micro-batches a plan file records for a candidate: its m, except for 1F1B-RR with every stage
// replicated u times, which train --plan runs as u copies of the pipeline (--replicas u), each with its
// own m: m / u of them (the same schedule: each copy's replica of stage s gets every u-th micro-batch and
// keeps p - s of them in flight, as plain 1F1B does; m is a multiple of u).
int equal_copies_microbatches(const PlanCandidate& c) {
  if (c.replication.empty()) return c.m;
  const int u = c.replication.front();
  if (u <= 1 || std::any_of(c.replication.begin(), c.replication.end(), [&](int r) { return r != u; })) return c.m;
  return c.m / u;
}

}  // namespace

PlanFile plan_file_for(const Profile& prof, const PlanSearchResult& res) {
  const PlanCandidate& top = res.chosen();
  PlanFile f;
  Plan& chosen = f.plan;
  chosen.model = prof.model;
  chosen.layers = static_cast<int>(prof.layers.size());
  chosen.options = res.pipedream_options;
  // Searched with every replication 1 (--no-hybrid, UMPIPE): PipeDream's --straight_pipeline.
  chosen.options.straight_pipeline = !(res.hybrid && res.replicated_may_win);
  chosen.balance = top.balance;
  // d copies of one pipeline: every stage replicated d times (train --plan runs them as --replicas d).
  chosen.replication = top.replication.empty() ? std::vector<int>(top.balance.size(), std::max(1, top.replicas))
                                               : top.replication;
  chosen.time_ms = top.makespan;
  // Data parallelism as simulated (null in the file where it could not be: no micro-batch count fits).
  const double inf = std::numeric_limits<double>::infinity();
  chosen.data_parallel_time_ms = res.data_parallel ? res.data_parallel_ms : inf;
  chosen.speedup = res.data_parallel && top.makespan > 0 ? res.data_parallel_ms / top.makespan : inf;
  chosen.data_parallel_fits = res.data_parallel ? res.data_parallel_fits : false;
  // Per stage: compute per micro-batch (F + B + W from the simulator's costs) and static bytes.
  StageCostOptions so;
  so.micro_batch = (top.samples > 0 ? top.samples : static_cast<double>(res.batch_size)) / top.m;
  for (const StageCost& c : stage_costs(prof, top.balance, so).stage) chosen.stage_time_ms.push_back(c.f + c.b + c.w);
  // Per stage: the simulated peak of the rank holding it (what the chosen row prints as its peak); the
  // static bytes where the candidate has no per-stage peaks. No stage_in_flight (plan_file_to_json drops
  // it): PipeDream's count of mini-batches in flight does not describe a synchronous schedule, and nothing
  // reads it from the top level.
  chosen.stage_memory_bytes = top.stage_peak_bytes.size() == top.balance.size() ? top.stage_peak_bytes
                                                                                : stage_static_bytes(prof, top.balance);
  f.schedule = top.schedule;
  f.microbatches = equal_copies_microbatches(top);
  f.virtual_stages = std::max(1, top.virtual_stages);
  f.batch_size = res.batch_size;
  f.placement = top.placement;
  f.threads = prof.threads;
  f.balance_kind = top.kind;
  f.balance_solver = top.solver;
  f.predicted_bubble_fraction = top.bubble;
  f.predicted_peak_bytes = top.peak_bytes;
  if (res.memory_limit_bytes > 0) f.fits_memory_limit = top.fits;
  f.pipedream = res.replicated_plan ? res.replicated_plan : res.pipedream;
  if (res.replicated) {  // how train --plan-use pipedream runs it: synchronous 1F1B-RR with this m
    f.pipedream_schedule = "1f1b";
    f.pipedream_microbatches = equal_copies_microbatches(*res.replicated);
    f.pipedream_simulated_ms = res.replicated->makespan;
  }
  return f;
}

nlohmann::json plan_file_to_json(const PlanFile& f) {
  nlohmann::json j = plan_to_json(f.plan);
  if (!f.schedule.empty()) j["schedule"] = f.schedule;
  if (f.microbatches > 0) j["microbatches"] = f.microbatches;
  if (f.virtual_stages > 1) j["virtual_stages"] = f.virtual_stages;
  if (f.batch_size > 0) j["batch_size"] = f.batch_size;
  if (!f.placement.empty()) j["placement"] = f.placement;
  if (f.threads > 0) j["threads"] = f.threads;
  if (!f.balance_kind.empty()) j["balance_kind"] = f.balance_kind;
  if (!f.balance_solver.empty()) j["balance_solver"] = f.balance_solver;
  if (!f.schedule.empty()) j["predicted_bubble_fraction"] = f.predicted_bubble_fraction;
  if (f.predicted_peak_bytes > 0) j["predicted_peak_bytes"] = f.predicted_peak_bytes;
  if (f.fits_memory_limit) j["fits_memory_limit"] = *f.fits_memory_limit;
  if (f.pipedream) {
    j["pipedream"] = plan_to_json(*f.pipedream);
    if (!f.pipedream_schedule.empty()) {
      j["pipedream"]["schedule"] = f.pipedream_schedule;
      j["pipedream"]["microbatches"] = f.pipedream_microbatches;
      j["pipedream"]["simulated_time_ms"] = f.pipedream_simulated_ms;
    }
  }
  if (!f.umpipe.is_null()) j["umpipe"] = f.umpipe;
  return j;
}

namespace {

[[noreturn]] void file_fail(const std::string& origin, const std::string& field, const nlohmann::json& value,
                            const std::string& fix) {
  throw UsageError(fmt::format("{}: \"{}\" is {}: {}", origin, field, json_excerpt(value), fix));
}

// The optional run fields of a plan (or of its "pipedream" section).
void read_run_fields(const nlohmann::json& j, const std::string& origin, const std::string& prefix,
                     std::string& schedule, int& microbatches) {
  if (j.contains("schedule")) {
    if (!j["schedule"].is_string()) file_fail(origin, prefix + "schedule", j["schedule"], "write a schedule name");
    schedule = j["schedule"].get<std::string>();
  }
  if (j.contains("microbatches")) {
    const auto& m = j["microbatches"];
    if (!m.is_number_integer() || m.get<long long>() < 1 || m.get<long long>() > (1 << 20))
      file_fail(origin, prefix + "microbatches", m, "write a micro-batch count, an integer in 1..1048576");
    microbatches = m.get<int>();
  }
}

}  // namespace

PlanFile plan_file_from_json(const nlohmann::json& j, const std::string& origin) {
  PlanFile f;
  f.plan = plan_from_json(j, origin);  // checks the object, format, version and the plan's own fields
  read_run_fields(j, origin, "", f.schedule, f.microbatches);
  if (j.contains("virtual_stages")) {
    const auto& v = j["virtual_stages"];
    if (!v.is_number_integer() || v.get<long long>() < 1 || v.get<long long>() > 64 ||
        f.plan.balance.size() % static_cast<std::size_t>(v.get<long long>()) != 0)
      file_fail(origin, "virtual_stages", v, "write the stages per rank, an integer in 1..64 that divides the balance's "
                "length");
    f.virtual_stages = v.get<int>();
  }
  if (j.contains("batch_size")) {
    const auto& b = j["batch_size"];
    if (!b.is_number_integer() || b.get<long long>() < 1)
      file_fail(origin, "batch_size", b, "write the mini-batch size, an integer >= 1");
    f.batch_size = b.get<int64_t>();
  }
  if (j.contains("placement")) {
    const auto& pl = j["placement"];
    if (!pl.is_string() || (pl.get<std::string>() != "pipeline-inner" && pl.get<std::string>() != "replicas-inner"))
      file_fail(origin, "placement", pl, "write pipeline-inner (a pipeline's ranks side by side) or replicas-inner (a "
                "stage's copies side by side)");
    f.placement = pl.get<std::string>();
  }
  if (j.contains("threads")) {
    const auto& t = j["threads"];
    if (!t.is_number_integer() || t.get<long long>() < 1 || t.get<long long>() > 4096)
      file_fail(origin, "threads", t, "write the profile's intra-op threads per rank, an integer in 1..4096");
    f.threads = t.get<int>();
  }
  for (const char* key : {"balance_kind", "balance_solver"})
    if (j.contains(key)) {
      if (!j[key].is_string()) file_fail(origin, key, j[key], "write a string");
      (std::string(key) == "balance_kind" ? f.balance_kind : f.balance_solver) = j[key].get<std::string>();
    }
  if (j.contains("predicted_bubble_fraction") && j["predicted_bubble_fraction"].is_number())
    f.predicted_bubble_fraction = j["predicted_bubble_fraction"].get<double>();
  if (j.contains("predicted_peak_bytes") && j["predicted_peak_bytes"].is_number())
    f.predicted_peak_bytes = j["predicted_peak_bytes"].get<double>();
  if (j.contains("fits_memory_limit")) {
    if (!j["fits_memory_limit"].is_boolean())
      file_fail(origin, "fits_memory_limit", j["fits_memory_limit"], "write true or false");
    f.fits_memory_limit = j["fits_memory_limit"].get<bool>();
  }
  if (j.contains("pipedream")) {
    const nlohmann::json& pd = j["pipedream"];
    f.pipedream = plan_from_json(pd, origin + " (pipedream)");
    read_run_fields(pd, origin, "pipedream.", f.pipedream_schedule, f.pipedream_microbatches);
    if (pd.contains("simulated_time_ms") && pd["simulated_time_ms"].is_number())
      f.pipedream_simulated_ms = pd["simulated_time_ms"].get<double>();
  }
  if (j.contains("umpipe")) {
    if (!j["umpipe"].is_object()) file_fail(origin, "umpipe", j["umpipe"], "write UMPIPE's partitions as an object");
    f.umpipe = j["umpipe"];
  }
  return f;
}

void write_plan_file(const std::string& path, const PlanFile& file) {
  write_file_atomic(path, plan_file_to_json(file).dump(2) + "\n");
}

PlanFile read_plan_file(const std::string& path) {
  const std::string text = read_file_capped(path, "plan", kMaxPlanFileBytes);
  return plan_file_from_json(parse_json_text(text, path), path);
}

}  // namespace pipetrain

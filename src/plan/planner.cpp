#include "pipetrain/plan/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <tuple>
#include <type_traits>

#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/core/read_file.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/profile.h"

namespace pipetrain {
namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

long ceil_div(long a, long b) { return (a + b - 1) / b; }

// Per-device memory of a stage by the paper form's model (planner.h): weights, gradients, optimizer
// state, n activation sets, and n - 1 stashed weight versions with weight stashing.
double paper_memory(double weights, double optimizer, double activations, long in_flight, bool stashing) {
  const double n = static_cast<double>(in_flight);
  return 2 * weights + optimizer + n * activations + (stashing ? (n - 1) * weights : 0.0);
}

// One stage of the flattened plan.
struct FlatStage {
  int first = 0, last = 0;  // layers, inclusive
  long replication = 1;
  double time_ms = 0;
};

// The dynamic programme of planner.h. A "context" (R, E) carries what a level-k range needs to know
// about where it sits in the flattened plan, for the paper form's exact in-flight count: R is the
// product of the replication factors of the stages enclosing it at higher levels, E the devices after
// its level-k group (inside the enclosing stages, and after them). A level-0 stage with r devices and
// m devices at and after it in its group then has R*r replicas and R*m + E devices at and after it.
// Without a memory limit, or in the reference form (whose memory estimate is local to each level),
// every context behaves the same, so it is normalised to (1, 0) and each table is built once.
class Dp {
 public:
  Dp(const Profile& p, const PlannerOptions& o) : o_(o), L_(static_cast<int>(p.layers.size())) {
    T_.assign(static_cast<std::size_t>(L_) + 1, 0.0);
    W_ = A_ = O_ = T_;
    for (int l = 0; l < L_; ++l) {
      const LayerProfile& x = p.layers[static_cast<std::size_t>(l)];
      const std::size_t u = static_cast<std::size_t>(l);
      T_[u + 1] = T_[u] + x.forward_ms + x.backward_ms;
      W_[u + 1] = W_[u] + x.parameter_bytes;
      A_[u + 1] = A_[u] + x.activation_bytes;
      O_[u + 1] = O_[u] + x.optimizer_bytes;
      out_.push_back(x.activation_bytes);
    }
    long g = 1;
    for (const NetworkLevel& lv : o.levels) {
      G_.push_back(g);
      g *= lv.machines;
    }
    paper_ = o.cost_form == PlannerCostForm::paper;
    contexts_matter_ = paper_ && std::isfinite(o.memory_limit_bytes);
  }

  int levels() const { return static_cast<int>(o_.levels.size()); }

  // Best time of all layers on exactly m units of the outermost level.
  double top(int m) { return at(table(levels() - 1, Ctx{}, L_ - 1), 0, 0, m); }

  // The flattened stages of the top-level solution on m units.
  std::vector<FlatStage> expand_top(int m) {
    std::vector<FlatStage> out;
    expand(levels() - 1, Ctx{}, 0, L_ - 1, m, 0, 1, out);
    return out;
  }

  double range_t(int i, int j) const { return T_[static_cast<std::size_t>(j) + 1] - T_[static_cast<std::size_t>(i)]; }
  double range_w(int i, int j) const { return W_[static_cast<std::size_t>(j) + 1] - W_[static_cast<std::size_t>(i)]; }
  double range_a(int i, int j) const { return A_[static_cast<std::size_t>(j) + 1] - A_[static_cast<std::size_t>(i)]; }
  double range_o(int i, int j) const { return O_[static_cast<std::size_t>(j) + 1] - O_[static_cast<std::size_t>(i)]; }

  // Ring all-reduce of w bytes over r units of level k, in ms, before the form's division.
  double allreduce_ms(int k, double w, int r) const {
    if (r <= 1 || w == 0) return 0.0;
    return 1000.0 * 4.0 * (r - 1) * w / (r * o_.levels[static_cast<std::size_t>(k)].bandwidth);
  }

  // The form's combination of compute t and all-reduce ar on r units of level k.
  double combine(int k, double t, double ar, int r, bool first) const {
    if (paper_) return std::max(t, ar / static_cast<double>(G_[static_cast<std::size_t>(k)])) / r;
    if (k >= 1 && first) ar /= o_.levels[static_cast<std::size_t>(k) - 1].machines;
    return (t + ar) / r;
  }

 private:
  struct Ctx {
    long R = 1, E = 0;
  };
  struct Table {
    int b = 0, M = 0;
    std::vector<double> best;    // [x][i][m]: x = 0 when the stage at i opens the range, 1 otherwise
    std::vector<int> cut, reps;  // the first stage's last layer and replication
  };
  static std::size_t idx(const Table& t, int x, int i, int m) {
    return (static_cast<std::size_t>(x) * static_cast<std::size_t>(t.b + 1) + static_cast<std::size_t>(i)) *
               static_cast<std::size_t>(t.M + 1) +
           static_cast<std::size_t>(m);
  }
  static double at(const Table& t, int x, int i, int m) { return t.best[idx(t, x, i, m)]; }

  Ctx inner(int k, Ctx c, int r, int m) const {
    if (!contexts_matter_) return Ctx{};
    return Ctx{c.R * r, c.E + c.R * G_[static_cast<std::size_t>(k)] * (m - r)};
  }

  double transfer_ms(int k, double bytes, double replicas) const {
    const double c = o_.activation_compression > 0 ? o_.activation_compression : 1.0;
    if (bytes == 0) return 0.0;
    return 1000.0 * 2.0 * bytes / (o_.levels[static_cast<std::size_t>(k)].bandwidth * replicas * c);
  }

  // The cost of stage i..j on r units of level k, m units at and after it in its group, with every
  // transfer term the form charges to it; infinity when it does not fit in memory.
  double stage_cost(int k, Ctx c, int i, int j, int r, int m, bool first, bool has_next) {
    const double limit = o_.memory_limit_bytes;
    if (std::isfinite(limit)) {
      if (paper_ && k == 0) {
        const long n = ceil_div(c.R * m + c.E, c.R * r);
        if (paper_memory(range_w(i, j), range_o(i, j), range_a(i, j), n, o_.weight_stashing) > limit) return kInf;
      } else if (!paper_) {
        const double stash = static_cast<double>((m - 1) / r) * (range_a(i, j) + range_w(i, j));
        if (stash > limit) return kInf;
      }
    }
    const double t = k == 0 ? range_t(i, j) : range_time(k - 1, inner(k, c, r, m), i, j);
    if (t == kInf) return kInf;
    double cost = combine(k, t, allreduce_ms(k, range_w(i, j), r), r, first);
    if (paper_) {
      if (has_next) cost = std::max(cost, transfer_ms(k, out_[static_cast<std::size_t>(j)], 1.0));
    } else if (o_.activation_compression > 0 && !first) {
      cost = std::max(cost, transfer_ms(k, out_[static_cast<std::size_t>(i) - 1], r));
      if (j < L_ - 1) cost = std::max(cost, transfer_ms(k, out_[static_cast<std::size_t>(j)], r));
    }
    return cost;
  }

  // Best time of layers a..b on a whole level-k group (all M_k units).
  double range_time(int k, Ctx c, int a, int b) {
    return at(table(k, c, b), 0, a, o_.levels[static_cast<std::size_t>(k)].machines);
  }

  // best[x][i][m]: the smallest bottleneck of layers i..b on exactly m units of level k, a suffix of the
  // group; x says whether the stage starting at i is the first of the range (the reference form charges
  // that stage differently). Suffixes rather than prefixes so that m is the count of units at and after
  // the first stage, which the memory model needs.
  const Table& table(int k, Ctx c, int b) {
    const auto key = std::make_tuple(k, c.R, c.E, b);
    auto found = memo_.find(key);
    if (found != memo_.end()) return found->second;
    Table t;
    t.b = b;
    t.M = o_.levels[static_cast<std::size_t>(k)].machines;
    const std::size_t size = 2 * static_cast<std::size_t>(b + 1) * static_cast<std::size_t>(t.M + 1);
    t.best.assign(size, kInf);
    t.cut.assign(size, -1);
    t.reps.assign(size, 0);
    if (k == 0 && (paper_ || !(o_.activation_compression > 0))) {
      fill_level0(t, c, b);
      return memo_.emplace(key, std::move(t)).first->second;
    }
    for (int i = b; i >= 0; --i)
      for (int x = i == 0 ? 0 : 1; x >= 0; --x)  // no stage precedes layer 0, so it always opens its range
        for (int m = 1; m <= t.M; ++m) {
          double best = kInf;
          int cut = -1, reps = 0;
          for (int j = i; j <= b; ++j)
            for (int r = 1; r <= (o_.straight_pipeline ? 1 : m); ++r) {
              double v;
              if (j == b) {
                if (r != m) continue;  // the last stage takes the units left
                v = stage_cost(k, c, i, j, r, m, x == 0, false);
              } else {
                if (r >= m) continue;  // later stages need at least one unit
                const double rest = at(t, 1, j + 1, m - r);
                if (rest == kInf) continue;
                v = std::max(stage_cost(k, c, i, j, r, m, x == 0, true), rest);
              }
              if (v < best - 1e-12 * std::max(1.0, std::abs(v))) best = v, cut = j, reps = r;
            }
          const std::size_t u = idx(t, x, i, m);
          t.best[u] = best;
          t.cut[u] = cut;
          t.reps[u] = reps;
        }
    return memo_.emplace(key, std::move(t)).first->second;
  }

  // The level-0 table in O(b M^2 log b) instead of the loop above's O(b^2 M^2) (which took 200 s on
  // 100k layers). For a stage i..j (j < b) on r of m units the loop minimises over j
  //   v(j) = max(f(j), g(j)),  f(j) = the stage's own cost (compute, all-reduce, memory; nondecreasing
  //   in j since every layer adds nonnegative time and bytes), g(j) = max(transfer after j, best of
  //   j+1..b on m - r units), which depends on j and m - r only (the transfer term of the paper form,
  //   or none in the reference form without compression; with compression it depends on r too, and
  //   that case keeps the loop).
  // min_j max(f(j), g(j)) = min_j max(f(j), min_{i<=j'<=j} g(j')), so only the positions where g sets
  // a new minimum, scanning right from i ("records"), can be optimal; along them f rises and g falls,
  // so the best record is found by binary search. The records from i are those from i + 1 that lie
  // below g(i), plus i: a stack per m - r, updated in O(1) amortised as i decreases. Ties go, as in the
  // loop, to the smallest j, then the smallest r.
  void fill_level0(Table& t, Ctx c, int b) {
    const int M = t.M;
    // stacks[mm]: records of g for mm units, the smallest position at the back.
    std::vector<std::vector<std::pair<int, double>>> stacks(static_cast<std::size_t>(M) + 1);
    auto tolerance = [](double v) { return 1e-12 * std::max(1.0, std::abs(v)); };
    for (int i = b; i >= 0; --i) {
      if (i < b)
        for (int mm = 1; mm < M; ++mm) {
          double g = at(t, 1, i + 1, mm);
          if (paper_) g = std::max(g, transfer_ms(0, out_[static_cast<std::size_t>(i)], 1.0));
          auto& st = stacks[static_cast<std::size_t>(mm)];
          while (!st.empty() && st.back().second >= g) st.pop_back();
          st.emplace_back(i, g);
        }
      for (int x = i == 0 ? 0 : 1; x >= 0; --x)
        for (int m = 1; m <= M; ++m) {
          double best = kInf;
          int cut = -1, reps = 0;
          for (int r = 1; r <= (o_.straight_pipeline ? 1 : m); ++r) {
            double v = kInf;
            int j = -1;
            if (r == m) {  // the last stage takes the units left: only j = b
              v = stage_cost(0, c, i, b, r, m, x == 0, false);
              j = b;
            } else if (i < b) {
              const auto& st = stacks[static_cast<std::size_t>(m - r)];
              const int n = static_cast<int>(st.size());
              auto rec = [&](int q) -> const std::pair<int, double>& { return st[static_cast<std::size_t>(n - 1 - q)]; };
              auto f = [&](int q) { return stage_cost(0, c, i, rec(q).first, r, m, x == 0, false); };
              int lo = 0, hi = n;  // the first record where f >= g
              while (lo < hi) {
                const int mid = (lo + hi) / 2;
                if (f(mid) >= rec(mid).second) hi = mid;
                else lo = mid + 1;
              }
              const int cross = lo;
              if (cross < n) v = f(cross), j = rec(cross).first;
              if (cross > 0 && rec(cross - 1).second <= v) v = rec(cross - 1).second, j = rec(cross - 1).first;
              if (v < kInf) {  // the smallest j within the tolerance: the first record before cross with g <= v + tol
                int a = 0, z = cross;
                while (a < z) {
                  const int mid = (a + z) / 2;
                  if (rec(mid).second <= v + tolerance(v)) z = mid;
                  else a = mid + 1;
                }
                if (a < cross) j = rec(a).first;
                else j = rec(cross).first;
              }
            }
            if (v == kInf) continue;
            if (v < best - tolerance(v) || (v <= best + tolerance(best) && j < cut)) best = v, cut = j, reps = r;
          }
          const std::size_t u = idx(t, x, i, m);
          t.best[u] = best;
          t.cut[u] = cut;
          t.reps[u] = reps;
        }
    }
  }

  void expand(int k, Ctx c, int a, int b, int m, int x, long outer, std::vector<FlatStage>& out) {
    int i = a;
    while (i <= b) {
      const Table& t = table(k, c, b);
      const std::size_t u = idx(t, x, i, m);
      const int j = t.cut[u], r = t.reps[u];
      if (j < 0) throw std::logic_error("planner: expanding an infeasible state");
      if (k == 0) {
        FlatStage s;
        s.first = i;
        s.last = j;
        s.replication = outer * r;
        s.time_ms = combine(0, range_t(i, j), allreduce_ms(0, range_w(i, j), r), r, x == 0) / outer;
        out.push_back(s);
      } else {
        expand(k - 1, inner(k, c, r, m), i, j, o_.levels[static_cast<std::size_t>(k) - 1].machines, 0, outer * r, out);
      }
      i = j + 1;
      m -= r;
      x = 1;
    }
  }

  PlannerOptions o_;
  int L_;
  bool paper_ = true, contexts_matter_ = false;
  std::vector<double> T_, W_, A_, O_, out_;
  std::vector<long> G_;
  std::map<std::tuple<int, long, long, int>, Table> memo_;
};

std::string fmt_bytes(double b) {
  if (!std::isfinite(b)) return "unlimited";
  return fmt::format("{:.4g} GB", b / 1e9);
}
}  // namespace

PlannerCostForm parse_planner_cost_form(const std::string& name) {
  if (name == "paper") return PlannerCostForm::paper;
  if (name == "reference") return PlannerCostForm::reference;
  throw UsageError("unknown planner cost form '" + name +
                   "': use paper (max of compute and all-reduce, the default) or reference (PipeDream's code: "
                   "their sum)");
}

const char* to_string(PlannerCostForm form) { return form == PlannerCostForm::paper ? "paper" : "reference"; }

int planner_devices(const std::vector<NetworkLevel>& levels) {
  std::string product;
  for (const NetworkLevel& l : levels) product += (product.empty() ? "" : " x ") + std::to_string(l.machines);
  long long n = 1;
  for (const NetworkLevel& l : levels) {
    if (l.machines < 1)
      throw UsageError(fmt::format("the network levels {} have a level of {} machines: give at least 1", product,
                                   l.machines));
    n *= l.machines;  // at most kMaxLevelDevices x INT_MAX: no overflow
    if (n > kMaxLevelDevices)
      throw UsageError(fmt::format("the network levels describe {} = more than {} devices, the most a plan takes: give "
                                   "levels whose MACHINES multiply to the devices planned for",
                                   product, kMaxLevelDevices));
  }
  return static_cast<int>(n);
}

void check_planner_options(const PlannerOptions& o) {
  if (o.levels.empty())
    throw UsageError(
        "the planner needs at least one network level: machines and bandwidth, e.g. 8 devices at "
        "10 GB/s");
  long devices = 1;
  for (std::size_t k = 0; k < o.levels.size(); ++k) {
    const NetworkLevel& l = o.levels[k];
    if (l.machines < 1)
      throw UsageError(fmt::format("network level {} has {} machines: give at least 1", k, l.machines));
    if (!(l.bandwidth > 0))
      throw UsageError(
          fmt::format("network level {} has bandwidth {} bytes/s: give a positive number (infinity "
                      "is allowed)",
                      k, l.bandwidth));
    devices *= l.machines;
    if (devices > 4096)
      throw UsageError(fmt::format("the network levels describe {}+ devices; the planner handles up to 4096", devices));
  }
  if (!(o.memory_limit_bytes > 0))
    throw UsageError(fmt::format("memory limit {} bytes: give a positive number of bytes per device, or none",
                                 o.memory_limit_bytes));
  if (!(o.activation_compression >= 0) || !std::isfinite(o.activation_compression))
    throw UsageError(
        fmt::format("activation compression {}: give a ratio > 0, or 0 for none", o.activation_compression));
}

int Plan::devices_used() const { return std::accumulate(replication.begin(), replication.end(), 0); }

double data_parallel_time_ms(const Profile& profile, const PlannerOptions& options) {
  validate_profile(profile);
  check_planner_options(options);
  Dp dp(profile, options);
  const int last = static_cast<int>(profile.layers.size()) - 1;
  double t = dp.range_t(0, last);
  for (int k = 0; k < dp.levels(); ++k) {
    const int r = options.levels[static_cast<std::size_t>(k)].machines;
    t = dp.combine(k, t, dp.allreduce_ms(k, dp.range_w(0, last), r), r, true);
  }
  return t;
}

Plan plan_pipedream(const Profile& profile, const PlannerOptions& options) {
  validate_profile(profile);
  check_planner_options(options);
  const int L = static_cast<int>(profile.layers.size());
  const int devices = planner_devices(options.levels);
  Dp dp(profile, options);
  const int top_units = options.levels.back().machines;
  int chosen = top_units;
  double best = dp.top(top_units);
  if (options.allow_fewer_machines)
    for (int m = 1; m <= top_units; ++m) {  // fewest units among the best times
      const double v = dp.top(m);
      if (v < best - 1e-12 * std::max(1.0, std::abs(v)) || (v <= best && m < chosen)) best = v, chosen = m;
    }
  if (best == kInf) {
    std::string why;
    if (options.straight_pipeline && L < devices && !options.allow_fewer_machines)
      why = fmt::format(
          "a straight pipeline on {} devices needs at least {} layers and the profile has {}: allow "
          "fewer machines, replication, or use fewer devices",
          devices, devices, L);
    else if (std::isfinite(options.memory_limit_bytes))
      why = fmt::format(
          "no split fits in {} per device: raise the memory limit, add devices, or shrink the "
          "micro-batch",
          fmt_bytes(options.memory_limit_bytes));
    else
      why = fmt::format("no plan uses exactly the {} units of the outer level with {} layers: allow fewer machines",
                        top_units, L);
    throw UsageError("planner: " + why);
  }
  const std::vector<FlatStage> flat = dp.expand_top(chosen);
  Plan plan;
  plan.model = profile.model;
  plan.layers = L;
  plan.options = options;
  plan.time_ms = best;
  long after = 0;
  for (const FlatStage& s : flat) after += s.replication;
  for (const FlatStage& s : flat) {
    const long n = ceil_div(after, s.replication);
    plan.balance.push_back(s.last - s.first + 1);
    plan.replication.push_back(static_cast<int>(s.replication));
    plan.stage_time_ms.push_back(s.time_ms);
    plan.stage_in_flight.push_back(static_cast<int>(n));
    plan.stage_memory_bytes.push_back(paper_memory(dp.range_w(s.first, s.last), dp.range_o(s.first, s.last),
                                                   dp.range_a(s.first, s.last), n, options.weight_stashing));
    after -= s.replication;
  }
  check_balance(plan.balance, L);
  plan.data_parallel_time_ms = data_parallel_time_ms(profile, options);
  plan.speedup = plan.data_parallel_time_ms / plan.time_ms;
  if (options.cost_form == PlannerCostForm::paper)
    plan.data_parallel_fits = paper_memory(dp.range_w(0, L - 1), dp.range_o(0, L - 1), dp.range_a(0, L - 1), 1,
                                           options.weight_stashing) <= options.memory_limit_bytes;
  else
    plan.data_parallel_fits = true;  // the reference estimate stashes nothing when no stage follows
  return plan;
}

// --- JSON ------------------------------------------------------------------------------------------
namespace {
using nlohmann::json;

// Infinity (no limit, unlimited bandwidth) is written as null: JSON has no infinity.
json finite_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

[[noreturn]] void plan_fail(const std::string& origin, const std::string& where, const std::string& problem,
                            const std::string& fix) {
  throw UsageError(fmt::format("{}: {}: {}; {}", origin, where, problem, fix));
}

const json& need(const json& obj, const std::string& origin, const std::string& path, const std::string& key) {
  auto it = obj.find(key);
  if (it == obj.end())
    plan_fail(origin, path, "the required field \"" + key + "\" is missing", "add it (docs/PROFILE.md)");
  return *it;
}

double number_or_inf(const json& v, const std::string& origin, const std::string& where) {
  if (v.is_null()) return kInf;
  if (!v.is_number()) plan_fail(origin, where, "is " + json_excerpt(v), "write a number, or null for unlimited");
  return v.get<double>();
}

double number(const json& v, const std::string& origin, const std::string& where) {
  if (!v.is_number()) plan_fail(origin, where, "is " + json_excerpt(v), "write a number");
  return v.get<double>();
}

bool boolean(const json& v, const std::string& origin, const std::string& where) {
  if (!v.is_boolean()) plan_fail(origin, where, "is " + json_excerpt(v), "write true or false");
  return v.get<bool>();
}

template <class T>
std::vector<T> array_of(const json& v, const std::string& origin, const std::string& where, std::size_t size) {
  if (!v.is_array()) plan_fail(origin, where, "is " + json_excerpt(v), "write an array with one entry per stage");
  if (size != static_cast<std::size_t>(-1) && v.size() != size)
    plan_fail(origin, where, fmt::format("has {} entries for {} stages", v.size(), size), "give one entry per stage");
  std::vector<T> out;
  for (std::size_t s = 0; s < v.size(); ++s) {
    const json& e = v[s];
    const std::string at = fmt::format("{}[{}]", where, s);
    if constexpr (std::is_integral_v<T>) {
      if (!e.is_number_integer()) plan_fail(origin, at, "is " + json_excerpt(e), "write an integer");
      out.push_back(e.get<T>());
    } else {
      out.push_back(number(e, origin, at));
    }
  }
  return out;
}
}  // namespace

json plan_to_json(const Plan& p) {
  json levels = json::array();
  for (const NetworkLevel& l : p.options.levels)
    levels.push_back({{"machines", l.machines}, {"bandwidth_bytes_per_s", finite_or_null(l.bandwidth)}});
  json options = {{"levels", levels},
                  {"cost_form", to_string(p.options.cost_form)},
                  {"memory_limit_bytes", finite_or_null(p.options.memory_limit_bytes)},
                  {"straight_pipeline", p.options.straight_pipeline},
                  {"allow_fewer_machines", p.options.allow_fewer_machines},
                  {"activation_compression", p.options.activation_compression},
                  {"weight_stashing", p.options.weight_stashing}};
  json j{{"format", kPlanFormat},
              {"version", kPlanVersion},
              {"planner", "pipedream"},
              {"model", p.model},
              {"layers", p.layers},
              {"options", options},
              {"balance", p.balance},
              {"replication", p.replication},
              {"stage_time_ms", p.stage_time_ms},
              {"stage_memory_bytes", p.stage_memory_bytes},
              {"stage_in_flight", p.stage_in_flight},
              {"time_ms", finite_or_null(p.time_ms)},
              {"data_parallel_time_ms", finite_or_null(p.data_parallel_time_ms)},
              {"speedup_over_data_parallel", finite_or_null(p.speedup)},
              {"data_parallel_fits", p.data_parallel_fits}};
  if (p.stage_in_flight.empty()) j.erase("stage_in_flight");  // not recorded (a plan file's synchronous plan)
  return j;
}

Plan plan_from_json(const json& j, const std::string& origin) {
  if (!j.is_object()) plan_fail(origin, "the top level", "is not a JSON object", "a plan file is one object {...}");
  const json& format = need(j, origin, "the top level", "format");
  if (format != kPlanFormat)
    plan_fail(origin, "format", "is " + json_excerpt(format), std::string("a plan has \"format\": \"") + kPlanFormat + "\"");
  const json& version = need(j, origin, "the top level", "version");
  if (!version.is_number_integer() || version.get<long long>() < 1 || version.get<long long>() > kPlanVersion)
    plan_fail(origin, "version", "is " + json_excerpt(version),
              fmt::format("this pipetrain reads plan versions 1..{}", kPlanVersion));
  Plan p;
  const json& model = need(j, origin, "the top level", "model");
  if (!model.is_string()) plan_fail(origin, "model", "is " + json_excerpt(model), "write a string");
  p.model = model.get<std::string>();
  const json& layers = need(j, origin, "the top level", "layers");
  if (!layers.is_number_integer() || layers.get<long long>() < 1)
    plan_fail(origin, "layers", "is " + json_excerpt(layers), "write the model's layer count, an integer >= 1");
  p.layers = layers.get<int>();
  p.balance =
      array_of<int>(need(j, origin, "the top level", "balance"), origin, "balance", static_cast<std::size_t>(-1));
  try {
    check_balance(p.balance, p.layers);
  } catch (const UsageError& e) {
    plan_fail(origin, "balance", e.what(), "the plan does not fit its own layer count");
  }
  const std::size_t stages = p.balance.size();
  p.replication = array_of<int>(need(j, origin, "the top level", "replication"), origin, "replication", stages);
  for (std::size_t s = 0; s < stages; ++s)
    if (p.replication[s] < 1)
      plan_fail(origin, fmt::format("replication[{}]", s), fmt::format("is {}", p.replication[s]),
                "every stage runs on at least 1 device");
  p.stage_time_ms =
      array_of<double>(need(j, origin, "the top level", "stage_time_ms"), origin, "stage_time_ms", stages);
  p.stage_memory_bytes =
      array_of<double>(need(j, origin, "the top level", "stage_memory_bytes"), origin, "stage_memory_bytes", stages);
  if (j.contains("stage_in_flight"))  // optional: a plan file's synchronous top level has none
    p.stage_in_flight = array_of<int>(j["stage_in_flight"], origin, "stage_in_flight", stages);
  p.time_ms = number_or_inf(need(j, origin, "the top level", "time_ms"), origin, "time_ms");
  p.data_parallel_time_ms =
      number_or_inf(need(j, origin, "the top level", "data_parallel_time_ms"), origin, "data_parallel_time_ms");
  p.speedup = number_or_inf(need(j, origin, "the top level", "speedup_over_data_parallel"), origin,
                            "speedup_over_data_parallel");
  p.data_parallel_fits = boolean(need(j, origin, "the top level", "data_parallel_fits"), origin, "data_parallel_fits");
  const json& o = need(j, origin, "the top level", "options");
  if (!o.is_object()) plan_fail(origin, "options", "is " + json_excerpt(o), "write an object");
  const json& levels = need(o, origin, "options", "levels");
  if (!levels.is_array() || levels.empty())
    plan_fail(origin, "options.levels", "is " + json_excerpt(levels), "write an array of {machines, bandwidth_bytes_per_s}");
  for (std::size_t k = 0; k < levels.size(); ++k) {
    const std::string at = fmt::format("options.levels[{}]", k);
    if (!levels[k].is_object()) plan_fail(origin, at, "is " + json_excerpt(levels[k]), "write an object");
    const json& machines = need(levels[k], origin, at, "machines");
    if (!machines.is_number_integer()) plan_fail(origin, at + ".machines", "is " + json_excerpt(machines), "write an integer");
    NetworkLevel l;
    l.machines = machines.get<int>();
    l.bandwidth =
        number_or_inf(need(levels[k], origin, at, "bandwidth_bytes_per_s"), origin, at + ".bandwidth_bytes_per_s");
    p.options.levels.push_back(l);
  }
  const json& form = need(o, origin, "options", "cost_form");
  if (!form.is_string())
    plan_fail(origin, "options.cost_form", "is " + json_excerpt(form), "write \"paper\" or \"reference\"");
  try {
    p.options.cost_form = parse_planner_cost_form(form.get<std::string>());
  } catch (const UsageError& e) {
    plan_fail(origin, "options.cost_form", e.what(), "write \"paper\" or \"reference\"");
  }
  p.options.memory_limit_bytes =
      number_or_inf(need(o, origin, "options", "memory_limit_bytes"), origin, "options.memory_limit_bytes");
  p.options.straight_pipeline =
      boolean(need(o, origin, "options", "straight_pipeline"), origin, "options.straight_pipeline");
  p.options.allow_fewer_machines =
      boolean(need(o, origin, "options", "allow_fewer_machines"), origin, "options.allow_fewer_machines");
  p.options.activation_compression =
      number(need(o, origin, "options", "activation_compression"), origin, "options.activation_compression");
  p.options.weight_stashing = boolean(need(o, origin, "options", "weight_stashing"), origin, "options.weight_stashing");
  try {
    check_planner_options(p.options);
  } catch (const UsageError& e) {
    plan_fail(origin, "options", e.what(), "fix the options");
  }
  // A plan file whose ranks hold v stages each (its "virtual_stages", search.h's PlanFile) lists every
  // stage: its ranks are the replication's sum over v.
  long long per_rank = 1;
  if (j.contains("virtual_stages") && j["virtual_stages"].is_number_integer() && j["virtual_stages"].get<long long>() > 1)
    per_rank = j["virtual_stages"].get<long long>();
  if (p.devices_used() / per_rank > planner_devices(p.options.levels))
    plan_fail(
        origin, "replication",
        fmt::format("uses {} devices but the levels have {}", p.devices_used() / per_rank, planner_devices(p.options.levels)),
        "the replication factors must fit the devices");
  return p;
}

std::string plan_to_json_text(const Plan& plan) { return plan_to_json(plan).dump(2) + "\n"; }

Plan plan_from_json_text(const std::string& text, const std::string& origin) {
  return plan_from_json(parse_json_text(text, origin), origin);
}

void save_plan(const std::string& path, const Plan& plan) { write_file_atomic(path, plan_to_json_text(plan)); }

Plan load_plan(const std::string& path) {
  return plan_from_json_text(read_file_capped(path, "plan", kMaxPlanFileBytes), path);
}

}  // namespace pipetrain

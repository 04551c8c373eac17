// UMPIPE planners (plan/umpipe.h): the best equal partition, local greedy, global-greedy DP
// (docs/ALGORITHMS.md §7.5) and DGAP (§7.4), with DGAP's genotype helpers and repair.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "pipetrain/core/error.h"
#include "pipetrain/core/random.h"
#include "pipetrain/plan/umpipe.h"

namespace pipetrain {
namespace {

// xoshiro256** seeded by splitmix64, with our own mappings to ranges: std's distributions differ between
// standard libraries, and DGAP must give the same plan for a seed everywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (auto& word : s_) {  // splitmix64's stream from `seed`
      word = splitmix64(seed);
      seed += 0x9e3779b97f4a7c15ULL;
    }
  }
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }     // [0, 1)
  int below(int n) { return std::min(n - 1, static_cast<int>(uniform() * n)); }  // [0, n)
  bool chance(double p) { return uniform() < p; }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

// Candidate family of the baselines: equal splits into n micro-batches, n = first..N, where `first` is
// the fewest whose largest part ceil(N/n) fits the cap.
int fewest_parts(int samples, int cap) { return (samples + cap - 1) / cap; }

int min_cap(const UmpipeCaps& caps) {
  int c = std::numeric_limits<int>::max();
  for (int x : caps.forward) c = std::min(c, x);
  for (int x : caps.backward) c = std::min(c, x);
  return c;
}

}  // namespace

// --- genotype ----------------------------------------------------------------------------------------

std::vector<int> cuts_to_partition(const std::vector<uint8_t>& cuts) {
  std::vector<int> sizes;
  int len = 0;
  for (uint8_t cut : cuts) {
    ++len;
    if (cut) {
      sizes.push_back(len);
      len = 0;
    }
  }
  sizes.push_back(len + 1);
  return sizes;
}

std::vector<uint8_t> partition_to_cuts(const std::vector<int>& sizes) {
  const int n = std::accumulate(sizes.begin(), sizes.end(), 0);
  if (n < 1) throw UsageError("partition_to_cuts: the sizes must sum to >= 1");
  std::vector<uint8_t> cuts(static_cast<std::size_t>(n - 1), 0);
  int end = 0;
  for (std::size_t k = 0; k + 1 < sizes.size(); ++k) {
    if (sizes[k] < 1) throw UsageError(fmt::format("partition_to_cuts: micro-batch {} has {} samples", k, sizes[k]));
    end += sizes[k];
    cuts[static_cast<std::size_t>(end - 1)] = 1;
  }
  return cuts;
}

void repair_cuts(std::vector<uint8_t>& cuts, int cap, int min_size) {
  if (cap < 1) throw UsageError(fmt::format("repair_cuts: the cap must be >= 1, got {}", cap));
  // Cap: after sample t the open micro-batch holds `len` samples; when it is full, cut after t. The
  // last micro-batch then has at most cap samples too, because it was below cap before its last sample.
  int len = 0;
  for (auto& cut : cuts) {
    ++len;
    if (cut) {
      len = 0;
    } else if (len == cap) {
      cut = 1;
      len = 0;
    }
  }
  if (min_size <= 1) return;
  // Minimum: merge a small micro-batch into its smaller neighbour when the result stays within the cap
  // (the cap wins over the minimum where both cannot hold).
  std::vector<int> sizes = cuts_to_partition(cuts);
  for (std::size_t i = 0; i < sizes.size();) {
    if (sizes[i] >= min_size || sizes.size() == 1) {
      ++i;
      continue;
    }
    const bool has_prev = i > 0, has_next = i + 1 < sizes.size();
    const int prev = has_prev ? sizes[i - 1] + sizes[i] : std::numeric_limits<int>::max();
    const int next = has_next ? sizes[i + 1] + sizes[i] : std::numeric_limits<int>::max();
    if (std::min(prev, next) > cap) {
      ++i;
      continue;
    }
    if (next <= prev) {
      sizes[i] = next;
      sizes.erase(sizes.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    } else {
      sizes[i - 1] = prev;
      sizes.erase(sizes.begin() + static_cast<std::ptrdiff_t>(i));
      --i;
    }
  }
  cuts = partition_to_cuts(sizes);
}

// --- baselines ---------------------------------------------------------------------------------------

UmpipeResult plan_umpipe_equal(const UmpipeModel& model) {
  const UmpipeCaps caps = umpipe_caps(model);
  const UmpipeEvaluator ev(model);
  const int n = model.samples, p = model.stage_count();
  UmpipeResult best;
  best.planner = "equal";
  best.step_ms = std::numeric_limits<double>::infinity();
  for (int m = fewest_parts(n, min_cap(caps)); m <= n; ++m) {
    const UmpipePlan plan = equal_plan(p, n, m);
    const double t = ev.step_ms(plan);
    ++best.evaluations;
    if (t < best.step_ms) {
      best.step_ms = t;
      best.plan = plan;
      best.microbatches = m;
    }
  }
  return best;
}

UmpipeResult plan_umpipe_local_greedy(const UmpipeModel& model) {
  const UmpipeCaps caps = umpipe_caps(model);
  const UmpipeEvaluator ev(model);
  const int n = model.samples, p = model.stage_count();
  UmpipeResult r;
  r.planner = "local-greedy";
  r.plan.forward.resize(static_cast<std::size_t>(p));
  r.plan.backward.resize(static_cast<std::size_t>(p));
  std::vector<UmpipeRow> fwd(static_cast<std::size_t>(p)), bwd(static_cast<std::size_t>(p));
  for (int j = 0; j < p; ++j) {
    const auto js = static_cast<std::size_t>(j);
    double best = std::numeric_limits<double>::infinity();
    for (int parts = fewest_parts(n, caps.forward[js]); parts <= n; ++parts) {
      std::vector<int> sizes = equal_partition(n, parts);
      UmpipeRow row = ev.forward_row(j, sizes, j > 0 ? &fwd[js - 1] : nullptr);
      ++r.evaluations;
      if (row.finish() < best) {
        best = row.finish();
        r.plan.forward[js] = std::move(sizes);
        fwd[js] = std::move(row);
      }
    }
  }
  for (int j = p - 1; j >= 0; --j) {
    const auto js = static_cast<std::size_t>(j);
    double best = std::numeric_limits<double>::infinity();
    for (int parts = fewest_parts(n, caps.backward[js]); parts <= n; ++parts) {
      std::vector<int> sizes = equal_partition(n, parts);
      UmpipeRow row = ev.backward_row(j, sizes, j + 1 < p ? &bwd[js + 1] : nullptr, fwd[js].finish());
      ++r.evaluations;
      if (row.finish() < best) {
        best = row.finish();
        r.plan.backward[js] = std::move(sizes);
        bwd[js] = std::move(row);
      }
    }
  }
  r.step_ms = ev.step_ms(r.plan);
  return r;
}

UmpipeResult plan_umpipe_global_dp(const UmpipeModel& model) {
  const UmpipeCaps caps = umpipe_caps(model);
  const UmpipeEvaluator ev(model);
  const int n = model.samples, p = model.stage_count();
  UmpipeResult r;
  r.planner = "global-dp";
  struct State {
    int parts = 0;  // the candidate: equal_partition(N, parts)
    int from = -1;  // index of the predecessor state
    UmpipeRow row;
  };
  auto candidates = [&](int cap) {
    std::vector<State> v;
    for (int parts = fewest_parts(n, cap); parts <= n; ++parts) v.push_back(State{parts, -1, {}});
    return v;
  };
  // One DP pass over stages in `order`; `eval(j, sizes, prev_row)` gives the row of stage j.
  auto pass = [&](const std::vector<int>& order, const std::vector<int>& cap, auto eval) {
    std::vector<std::vector<State>> dp;
    for (std::size_t step = 0; step < order.size(); ++step) {
      const int j = order[step];
      std::vector<State> states = candidates(cap[static_cast<std::size_t>(j)]);
      for (State& s : states) {
        const std::vector<int> sizes = equal_partition(n, s.parts);
        if (step == 0) {
          s.row = eval(j, sizes, nullptr);
          ++r.evaluations;
          continue;
        }
        double best = std::numeric_limits<double>::infinity();
        const std::vector<State>& prev = dp.back();
        for (std::size_t c = 0; c < prev.size(); ++c) {
          UmpipeRow row = eval(j, sizes, &prev[c].row);
          ++r.evaluations;
          if (row.finish() < best) {
            best = row.finish();
            s.from = static_cast<int>(c);
            s.row = std::move(row);
          }
        }
      }
      dp.push_back(std::move(states));
    }
    return dp;
  };
  // The partitions along the back-pointers from final state `c`, indexed by stage.
  auto backtrack = [&](const std::vector<std::vector<State>>& dp, const std::vector<int>& order, int c) {
    std::vector<std::vector<int>> rows(static_cast<std::size_t>(p));
    for (std::size_t step = dp.size(); step-- > 0;) {
      const State& s = dp[step][static_cast<std::size_t>(c)];
      rows[static_cast<std::size_t>(order[step])] = equal_partition(n, s.parts);
      c = s.from;
    }
    return rows;
  };

  std::vector<int> up(static_cast<std::size_t>(p)), down;
  std::iota(up.begin(), up.end(), 0);
  down.assign(up.rbegin(), up.rend());
  const auto fdp = pass(up, caps.forward, [&](int j, const std::vector<int>& sizes, const UmpipeRow* prev) {
    return ev.forward_row(j, sizes, prev);
  });
  int best_final = 0;
  for (std::size_t c = 1; c < fdp.back().size(); ++c)
    if (fdp.back()[c].row.finish() < fdp.back()[static_cast<std::size_t>(best_final)].row.finish())
      best_final = static_cast<int>(c);
  r.plan.forward = backtrack(fdp, up, best_final);
  std::vector<double> forward_finish(static_cast<std::size_t>(p));
  {
    UmpipeRow prev;
    for (int j = 0; j < p; ++j) {
      UmpipeRow row = ev.forward_row(j, r.plan.forward[static_cast<std::size_t>(j)], j > 0 ? &prev : nullptr);
      forward_finish[static_cast<std::size_t>(j)] = row.finish();
      prev = std::move(row);
    }
  }
  const auto bdp = pass(down, caps.backward, [&](int j, const std::vector<int>& sizes, const UmpipeRow* prev) {
    return ev.backward_row(j, sizes, prev, forward_finish[static_cast<std::size_t>(j)]);
  });
  r.step_ms = std::numeric_limits<double>::infinity();
  for (std::size_t c = 0; c < bdp.back().size(); ++c) {
    UmpipePlan plan;
    plan.forward = r.plan.forward;
    plan.backward = backtrack(bdp, down, static_cast<int>(c));
    const double t = ev.step_ms(plan);
    ++r.evaluations;
    if (t < r.step_ms) {
      r.step_ms = t;
      r.plan.backward = plan.backward;
    }
  }
  return r;
}

// --- DGAP --------------------------------------------------------------------------------------------

namespace {

// An individual: the forward chromosome CF (rows 0..p-1) and the backward chromosome CB (rows p..2p-1),
// each row N-1 cut bits.
struct Individual {
  std::vector<std::vector<uint8_t>> rows;
  double fitness = 0;
};

UmpipePlan decode(const Individual& ind, int p) {
  UmpipePlan plan;
  for (int j = 0; j < p; ++j) {
    plan.forward.push_back(cuts_to_partition(ind.rows[static_cast<std::size_t>(j)]));
    plan.backward.push_back(cuts_to_partition(ind.rows[static_cast<std::size_t>(p + j)]));
  }
  return plan;
}

Individual encode(const UmpipePlan& plan) {
  Individual ind;
  for (const auto& row : plan.forward) ind.rows.push_back(partition_to_cuts(row));
  for (const auto& row : plan.backward) ind.rows.push_back(partition_to_cuts(row));
  return ind;
}

void check_options(const DgapOptions& o) {
  auto bad = [](const std::string& what) { throw UsageError("DGAP: " + what); };
  if (o.population < 2) bad(fmt::format("population must be >= 2, got {}", o.population));
  if (o.generations < 0) bad(fmt::format("generations must be >= 0, got {}", o.generations));
  if (o.stall_generations < 1) bad(fmt::format("stall_generations must be >= 1, got {}", o.stall_generations));
  if (o.elite < 1 || o.elite >= o.population)
    bad(fmt::format("elite must be in 1..population-1 (elitism keeps the best plan), got {}", o.elite));
  if (o.equal_seeds < 1)
    bad(fmt::format("equal_seeds must be >= 1 (the best equal plan seeds DGAP), got {}", o.equal_seeds));
  if (o.min_micro_batch < 1) bad(fmt::format("min_micro_batch must be >= 1, got {}", o.min_micro_batch));
  if (!(o.mutation_rate <= 1))
    bad(fmt::format("mutation_rate must be <= 1 (< 0 for the default), got {}", o.mutation_rate));
  if (!(o.stagewise_seeds >= 0 && o.stagewise_seeds <= 1))
    bad(fmt::format("stagewise_seeds must be a share of the population in [0, 1], got {}", o.stagewise_seeds));
  for (const auto& [v, name] : {std::pair{o.shift_rate, "shift_rate"},
                                {o.resplit_rate, "resplit_rate"},
                                {o.row_crossover_rate, "row_crossover_rate"},
                                {o.inner_crossover_rate, "inner_crossover_rate"}})
    if (!(v >= 0 && v <= 1)) bad(fmt::format("{} must be a probability in [0, 1], got {}", name, v));
}

}  // namespace

UmpipeResult plan_umpipe_dgap(const UmpipeModel& model, const DgapOptions& o,
                              const std::function<void(const DgapProgress&)>& progress) {
  check_options(o);
  const UmpipeCaps caps = umpipe_caps(model);
  const UmpipeEvaluator ev(model);
  const int n = model.samples, p = model.stage_count(), size = o.population;
  const auto bits = static_cast<std::size_t>(n - 1);
  Rng rng(o.seed);
  UmpipeResult result;
  result.planner = "dgap";
  auto cap_of = [&](int row) {
    return row < p ? caps.forward[static_cast<std::size_t>(row)] : caps.backward[static_cast<std::size_t>(row - p)];
  };
  auto repair = [&](Individual& ind) {
    for (int row = 0; row < 2 * p; ++row)
      repair_cuts(ind.rows[static_cast<std::size_t>(row)], cap_of(row), o.min_micro_batch);
  };

  // First population: the best equal plans (fastest first), optionally the baselines, then random masks
  // with cut densities spread over [1/N, 1/2].
  std::vector<Individual> pop;
  {
    std::vector<std::pair<double, int>> equal;
    for (int m = fewest_parts(n, min_cap(caps)); m <= n; ++m) {
      equal.emplace_back(ev.step_ms(equal_plan(p, n, m)), m);
      ++result.evaluations;
    }
    std::sort(equal.begin(), equal.end());
    for (std::size_t k = 0; k < equal.size() && static_cast<int>(k) < std::min(o.equal_seeds, size); ++k)
      pop.push_back(encode(equal_plan(p, n, equal[k].second)));
    if (o.seed_baselines)
      for (const UmpipeResult& b : {plan_umpipe_local_greedy(model), plan_umpipe_global_dp(model)})
        if (static_cast<int>(pop.size()) < size) pop.push_back(encode(b.plan));
    // Stage-wise equal plans: every row an equal split with its own count, the family the baselines
    // search. Row crossover recombines them; random masks alone rarely produce such regular rows.
    const int stagewise = static_cast<int>(o.stagewise_seeds * size);
    for (int k = 0; k < stagewise && static_cast<int>(pop.size()) < size; ++k) {
      Individual ind;
      for (int row = 0; row < 2 * p; ++row) {
        const int first = fewest_parts(n, cap_of(row));
        ind.rows.push_back(partition_to_cuts(equal_partition(n, first + rng.below(n - first + 1))));
      }
      pop.push_back(std::move(ind));
    }
    while (static_cast<int>(pop.size()) < size) {
      Individual ind;
      const double density = 1.0 / n + (0.5 - 1.0 / n) * rng.uniform();
      for (int row = 0; row < 2 * p; ++row) {
        std::vector<uint8_t> cuts(bits);
        for (auto& c : cuts) c = rng.chance(density) ? 1 : 0;
        ind.rows.push_back(std::move(cuts));
      }
      repair(ind);
      pop.push_back(std::move(ind));
    }
    for (Individual& ind : pop) repair(ind);  // seeds are within caps; the minimum size may merge them
  }
  const Individual best_seed = pop.front();

  UmpipePopulation soa(p, n, size);
  std::vector<double> fitness;
  auto evaluate = [&] {
    for (int i = 0; i < size; ++i) {
      const Individual& ind = pop[static_cast<std::size_t>(i)];
      for (int row = 0; row < 2 * p; ++row) {
        const std::vector<int> sizes = cuts_to_partition(ind.rows[static_cast<std::size_t>(row)]);
        soa.set_row(i, row >= p, row % p, sizes.data(), static_cast<int>(sizes.size()));
      }
    }
    ev.evaluate(soa, fitness);
    result.evaluations += size;
    for (int i = 0; i < size; ++i) pop[static_cast<std::size_t>(i)].fitness = fitness[static_cast<std::size_t>(i)];
  };
  auto ranked = [&] {
    std::vector<int> order(static_cast<std::size_t>(size));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      const double fa = pop[static_cast<std::size_t>(a)].fitness, fb = pop[static_cast<std::size_t>(b)].fitness;
      return fa < fb || (fa == fb && a < b);
    });
    return order;
  };
  auto report = [&](int generation, double best, int stall) {
    if (!progress) return;
    double mean = 0;
    for (const Individual& ind : pop) mean += ind.fitness;
    progress(DgapProgress{generation, best, mean / size, stall, result.evaluations});
  };
  auto tournament = [&]() -> const Individual& {
    const int a = rng.below(size), b = rng.below(size);
    const Individual &x = pop[static_cast<std::size_t>(a)], &y = pop[static_cast<std::size_t>(b)];
    return (y.fitness < x.fitness || (y.fitness == x.fitness && b < a)) ? y : x;
  };
  // Per-bit flips with probability mu, drawn as geometric gaps between flips.
  const double mu = o.mutation_rate >= 0 ? o.mutation_rate : n > 1 ? 1.0 / (static_cast<double>(p) * (n - 1)) : 0.0;
  auto mutate = [&](std::vector<uint8_t>& cuts) {
    if (mu <= 0 || cuts.empty()) return;
    const double log_keep = std::log1p(-std::min(mu, 1.0 - 1e-12));
    double pos = -1;
    for (;;) {
      pos += 1 + std::floor(std::log1p(-rng.uniform()) / log_keep);
      if (pos >= static_cast<double>(cuts.size())) break;
      cuts[static_cast<std::size_t>(pos)] ^= 1;
    }
  };
  auto shift = [&](std::vector<uint8_t>& cuts) {
    int count = 0;
    for (uint8_t c : cuts) count += c;
    if (count == 0) return;
    int pick = rng.below(count), at = 0;
    for (std::size_t t = 0; t < cuts.size(); ++t)
      if (cuts[t] && pick-- == 0) at = static_cast<int>(t);
    const int to = at + (rng.chance(0.5) ? 1 : -1);
    if (to < 0 || to >= static_cast<int>(cuts.size()) || cuts[static_cast<std::size_t>(to)]) return;
    cuts[static_cast<std::size_t>(at)] = 0;
    cuts[static_cast<std::size_t>(to)] = 1;
  };

  // Re-split: a run of neighbouring stages of one chromosome becomes equal splits into a common count,
  // one fewer than, as many as or one more than the first row's (within the caps). Neighbours that cut
  // alike hand micro-batches on without waiting for partial ones; a move that bit flips would need
  // many coordinated changes for, each of them worse on its own.
  auto resplit = [&](Individual& ind, int chromosome) {
    int first_stage = rng.below(p), last_stage = rng.below(p);
    if (first_stage > last_stage) std::swap(first_stage, last_stage);
    const auto& lead = ind.rows[static_cast<std::size_t>(chromosome * p + first_stage)];
    int count = 1;
    for (uint8_t c : lead) count += c;
    int fewest = 1;
    for (int j = first_stage; j <= last_stage; ++j)
      fewest = std::max(fewest, fewest_parts(n, cap_of(chromosome * p + j)));
    const std::vector<uint8_t> cuts =
        partition_to_cuts(equal_partition(n, std::clamp(count + rng.below(3) - 1, fewest, n)));
    for (int j = first_stage; j <= last_stage; ++j) ind.rows[static_cast<std::size_t>(chromosome * p + j)] = cuts;
  };

  evaluate();
  std::vector<int> order = ranked();
  double best = pop[static_cast<std::size_t>(order[0])].fitness;
  int stall = 0, generation = 0;
  report(0, best, 0);
  while (generation < o.generations && stall < o.stall_generations) {
    ++generation;
    std::vector<Individual> next;
    next.reserve(static_cast<std::size_t>(size));
    for (int e = 0; e < o.elite; ++e) next.push_back(pop[static_cast<std::size_t>(order[static_cast<std::size_t>(e)])]);
    while (static_cast<int>(next.size()) < size) {
      Individual a = tournament(), b = tournament();
      // The dual chromosome: CF (rows 0..p-1) and CB (rows p..2p-1) cross over independently, so a
      // child may take its forward rows from one parent and its backward rows from the other.
      if (rng.chance(o.row_crossover_rate))
        for (int row = 0; row < 2 * p; ++row)
          if (rng.chance(0.5)) std::swap(a.rows[static_cast<std::size_t>(row)], b.rows[static_cast<std::size_t>(row)]);
      for (int chromosome = 0; chromosome < 2 && bits > 1; ++chromosome)
        if (rng.chance(o.inner_crossover_rate)) {
          const auto row = static_cast<std::size_t>(chromosome * p + rng.below(p));
          const auto point = static_cast<std::ptrdiff_t>(1 + rng.below(static_cast<int>(bits) - 1));
          std::swap_ranges(a.rows[row].begin() + point, a.rows[row].end(), b.rows[row].begin() + point);
        }
      for (Individual* child : {&a, &b}) {
        for (int row = 0; row < 2 * p; ++row) {
          auto& cuts = child->rows[static_cast<std::size_t>(row)];
          mutate(cuts);
          if (rng.chance(o.shift_rate)) shift(cuts);
        }
        for (int chromosome = 0; chromosome < 2; ++chromosome)
          if (rng.chance(o.resplit_rate)) resplit(*child, chromosome);
        repair(*child);
      }
      next.push_back(std::move(a));
      if (static_cast<int>(next.size()) < size) next.push_back(std::move(b));
    }
    pop = std::move(next);
    evaluate();
    order = ranked();
    const double now = pop[static_cast<std::size_t>(order[0])].fitness;
    if (now < best) {
      stall = best - now > 1e-12 * std::abs(best) ? 0 : stall + 1;
      best = now;
    } else {
      ++stall;
    }
    report(generation, best, stall);
  }
  // The reported time is the scalar evaluator's; the best equal seed competes too, so rounding in the
  // vectorised form can never make DGAP's answer worse than the best equal plan.
  result.generations = generation;
  result.plan = decode(pop[static_cast<std::size_t>(order[0])], p);
  result.step_ms = ev.step_ms(result.plan);
  const UmpipePlan seed_plan = decode(best_seed, p);
  const double seed_ms = ev.step_ms(seed_plan);
  if (seed_ms < result.step_ms) {
    result.plan = seed_plan;
    result.step_ms = seed_ms;
  }
  return result;
}

std::vector<UmpipeResult> plan_umpipe_all(const UmpipeModel& model, const DgapOptions& options,
                                          const std::function<void(const DgapProgress&)>& progress) {
  return {plan_umpipe_equal(model), plan_umpipe_local_greedy(model), plan_umpipe_global_dp(model),
          plan_umpipe_dgap(model, options, progress)};
}

}  // namespace pipetrain

// UMPIPE planning benchmark (plan/umpipe.h, docs/ALGORITHMS.md §7; torch-free, links only pipetrain_core).
//
// 1. Evaluator speed (§7.3, issue 7's ">= 10x per individual at population 256"): the time per
//    individual of UmpipeEvaluator::step_ms (the scalar recurrence, one plan at a time) against
//    UmpipeEvaluator::evaluate (the vectorised max-plus form over the whole population), median over
//    --repeats, for every instruction set this CPU has, on two populations of 256: "random" (cut
//    densities spread over [1/N, 1/2], as DGAP's first generation) and "converged" (DGAP's answer with
//    one or two cuts flipped per individual, like a late generation).
// 2. Predicted step time of the four planners (best equal partition = GPipe with the best m, local
//    greedy, global-greedy DP, DGAP with default options; also DGAP with the baselines among its seeds)
//    on
//    (a) a GPT-like model, "gpt14": embedding, 12 transformer blocks and a head, profiled at several
//        micro-batch sizes from per-layer affine times with large fixed costs on the embedding and the
//        head (synthetic: no profile of a real GPT is made without LibTorch), and
//    (b) VGG-16 from PipeDream's published profile (one size, 128; each layer gets a fixed
//        --vgg-overhead ms per micro-batch and pass, the part of its time that does not scale with b),
//    for 2, 4 and 8 stages, balanced by time with the min-max solver.
//
//   build/bench/bench_umpipe --out umpipe.json [--repeats 31] [--vgg PATH] [--bandwidth 10]
//       [--latency-us 50] [--vgg-overhead 0.05] [--seed 1] [--quick]
//
// Prints both tables and writes them as JSON to --out. --vgg defaults to the repository's
// data/pipedream/vgg16-graph.txt. --quick (the `make test` run): 1 repeat, 2 and 4 stages only, and a
// small DGAP (population 16, at most 20 generations); its numbers only show the program works.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/plan/umpipe.h"

#include "bench_util.h"

using namespace pipetrain;

namespace {

struct Args {
  std::string out;
  std::string vgg;
  int repeats = 31;
  double bandwidth_gbps = 10;
  double latency_us = 50;
  double vgg_overhead_ms = 0.05;
  uint64_t seed = 1;
  bool quick = false;
};

// PipeDream's published VGG-16 profile, vendored in the repository (data/pipedream/README.md).
std::string default_vgg_path() {
#ifdef PIPETRAIN_SOURCE_DIR
  return std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt";
#else
  return "";
#endif
}

// The GPT-like profile. Per-layer times t(b) = alpha + beta b in ms at b = 1..32 (b0 = 8), backward
// twice the forward. The embedding and the head carry large fixed costs (token and position lookups,
// the vocabulary projection, softmax and loss: many small kernels per micro-batch), the head also the
// largest per-sample cost; a block is cheap to launch. Sizes for GPT-1 shapes: 768 wide, 256 tokens,
// a 40478-token vocabulary, fp32, Adam.
Profile gpt14_profile() {
  Profile prof;
  prof.model = "gpt14 (synthetic)";
  prof.micro_batch_size = 8;
  prof.source = "bench_umpipe: affine per-layer times, GPT-like";
  const double token_act = 256.0 * 768 * 4;  // bytes per sample after the embedding and every block
  const double vocab = 40478, d = 768;
  auto add = [&](const std::string& name, const std::string& type, double alpha, double beta, double act,
                 double params) {
    LayerProfile l;
    l.name = name;
    l.type = type;
    auto f = [&](int b) { return alpha + beta * b; };
    l.forward_ms = f(8);
    l.backward_ms = 2 * f(8);
    for (int b : {1, 2, 4, 16, 32}) l.by_micro_batch.push_back(SizeMeasurement{b, f(b), 2 * f(b)});
    l.activation_bytes = act * 8;
    l.parameter_bytes = params * 4;
    l.optimizer_bytes = 2 * params * 4;
    prof.layers.push_back(l);
  };
  add("embed", "Embedding", 2.0, 0.03, token_act, (vocab + 512) * d);
  for (int i = 0; i < 12; ++i) add(fmt::format("block{}", i), "Block", 0.15, 0.11, token_act, 12 * d * d + 13 * d);
  add("head", "Head", 2.5, 0.45, 256.0 * vocab * 4, vocab * d);
  return prof;
}

using pipetrain::bench::median;

using Clock = std::chrono::steady_clock;

struct SpeedRow {
  std::string population, isa;
  double micro_batches_per_individual = 0, scalar_ns = 0, vector_ns = 0;
};

std::vector<SpeedRow> evaluator_speed(const UmpipeModel& model, const UmpipePlan& good, const Args& a) {
  const int p = model.stage_count(), n = model.samples, size = 256;
  const UmpipeEvaluator ev(model);
  std::mt19937_64 rng(a.seed);
  std::uniform_real_distribution<double> u(0, 1);
  auto random_row = [&](double density) {
    std::vector<uint8_t> cuts(static_cast<std::size_t>(n - 1));
    for (auto& c : cuts) c = u(rng) < density;
    return cuts;
  };
  std::vector<std::pair<std::string, std::vector<UmpipePlan>>> pops(2);
  pops[0].first = "random";
  pops[1].first = "converged";
  for (int i = 0; i < size; ++i) {
    UmpipePlan r;
    const double density = 1.0 / n + (0.5 - 1.0 / n) * u(rng);
    for (int j = 0; j < p; ++j) {
      r.forward.push_back(cuts_to_partition(random_row(density)));
      r.backward.push_back(cuts_to_partition(random_row(density)));
    }
    pops[0].second.push_back(r);
    UmpipePlan c = good;
    const int flips = 1 + static_cast<int>(u(rng) * 2);
    for (int f = 0; f < flips && n > 1; ++f) {
      auto& rows = u(rng) < 0.5 ? c.forward : c.backward;
      auto& row = rows[static_cast<std::size_t>(u(rng) * p)];
      std::vector<uint8_t> cuts = partition_to_cuts(row);
      cuts[static_cast<std::size_t>(u(rng) * (n - 1))] ^= 1;
      row = cuts_to_partition(cuts);
    }
    pops[1].second.push_back(c);
  }
  std::vector<SpeedRow> rows;
  for (const auto& [name, plans] : pops) {
    UmpipePopulation pop(p, n, size);
    double mb = 0;
    for (int i = 0; i < size; ++i) {
      pop.set(i, plans[static_cast<std::size_t>(i)]);
      for (const auto& r : plans[static_cast<std::size_t>(i)].forward) mb += static_cast<double>(r.size());
      for (const auto& r : plans[static_cast<std::size_t>(i)].backward) mb += static_cast<double>(r.size());
    }
    // Repeats interleave the scalar pass and one pass per instruction set, so load from other processes
    // on the machine falls on all of them alike.
    const std::vector<std::string> isas = UmpipeEvaluator::available_vector_isas();
    std::vector<double> scalar, out;
    std::vector<std::vector<double>> vec(isas.size());
    volatile double sink = 0;
    for (const std::string& isa : isas) {  // warm-up: builds the slot lists once, as DGAP's first call does
      UmpipeEvaluator::force_vector_isa(isa);
      ev.evaluate(pop, out);
    }
    for (int rep = 0; rep < a.repeats; ++rep) {
      auto t0 = Clock::now();
      double s = 0;
      for (const UmpipePlan& plan : plans) s += ev.step_ms(plan);
      sink = sink + s;
      scalar.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / size);
      for (std::size_t k = 0; k < isas.size(); ++k) {
        UmpipeEvaluator::force_vector_isa(isas[k]);
        t0 = Clock::now();
        ev.evaluate(pop, out);
        vec[k].push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / size);
      }
    }
    for (std::size_t k = 0; k < isas.size(); ++k)
      rows.push_back(SpeedRow{name, isas[k], mb / size, median(scalar), median(vec[k])});
    UmpipeEvaluator::force_vector_isa("best");
  }
  return rows;
}

struct PlanRow {
  std::string model;
  int stages = 0, samples = 0, equal_m = 0, dgap_generations = 0;
  std::vector<int> balance;
  double equal = 0, local = 0, dp = 0, dgap = 0, dgap_plan_ms = 0, dgap_seeded = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--out")
      a.out = value();
    else if (k == "--vgg")
      a.vgg = value();
    else if (k == "--repeats")
      a.repeats = std::stoi(value());
    else if (k == "--bandwidth")
      a.bandwidth_gbps = std::stod(value());
    else if (k == "--latency-us")
      a.latency_us = std::stod(value());
    else if (k == "--vgg-overhead")
      a.vgg_overhead_ms = std::stod(value());
    else if (k == "--seed")
      a.seed = std::stoull(value());
    else if (k == "--quick")
      a.quick = true;
    else {
      std::fprintf(stderr,
                   "usage: bench_umpipe [--out FILE] [--repeats R] [--vgg PATH] [--bandwidth GB/s] [--latency-us US] "
                   "[--vgg-overhead MS] [--seed S] [--quick]\n");
      return 2;
    }
  }
  if (a.vgg.empty()) a.vgg = default_vgg_path();
  if (a.repeats < 1 || a.quick) a.repeats = 1;

  struct Case {
    std::string name;
    Profile profile;
    int samples;
    double overhead;
  };
  std::vector<Case> cases{{"gpt14", gpt14_profile(), 64, 0.0}};
  if (!a.vgg.empty()) {
    PipeDreamOptions po;
    po.model = "vgg16";
    po.micro_batch_size = 128;
    po.optimizer_bytes_per_parameter_byte = 1;  // SGD with momentum
    cases.push_back({"vgg16", load_pipedream_graph(a.vgg, po), 128, a.vgg_overhead_ms});
  } else {
    std::fprintf(stderr, "note: no VGG-16 profile (pass --vgg PATH); skipping it\n");
  }

  std::vector<PlanRow> plans;
  UmpipePlan gpt4_dgap;
  UmpipeModel gpt4_model;
  const std::vector<int> stage_counts = a.quick ? std::vector<int>{2, 4} : std::vector<int>{2, 4, 8};
  for (const Case& c : cases)
    for (int stages : stage_counts) {
      UmpipeProfileOptions o;
      o.samples = c.samples;
      o.bandwidth_bytes_per_s = a.bandwidth_gbps * 1e9;
      o.latency_ms = a.latency_us / 1e3;
      o.single_size_overhead_ms = c.overhead;
      PlanRow row;
      row.model = c.name;
      row.stages = stages;
      row.samples = c.samples;
      row.balance = plan_balance(c.profile, stages, "time");
      const UmpipeModel model = umpipe_model_from_profile(c.profile, row.balance, o);
      const UmpipeResult eq = plan_umpipe_equal(model), lg = plan_umpipe_local_greedy(model),
                         dp = plan_umpipe_global_dp(model);
      DgapOptions d;
      d.seed = a.seed;
      if (a.quick) {
        d.population = 16;
        d.generations = 20;
        d.stall_generations = 10;
      }
      const auto t0 = Clock::now();
      const UmpipeResult ga = plan_umpipe_dgap(model, d);
      row.dgap_plan_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      row.equal = eq.step_ms;
      row.equal_m = eq.microbatches;
      row.local = lg.step_ms;
      row.dp = dp.step_ms;
      row.dgap = ga.step_ms;
      row.dgap_generations = ga.generations;
      d.seed_baselines = true;
      row.dgap_seeded = plan_umpipe_dgap(model, d).step_ms;
      plans.push_back(row);
      if (c.name == "gpt14" && stages == 4) {
        gpt4_dgap = ga.plan;
        gpt4_model = model;
      }
    }

  std::printf("UMPIPE predicted step time (ms per mini-batch), balance by time (min-max), links %.3g GB/s + %.3g us\n",
              a.bandwidth_gbps, a.latency_us);
  std::printf("%-7s %6s %4s %-16s %10s %4s %10s %10s %10s %8s %6s %8s %11s\n", "model", "stages", "N", "balance",
              "equal", "m", "local", "global-dp", "dgap", "gain", "gens", "dgap ms", "dgap+seeds");
  nlohmann::json jplans = nlohmann::json::array();
  for (const PlanRow& r : plans) {
    std::string bal;
    for (int x : r.balance) bal += (bal.empty() ? "" : ",") + std::to_string(x);
    const double gain = 100.0 * (r.equal - r.dgap) / r.equal;
    std::printf("%-7s %6d %4d %-16s %10.3f %4d %10.3f %10.3f %10.3f %7.2f%% %6d %8.0f %11.3f\n", r.model.c_str(),
                r.stages, r.samples, bal.c_str(), r.equal, r.equal_m, r.local, r.dp, r.dgap, gain, r.dgap_generations,
                r.dgap_plan_ms, r.dgap_seeded);
    jplans.push_back({{"model", r.model},
                      {"stages", r.stages},
                      {"samples", r.samples},
                      {"balance", r.balance},
                      {"equal_ms", r.equal},
                      {"equal_m", r.equal_m},
                      {"local_greedy_ms", r.local},
                      {"global_dp_ms", r.dp},
                      {"dgap_ms", r.dgap},
                      {"dgap_gain_over_equal_percent", gain},
                      {"dgap_generations", r.dgap_generations},
                      {"dgap_planning_ms", r.dgap_plan_ms},
                      {"dgap_with_baseline_seeds_ms", r.dgap_seeded}});
  }

  const std::vector<SpeedRow> speed = evaluator_speed(gpt4_model, gpt4_dgap, a);
  std::printf("\nEvaluator time per individual, population 256, gpt14 on 4 stages (N = %d), median of %d repeats\n",
              gpt4_model.samples, a.repeats);
  std::printf("%-10s %-11s %8s %12s %12s %8s\n", "population", "isa", "mb/ind", "scalar ns", "vector ns", "ratio");
  nlohmann::json jspeed = nlohmann::json::array();
  for (const SpeedRow& r : speed) {
    std::printf("%-10s %-11s %8.1f %12.1f %12.1f %7.2fx\n", r.population.c_str(), r.isa.c_str(),
                r.micro_batches_per_individual, r.scalar_ns, r.vector_ns, r.scalar_ns / r.vector_ns);
    jspeed.push_back({{"population", r.population},
                      {"isa", r.isa},
                      {"micro_batches_per_individual", r.micro_batches_per_individual},
                      {"scalar_ns_per_individual", r.scalar_ns},
                      {"vector_ns_per_individual", r.vector_ns},
                      {"ratio", r.scalar_ns / r.vector_ns}});
  }
  std::printf("best instruction set here: %s\n", UmpipeEvaluator::vector_isa());

  if (!a.out.empty()) {
    nlohmann::json j{{"bench", "umpipe_eval"},
                     {"bandwidth_gbps", a.bandwidth_gbps},
                     {"latency_us", a.latency_us},
                     {"vgg_overhead_ms_per_layer_and_pass", a.vgg_overhead_ms},
                     {"seed", a.seed},
                     {"repeats", a.repeats},
                     {"planners", jplans},
                     {"evaluator", jspeed}};
    std::ofstream(a.out) << j.dump(2) << "\n";
    std::printf("written to %s\n", a.out.c_str());
  }
  return 0;
}

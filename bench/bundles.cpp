// What bundles and tied weights cost (issue 13): the zoo's GPT trained three ways side by side, in
// interleaved rounds so the machine's noise falls on all of them alike:
//   tensor  the GPT fed one tensor (one-entry bundles: each transfer sends the tensor itself)
//   bundle  the same GPT fed a bundle {x: ids, mask: [N, T] bool}; the mask passes every boundary, so
//           each activation transfer packs two entries into one buffer (and the mask gets no gradient)
//   tied    the GPT with --tie-embeddings: the token embedding and the head are one weight, summed over
//           the pipeline by one extra all-reduce per step
// It prints rank 0's median step time per variant, each against `tensor`, and the median time of an
// all-reduce of the tied weight's size (what `tied` adds to a step) measured alone.
//
//   build/pipetrain launch -n 2 -- build/bench/bench_bundles --transport gloo
//   build/bench/bench_bundles --transport local                          (threads of one process)
//   ... --quick (the `make test` run): 2 rounds of 2 steps
//
// Options: --rounds R (10), --steps N per round and variant (5), --microbatches M (4), --batch B (16).
// One intra-op thread per rank.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/transport.h"
#include "pipetrain/zoo/models.h"

#include "bench_util.h"

namespace {

using Clock = std::chrono::steady_clock;

using pipetrain::bench::median;

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s --transport local|shm|gloo|mpi [--rounds R (10)] [--steps N (5)] [--microbatches M (4)] "
               "[--batch B (16)] [--quick]\nprocess transports run as ranks: pipetrain launch -n 2 -- %s --transport gloo\n",
               argv0, argv0);
  return 2;
}

struct Variant {
  std::string name;
  std::unique_ptr<pipetrain::PipelineRank> rank;
  std::vector<double> ms;
};

// The variants of one rank over transport `t`.
std::vector<Variant> make_variants(const std::shared_ptr<pipetrain::Transport>& t, int m) {
  std::vector<Variant> out;
  for (const std::string name : {"tensor", "bundle", "tied"}) {
    pipetrain::zoo::GptConfig c;
    c.tie_embeddings = name == "tied";
    pipetrain::PipelineOptions o;
    o.schedule = "1f1b";
    o.microbatches = m;
    o.threads = 1;
    o.optimizer.name = "adam";
    o.optimizer.lr = 1e-3;
    o.tied = pipetrain::zoo::gpt_ties(c);
    torch::nn::Sequential model;
    {
      std::lock_guard<std::mutex> lock(pipetrain::default_generator_mutex());
      torch::manual_seed(1);
      model = pipetrain::zoo::make_gpt(c);
    }
    out.push_back(Variant{name, std::make_unique<pipetrain::PipelineRank>(model, pipetrain::zoo::cross_entropy, t, o), {}});
  }
  return out;
}

struct Result {
  std::vector<std::pair<std::string, double>> medians;
  double allreduce_ms = 0;
  int64_t tied_numel = 0;
};

Result run_rank(const std::shared_ptr<pipetrain::Transport>& t, int rounds, int steps, int m, int64_t batch) {
  std::vector<Variant> variants = make_variants(t, m);
  const pipetrain::zoo::GptConfig c;
  torch::Tensor ids, target;
  {  // every rank draws the same batches; under the lock, as ranks that are threads build their models under
     // it from the same default generator (a draw between another rank's seed and its weights untied them)
    std::lock_guard<std::mutex> lock(pipetrain::default_generator_mutex());
    torch::manual_seed(2);
    ids = torch::randint(c.vocab, {batch, c.seq_len}, torch::kLong);
    target = torch::randint(c.vocab, {batch, c.seq_len}, torch::kLong);
  }
  const torch::Tensor mask = torch::ones({batch, c.seq_len}, torch::kBool);
  for (int r = 0; r < rounds + 1; ++r)  // round 0 warms up
    for (Variant& v : variants)
      for (int k = 0; k < steps; ++k) {
        t->barrier();
        const auto t0 = Clock::now();
        if (v.name == "bundle")
          v.rank->train_step(pipetrain::Bundle{{"x", ids}, {"mask", mask}}, target, batch);
        else
          v.rank->train_step(ids, target, batch);
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (r > 0) v.ms.push_back(ms);
      }
  Result res;
  for (const Variant& v : variants) res.medians.emplace_back(v.name, median(v.ms));
  // The all-reduce `tied` adds: the tied weight's gradient, in float64, over every rank.
  res.tied_numel = c.vocab * c.d_model;
  std::vector<double> ar;
  for (int k = 0; k < 10 + rounds * steps; ++k) {
    torch::Tensor g = torch::ones({res.tied_numel}, torch::kDouble);
    t->barrier();
    const auto t0 = Clock::now();
    t->all_reduce_sum(g);
    if (k >= 10) ar.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  res.allreduce_ms = median(ar);
  t->barrier();
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  std::string transport;
  int rounds = 10, steps = 5, m = 4;
  int64_t batch = 16;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      rounds = 2;
      steps = 2;
      continue;
    }
    if (i + 1 >= argc) return usage(argv[0]);
    const std::string v = argv[++i];
    if (a == "--transport") transport = v;
    else if (a == "--rounds") rounds = std::atoi(v.c_str());
    else if (a == "--steps") steps = std::atoi(v.c_str());
    else if (a == "--microbatches") m = std::atoi(v.c_str());
    else if (a == "--batch") batch = std::atoll(v.c_str());
    else return usage(argv[0]);
  }
  if (transport.empty() || rounds < 1 || steps < 1 || m < 1 || batch < m) return usage(argv[0]);
  at::set_num_threads(1);
  Result r;
  bool leader = true;
  int ranks = 2;
  if (transport == "local") {
    auto ts = pipetrain::make_local_transports(2);
    std::vector<Result> all(2);
    pipetrain::run_on_threads(2, [&](int k) {
      at::set_num_threads(1);
      all[static_cast<std::size_t>(k)] = run_rank(ts[static_cast<std::size_t>(k)], rounds, steps, m, batch);
    });
    r = all[0];
  } else {
    auto t = pipetrain::make_process_transport(transport);
    leader = t->rank() == 0;
    ranks = t->world_size();
    r = run_rank(t, rounds, steps, m, batch);
  }
  if (!leader) return 0;
  std::printf("GPT (zoo defaults), 1f1b, %d ranks over %s, batch %lld, m=%d, 1 thread per rank, %d rounds x %d steps\n",
              ranks, transport.c_str(), static_cast<long long>(batch), m, rounds, steps);
  std::printf("%-8s %16s %10s\n", "variant", "median_step_ms", "vs_tensor");
  const double base = r.medians.front().second;
  for (const auto& [name, ms] : r.medians) std::printf("%-8s %16.3f %10.3f\n", name.c_str(), ms, ms / base);
  std::printf("tied_allreduce %lld doubles: median %.3f ms\n", static_cast<long long>(r.tied_numel), r.allreduce_ms);
  return 0;
}

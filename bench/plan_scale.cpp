// The planner and the simulator at scale (issue 28; plan/search.h, core/simulate.h). Torch-free: links
// only pipetrain_core.
//
// 1. Planning: search_plans with its default options (every hybrid plan: stages x replicas, schedules
//    gpipe 1f1b zb-h1 interleaved(v=2) zb-v, m in 1..32, four balance kinds) at 8, 64, 256, 1024 and 4096
//    ranks, for
//    (a) VGG-16 from PipeDream's published profile (data/pipedream/vgg16-graph.txt, profiled at 128
//        samples, 39 layers; 1.25 GB/s between ranks as in the issue), and
//    (b) "gpt96": a synthetic 96-block GPT (embedding, 96 blocks, head; hidden 2048, sequence 1024,
//        one sample profiled; times from the blocks' FLOPs at 100 TFLOP/s, bf16 activations, Adam state),
//        at 25 GB/s: no real profile of such a model can be made on this machine.
//    Per row: the planning time (median of --repeats), the chosen plan and its predicted samples/s,
//    data parallelism's, PipeDream's plan's (as 1F1B-RR) and the best of PipeDream's plan for R/d ranks
//    x d copies ("pd_copies_sps") in the same simulation, and how many candidates the search had and
//    simulated. The mini-batch is the default, max(8, R) profiled batches.
// 2. Simulation: generate + simulate at p x m from 64 x 256 to 512 x 2048 for 1f1b, zb-h1 and
//    interleaved (v=2): the time of simulate_metrics (no timeline) and of simulate (with the timeline),
//    and each case's peak resident memory, measured in a child process per case (getrusage).
//
// 3. Simulate's outputs (what `pipetrain simulate --trace/--svg/--ascii/--json` does after generating):
//    per output, in a child process of its own, simulate_compact + the streamed writer into a file
//    (write_file_atomic), or for json simulate_metrics + predict_heap; its time and the child's peak
//    resident memory, and the file's size.
//
//   build/bench_plan_scale [--quick] [--repeats 3] [--vgg PATH] [--only plan|simulate|outputs]
//       [--copy-plans N]       (PlanSearchOptions::pipedream_copy_plans, default 8; 0: without PipeDream's
//                               plan x copies, the search as it was before they were added)
//       [--write-gpt96 FILE]   (writes the synthetic GPT profile as a pipetrain profile JSON and exits)
//
// --quick (the ctest run): 8 and 64 ranks, one simulation and each output at 8 x 32; its numbers only
// show it works.
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "pipetrain/core/generators.h"
#include "pipetrain/core/heap.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/plan/search.h"

using namespace pipetrain;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A synthetic GPT: embedding, `blocks` transformer blocks, head. Hidden h, sequence s, one sample.
Profile gpt_profile(int blocks) {
  const double h = 2048, s = 1024, vocab = 50304, flops_per_ms = 100e12 / 1e3;
  Profile p;
  p.model = "gpt96";
  p.micro_batch_size = 1;
  p.source = "synthetic (bench/plan_scale.cpp)";
  auto layer = [&](const std::string& name, const std::string& type, double fwd_flops, double params, double held) {
    LayerProfile l;
    l.name = name;
    l.type = type;
    l.forward_ms = fwd_flops / flops_per_ms;
    l.backward_ms = 2 * l.forward_ms;
    l.activation_bytes = s * h * 2;  // bf16 hidden states to the next layer
    l.saved_bytes = held;
    l.parameter_bytes = params * 2;
    l.optimizer_bytes = params * 12;  // fp32 master weights and Adam's two moments
    p.layers.push_back(l);
  };
  layer("embedding", "Embedding", 2 * s * h, vocab * h, s * h * 2);
  for (int b = 0; b < blocks; ++b)
    layer("block" + std::to_string(b), "Block", 24 * s * h * h + 4 * s * s * h, 12 * h * h, 34 * s * h);
  layer("head", "Linear", 2 * s * h * vocab, vocab * h, s * vocab * 4);
  return p;
}

void plan_rows(const std::string& name, const Profile& prof, double bandwidth_gbps, const std::vector<int>& ranks,
               int repeats, int copy_plans) {
  fmt::print("# planning {}: {} layers, {} GB/s, default options\n", name, prof.layers.size(), bandwidth_gbps);
  fmt::print("{:<5} {:<7} {:>6} {:>9} {:>10} {:>10} {:>12} {:>12} {:>12} {:>14} {:>12}  {}\n", "what", "model", "ranks",
             "plan_s", "cands", "simulated", "chosen_sps", "dp_sps", "pipedream_sps", "pd_copies_sps", "vs_dp", "chosen");
  for (int R : ranks) {
    PlanSearchOptions o;
    o.ranks = R;
    o.bandwidth_bytes_per_ms = bandwidth_gbps * 1e6;
    o.pipedream_copy_plans = copy_plans;
    std::vector<double> times;
    PlanSearchResult res;
    for (int k = 0; k < repeats; ++k) {
      const double t0 = now_s();
      res = search_plans(prof, o);
      times.push_back(now_s() - t0);
    }
    const PlanCandidate& c = res.chosen();
    const double batch = static_cast<double>(res.batch_size);
    auto sps = [&](double ms) { return ms > 0 ? 1e3 * batch / ms : 0.0; };
    const std::string shape =
        c.replication.empty()
            ? fmt::format("{}x{} {} v={} m={}", c.stages, c.replicas, c.schedule, c.virtual_stages, c.m)
        : c.copies > 1
            ? fmt::format("PipeDream's {} stages on {} ranks x {} copies, 1F1B-RR m={}", c.balance.size(),
                          c.ranks_used / c.copies, c.copies, c.m)
            : fmt::format("1F1B-RR {} stages on {} ranks m={}", c.balance.size(), c.ranks_used, c.m);
    const PlanCandidate* copies = nullptr;
    for (const PlanCandidate& x : res.pipedream_copies)
      if (!copies || better_candidate(x, *copies)) copies = &x;
    fmt::print("{:<5} {:<7} {:>6} {:>9.3f} {:>10} {:>10} {:>12.1f} {:>12.1f} {:>12} {:>14} {:>12.2f}  {}\n", "plan", name,
               R, median(times), res.considered, res.candidates.size(), sps(c.makespan), sps(res.data_parallel_ms),
               res.replicated ? fmt::format("{:.1f}", sps(res.replicated->makespan)) : std::string("-"),
               copies ? fmt::format("{:.1f} (d={})", sps(copies->makespan), copies->copies) : std::string("-"),
               res.data_parallel_ms > 0 ? res.data_parallel_ms / c.makespan : 0.0, shape);
    std::fflush(stdout);
  }
}

Schedule generated(const std::string& name, int p, int m, int v) {
  GeneratorOptions g;
  g.ranks = p;
  g.microbatches = m;
  g.virtual_stages = v;
  return generate(name, g);
}

// One simulation case in a child process, so its peak resident memory is its own.
void simulate_case(const std::string& name, int p, int m, int v) {
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    double t0 = now_s();
    const Schedule s = generated(name, p, m, v);
    const double gen = now_s() - t0;
    const CostModel costs = CostModel::uniform(s.stages, StageCost{1, 1, 1, 1}, v, 0.1);
    t0 = now_s();
    const Metrics metrics = simulate_metrics(s, costs);
    const double fast = now_s() - t0;
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    const double rss_fast = ru.ru_maxrss / 1024.0;
    t0 = now_s();
    const SimResult full = simulate(s, costs);
    const double slow = now_s() - t0;
    getrusage(RUSAGE_SELF, &ru);
    fmt::print("{:<5} {:<12} {:>5} {:>6} {:>3} {:>9.3f} {:>10.3f} {:>10.1f} {:>11.3f} {:>10.1f} {:>12.2f}\n", "sim", name,
               p, m, v, gen, fast, rss_fast, slow, ru.ru_maxrss / 1024.0, metrics.makespan);
    if (full.metrics.makespan != metrics.makespan) fmt::print("MISMATCH: timeline and metrics-only makespans differ\n");
    std::fflush(stdout);
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
}

// One output of `simulate` in a child process: trace, svg, ascii (into a file in `dir`) or json (the heap
// walk --json adds to the metrics).
void output_case(const std::string& name, int p, int m, int v, const std::string& what, const std::string& dir) {
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    const Schedule s = generated(name, p, m, v);
    const CostModel costs = CostModel::uniform(s.stages, StageCost{1, 1, 1, 1}, v, 0.1);
    const std::string path = dir + "/out." + what;
    const double t0 = now_s();
    double makespan = 0;
    if (what == "json") {
      makespan = simulate_metrics(s, costs).makespan;
      const std::vector<HeapPeak> heap = predict_heap(s, costs, HeapOptions{});
      if (heap.size() != static_cast<std::size_t>(s.ranks)) fmt::print("MISMATCH: one heap entry per rank\n");
    } else {
      const CompactSimResult r = simulate_compact(s, costs);
      makespan = r.metrics.makespan;
      write_file_atomic(path, [&](TextSink& out) {
        if (what == "trace") write_chrome_trace(r.timeline, out);
        else if (what == "svg") write_gantt_svg(r.timeline, r.metrics, out);
        else write_ascii_gantt(r.timeline, out);
      });
    }
    const double secs = now_s() - t0;
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    struct stat st {};
    const double mb = what != "json" && ::stat(path.c_str(), &st) == 0 ? st.st_size / 1e6 : 0.0;
    std::remove(path.c_str());
    fmt::print("{:<5} {:<12} {:>5} {:>6} {:>3} {:<6} {:>11.3f} {:>10.1f} {:>9.1f} {:>12.2f}\n", "out", name, p, m, v, what,
               secs, ru.ru_maxrss / 1024.0, mb, makespan);
    std::fflush(stdout);
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) fmt::print("FAILED: {} {} x {} {}\n", name, p, m, what);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int repeats = 3, copy_plans = PlanSearchOptions().pipedream_copy_plans;
  std::string only, vgg = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        fmt::print(stderr, "{} needs a value\n", a);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--quick") quick = true;
    else if (a == "--repeats") repeats = std::max(1, std::stoi(next()));
    else if (a == "--vgg") vgg = next();
    else if (a == "--only") only = next();
    else if (a == "--copy-plans") copy_plans = std::max(0, std::stoi(next()));
    else if (a == "--write-gpt96") {
      save_profile(next(), gpt_profile(96));
      return 0;
    } else {
      fmt::print(stderr, "unknown flag {}: see the comment at the top of bench/plan_scale.cpp\n", a);
      return 2;
    }
  }
  if (quick) repeats = 1;
  const std::vector<int> ranks = quick ? std::vector<int>{8, 64} : std::vector<int>{8, 64, 256, 1024, 4096};
  if (only.empty() || only == "plan") {
    PipeDreamOptions po;
    po.micro_batch_size = 128;
    po.model = "vgg16";
    plan_rows("vgg16", load_pipedream_graph(vgg, po), 1.25, ranks, repeats, copy_plans);
    plan_rows("gpt96", gpt_profile(96), 25, ranks, repeats, copy_plans);
  }
  if (only.empty() || only == "simulate") {
    fmt::print("# simulate: generate + simulate, F=B=W=1, comm 0.1; seconds; peak RSS MiB (metrics-only, then with "
               "the timeline)\n");
    fmt::print("{:<5} {:<12} {:>5} {:>6} {:>3} {:>9} {:>10} {:>10} {:>11} {:>10} {:>12}\n", "what", "schedule", "p", "m",
               "v", "gen_s", "metrics_s", "rss_MiB", "timeline_s", "rss_MiB", "makespan");
    std::vector<std::pair<int, int>> sizes{{64, 256}, {128, 512}, {256, 1024}, {512, 2048}};
    if (quick) sizes = {{8, 32}};
    for (const auto& [p, m] : sizes) {
      simulate_case("1f1b", p, m, 1);
      simulate_case("zb-h1", p, m, 1);
      simulate_case("interleaved", p, m, 2);
    }
  }
  if (only.empty() || only == "outputs") {
    char tmpl[] = "/tmp/bench_plan_scale.XXXXXX";
    const char* dir = ::mkdtemp(tmpl);
    if (!dir) {
      fmt::print(stderr, "cannot create a temporary folder: {}\n", std::strerror(errno));
      return 1;
    }
    fmt::print("# simulate's outputs: generate + simulate_compact + the streamed writer into a file (json: "
               "simulate_metrics + predict_heap); F=B=W=1, comm 0.1; seconds after generating; the child's peak "
               "RSS MiB; file MB\n");
    fmt::print("{:<5} {:<12} {:>5} {:>6} {:>3} {:<6} {:>11} {:>10} {:>9} {:>12}\n", "what", "schedule", "p", "m", "v",
               "output", "seconds", "rss_MiB", "file_MB", "makespan");
    std::vector<std::pair<int, int>> sizes{{64, 256}, {512, 2048}};
    if (quick) sizes = {{8, 32}};
    for (const auto& [p, m] : sizes)
      for (const char* what : {"trace", "svg", "ascii", "json"}) {
        output_case("1f1b", p, m, 1, what, dir);
        output_case("zb-h1", p, m, 1, what, dir);
        output_case("interleaved", p, m, 2, what, dir);
      }
    ::rmdir(dir);
  }
  return 0;
}

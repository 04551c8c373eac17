// Per-action overhead of the executor (issue 15): every schedule on a model of near-empty layers (a 1x1
// linear layer each, on a [1, 1] micro-batch), so what a step costs is the executor's own work per
// action plus the transport's per transfer. For each schedule it prints rank 0's median step time, its
// actions per step (compute, sends, receives and the step, from the lowered schedule), the microseconds
// per action (step time / actions), rank 0's thread CPU time per step (its own work, without the time
// it waits blocked for the other rank: the bubble), the layers' compute alone (their forward and
// backward for rank 0's micro-batches, timed outside the executor) and the executor's overhead per
// action: (CPU time - compute) / actions. A transport that spins while it waits (shm spins briefly
// before it sleeps) counts that spin as CPU time, so its overhead is an upper bound.
// The same CPU time is then split in two: what the rank's thread spends inside the transport's calls
// (isend, irecv, Work::wait, all_reduce_sum, barrier: posting and copying messages, spinning, sleeping,
// waking the peer and being woken), measured by wrapping the transport, per send and receive
// ("xport_cpu_per_xfer"); and the rest, the executor's own work per action beside the layers' compute
// ("exec_per_action"). The wrapper's two clock reads per call are the benchmark's own cost: it measures
// one read (a system call, about half a microsecond here) and takes one per call off each share.
// Asynchronous schedules (2bw, pipedream) run 8 steps per train_steps call, as the trainer runs them
// (a call per stretch between evaluations), so their pipeline stays full across steps; the figures are
// per step.
//
//   build/bench/bench_executor_overhead --transport local                        (threads of one process)
//   build/pipetrain launch -n 2 -- build/bench/bench_executor_overhead --transport shm
//   ... --quick (the `make test` run): 3 schedules, 5 steps
//
// Options: --stages P (2; the number of ranks for local), --microbatches M (8), --steps N (200),
// --warmup W (20), --schedules gpipe,1f1b,... (all 7 by default), --ops (LibTorch operator calls per
// step and rank, by name). One intra-op thread per rank.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "pipetrain/core/generators.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/transport.h"

#include "bench_util.h"

namespace {

using Clock = std::chrono::steady_clock;

using pipetrain::bench::median;

// --ops: LibTorch operator calls counted per rank thread (top-level calls only, so an op another op
// calls inside counts in its caller). A count does not depend on the machine's load, unlike a time.
std::mutex ops_mu;
std::map<int, std::map<std::string, long>> ops_by_rank;  // rank -> op name -> calls
thread_local int ops_rank = -1;
thread_local int ops_depth = 0;

void count_ops() {
  at::addGlobalCallback(at::RecordFunctionCallback(
                            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
                              if (ops_rank >= 0 && ops_depth++ == 0) {
                                std::lock_guard<std::mutex> g(ops_mu);
                                ++ops_by_rank[ops_rank][fn.name()];
                              }
                              return nullptr;
                            },
                            [](const at::RecordFunction&, at::ObserverContext*) {
                              if (ops_rank >= 0) --ops_depth;
                            })
                            .scopes({at::RecordScope::FUNCTION}));
}

// Rank `r`'s counted calls per step, most frequent first.
void print_ops(int r, int steps) {
  std::lock_guard<std::mutex> g(ops_mu);
  std::vector<std::pair<long, std::string>> v;
  long total = 0;
  for (const auto& [name, n] : ops_by_rank[r]) {
    v.emplace_back(n, name);
    total += n;
  }
  std::sort(v.rbegin(), v.rend());
  std::printf("  rank %d: %.1f LibTorch ops per step:", r, static_cast<double>(total) / steps);
  for (const auto& [n, name] : v) std::printf(" %s %.1f", name.c_str(), static_cast<double>(n) / steps);
  std::printf("\n");
  ops_by_rank[r].clear();
}

torch::nn::Sequential tiny_model(int layers) {
  torch::manual_seed(1);
  torch::nn::Sequential m;
  for (int i = 0; i < layers; ++i) m->push_back(torch::nn::Linear(1, 1));
  return m;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) { return (out - target).pow(2).mean(); }

// CPU time of the calling thread: a rank's own work, without the time it waits blocked for a peer.
double thread_cpu_us() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) * 1e-3;
}

// Forwards everything to the transport it wraps, and adds the calling thread's CPU time spent inside
// its calls (isend, irecv, Work::wait, all_reduce_sum, barrier) to `wait_cpu_us`. Each rank's operations
// come from one thread, so the counter is that rank's.
class WaitTimingTransport : public pipetrain::Transport {
 public:
  explicit WaitTimingTransport(std::shared_ptr<pipetrain::Transport> inner) : inner_(std::move(inner)) {}
  double wait_cpu_us = 0;
  long calls = 0;  // calls timed (each reads the thread's CPU clock twice)

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string name() const override { return inner_->name(); }
  bool shares_process() const override { return inner_->shares_process(); }
  std::unique_ptr<pipetrain::Work> isend(const torch::Tensor& tensor, int dst, int tag) override {
    const Timed timed(*this);
    return std::make_unique<TimedWork>(inner_->isend(tensor, dst, tag), this);
  }
  std::unique_ptr<pipetrain::Work> irecv(torch::Tensor& tensor, int src, int tag) override {
    const Timed timed(*this);
    return std::make_unique<TimedWork>(inner_->irecv(tensor, src, tag), this);
  }
  void all_reduce_sum(torch::Tensor& tensor) override {
    const Timed timed(*this);
    inner_->all_reduce_sum(tensor);
  }
  void barrier() override {
    const Timed timed(*this);
    inner_->barrier();
  }
  void abort(const std::string& message) noexcept override { inner_->abort(message); }

 private:
  // One timed call: counts it, and adds the thread's CPU time from here to the end of the scope.
  struct Timed {
    explicit Timed(WaitTimingTransport& t) : owner(t) { ++owner.calls; }
    ~Timed() { owner.wait_cpu_us += thread_cpu_us() - c0; }
    WaitTimingTransport& owner;
    const double c0 = thread_cpu_us();
  };
  class TimedWork : public pipetrain::Work {
   public:
    TimedWork(std::unique_ptr<pipetrain::Work> inner, WaitTimingTransport* owner) : inner_(std::move(inner)), owner_(owner) {}
    void wait() override {
      const Timed timed(*owner_);
      inner_->wait();
    }

   private:
    std::unique_ptr<pipetrain::Work> inner_;
    WaitTimingTransport* owner_;
  };
  std::shared_ptr<pipetrain::Transport> inner_;
};

struct Row {
  double step_us = 0;
  double cpu_us = 0;       // the rank's thread CPU time per step (median)
  double wait_cpu_us = 0;  // of which inside the transport's calls (median)
  double calls = 0;        // the transport's calls per step, each timed with two clock reads
  double actions = 0, transfers = 0, receives = 0;  // per step
};

// What one read of the thread's CPU clock costs (a system call): the median of 20 averages of 100 reads.
double clock_read_us() {
  std::vector<double> us;
  for (int k = 0; k < 20; ++k) {
    const auto t0 = Clock::now();
    for (int i = 0; i < 100; ++i) (void)thread_cpu_us();
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / 100);
  }
  return median(us);
}

// Steps per train_steps call: one for synchronous schedules; for the asynchronous ones as many as the
// trainer runs between evaluations, here 8, so that the pipeline does not drain between steps (it
// drains at a call's end) and the call's own work (its reductions) is shared by its steps.
int steps_per_call(const std::string& schedule) { return pipetrain::schedule_traits(schedule).synchronous ? 1 : 8; }

// Runs `steps` steps of `schedule` on rank `t`'s pipeline; rank 0's median step and action counts.
Row run_rank(const std::shared_ptr<pipetrain::Transport>& inner, const std::string& schedule, int stages, int m,
             int steps, int warmup, bool count) {
  const auto t = std::make_shared<WaitTimingTransport>(inner);
  pipetrain::PipelineOptions o;
  o.schedule = schedule;
  o.microbatches = schedule == "pipedream" || schedule == "spectrain" ? 1 : m;
  o.virtual_stages = schedule == "interleaved" ? 2 : 1;
  o.threads = 1;
  o.optimizer.lr = 1e-3;
  const int layers = stages * o.virtual_stages;
  pipetrain::PipelineRank rank(tiny_model(layers), mse, t, o);
  const int K = steps_per_call(schedule);
  const int64_t batch = int64_t{o.microbatches} * K;
  const torch::Tensor x = torch::ones({batch, 1}), y = torch::zeros({batch, 1});
  std::vector<double> us, cpu, waits, calls;
  const int call_warmup = (warmup + K - 1) / K, call_count = std::max(1, steps / K);
  for (int k = 0; k < call_warmup + call_count; ++k) {
    t->barrier();
    if (k >= call_warmup && count) ops_rank = t->rank();
    const auto t0 = Clock::now();
    const double w0 = t->wait_cpu_us;
    const long n0 = t->calls;
    const double c0 = thread_cpu_us();
    rank.train_steps(x, y, batch, K);
    const double c = thread_cpu_us() - c0;
    const double w = t->wait_cpu_us - w0;
    const long n = t->calls - n0;
    ops_rank = -1;
    const double d = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    if (k >= call_warmup) {
      us.push_back(d / K);
      cpu.push_back(c / K);
      waits.push_back(w / K);
      calls.push_back(static_cast<double>(n) / K);
    }
  }
  Row r;
  r.step_us = median(us);
  r.cpu_us = median(cpu);
  r.wait_cpu_us = median(waits);
  r.calls = median(calls);
  for (const auto& a : rank.schedule_for(K).actions[static_cast<std::size_t>(t->rank())]) {
    ++r.actions;
    if (a.kind == pipetrain::ActionKind::SendAct || a.kind == pipetrain::ActionKind::SendGrad) ++r.transfers;
    if (a.kind == pipetrain::ActionKind::RecvAct || a.kind == pipetrain::ActionKind::RecvGrad) ++r.receives;
  }
  r.actions /= K;  // per step
  r.transfers /= K;
  r.receives /= K;
  t->barrier();
  return r;
}

// The layers' own compute for one step of rank 0 (its stage's forward and backward per micro-batch).
double compute_us(int m, int steps) {
  auto layer = torch::nn::Linear(1, 1);
  const torch::Tensor x = torch::ones({1, 1}), g = torch::ones({1, 1});
  std::vector<double> us;
  for (int k = 0; k < steps; ++k) {
    const auto t0 = Clock::now();
    for (int i = 0; i < m; ++i) {
      torch::Tensor out = layer->forward(x);
      out.backward(g);
    }
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return median(us);
}

// "a,b,c" -> {"a", "b", "c"}.
std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = text.find(',', start);
    out.push_back(text.substr(start, comma == std::string::npos ? comma : comma - start));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s --transport local|shm|gloo|mpi [--stages P (2)] [--microbatches M (8)] [--steps N (200)] "
               "[--warmup W (20)] [--schedules a,b,...] [--quick] [--ops]\nprocess transports run as ranks, e.g. pipetrain launch -n 2 -- %s "
               "--transport shm\n",
               argv0, argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string transport;
  int stages = 2, m = 8, steps = 200, warmup = 20;
  bool ops = false;
  std::vector<std::string> schedules = {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "2bw", "pipedream"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      schedules = {"gpipe", "1f1b", "zb-h1"};
      steps = 5;
      warmup = 1;
      continue;
    }
    if (a == "--ops") {
      ops = true;
      continue;
    }
    if (i + 1 >= argc) return usage(argv[0]);
    const std::string v = argv[++i];
    if (a == "--transport") transport = v;
    else if (a == "--stages") stages = std::atoi(v.c_str());
    else if (a == "--microbatches") m = std::atoi(v.c_str());
    else if (a == "--steps") steps = std::atoi(v.c_str());
    else if (a == "--warmup") warmup = std::atoi(v.c_str());
    else if (a == "--schedules") schedules = split_list(v);
    else return usage(argv[0]);
  }
  if (transport.empty() || steps < 1 || stages < 1 || m < 1) return usage(argv[0]);
  at::set_num_threads(1);
  if (ops) count_ops();
  std::vector<std::shared_ptr<pipetrain::Transport>> local;
  std::shared_ptr<pipetrain::Transport> mine;
  if (transport == "local") {
    local = pipetrain::make_local_transports(stages);
  } else {
    mine = pipetrain::make_process_transport(transport);
    stages = mine->world_size();
  }
  const bool leader = transport == "local" || mine->rank() == 0;
  // The wrapper's clock reads are the benchmark's, not the runtime's: each timed call reads the clock
  // twice, about one read's cost falling inside the call and one outside, so one read per call is taken
  // off the transport's share and one off the executor's.
  const double clock_us = clock_read_us();
  if (leader)
    std::printf("# rank 0's figures; one read of the thread CPU clock %.2f us, two per timed transport call, "
                "taken off the CPU figures; steps per call: 1 (synchronous), 8 (asynchronous)\n"
                "%-9s %-12s %6s %3s %10s %8s %10s %13s %10s %10s %12s %12s %16s %18s\n",
                clock_us, "transport", "schedule", "stages", "m", "step_us", "actions", "transfers", "us_per_action",
                "cpu_us", "compute_us", "overhead_us", "xport_cpu_us", "exec_per_action", "xport_cpu_per_xfer");
  for (const std::string& s : schedules) {
    Row row;
    if (transport == "local") {
      std::vector<Row> rows(static_cast<std::size_t>(stages));
      pipetrain::run_on_threads(stages, [&](int r) {
        rows[static_cast<std::size_t>(r)] = run_rank(local[static_cast<std::size_t>(r)], s, stages, m, steps, warmup, ops);
      });
      row = rows[0];
    } else {
      row = run_rank(mine, s, stages, m, steps, warmup, ops);
    }
    if (leader) {
      const int mm = s == "pipedream" ? 1 : m;
      const int per_rank = s == "interleaved" ? 2 : 1;
      const double compute = compute_us(mm * per_rank, std::max(steps, 20));
      const double actions = std::max(1.0, row.actions);
      const double xfers = std::max(1.0, row.transfers + row.receives);
      const double cpu = row.cpu_us - 2 * row.calls * clock_us, xport = row.wait_cpu_us - row.calls * clock_us;
      std::printf("%-9s %-12s %6d %3d %10.1f %8.1f %10.1f %13.2f %10.1f %10.1f %12.2f %12.1f %16.2f %18.2f\n",
                  transport.c_str(), s.c_str(), stages, mm, row.step_us, row.actions, row.transfers,
                  row.step_us / actions, cpu, compute, (cpu - compute) / actions, xport,
                  (cpu - compute - xport) / actions, xport / xfers);
    }
    if (ops) {
      const int counted = std::max(1, steps / steps_per_call(s)) * steps_per_call(s);
      if (transport == "local")
        for (int r = 0; r < stages; ++r) print_ops(r, counted);
      else
        print_ops(mine->rank(), counted);
    }
    std::fflush(stdout);
  }
  return 0;
}

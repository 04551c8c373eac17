// `pipetrain train`: trains a model with a pipeline schedule across ranks (threads or processes),
// prints progress and a summary with the measured bubble against the simulator's prediction, and can
// write the measured timeline as a Chrome trace and an SVG.
#include <fmt/format.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli_common.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/runtime/info.h"
#include "run_common.h"

namespace pipetrain::cli {
namespace {

struct TrainFlags {
  ModelFlags model;
  PipelineFlags pipe;
  int64_t batch_size = 16;
  int steps = 10;
  std::string optimizer = "adam";
  double lr = 1e-3;
  double momentum = 0.9;
  double weight_decay = 0.0;
  double clip = 0.0;
  std::string trace, svg, log;
  bool memory = false;
};

// Per-stage mean compute times of a measured timeline, as a cost model for the simulator.
CostModel measured_costs(const Timeline& t, int stages) {
  std::map<std::pair<int, ActionKind>, std::pair<double, int>> sum;
  for (const TimedAction& e : t.events)
    if (is_compute(e.action.kind)) {
      auto& s = sum[{e.action.stage, e.action.kind}];
      s.first += e.end - e.start;
      ++s.second;
    }
  auto mean = [&](int s, ActionKind k) {
    auto it = sum.find({s, k});
    return it == sum.end() ? 0.0 : it->second.first / it->second.second;
  };
  CostModel c;
  for (int s = 0; s < stages; ++s) {
    StageCost sc;
    sc.f = mean(s, ActionKind::F);
    if (sum.count({s, ActionKind::BW})) {
      sc.b = mean(s, ActionKind::BW);
      sc.w = 0;
    } else {
      sc.b = mean(s, ActionKind::B);
      sc.w = mean(s, ActionKind::W);
    }
    c.stage.push_back(sc);
  }
  return c;
}

// PIPETRAIN_FAULT="RANK:ACTION:KIND" makes rank RANK fail just before ACTION (text form, e.g. 1F2) of
// the first step: KIND "throw" raises an error, "kill" sends the process SIGKILL. For failure tests.
std::function<void(int, int, const Action&)> fault_injector(const std::string& spec) {
  const auto a = spec.find(':'), b = spec.rfind(':');
  if (a == std::string::npos || a == b)
    throw UsageError("PIPETRAIN_FAULT='" + spec + "' must read RANK:ACTION:KIND, e.g. 1:1F2:throw or 1:1F2:kill");
  const int rank = std::stoi(spec.substr(0, a));
  const Action action = parse_action(spec.substr(a + 1, b - a - 1));
  const std::string kind = spec.substr(b + 1);
  if (kind != "throw" && kind != "kill")
    throw UsageError("PIPETRAIN_FAULT kind '" + kind + "' must be throw or kill");
  return [=](int r, int step, const Action& act) {
    if (r != rank || step != 0 || act != action) return;
    if (kind == "kill") ::kill(::getpid(), SIGKILL);
    throw std::runtime_error("injected fault before " + to_string(act));
  };
}

int train_rank(const TrainFlags& f, std::shared_ptr<Transport> transport) {
  const bool leader = transport->rank() == 0;
  PipelineOptions o = f.pipe.options(f.model.seed, transport->rank());
  o.optimizer.name = f.optimizer;
  o.optimizer.lr = f.lr;
  o.optimizer.momentum = f.optimizer == "sgd" ? f.momentum : 0.0;
  o.optimizer.weight_decay = f.weight_decay;
  o.optimizer.clip_grad_norm = f.clip;
  o.measure_memory = f.memory;
  if (const char* fault = std::getenv("PIPETRAIN_FAULT")) o.before_action = fault_injector(fault);
  auto model = f.model.factory()();
  auto data = f.model.dataset();
  PipelineRank rank(model, f.model.loss(), transport, o);
  std::unique_ptr<std::ofstream> log;
  if (leader && !f.log.empty()) {
    log = std::make_unique<std::ofstream>(f.log);
    if (!*log) throw std::runtime_error("cannot write the log file '" + f.log + "'");
  }
  if (leader) {
    std::string balance;
    for (int n : rank.balance()) balance += (balance.empty() ? "" : ",") + std::to_string(n);
    std::cout << fmt::format("pipetrain train: {}\n  {} stages over {} ({} threads per rank), schedule {}, m={}, "
                             "batch {}, balance {}, checkpoint {}, optimizer {} lr {}\n  {}",
                             f.model.describe(), f.pipe.stages, transport->name(), o.threads, f.pipe.schedule,
                             f.pipe.microbatches, f.batch_size, balance, f.pipe.checkpoint, f.optimizer, f.lr,
                             describe(runtime_info()))
              << std::flush;
  }
  std::vector<double> step_ms;
  double first_loss = 0, last_loss = 0;
  StepStats last;
  for (int step = 0; step < f.steps; ++step) {
    zoo::Batch b = data->batch(step, f.batch_size);
    transport->barrier();  // steps start together, so step times are comparable across ranks
    const auto t0 = std::chrono::steady_clock::now();
    last = rank.train_step(b.input, b.target, f.batch_size);
    transport->barrier();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    step_ms.push_back(ms);
    if (step == 0) first_loss = last.loss;
    last_loss = last.loss;
    if (leader) {
      std::cout << fmt::format("step {:>4}/{}  loss {:.4f}  grad norm {:.3f}  {:.1f} ms  {:.1f} samples/s\n", step + 1,
                               f.steps, last.loss, last.grad_norm, ms, 1000.0 * f.batch_size / ms)
                << std::flush;
      if (log)
        *log << nlohmann::json{{"step", step + 1}, {"loss", last.loss}, {"lr", f.lr}, {"grad_norm", last.grad_norm},
                               {"step_ms", ms}, {"samples_per_s", 1000.0 * f.batch_size / ms}}
                    .dump()
             << "\n";
    }
  }
  // The last step's timeline from every rank, and the simulator's prediction from its measured costs.
  Timeline all = gather_timeline(last.timeline, *transport);
  torch::Tensor heap = torch::zeros({transport->world_size()}, torch::kDouble);
  heap[transport->rank()] = last.peak_heap_growth;
  transport->all_reduce_sum(heap);
  if (!leader) return 0;
  double t0 = 1e300;
  for (const auto& e : all.events) t0 = std::min(t0, e.start);
  for (auto& e : all.events) {
    e.start -= t0;
    e.end -= t0;
  }
  const Metrics measured = compute_metrics(all);
  const Schedule plain = strip_communication(rank.schedule());
  const SimResult predicted = simulate(plain, measured_costs(all, plain.stages));
  std::vector<double> sorted = step_ms;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  std::cout << fmt::format(
      "summary: loss {:.4f} -> {:.4f} over {} steps; median step {:.1f} ms, {:.1f} samples/s\n"
      "  last step: measured makespan {:.1f} ms, bubble fraction {:.3f}; simulated from measured stage costs: "
      "makespan {:.1f} ms, bubble fraction {:.3f}; efficiency (predicted/measured) {:.2f}\n",
      first_loss, last_loss, f.steps, median, 1000.0 * f.batch_size / median, measured.makespan,
      measured.bubble_fraction, predicted.metrics.makespan, predicted.metrics.bubble_fraction,
      measured.makespan > 0 ? predicted.metrics.makespan / measured.makespan : 0.0);
  for (const RankMetrics& r : measured.per_rank)
    std::cout << fmt::format("  stage {}: busy {:.1f} ms, span {:.1f} ms, bubble {:.1f} ms{}\n", r.rank, r.busy, r.span,
                             r.bubble,
                             f.memory ? fmt::format(", peak heap growth {:.2f} MiB", heap[r.rank].item<double>() / 1048576.0)
                                      : std::string());
  if (!f.trace.empty()) {
    write_file_atomic(f.trace, chrome_trace_json(all));
    std::cout << "measured trace written to " << f.trace << "\n";
  }
  if (!f.svg.empty()) {
    write_file_atomic(f.svg, gantt_svg(all, measured));
    std::cout << "measured timeline written to " << f.svg << "\n";
  }
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<TrainFlags>();
  CLI::App* cmd = app.add_subcommand("train", "train a model with a pipeline schedule across ranks");
  f->model.add_to(*cmd);
  f->pipe.add_to(*cmd);
  cmd->add_option("--batch-size", f->batch_size, "samples per step (mini-batch), default 16");
  cmd->add_option("--steps", f->steps, "optimizer steps, default 10");
  cmd->add_option("--optimizer", f->optimizer, "sgd, adam or adamw; default adam");
  cmd->add_option("--lr", f->lr, "learning rate, default 1e-3");
  cmd->add_option("--momentum", f->momentum, "SGD momentum, default 0.9");
  cmd->add_option("--weight-decay", f->weight_decay, "weight decay, default 0");
  cmd->add_option("--clip", f->clip, "clip gradients to this global norm; default 0 (off)");
  cmd->add_option("--trace", f->trace, "write the last step's measured timeline as a Chrome trace");
  cmd->add_option("--svg", f->svg, "write the last step's measured timeline as an SVG");
  cmd->add_option("--log", f->log, "write one JSON object per step to this file");
  cmd->add_flag("--memory", f->memory,
                "measure each rank's peak heap growth during a step (activations, buffers, gradients); with "
                "--transport local all ranks share one heap");
  cmd->footer(
      "Without a launcher, --stages P starts P local processes over gloo (use --transport local for threads).\n"
      "Examples:\n"
      "  pipetrain train --stages 2 --schedule 1f1b --microbatches 4 --batch-size 16 --steps 20\n"
      "  pipetrain train --transport local -p 4 -s zb-h1 -m 8 --svg run.svg --trace run.json\n"
      "  pipetrain launch -n 2 -- pipetrain train --stages 2 --transport gloo\n"
      "  mpirun -n 2 pipetrain train --stages 2 --transport mpi");
  cmd->callback([f, &exit_code] {
    exit_code = guarded("train", [&] {
      if (f->batch_size < 1) throw UsageError("--batch-size must be >= 1, got " + std::to_string(f->batch_size));
      if (f->steps < 1) throw UsageError("--steps must be >= 1, got " + std::to_string(f->steps));
      // Check what can be checked before any rank starts, so bad input is exit 2 with one message.
      const PipelineOptions o = f->pipe.options(f->model.seed);
      auto model = f->model.factory()();
      choose_balance(model, f->pipe.stages * o.virtual_stages, o.balance);
      split_equal(f->batch_size, o.microbatches);
      GeneratorOptions g;
      g.ranks = f->pipe.stages;
      g.microbatches = o.microbatches;
      g.virtual_stages = o.virtual_stages;
      generate(o.schedule, g);
      if (o.schedule == "pipedream" || o.schedule == "2bw")
        throw UsageError("schedule '" + o.schedule + "' is asynchronous and not run by this executor yet: use gpipe, "
                         "1f1b, interleaved, zb-h1, zb-h2 or zb-auto");
      if (f->optimizer != "sgd" && f->optimizer != "adam" && f->optimizer != "adamw")
        throw UsageError("unknown optimizer '" + f->optimizer + "': use sgd, adam or adamw");
      if (!(f->lr > 0)) throw UsageError("--lr must be > 0, got " + std::to_string(f->lr));
      return run_ranks(f->pipe, cli_argc(), cli_argv(), [&](std::shared_ptr<Transport> t) { return train_rank(*f, t); });
    });
  });
}

}  // namespace pipetrain::cli

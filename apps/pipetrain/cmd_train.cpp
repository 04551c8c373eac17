// `pipetrain train`: the main job. Trains a model on real data with a pipeline schedule across ranks
// (threads or processes): a progress bar, evaluation on the held-out split, checkpoints that resume
// bitwise, a text sample for language models, and a summary with the measured bubble against the
// simulator's prediction; the measured timeline can be written as a Chrome trace and an SVG.
#include <fmt/format.h>

#include <ATen/CPUGeneratorImpl.h>
#include <signal.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>

#include "cli_common.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/runtime/checkpoint.h"
#include "pipetrain/runtime/info.h"
#include "run_common.h"

namespace pipetrain::cli {
namespace {

struct TrainFlags {
  ModelFlags model;
  PipelineFlags pipe;
  int64_t batch_size = 32;
  int steps = 0;        // 0: from --epochs, else kDefaultSteps
  double epochs = 0;
  std::string optimizer = "adam";
  double lr = 3e-3;
  double momentum = 0.9;
  double weight_decay = 0.0;
  double clip = 1.0;
  std::string lr_schedule = "cosine";  // constant | cosine | linear
  int warmup = -1;  // -1: 5% of the steps, at most 100
  int eval_every = -1;       // -1: ten evaluations per run; 0: none
  int64_t eval_samples = 0;  // 0: all of the held-out split (images), 256 windows (text)
  int64_t eval_batch = 0;    // 0: 4 x batch size
  std::string save, resume;
  int save_every = 0;
  bool save_on_interrupt = false;  // SIGINT/SIGTERM: write one more checkpoint (at the step reached) before stopping
  int sample = 300;          // characters to generate at the end (text data)
  double temperature = 0.8;
  std::string trace, svg, log, config;
  std::string progress = "auto";  // auto | bar | lines | quiet
  bool memory = false;
  // Asynchronous schedules (pipedream, 2bw, spectrain; executor.h).
  bool vertical_sync = false;
  bool no_stash = false;
  int steps_per_call = 0;  // steps per executor call; 0: up to the next evaluation or checkpoint, at most 256
};
// Default cap on the steps of one asynchronous call: the call's batch is held at once (256 Fashion-MNIST
// batches of 64 are 51 MB), and one fill and drain per 256 steps costs (p-1)/(256+p-1) of the time.
constexpr int kMaxStepsPerCall = 256;

bool is_async(const std::string& schedule) {
  return !schedule_traits(schedule).synchronous;
}

// The first step after `step` at which an asynchronous run drains its pipeline: the next evaluation,
// checkpoint, multiple of --steps-per-call (default kMaxStepsPerCall), or the end. A pure function of the
// step, so a resumed run (which starts at such a boundary) cuts the remaining steps into the same calls.
int next_boundary(const TrainFlags& f, int step, int total, int eval_every) {
  int b = total;
  auto up_to = [&](int every) {
    if (every > 0) b = std::min(b, (step / every + 1) * every);
  };
  up_to(eval_every);
  if (!f.save.empty()) up_to(f.save_every);
  up_to(f.steps_per_call > 0 ? f.steps_per_call : kMaxStepsPerCall);
  return b;
}
constexpr int kDefaultSteps = 600;  // the demo: about 1.5 minutes on 2 cores

// The steps of --epochs E over `train_size` samples; refused past 1e9 (--epochs inf was -2147483648 steps).
int steps_for_epochs(double epochs, int64_t train_size, int64_t batch_size) {
  const double steps = std::ceil(epochs * static_cast<double>(train_size) / static_cast<double>(batch_size));
  if (!(steps <= 1e9))
    throw UsageError(fmt::format("--epochs {} is {} steps of --batch-size {}, over the limit of 1e9: give fewer epochs",
                                 epochs, steps, batch_size));
  return static_cast<int>(steps);
}

std::string comma_list(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

// The banner's lines for a run of a plan's UMPIPE partitions.
std::string umpipe_banner(const PipelineFlags& pipe) {
  const UmpipeResult& r = *pipe.umpipe_chosen;
  std::string out = fmt::format(
      "  UMPIPE: the {} partitions of {} (predicted {:.2f} ms per step), per stage its own micro-batches, GPipe order, "
      "every backward chunk re-materialised; schedule and m above apply to evaluation only\n",
      r.planner, pipe.plan_file, r.step_ms);
  for (std::size_t j = 0; j < r.plan.forward.size(); ++j)
    out += fmt::format("    stage {} forward {} | backward {}{}\n", j, comma_list(r.plan.forward[j]),
                       comma_list(r.plan.backward[j]),
                       j + 1 == r.plan.forward.size() ? " (its forward is done in the backward's recompute)" : "");
  return out;
}

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

// PIPETRAIN_FAULT="RANK:ACTION:KIND[:STEP]" makes rank RANK fail just before ACTION (text form, e.g. 1F2)
// of step STEP (0-based, default 0): KIND "throw" raises an error, "kill" sends the process SIGKILL,
// "interrupt" sends SIGINT to the process that started the ranks (the launcher: a Ctrl-C at a known
// point; with no launcher, to this process). For failure, interrupt and crash-recovery tests.
std::function<void(int, int, const Action&)> fault_injector(const std::string& spec) {
  std::vector<std::string> parts;
  for (std::size_t at = 0;;) {
    const auto colon = spec.find(':', at);
    parts.push_back(spec.substr(at, colon == std::string::npos ? std::string::npos : colon - at));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  if (parts.size() != 3 && parts.size() != 4)
    throw UsageError("PIPETRAIN_FAULT='" + spec + "' must read RANK:ACTION:KIND[:STEP], e.g. 1:1F2:throw or 1:1F2:kill:3");
  int rank = 0, at_step = 0;
  try {
    rank = std::stoi(parts[0]);
    if (parts.size() == 4) at_step = std::stoi(parts[3]);
  } catch (const std::exception&) {
    throw UsageError("PIPETRAIN_FAULT='" + spec + "': RANK and STEP must be integers");
  }
  const Action action = parse_action(parts[1]);
  const std::string kind = parts[2];
  if (kind != "throw" && kind != "kill" && kind != "interrupt")
    throw UsageError("PIPETRAIN_FAULT kind '" + kind + "' must be throw, kill or interrupt");
  const pid_t interrupt_target = std::getenv("RANK") ? ::getppid() : ::getpid();  // process ranks: their launcher
  return [=](int r, int step, const Action& act) {
    if (r != rank || step != at_step || act != action) return;
    if (kind == "kill") ::kill(::getpid(), SIGKILL);
    if (kind == "interrupt") {
      ::kill(interrupt_target, SIGINT);
      return;
    }
    throw std::runtime_error("injected fault before " + to_string(act));
  };
}

// Learning rate of step k (0-based) of `total`: linear warm-up over `warmup` steps, then constant, or
// a cosine or linear decay to a tenth of the peak at the last step. A pure function of k, so a resumed
// run continues the same schedule.
int warmup_steps(const TrainFlags& f, int total) { return f.warmup >= 0 ? f.warmup : std::min(100, total / 20); }

double lr_at(const TrainFlags& f, int k, int total) {
  const int warmup = warmup_steps(f, total);
  if (warmup > 0 && k < warmup) return f.lr * (k + 1) / warmup;
  if (f.lr_schedule == "constant") return f.lr;
  const double span = std::max(1, total - warmup - 1);
  const double progress = std::min(1.0, (k - warmup) / span);
  if (f.lr_schedule == "linear") return f.lr * (1.0 - 0.9 * progress);
  return f.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

std::string duration_text(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "?";
  const auto s = static_cast<long>(std::lround(seconds));
  return s >= 3600 ? fmt::format("{}h{:02d}m", s / 3600, (s / 60) % 60) : fmt::format("{}m{:02d}s", s / 60, s % 60);
}

std::string rate_text(double per_second) {
  return per_second >= 1e4 ? fmt::format("{:.1f}k", per_second / 1e3) : fmt::format("{:.0f}", per_second);
}

// The run as stored in checkpoints: what must match to resume (model, data, optimizer.name) and what
// documents it.
nlohmann::json run_json(const TrainFlags& f, int total_steps) {
  nlohmann::json j{{"model", f.model.model_json()},
          {"data", f.model.data_json()},
          {"optimizer",
           {{"name", f.optimizer},
            {"lr", f.lr},
            {"momentum", f.momentum},
            {"weight_decay", f.weight_decay},
            {"clip", f.clip},
            {"lr_schedule", f.lr_schedule},
            {"warmup", warmup_steps(f, total_steps)}}},
          {"seed", f.model.seed},
          {"batch_size", f.batch_size},
          {"schedule", f.pipe.schedule},
          {"microbatches", f.pipe.microbatches},
          {"steps", total_steps}};
  if (is_async(f.pipe.schedule))
    j["asynchronous"] = {
        {"vertical_sync", f.vertical_sync}, {"no_stash", f.no_stash}, {"steps_per_call", f.steps_per_call}};
  return j;
}

// Progress per step. bar: one line that redraws itself (a terminal); lines: a line per step with its
// time (logs, benchmarks); quiet: nothing per step; auto: bar on a terminal, else a bar-style line
// every 5% of the run.
class Progress {
 public:
  Progress(const std::string& mode, int total, int start, const std::string& unit)
      : total_(total), start_(start), unit_(unit), t0_(std::chrono::steady_clock::now()) {
    const bool tty = ::isatty(STDOUT_FILENO) != 0;
    mode_ = mode == "auto" ? (tty ? "bar" : "every") : mode;
    every_ = std::max(1, (total - start) / 20);
  }
  void step(int done, double loss, double grad_norm, double lr, double ms, double units_per_s) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    const double eta = elapsed / std::max(1, done - start_) * (total_ - done);
    if (mode_ == "quiet") return;
    if (mode_ == "lines") {
      std::cout << fmt::format("step {:>5}/{}  loss {:.4f}  grad norm {:.3f}  lr {:.2e}  {:.1f} ms  {} {}/s  ETA {}\n",
                               done, total_, loss, grad_norm, lr, ms, rate_text(units_per_s), unit_, duration_text(eta))
                << std::flush;
      return;
    }
    const int width = 24, filled = static_cast<int>(width * static_cast<double>(done) / total_);
    const std::string line = fmt::format("[{}{}] {:>5}/{}  loss {:.4f}  lr {:.2e}  {} {}/s  ETA {}",
                                         std::string(filled, '#'), std::string(width - filled, '.'), done, total_, loss,
                                         lr, rate_text(units_per_s), unit_, duration_text(eta));
    if (mode_ == "bar") {
      std::cout << "\r" << line << "\033[K" << std::flush;
      bar_open_ = done != total_;
      if (done == total_) std::cout << "\n";
    } else if ((done - start_) % every_ == 0 || done == total_ || done == start_ + 1) {
      std::cout << line << "\n" << std::flush;
    }
  }
  // A message between progress lines (evaluation, checkpoint).
  void note(const std::string& text) {
    if (bar_open_) std::cout << "\r\033[K";
    std::cout << text << "\n" << std::flush;
  }

 private:
  int total_, start_;
  std::string unit_, mode_;
  int every_ = 1;
  bool bar_open_ = false;
  std::chrono::steady_clock::time_point t0_;
};

struct EvalResult {
  double loss = 0, accuracy = 0;
  int64_t samples = 0;
};

// Evaluates on the first `count` held-out samples in chunks (collective: every rank calls it).
EvalResult evaluate_heldout(PipelineRank& rank, zoo::Dataset* data, int64_t count, int64_t chunk) {
  EvalResult r;
  double loss = 0, correct = 0;
  for (int64_t begin = 0; begin < count; begin += chunk) {
    const int64_t n = std::min(chunk, count - begin);
    zoo::Batch b;
    if (data) b = data->eval_batch(begin, n);
    const EvalStats e = rank.evaluate(b.input, b.target, n);
    loss += e.loss * static_cast<double>(n);
    correct += e.accuracy * static_cast<double>(n);
    r.samples += n;
  }
  r.loss = loss / static_cast<double>(std::max<int64_t>(r.samples, 1));
  r.accuracy = correct / static_cast<double>(std::max<int64_t>(r.samples, 1));
  return r;
}

std::string eval_text(const TrainFlags& f, const EvalResult& e) {
  if (f.model.is_text() || (f.model.model == "gpt"))
    return fmt::format("loss {:.4f}, perplexity {:.2f}, next-character accuracy {:.1f}%", e.loss, std::exp(e.loss),
                       100 * e.accuracy);
  return fmt::format("loss {:.4f}, accuracy {:.2f}%", e.loss, 100 * e.accuracy);
}

// Generates `n` characters after a held-out prompt, sampling the last stage's output with a
// temperature; the token goes back to stage 0 through an all-reduce. Collective. Returns the prompt
// and the continuation on rank 0.
std::pair<std::string, std::string> generate_text(const TrainFlags& f, PipelineRank& rank, Transport& t,
                                                  zoo::Dataset* data) {
  const bool first = data && t.rank() == 0;
  torch::Tensor context;
  std::string vocabulary;
  if (first) {
    context = data->eval_batch(0, 1).input;  // [1, T]: the first held-out window
    vocabulary = data->vocabulary();
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(f.model.seed + 7);
  std::vector<int64_t> tokens;
  for (int k = 0; k < f.sample; ++k) {
    torch::Tensor out = rank.forward_only(context, 1, 1);
    torch::Tensor token = torch::zeros({1}, torch::kDouble);
    if (out.defined()) {
      torch::Tensor logits = out[0][-1].to(torch::kCPU, torch::kDouble) / std::max(1e-3, f.temperature);
      torch::Tensor probs = torch::softmax(logits, -1);
      token[0] = static_cast<double>(torch::multinomial(probs, 1, false, gen).item<int64_t>() + 1);
    }
    t.all_reduce_sum(token);
    const auto id = static_cast<int64_t>(token.item<double>()) - 1;
    tokens.push_back(id);
    if (first) context = torch::cat({context.slice(1, 1), torch::full({1, 1}, id, torch::kLong)}, 1);
  }
  if (!first) return {};
  return {zoo::decode_text(vocabulary, data->eval_batch(0, 1).input),
          zoo::decode_text(vocabulary, torch::tensor(tokens, torch::kLong))};
}

double peak_rss_mib() {
  struct rusage u {};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

// "stage S" for a rank, or "rank R (stage S replica Q)" when stages are replicated (1F1B-RR).
std::string rank_label(const Schedule& s, int rank) {
  if (!s.replicated()) {
    std::vector<int> mine;  // several with virtual stages (interleaved, V shapes)
    for (int st = 0; st < s.stages; ++st)
      if (s.rank_of(st) == rank) mine.push_back(st);
    if (mine.size() == 1) return fmt::format("stage {}", mine[0]);
    return fmt::format("rank {} (stages {})", rank, fmt::join(mine, ", "));
  }
  const int st = s.first_stage_of(rank);
  const auto& reps = s.stage_replicas[static_cast<std::size_t>(st)];
  return fmt::format("rank {} (stage {} replica {})", rank, st, std::find(reps.begin(), reps.end(), rank) - reps.begin());
}

// SIGINT and SIGTERM during training. The handler only notes the signal (a second one ends the process
// at once, as the default would); the ranks agree on it at the start of each call (stop_requested, one
// all-reduce of a flag), so they all stop after the same step: a save in progress completes, no
// DIR.partial or temporary file is left, and with --save-on-interrupt one more checkpoint is written at
// the step reached. The exit code is 128 + the signal, as a shell reports a run killed by it.
volatile sig_atomic_t g_stop_signal = 0;
volatile sig_atomic_t g_stop_signal_at = 0;  // CLOCK_MONOTONIC seconds of the first one
// Set once the training loop runs (it reads g_stop_signal at every call). Before that (rendezvous,
// building the model, the first evaluation) nothing would read the flag, so a signal keeps its
// default effect: `timeout` or Ctrl-C during start-up ends the rank at once.
volatile sig_atomic_t g_stop_cooperative = 0;
extern "C" void on_stop_signal(int sig) {
  if (!g_stop_cooperative) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  timespec now {};
  ::clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  if (g_stop_signal != 0) {
    // A launcher signals a rank's process group and the rank itself, so one Ctrl-C can arrive twice:
    // only a second signal a second or more later means "stop now".
    if (now.tv_sec - g_stop_signal_at < 1) return;
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_stop_signal_at = static_cast<sig_atomic_t>(now.tv_sec);
  g_stop_signal = sig;
}
class StopSignalScope {
 public:
  StopSignalScope() {
    g_stop_signal = 0;
    g_stop_cooperative = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
  }
  ~StopSignalScope() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }

 private:
  struct sigaction old_int_ {}, old_term_ {};
};
// The signal some rank got (0: none), the same on every rank: a collective.
int stop_requested(Transport& world) {
  torch::Tensor t = torch::full({1}, static_cast<double>(g_stop_signal), torch::kDouble);
  world.all_reduce_sum(t);
  const double sum = t.item<double>();
  if (sum == 0) return 0;
  return g_stop_signal != 0 ? static_cast<int>(g_stop_signal) : SIGINT;  // ranks report their own, else SIGINT
}

// Ranks started by hand (torchrun, mpirun, RANK=... by hand) with different settings would wait for
// each other in different collectives: a hang (--log on one rank only adds collectives to every step).
// So the first collective of a run compares a hash of every setting that shapes the run's collectives
// and model; output files count only by whether they are given, so each rank may name its own.
void check_same_settings(const TrainFlags& f, Transport& world) {
  nlohmann::json j = run_json(f, 0);
  const PipelineFlags& p = f.pipe;
  j["pipeline"] = {p.stages, p.replicas, p.virtual_stages, p.balance, p.balance_solver, p.checkpoint,
                   p.replication, p.plan_use, !p.plan_file.empty(), !p.profile_file.empty()};
  j["run"] = {f.steps, f.epochs, f.eval_every, f.eval_samples, f.eval_batch, f.save_every, f.sample,
              f.save_on_interrupt, f.memory, f.steps_per_call, f.vertical_sync, f.no_stash, !f.save.empty(),
              !f.resume.empty(), !f.log.empty(), !f.trace.empty(), !f.svg.empty()};
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a
  for (const unsigned char c : j.dump()) h = (h ^ c) * 0x100000001b3ULL;
  const int n = world.world_size();
  torch::Tensor t = torch::zeros({n, 2}, torch::kDouble);  // two 32-bit halves: exact in a double
  t[world.rank()][0] = static_cast<double>(h >> 32);
  t[world.rank()][1] = static_cast<double>(h & 0xffffffffULL);
  world.all_reduce_sum(t);
  for (int r = 1; r < n; ++r)
    if (!torch::equal(t[r], t[0]))
      throw UsageError("rank " + std::to_string(r) + " was started with other settings than rank 0 (model, data, "
                       "schedule, steps, or which of --log/--trace/--svg/--save are given): start every rank with "
                       "the same flags; only output file names may differ");
}

int train_rank(const TrainFlags& f, std::shared_ptr<Transport> world) {
  check_same_settings(f, *world);
  // With --replicas R the world holds R copies of the pipeline (hybrid data + pipeline parallelism):
  // `transport` is this rank's pipeline, `replica` its copy's index; copy k trains on the k-th 1/R of
  // every mini-batch and the stages average their gradients over the copies before stepping.
  const std::shared_ptr<Transport> transport = f.pipe.pipeline_group(world);
  const int replica = f.pipe.replicas > 1 ? world->rank() / f.pipe.stages : 0;  // 1F1B-RR: one pipeline
  const int64_t share = f.batch_size / f.pipe.replicas;  // samples per copy and step
  const bool leader = world->rank() == 0;
  const int p = transport->world_size();
  PipelineOptions o = f.pipe.options(f.model.seed, world->rank());
  o.balance = resolve_balance(f.pipe, f.model, share / std::max(1, f.pipe.microbatches), *world);
  o.data_parallel = f.pipe.replica_group(world);
  o.optimizer.name = f.optimizer;
  o.optimizer.lr = f.lr;
  o.optimizer.momentum = f.optimizer == "sgd" ? f.momentum : 0.0;
  o.optimizer.weight_decay = f.weight_decay;
  o.optimizer.clip_grad_norm = f.clip;
  o.measure_memory = f.memory;
  o.vertical_sync = f.vertical_sync;
  o.weight_stashing = !f.no_stash;
  if (f.pipe.umpipe_chosen) o.umpipe = std::make_shared<UmpipePlan>(f.pipe.umpipe_chosen->plan);
  const bool async = is_async(f.pipe.schedule);
  int total = 0;  // set below, before the first step
  // One call runs several steps: each stage sets the learning rate of its step just before stepping.
  if (async) o.learning_rate = [&f, &total](int k) { return lr_at(f, k, total); };
  if (const char* fault = std::getenv("PIPETRAIN_FAULT")) o.before_action = fault_injector(fault);
  auto model = f.model.factory()();
  PipelineRank rank(model, f.model.loss(), transport, o);
  const std::vector<int> mine = rank.local_stages();
  const int last_stage = rank.schedule().stages - 1;
  // Only the ranks of the first and the last stage touch the data.
  std::unique_ptr<zoo::Dataset> data;
  if (std::find(mine.begin(), mine.end(), 0) != mine.end() ||
      std::find(mine.begin(), mine.end(), last_stage) != mine.end())
    data = f.model.dataset();
  // Rank 0 holds stage 0, so it has the data; it tells the others the sizes of the splits.
  torch::Tensor sizes = torch::zeros({2}, torch::kDouble);
  if (leader) {
    sizes[0] = static_cast<double>(data->train_size());
    sizes[1] = static_cast<double>(data->eval_size());
  }
  world->all_reduce_sum(sizes);
  const auto train_size = static_cast<int64_t>(sizes[0].item<double>());
  const auto eval_size = static_cast<int64_t>(sizes[1].item<double>());
  total = f.steps > 0 ? f.steps : kDefaultSteps;
  if (f.steps == 0 && f.epochs > 0) {
    if (train_size == 0) throw UsageError("--epochs needs a finite data set; --data " + f.model.data + " is endless: use --steps");
    total = steps_for_epochs(f.epochs, train_size, f.batch_size);
  }
  if (!f.resume.empty()) load_checkpoint(rank, f.resume);
  const int start = rank.step();
  if (start >= total)
    throw UsageError("checkpoint " + f.resume + " is at step " + std::to_string(start) + " and the run has " +
                     std::to_string(total) + " steps: pass --steps larger than " + std::to_string(start));
  const int64_t eval_count =
      f.eval_every == 0 ? 0  // --eval-every 0: no evaluation
      : f.eval_samples > 0 ? std::min(f.eval_samples, eval_size) : (f.model.is_text() ? std::min<int64_t>(256, eval_size) : eval_size);
  const int64_t eval_chunk = f.eval_batch > 0 ? f.eval_batch : 4 * f.batch_size;
  const int eval_every = f.eval_every > 0 ? f.eval_every : f.eval_every == 0 ? total : std::max(1, total / 10);
  const bool text = f.model.model == "gpt";
  const double units_per_sample = text ? static_cast<double>(f.model.gpt.seq_len) : 1.0;

  std::unique_ptr<std::ofstream> log;
  if (leader && !f.log.empty()) {
    log = std::make_unique<std::ofstream>(f.log, start > 0 ? std::ios::app : std::ios::trunc);
    if (!*log) throw std::runtime_error("cannot write the log file '" + f.log + "'");
  }
  if (leader) {
    std::string balance;
    for (int n : rank.balance()) balance += (balance.empty() ? "" : ",") + std::to_string(n);
    std::cout << fmt::format("pipetrain train: {}\n  {} over {} ({} threads per rank), schedule {}, m={}, "
                             "batch {}, balance {}, re-materialisation {}\n  optimizer {} lr {} ({}{}), clip {}, "
                             "{} steps{}{}\n  {}",
                             f.model.describe(),
                             f.pipe.replicas > 1 ? fmt::format("{} stages x {} replicas", f.pipe.stages, f.pipe.replicas)
                             : !f.pipe.replication.empty()
                                 ? fmt::format("{} stages replicated {} (1F1B-RR, {} ranks)", f.pipe.stages,
                                               f.pipe.replication, f.pipe.world_size())
                                 : fmt::format("{} stages", f.pipe.stages),
                             transport->name(), o.threads,
                             async ? fmt::format("{} (weights: {}{})", f.pipe.schedule, to_string(rank.weight_policy()),
                                                 schedule_traits(f.pipe.schedule).one_microbatch_per_step
                                                     ? ", a step per micro-batch"
                                                     : "")
                                   : f.pipe.schedule,
                             f.pipe.microbatches, f.batch_size, balance, f.pipe.checkpoint, f.optimizer, f.lr,
                             f.lr_schedule, warmup_steps(f, total) > 0 ? fmt::format(", warm-up {}", warmup_steps(f, total)) : "", f.clip, total,
                             train_size > 0 ? fmt::format(" ({:.2f} epochs)", static_cast<double>(total) * f.batch_size / train_size) : "",
                             start > 0 ? fmt::format(", resuming at step {} from {}", start, f.resume) : "",
                             describe(runtime_info()))
              << std::flush;
    if (f.pipe.umpipe_chosen) std::cout << umpipe_banner(f.pipe) << std::flush;
  }
  Progress progress(f.progress, total, start, text ? "tokens" : "samples");
  auto run_eval = [&](int step) -> std::optional<EvalResult> {
    if (eval_count == 0) return std::nullopt;
    const EvalResult e = evaluate_heldout(rank, data.get(), eval_count, eval_chunk);
    if (leader) progress.note(fmt::format("eval at step {}: {} ({} held-out {})", step, eval_text(f, e), e.samples,
                                          text ? "windows" : "samples"));
    return e;
  };
  std::optional<EvalResult> first_eval, last_eval;
  if (start == 0) first_eval = run_eval(0);
  std::vector<double> step_ms;
  double first_loss = 0, last_loss = 0;
  StepStats last;
  std::map<int, WeightMemory> weight_memory;  // asynchronous: peak extra weight sets per stage of this rank
  // Synchronous schedules: a call per step. Asynchronous ones: a call per run of steps between
  // evaluations and checkpoints (next_boundary), during which the pipeline never drains.
  int last_saved = start;
  g_stop_cooperative = 1;  // from here on the loop reads the flag (stop_requested)
  for (int step = start; step < total;) {
    if (const int sig = stop_requested(*world)) {
      const std::string name = sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "signal " + std::to_string(sig);
      if (f.save_on_interrupt && !f.save.empty() && step > last_saved) {
        if (replica == 0) save_checkpoint(rank, *transport, f.save, run_json(f, total));
        world->barrier();
        last_saved = step;
        if (leader) progress.note(fmt::format("checkpoint at step {} written to {}", step, f.save));
      }
      if (leader) {
        progress.note(fmt::format("stopped by {} after step {} of {}", name, step, total));
        if (!f.save.empty() && last_saved > 0)
          std::cout << "the checkpoint in " << f.save << " is at step " << last_saved << "; continue with --resume "
                    << f.save << "\n" << std::flush;
      }
      return 128 + sig;
    }
    const int calls_steps = async ? next_boundary(f, step, total, eval_every) - step : 1;
    const double lr = lr_at(f, step, total);
    rank.set_learning_rate(lr);
    zoo::Batch b;
    if (data) {
      if (calls_steps == 1) {
        b = data->batch(step, f.batch_size);
      } else {
        // Stage 0's rank needs the inputs, the last stage's the targets.
        const bool first = std::find(mine.begin(), mine.end(), 0) != mine.end();
        const bool final = std::find(mine.begin(), mine.end(), last_stage) != mine.end();
        std::vector<torch::Tensor> inputs, targets;
        for (int k = 0; k < calls_steps; ++k) {
          zoo::Batch one = data->batch(step + k, f.batch_size);
          if (first) inputs.push_back(one.input);
          if (final) targets.push_back(one.target);
        }
        if (first) b.input = torch::cat(inputs, 0);
        if (final) b.target = torch::cat(targets, 0);
      }
    }
    if (f.pipe.replicas > 1) {  // this copy's share of the mini-batch (synchronous: one step per call)
      if (b.input.defined()) b.input = b.input.slice(0, replica * share, (replica + 1) * share);
      if (b.target.defined()) b.target = b.target.slice(0, replica * share, (replica + 1) * share);
    }
    world->barrier();  // steps start together, so step times are comparable across ranks
    const auto t0 = std::chrono::steady_clock::now();
    last = rank.train_steps(b.input, b.target, share * calls_steps, calls_steps);
    world->barrier();
    const double call_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const double ms = call_ms / calls_steps;
    for (const WeightMemory& w : last.weight_memory) {
      WeightMemory& m = weight_memory[w.stage];
      m.stage = w.stage;
      m.set_bytes = w.set_bytes;
      m.peak_extra_sets = std::max(m.peak_extra_sets, w.peak_extra_sets);
    }
    // Busy time of each stage in this call (its compute actions), per step, for the log.
    torch::Tensor busy = torch::zeros({rank.schedule().stages}, torch::kDouble);
    if (!f.log.empty()) {  // the same on every rank: a collective
      for (const TimedAction& e : last.timeline.events)
        if (is_compute(e.action.kind)) busy[e.action.stage] += (e.end - e.start) / calls_steps;
      transport->all_reduce_sum(busy);
    }
    // The pipeline's own time in this call, per step, for the log: from the first event to the last over
    // all ranks (without the barriers; with UMPIPE also without the optimizer step, as its prediction).
    double pass_ms = 0;
    if (!f.log.empty()) {
      torch::Tensor span = torch::zeros({2 * p}, torch::kDouble);
      double first = 1e300, end = -1e300;
      for (const TimedAction& e : last.timeline.events) {
        first = std::min(first, e.start);
        end = std::max(end, e.end);
      }
      if (end >= first) {
        span[2 * transport->rank()] = first;
        span[2 * transport->rank() + 1] = end;
      }
      transport->all_reduce_sum(span);
      double lo = 1e300, hi = -1e300;
      for (int r = 0; r < p; ++r)
        if (span[2 * r + 1].item<double>() > 0) {
          lo = std::min(lo, span[2 * r].item<double>());
          hi = std::max(hi, span[2 * r + 1].item<double>());
        }
      pass_ms = hi > lo ? (hi - lo) / calls_steps : 0.0;
    }
    for (int k = 0; k < calls_steps; ++k, ++step) {
      const double loss = last.losses[static_cast<std::size_t>(k)];
      const double grad_norm = last.grad_norms[static_cast<std::size_t>(k)];
      const double step_lr = lr_at(f, step, total);
      step_ms.push_back(ms);
      if (step == start) first_loss = loss;
      last_loss = loss;
      const double per_s = 1000.0 * static_cast<double>(f.batch_size) / ms;
      if (leader) progress.step(step + 1, loss, grad_norm, step_lr, ms, per_s * units_per_sample);
      nlohmann::json entry;
      if (leader && log) {
        entry = {{"step", step + 1}, {"loss", loss}, {"lr", step_lr}, {"grad_norm", grad_norm}, {"step_ms", ms},
                 {"samples_per_s", per_s}};
        if (text) entry["tokens_per_s"] = per_s * units_per_sample;
        std::vector<double> bs(static_cast<std::size_t>(busy.numel()));
        for (int64_t s = 0; s < busy.numel(); ++s) bs[static_cast<std::size_t>(s)] = busy[s].item<double>();
        entry["busy_ms"] = bs;
        entry["pass_ms"] = pass_ms;
      }
      if ((step + 1) % eval_every == 0 || step + 1 == total) {  // only at a call's last step (next_boundary)
        last_eval = run_eval(step + 1);
        if (last_eval && leader && log) {
          entry["eval_loss"] = last_eval->loss;
          entry["eval_accuracy"] = last_eval->accuracy;
        }
      }
      if (leader && log) *log << entry.dump() << "\n" << std::flush;
      if (!f.save.empty() && ((f.save_every > 0 && (step + 1) % f.save_every == 0) || step + 1 == total)) {
        if (replica == 0) save_checkpoint(rank, *transport, f.save, run_json(f, total));  // copies are equal
        world->barrier();
        last_saved = step + 1;
        if (leader) progress.note(fmt::format("checkpoint at step {} written to {}", step + 1, f.save));
      }
    }
  }
  std::pair<std::string, std::string> sample;
  if (f.model.is_text() && f.sample > 0 && eval_size > 0) sample = generate_text(f, rank, *transport, data.get());

  // The last step's timeline from every rank, and the simulator's prediction from its measured costs.
  Timeline all = gather_timeline(last.timeline, *transport);
  torch::Tensor memory = torch::zeros({4, p}, torch::kDouble);
  memory[0][transport->rank()] = last.peak_heap_growth;
  memory[1][transport->rank()] = peak_rss_mib();
  for (const auto& [s, w] : weight_memory) {  // one stage per rank (asynchronous schedules are not interleaved)
    memory[2][s] = w.peak_extra_sets;
    memory[3][s] = w.set_bytes;
  }
  transport->all_reduce_sum(memory);
  if (!leader) return 0;
  double t0 = 1e300;
  for (const auto& e : all.events) t0 = std::min(t0, e.start);
  for (auto& e : all.events) {
    e.start -= t0;
    e.end -= t0;
  }
  const Metrics measured = compute_metrics(all);
  const Schedule plain = strip_communication(rank.schedule_for(last.steps));
  const SimResult predicted = simulate(plain, measured_costs(all, plain.stages));
  std::vector<double> sorted = step_ms;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const double per_s = 1000.0 * static_cast<double>(f.batch_size) / median;
  std::cout << fmt::format("summary: training loss {:.4f} -> {:.4f} over steps {}..{}; median step {:.1f} ms, {} {}/s\n",
                           first_loss, last_loss, start + 1, total, median, rate_text(per_s * units_per_sample),
                           text ? "tokens" : "samples");
  if (last_eval)
    std::cout << fmt::format("  held-out: {}{}\n", eval_text(f, *last_eval),
                             first_eval ? fmt::format(" (at step 0: loss {:.4f})", first_eval->loss) : "");
  if (f.pipe.umpipe_chosen)  // the plan's own prediction: the simulator's schedules do not cut unequally
    std::cout << fmt::format(
        "  last step: measured makespan {:.1f} ms, bubble fraction {:.3f}; UMPIPE {} plan predicted {:.1f} ms per step "
        "(compute and transfers, no optimizer step) against the measured median step {:.1f} ms: predicted/measured "
        "{:.2f}\n",
        measured.makespan, measured.bubble_fraction, f.pipe.umpipe_chosen->planner, f.pipe.umpipe_chosen->step_ms, median,
        median > 0 ? f.pipe.umpipe_chosen->step_ms / median : 0.0);
  else
  std::cout << fmt::format(
      "  last {}: measured makespan {:.1f} ms, bubble fraction {:.3f}; simulated from measured stage costs: "
      "makespan {:.1f} ms, bubble fraction {:.3f}; efficiency (predicted/measured) {:.2f}\n",
      last.steps == 1 ? std::string("step") : fmt::format("call ({} steps, one pipeline fill and drain)", last.steps),
      measured.makespan, measured.bubble_fraction, predicted.metrics.makespan, predicted.metrics.bubble_fraction,
      measured.makespan > 0 ? predicted.metrics.makespan / measured.makespan : 0.0);
  const bool shared = transport->shares_process();
  for (const RankMetrics& r : measured.per_rank)
    std::cout << fmt::format("  {}: busy {:.1f} ms, span {:.1f} ms, bubble {:.1f} ms; peak RSS {:.0f} MiB{}{}\n",
                             rank_label(rank.schedule(), r.rank), r.busy, r.span, r.bubble, memory[1][r.rank].item<double>(),
                             shared ? " (one process for all ranks)" : "",
                             f.memory ? fmt::format(", peak heap growth in a step {:.2f} MiB",
                                                    memory[0][r.rank].item<double>() / 1048576.0)
                                      : std::string());
  if (async) {
    std::string list;
    for (int s = 0; s < p; ++s)
      list += fmt::format("{}stage {} {} ({:.1f} KiB)", s ? ", " : "", s, static_cast<int>(memory[2][s].item<double>()),
                          memory[2][s].item<double>() * memory[3][s].item<double>() / 1024.0);
    std::cout << fmt::format("  weights ({}): extra weight sets kept at most, per stage: {}\n",
                             to_string(rank.weight_policy()), list);
  }
  if (!sample.second.empty()) {
    std::string prompt = sample.first.substr(sample.first.size() > 80 ? sample.first.size() - 80 : 0);
    std::cout << "sample (temperature " << f.temperature << ") after the held-out prompt \"..." << prompt << "\":\n"
              << sample.second << "\n";
  }
  if (!f.trace.empty()) {
    write_file_atomic(f.trace, chrome_trace_json(all));
    std::cout << "measured trace written to " << f.trace << "\n";
  }
  if (!f.svg.empty()) {
    write_file_atomic(f.svg, gantt_svg(all, measured));
    std::cout << "measured timeline written to " << f.svg << "\n";
  }
  if (!f.log.empty()) std::cout << "per-step log written to " << f.log << "\n";
  if (!f.save.empty()) std::cout << "checkpoint written to " << f.save << "\n";
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<TrainFlags>();
  CLI::App* cmd = app.add_subcommand("train", "train a model on real data with a pipeline schedule across ranks");
  f->model.add_to(*cmd);
  f->pipe.add_to(*cmd);
  f->pipe.add_umpipe_to(*cmd);
  cmd->add_option("--config", f->config,
                  "JSON file of flags, e.g. {\"stages\": 4, \"schedule\": \"zb-h1\", \"memory\": true}; flags on the "
                  "command line win");
  cmd->add_option("--batch-size", f->batch_size, "samples (text: windows) per step (mini-batch), default 32");
  cmd->add_option("--steps", f->steps, "optimizer steps, default 600 (or from --epochs)");
  cmd->add_option("--epochs", f->epochs, "passes over the training split (finite data sets), instead of --steps");
  cmd->add_option("--optimizer", f->optimizer, "sgd, adam or adamw; default adam");
  cmd->add_option("--lr", f->lr, "peak learning rate, default 3e-3");
  cmd->add_option("--lr-schedule", f->lr_schedule, "constant, cosine or linear (decay to lr/10); default cosine");
  cmd->add_option("--warmup", f->warmup, "linear warm-up steps; default 5% of the steps, at most 100");
  cmd->add_option("--momentum", f->momentum, "SGD momentum, default 0.9");
  cmd->add_option("--weight-decay", f->weight_decay, "weight decay, default 0");
  cmd->add_option("--clip", f->clip, "clip gradients to this global norm; 0 = off; default 1");
  cmd->add_option("--eval-every", f->eval_every,
                  "evaluate on the held-out split every K steps; 0 = never (no evaluation at all); default: 10 times a run");
  cmd->add_option("--eval-samples", f->eval_samples,
                  "held-out samples per evaluation (the first N); default all (images) or 256 windows (text)");
  cmd->add_option("--eval-batch", f->eval_batch, "samples per evaluation forward pass, default 4 x batch size");
  cmd->add_option("--save", f->save, "write a checkpoint to this folder at the end (and every --save-every steps)");
  cmd->add_option("--save-every", f->save_every, "also checkpoint every K steps; default 0 (only at the end)");
  cmd->add_flag("--save-on-interrupt", f->save_on_interrupt,
                "on SIGINT or SIGTERM (Ctrl-C), write one more checkpoint at the step reached before stopping; "
                "without it the last complete checkpoint is kept as it is");
  cmd->add_option("--resume", f->resume, "continue from this checkpoint folder (same model and data; any stages)");
  cmd->add_option("--sample", f->sample, "text: characters to generate at the end, default 300; 0 = none");
  cmd->add_option("--temperature", f->temperature, "text: sampling temperature, default 0.8");
  cmd->add_option("--trace", f->trace, "write the last step's measured timeline as a Chrome trace");
  cmd->add_option("--svg", f->svg, "write the last step's measured timeline as an SVG");
  cmd->add_option("--log", f->log, "write one JSON object per step to this file (JSON lines)");
  cmd->add_option("--progress", f->progress,
                  "bar (redrawn line), lines (one per step, with its time), quiet, or auto: bar when stdout is a "
                  "terminal, else (also for ranks started as processes, whose output the launcher relays line by "
                  "line) a line every 5% of the run; default auto")
      ->check(CLI::IsMember({"auto", "bar", "lines", "quiet"}));
  cmd->add_flag("--vertical-sync", f->vertical_sync,
                "pipedream: every stage uses the weight version stage 0 used for the mini-batch (PipeDream's vertical "
                "sync)");
  cmd->add_flag("--no-stash", f->no_stash,
                "pipedream: no weight stashing, the backward uses the current weights (the stale baseline)");
  cmd->add_option("--steps-per-call", f->steps_per_call,
                  "asynchronous schedules: steps the pipeline runs between drains; default 0 = up to the next "
                  "evaluation or checkpoint, at most 256");
  cmd->add_flag("--memory", f->memory,
                "measure each rank's peak heap growth during a step (activations, buffers, gradients); with "
                "--transport local all ranks share one heap");
  cmd->footer(
      "Without a launcher, --stages P starts P local processes over gloo (use --transport local for threads).\n"
      "Examples:\n"
      "  pipetrain train                                   # the gpt on the King James Bible, 2 stages, 1f1b\n"
      "  pipetrain train --model mlp --epochs 2 --stages 2 # Fashion-MNIST\n"
      "  pipetrain train --model cnn --stages 4 --schedule zb-h1 --microbatches 8 --svg run.svg --trace run.json\n"
      "  pipetrain train --model mlp --stages 4 --schedule pipedream --epochs 1  # asynchronous, weight stashing\n"
      "  pipetrain train --model mlp --stages 4 --schedule 2bw --microbatches 4 --epochs 1\n"
      "  pipetrain train --text my.txt --layers 6 --steps 1000 --save ckpt --save-every 100\n"
      "  pipetrain train --resume ckpt --steps 2000 --stages 4   # continue, regrouped into 4 stages\n"
      "  pipetrain train --config flags.json --lr 1e-3         # flags from a file, one overridden\n"
      "  pipetrain launch -n 2 -- pipetrain train --stages 2 --transport gloo\n"
      "  mpirun -n 2 pipetrain train --stages 2 --transport mpi");
  cmd->callback([f, cmd, &exit_code] {
    exit_code = guarded("train", [&] {
      if (f->batch_size < 1) throw UsageError("--batch-size must be >= 1, got " + std::to_string(f->batch_size));
      const bool steps_given = cmd->get_option("--steps")->count() > 0;
      const bool epochs_given = cmd->get_option("--epochs")->count() > 0;
      if (f->steps < 0 || (steps_given && f->steps == 0))
        throw UsageError("--steps must be >= 1, got " + std::to_string(f->steps) + ": give the optimizer steps to run");
      // 0, nan and inf used to run the default 600 steps (or -2147483648); 1e6 epochs is far past any run.
      if (epochs_given && !(f->epochs > 0 && f->epochs <= 1e6))
        throw UsageError("--epochs must be a number > 0 and at most 1e6, got " + fmt::format("{}", f->epochs) +
                         ": give the passes over the training split, e.g. --epochs 2 (or use --steps)");
      if (steps_given && epochs_given) throw UsageError("give --steps or --epochs, not both");
      if (f->eval_every < -1 || (cmd->get_option("--eval-every")->count() > 0 && f->eval_every < 0))
        throw UsageError("--eval-every must be >= 1 (or 0 for no evaluation), got " + std::to_string(f->eval_every));
      if (f->eval_samples < 0 || f->eval_batch < 0)
        throw UsageError("--eval-samples and --eval-batch must be >= 1 (or 0 for the default)");
      if (f->save_every < 0) throw UsageError("--save-every must be >= 0, got " + std::to_string(f->save_every));
      if (f->save_every > 0 && f->save.empty()) throw UsageError("--save-every needs --save DIR (where to write)");
      if (f->save_on_interrupt && f->save.empty()) throw UsageError("--save-on-interrupt needs --save DIR (where to write)");
      if (f->sample < 0) throw UsageError("--sample must be >= 0, got " + std::to_string(f->sample));
      if (!(f->temperature > 0)) throw UsageError("--temperature must be > 0, got " + fmt::format("{}", f->temperature));
      if (f->warmup < -1) throw UsageError("--warmup must be >= 0, got " + std::to_string(f->warmup));
      if (f->lr_schedule != "constant" && f->lr_schedule != "cosine" && f->lr_schedule != "linear")
        throw UsageError("unknown --lr-schedule '" + f->lr_schedule + "': use constant, cosine or linear");
      // Check what can be checked before any rank starts, so bad input is exit 2 with one message.
      f->model.prepare();
      f->pipe.prepare_umpipe(*cmd, f->batch_size);  // a plan's UMPIPE partitions: schedule gpipe, checked here
      // PipeDream and SpecTrain step after every micro-batch: the mini-batch (--batch-size) is the micro-batch.
      const bool one_per_step = schedule_traits(f->pipe.schedule).one_microbatch_per_step;
      if (one_per_step && cmd->get_option("--microbatches")->count() == 0) f->pipe.microbatches = 1;
      if (f->steps_per_call < 0)
        throw UsageError("--steps-per-call must be >= 0 (0: up to the next evaluation or checkpoint), got " +
                         std::to_string(f->steps_per_call));
      if (f->steps_per_call > 0 && !is_async(f->pipe.schedule))
        throw UsageError("--steps-per-call applies to the asynchronous schedules (pipedream, 2bw, spectrain), not '" +
                         f->pipe.schedule + "', which flushes after every step: drop --steps-per-call");
      PipelineOptions o = f->pipe.options(f->model.seed);
      auto model = f->model.factory()();
      check_balance_flags(f->pipe, f->model);
      if (f->pipe.replicas < 1) throw UsageError("--replicas must be >= 1, got " + std::to_string(f->pipe.replicas));
      if (f->pipe.plan_use != "pipeline" && f->pipe.plan_file.empty())
        throw UsageError("--plan-use " + f->pipe.plan_use + " picks a part of a plan file: pass --plan FILE too");
      if (f->pipe.replicas > 1 && !f->pipe.replication.empty())
        throw UsageError("--replication " + f->pipe.replication + " (replicated stages) and --replicas " +
                         std::to_string(f->pipe.replicas) + " (copies of the whole pipeline) do not combine: use one");
      if (f->pipe.replicas > 1) {
        if (f->batch_size % f->pipe.replicas != 0)
          throw UsageError("--batch-size " + std::to_string(f->batch_size) + " does not split evenly over --replicas " +
                           std::to_string(f->pipe.replicas) + ": use a multiple of " + std::to_string(f->pipe.replicas));
        if (is_async(f->pipe.schedule))
          throw UsageError("--replicas runs with the synchronous schedules (gpipe, 1f1b, interleaved, zb-*), not '" +
                           f->pipe.schedule + "'");
        split_equal(f->batch_size / f->pipe.replicas, o.microbatches);
      }
      split_equal(f->batch_size, o.microbatches);
      GeneratorOptions g;
      g.ranks = f->pipe.stages;
      g.microbatches = o.microbatches;
      g.virtual_stages = o.virtual_stages;
      generate(o.schedule, g);
      if (f->optimizer != "sgd" && f->optimizer != "adam" && f->optimizer != "adamw")
        throw UsageError("unknown optimizer '" + f->optimizer + "': use sgd, adam or adamw");
      o.optimizer.name = f->optimizer;
      o.optimizer.momentum = f->optimizer == "sgd" ? f->momentum : 0.0;
      o.vertical_sync = f->vertical_sync;
      o.weight_stashing = !f->no_stash;
      weight_policy_of(o);  // bad combinations (--vertical-sync with 1f1b, spectrain without momentum, ...)
      if (!(f->lr > 0)) throw UsageError("--lr must be > 0, got " + std::to_string(f->lr));
      if (!f->save.empty()) f->save = prepare_checkpoint_dir(f->save, "--save");  // before any step
      if (!f->resume.empty()) {
        const nlohmann::json saved = read_checkpoint(f->resume).at("run");
        const nlohmann::json now = run_json(*f, 0);
        std::vector<std::string> diffs = run_differences(saved, now, {"model", "data"});
        for (const auto& d : run_differences({{"optimizer", {{"name", saved.value("optimizer", nlohmann::json::object())
                                                                              .value("name", std::string())}}}},
                                             {{"optimizer", {{"name", f->optimizer}}}}, {"optimizer"}))
          diffs.push_back(d);
        if (!diffs.empty()) {
          std::string msg = "checkpoint " + f->resume + " does not match this run:";
          for (const auto& d : diffs) msg += "\n  " + d;
          throw UsageError(msg + "\npass the flags it was saved with (see its manifest.json), or start without --resume");
        }
      }
      StopSignalScope stop_signals;  // process-wide (a launcher parent installs its own while it runs)
      return run_ranks(f->pipe, cli_argc(), cli_argv(), [&](std::shared_ptr<Transport> t) { return train_rank(*f, t); });
    });
  });
}

}  // namespace pipetrain::cli

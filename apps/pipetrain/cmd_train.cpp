// `pipetrain train`: the main job. Trains a model on real data with a pipeline schedule across ranks
// (threads or processes): a progress bar, evaluation on the held-out split, checkpoints that resume
// bitwise, a text sample for language models, and a summary with the measured bubble against the
// simulator's prediction; the measured timeline can be written as a Chrome trace and an SVG.
#include <fmt/format.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <tuple>
#include <nlohmann/json.hpp>

#include "cli_common.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/runtime/checkpoint.h"
#include "pipetrain/runtime/info.h"
#include "pipetrain/runtime/launch.h"
#include "pipetrain/runtime/trainer.h"
#include "run_common.h"
#include "train_report.h"
#include "train_support.h"

namespace pipetrain::cli {
namespace {

// This rank's pipeline options from the flags (the balance is a collective over `world`).
// With --memory, rank 0 gets the profile the heap model predicts from in `profile` (none is measured for
// a run the model does not cover).
PipelineOptions rank_options(const TrainFlags& f, const std::shared_ptr<Transport>& world, int64_t share,
                             std::optional<Profile>& profile) {
  PipelineOptions o = f.pipe.options(f.model.seed, device_rank(world->name(), world->rank()));
  o.tied = f.model.ties();
  o.variable_shapes = f.model.gpt.variable_length;
  o.layers_per_stage = resolve_balance(f.pipe, f.model, share / std::max(1, f.pipe.microbatches), *world,
                                       f.memory && heap_model_missing(f).empty() ? &profile : nullptr);
  o.data_parallel = f.pipe.replica_group(world);
  o.optimizer.name = f.optimizer;
  o.optimizer.lr = f.lr;
  o.optimizer.momentum = f.optimizer == "sgd" ? f.momentum : 0.0;
  o.optimizer.weight_decay = f.weight_decay;
  o.optimizer.clip_grad_norm = f.clip;
  o.optimizer.nonfinite = f.nonfinite;
  o.measure_memory = f.memory;
  o.vertical_sync = f.vertical_sync;
  o.weight_stashing = !f.no_stash;
  if (f.pipe.umpipe_chosen) o.umpipe = std::make_shared<UmpipePlan>(f.pipe.umpipe_chosen->plan);
  if (const char* fault = std::getenv("PIPETRAIN_FAULT")) o.before_action = fault_injector(fault);
  return o;
}

TrainerOptions trainer_options(const TrainFlags& f, const LrSchedule& lr) {
  TrainerOptions to;
  to.steps = f.steps > 0 ? f.steps : f.epochs > 0 ? 0 : kDefaultSteps;
  to.epochs = f.epochs;
  to.batch_size = f.batch_size;
  to.lr = lr;
  to.eval_every = f.eval_every;
  // Default: all of the held-out split for images, 256 windows for text.
  to.eval_samples = f.eval_samples > 0 ? f.eval_samples : f.model.is_text() ? 256 : 0;
  to.eval_batch = f.eval_batch;
  to.save_dir = f.save;
  to.save_every = f.save_every;
  to.save_on_interrupt = f.save_on_interrupt;
  to.resume_dir = f.resume;
  to.run_description = [&f](int steps) { return run_json(f, steps); };
  to.steps_per_call = f.steps_per_call;
  to.stage_times = !f.log.empty();  // the same on every rank (check_same_settings)
  to.stop_requested = [] { return stop_signal_received(); };
  return to;
}

// The per-step log (--log): every write checked, so a full disk or an unwritable target stops the run
// with the path and the reason instead of ending with "written" over a log cut mid-line.
class LogFile {
 public:
  // `resumed_at` > 0: a run resumed at that step appends, after dropping the lines of later steps (a run
  // stopped after its last checkpoint logged them; they are trained again now) and a last line cut short.
  LogFile(const std::string& path, int resumed_at) : path_(path) {
    std::error_code ec;
    if (std::filesystem::is_fifo(path, ec)) {
      // Opening a FIFO that nobody reads blocked the run before its first step, silently.
      fd_ = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
      if (fd_ < 0 && errno == ENXIO) {
        errno = ENXIO;
        fail("it is a FIFO that no program reads (start its reader first)");
      }
      if (fd_ >= 0) ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
    } else {
      // Not truncated before it is ours: a second start of the same command emptied the first run's log,
      // which then filled with NUL bytes up to the first run's offset (both exited 0). An exclusive lock
      // on a regular file tells the second run, before it writes anything.
      // A resumed run's lines after its step are dropped under that lock too, in the same file (it replaced
      // the file by a rename before locking, so a run writing it lost its whole log).
      fd_ = ::open(path.c_str(), (resumed_at > 0 ? O_RDWR | O_APPEND : O_WRONLY) | O_CREAT | O_CLOEXEC, 0644);
      struct stat st {};
      if (fd_ >= 0 && ::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode)) {
        if (::flock(fd_, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
          ::close(fd_);
          fd_ = -1;
          throw UsageError("--log " + path_ + " is being written by another run now (the same command started "
                           "twice?): give each run its own --log, or wait for the other to finish");
        }
        if (resumed_at == 0 && ::ftruncate(fd_, 0) != 0) fail("cannot empty it");
        if (resumed_at > 0) drop_lines_after(resumed_at);
      }
    }
    if (fd_ < 0) fail("cannot open it");
  }
  LogFile(const LogFile&) = delete;
  LogFile& operator=(const LogFile&) = delete;
  ~LogFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write_line(const std::string& text) {
    const std::string line = text + "\n";
    // Where the line starts (a regular file): a write cut short by a full disk is taken back, so the log
    // holds whole JSON lines only (a half line failed every JSON-lines reader).
    const off_t start = ::lseek(fd_, 0, SEEK_END);
    std::size_t at = 0;
    while (at < line.size()) {
      const ssize_t n = ::write(fd_, line.data() + at, line.size() - at);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = errno;
        if (at > 0 && start >= 0 && ::ftruncate(fd_, start) == 0) ::lseek(fd_, start, SEEK_SET);
        errno = err;
        fail("cannot write to it");
      }
      at += static_cast<std::size_t>(n);
    }
  }
  // Closes the file, checking what the kernel reports at the end (a network file system's late error).
  void close() {
    const int fd = fd_;
    fd_ = -1;
    if (fd >= 0 && ::close(fd) != 0) fail("cannot finish writing it");
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    const int err = errno ? errno : EIO;
    throw std::runtime_error("--log " + path_ + ": " + what + ": " + std::strerror(err) +
                             (err == ENOSPC || err == EDQUOT ? " (the disk is full: free space or log elsewhere)" : ""));
  }
  // On the open, locked regular file.
  void drop_lines_after(int step) {
    std::string text;
    char buf[65536];
    for (off_t at = 0;;) {
      const ssize_t n = ::pread(fd_, buf, sizeof buf, at);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("cannot read it");
      if (n == 0) break;
      text.append(buf, static_cast<std::size_t>(n));
      at += n;
    }
    std::string kept;
    std::size_t at = 0;
    while (at < text.size()) {
      const std::size_t end = text.find('\n', at);
      if (end == std::string::npos) {
        // A log line cut short (a crash, a full disk) goes; anything else the user appended stays, with
        // the newline the appended lines need (a note without one was deleted without a word).
        const std::size_t first = text.find_first_not_of(" \t\r", at);
        if (first != std::string::npos && text[first] != '{') kept += text.substr(at) + "\n";
        break;
      }
      const std::string line = text.substr(at, end - at);
      at = end + 1;
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.contains("step") && j["step"].is_number() && j["step"].get<double>() > step) continue;
      kept += line + "\n";
    }
    if (kept.size() == text.size()) return;
    // Usually the lines dropped are the last ones: the file is cut there. Otherwise it is written again.
    if (text.compare(0, kept.size(), kept) == 0) {
      if (::ftruncate(fd_, static_cast<off_t>(kept.size())) != 0) fail("cannot cut it");
      return;
    }
    if (::ftruncate(fd_, 0) != 0) fail("cannot rewrite it");
    if (!kept.empty()) write_line(kept.substr(0, kept.size() - 1));  // kept ends with its newline
  }
  std::string path_;
  int fd_ = -1;
};

// What rank 0 shows while it trains: the progress bar or lines, and the per-step log.
struct RankOutput {
  std::unique_ptr<LogFile> log;
  std::unique_ptr<Progress> progress;
  HeapPrediction heap;  // --memory: the heap model's prediction per pipeline rank
  int nonfinite_steps = 0;  // steps whose loss or gradient norm was NaN or infinite (--nonfinite skip, ignore)
};

TrainerCallbacks callbacks(const TrainFlags& f, bool leader, RankOutput& out) {
  const bool text = f.model.model == "gpt";
  TrainerCallbacks cb;
  cb.on_eval = [&f, &out, leader, text](int step, const EvalResult& e) {
    if (leader)
      out.progress->note(fmt::format("eval at step {}: {} ({} held-out {})", step, eval_text(f, e), e.samples,
                                     !text ? "samples" : f.model.gpt.variable_length ? "lines" : "windows"));
  };
  cb.on_checkpoint = [&out, leader](int step, const std::string& dir) {
    if (leader) out.progress->note(fmt::format("checkpoint at step {} written to {}", step, dir));
  };
  cb.on_step = [&f, &out, leader, text](const StepRecord& s) {
    if (!leader) return;
    const double per_s = 1000.0 * static_cast<double>(f.batch_size) / s.ms;
    // Text: the step's real tokens (padding of --variable-length lines not counted), not batch x seq-len.
    const double tokens_per_s = 1000.0 * s.units / s.ms;
    out.progress->step(s.step, s.loss, s.grad_norm, s.lr, s.ms, text ? tokens_per_s : per_s);
    // --nonfinite skip dropped this step's update (ignore applied it): said for the first few steps, then
    // counted in the summary (a run of NaN losses would otherwise show nothing else).
    if (!std::isfinite(s.loss) || !std::isfinite(s.grad_norm)) {
      if (++out.nonfinite_steps <= 3)
        out.progress->note(fmt::format("step {}: loss {} and gradient norm {}: {}", s.step, s.loss, s.grad_norm,
                                       f.nonfinite == "skip" ? "its update was skipped (--nonfinite skip)"
                                                             : "its update was applied (--nonfinite ignore)"));
    }
    if (!out.log) return;
    nlohmann::json entry = {{"step", s.step}, {"loss", s.loss}, {"lr", s.lr}, {"grad_norm", s.grad_norm},
                            {"step_ms", s.ms}, {"samples_per_s", per_s}};
    if (text) entry["tokens_per_s"] = tokens_per_s;
    entry["busy_ms"] = s.busy_ms;
    entry["pass_ms"] = s.pass_ms;
    if (f.memory) {
      entry["heap_growth_mib"] = s.heap_growth_mib;  // per rank
      if (!out.heap.ranks.empty()) {
        std::vector<double> predicted;
        for (const HeapPeak& p : out.heap.ranks) predicted.push_back(p.total() / 1048576.0);
        entry["heap_predicted_mib"] = predicted;  // per pipeline rank, the heap model's
      }
    }
    if (std::any_of(s.device_peak_allocated_mib.begin(), s.device_peak_allocated_mib.end(),
                    [](double mib) { return mib >= 0; }))
      entry["gpu_peak_allocated_mib"] = s.device_peak_allocated_mib;  // per rank; -1 where not measured
    if (s.eval) {
      entry["eval_loss"] = s.eval->loss;
      entry["eval_accuracy"] = s.eval->accuracy;
    }
    out.log->write_line(entry.dump());
  };
  return cb;
}

// After the run, on rank 0: the summary, the text sample and the files written.
void print_outputs(const TrainFlags& f, PipelineRank& rank, const Transport& transport, const TrainResult& r,
                   const RunReport& rep, const std::pair<std::string, std::string>& sample,
                   const HeapPrediction& out_heap) {
  print_summary(f, rank, transport, r, rep, &out_heap);
  if (!sample.second.empty()) {
    std::string prompt = sample.first.substr(sample.first.size() > 80 ? sample.first.size() - 80 : 0);
    // Both quote the training text, whose escape sequences and bytes that are not UTF-8 reached the
    // terminal (ESC [2J cleared the screen): shown as \xNN, as every other quote of a file's text is.
    std::cout << "sample (temperature " << f.temperature << ") after the held-out prompt \"..." << escape_controls(prompt)
              << "\":\n" << escape_controls(sample.second) << "\n";
  }
  if (!f.trace.empty()) {
    write_file_atomic(f.trace, [&](TextSink& out) { write_chrome_trace(TimelineView(rep.timeline), out); });
    std::cout << "measured trace written to " << f.trace << "\n";
  }
  if (!f.svg.empty()) {
    write_file_atomic(f.svg, [&](TextSink& out) { write_gantt_svg(TimelineView(rep.timeline), rep.measured, out); });
    std::cout << "measured timeline written to " << f.svg << "\n";
  }
  if (!f.log.empty()) std::cout << "per-step log written to " << f.log << "\n";
  if (!f.save.empty()) std::cout << "checkpoint written to " << f.save << "\n";
}

// A --plan or --profile whose profile measured another of the zoo's models (pipetrain profile names it as
// describe() does: architecture, " on ", data) still runs, as its balance may be reused on purpose; but
// its times are that model's, so the run says so. Profiles from elsewhere (PipeDream's graphs) carry
// other names and are not compared.
void warn_if_profiled_on_another_model(const std::string& flag, const std::string& file, const std::string& measured,
                                       const std::string& run_model) {
  const auto architecture = [](const std::string& d) { return d.substr(0, d.find(" on ")); };
  bool ours = false;
  for (const char* prefix : {"gpt: ", "mlp: ", "cnn (", "resnet: ", "unet: "})
    ours = ours || measured.rfind(prefix, 0) == 0;
  if (file.empty() || !ours || architecture(measured) == architecture(run_model)) return;
  std::cerr << "warning: " << flag << " " << file << " was made from a profile of another model ("
            << architecture(measured) << ") than this run's (" << architecture(run_model) << "): its "
            << (flag == "--plan" ? "balance runs, but its predicted time is not this model's"
                                 : "times balance the stages, but they are not this model's")
            << "; profile this model with the same flags (pipetrain profile)"
            << (flag == "--plan" ? " and plan again" : "") << "\n";
}

int train_rank(const TrainFlags& f, std::shared_ptr<Transport> world) {
  check_same_settings(f, *world);
  world = f.pipe.placed_world(world);  // a plan's replicas-inner placement: the world in pipeline-inner order
  // With --replicas R the world holds R copies of the pipeline (hybrid data + pipeline parallelism):
  // `transport` is this rank's pipeline; copy k trains on the k-th 1/R of every mini-batch and the
  // stages average their gradients over the copies before stepping.
  const std::shared_ptr<Transport> transport = f.pipe.pipeline_group(world);
  const int64_t share = f.batch_size / f.pipe.replicas;  // samples per copy and step
  const bool leader = world->rank() == 0;
  if (leader) {
    warn_if_profiled_on_another_model("--plan", f.pipe.plan_file, f.pipe.plan_model, f.model.describe());
    if (!f.pipe.plan_file.empty() && f.pipe.plan_use == "pipeline" && !f.pipe.plan_fits_memory) {
      // pipetrain plan writes a plan that fits no rank's --memory for inspection, and says so; a run of it
      // says so again, as it needs that much memory per rank.
      std::cerr << fmt::format("warning: --plan {} does not fit the memory per rank it was planned for (its "
                               "\"fits_memory_limit\" is false; predicted peak {:.3f} GiB per rank): this run may "
                               "run out of memory; plan again with more --ranks, a higher --memory or a smaller "
                               "--batch-size\n",
                               f.pipe.plan_file, f.pipe.plan_peak_bytes / 1073741824.0);
    }
    if (!f.pipe.profile_file.empty())
      warn_if_profiled_on_another_model("--profile", f.pipe.profile_file, load_profile(f.pipe.profile_file).model,
                                        f.model.describe());
  }
  std::optional<Profile> profile;  // rank 0, with --memory: what the heap model predicts from
  PipelineOptions o = rank_options(f, world, share, profile);
  const LrSchedule lr = lr_schedule(f);
  int total = 0;  // the trainer's, set before the first step
  // One asynchronous call runs several steps: each stage sets the learning rate of its step just before
  // stepping.
  if (is_async(f.pipe.schedule)) o.learning_rate = [lr, &total](int k) { return lr.at(k, total); };
  // The gpt's ranks build only their own layers (each from its own seed: the weights of the whole model);
  // UMPIPE checks the whole model, so with a plan's partitions every rank builds it (the same weights).
  const std::optional<LayerwiseModel> layers = o.umpipe ? std::nullopt : f.model.layerwise();
  PipelineRank rank = layers ? PipelineRank(*layers, f.model.loss(), transport, o)
                             : PipelineRank(f.model.factory()(), f.model.loss(), transport, o);
  const std::vector<int> mine = rank.local_stages();
  const int last_stage = rank.schedule().stages - 1;
  // Only the ranks of the first and the last stage (and rank 0, which holds stage 0) touch the data.
  std::unique_ptr<zoo::Dataset> dataset;
  if (leader || std::find(mine.begin(), mine.end(), 0) != mine.end() ||
      std::find(mine.begin(), mine.end(), last_stage) != mine.end())
    dataset = f.model.dataset();
  std::optional<TrainData> data;
  if (dataset) data = zoo::train_data(*dataset);

  RankOutput out;
  if (f.memory && leader) out.heap = predict_run_heap(f, rank, o, profile);
  const bool text = f.model.model == "gpt";
  Trainer trainer(rank, world, transport, data ? &*data : nullptr, trainer_options(f, lr), callbacks(f, leader, out));
  trainer.prepare();
  total = trainer.total();
  if (leader && !f.log.empty()) {
    out.log = std::make_unique<LogFile>(f.log, trainer.start());
  }
  if (leader) {
    std::cout << banner(f, trainer, rank, *transport, o.threads) << std::flush;
    if (f.pipe.umpipe_chosen) std::cout << umpipe_banner(f.pipe) << std::flush;
  }
  out.progress = std::make_unique<Progress>(f.progress, total, trainer.start(), text ? "tokens" : "samples");
  stop_signals_cooperative();  // from here on the trainer polls the flag at every call
  const TrainResult r = trainer.run();
  if (r.stopped_by) {
    const int sig = r.stopped_by;
    if (leader) {
      const std::string name = sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "signal " + std::to_string(sig);
      out.progress->note(fmt::format("stopped by {} after step {} of {}", name, r.reached, r.total));
      if (!f.save.empty() && r.last_saved > 0 && r.last_saved >= r.total)
        std::cout << "the run is complete: the checkpoint in " << f.save << " is at its last step, " << r.last_saved
                  << "\n" << std::flush;
      else if (!f.save.empty() && r.last_saved > 0)
        std::cout << "the checkpoint in " << f.save << " is at step " << r.last_saved << "; continue with --resume "
                  << f.save << "\n" << std::flush;
    }
    return 128 + sig;
  }
  std::pair<std::string, std::string> sample;
  if (f.model.is_text() && f.sample > 0 && trainer.eval_size() > 0)
    sample = generate_text(f, rank, *transport, dataset.get());
  const RunReport rep = trainer.report(r);
  if (out.log) out.log->close();
  if (leader) print_outputs(f, rank, *transport, r, rep, sample, out.heap);
  if (leader && out.nonfinite_steps > 0)
    std::cout << fmt::format("{} of {} steps had a NaN or infinite loss or gradient norm; their updates were {} "
                             "(--nonfinite {})\n",
                             out.nonfinite_steps, r.reached - trainer.start(),
                             f.nonfinite == "skip" ? "skipped" : "applied", f.nonfinite);
  return 0;
}

void add_train_flags(CLI::App* cmd, const std::shared_ptr<TrainFlags>& f) {
  f->model.add_to(*cmd);
  f->pipe.add_to(*cmd);
  f->pipe.add_umpipe_to(*cmd);
  cmd->add_option("--config", f->config,
                  "JSON file of flags, e.g. {\"stages\": 4, \"schedule\": \"zb-h1\", \"memory\": true}; flags on the "
                  "command line win");
  cmd->add_option("--batch-size", f->batch_size, "samples (text: windows) per step (mini-batch), default a --plan's, else 32");
  cmd->add_option("--steps", f->steps, "optimizer steps, default 600 (or from --epochs)");
  cmd->add_option("--epochs", f->epochs, "passes over the training split (finite data sets), instead of --steps");
  cmd->add_option("--optimizer", f->optimizer, "sgd, adam or adamw; default adam");
  cmd->add_option("--lr", f->lr, "peak learning rate, default 3e-3");
  cmd->add_option("--lr-schedule", f->lr_schedule, "constant, cosine or linear (decay to lr/10); default cosine");
  cmd->add_option("--warmup", f->warmup, "linear warm-up steps; default 5% of the steps, at most 100");
  cmd->add_option("--momentum", f->momentum, "SGD momentum, default 0.9");
  cmd->add_option("--weight-decay", f->weight_decay, "weight decay, default 0");
  cmd->add_option("--clip", f->clip, "clip gradients to this global norm (pipedream and spectrain: each stage to it by its own "
                                   "norm); 0 = off; default 1");
  cmd->add_option("--nonfinite", f->nonfinite,
                  "a step whose loss or gradient norm is NaN or infinite (the run diverged): stop (the run ends with "
                  "exit 1 before that step's update; no checkpoint is written after it), skip (that step's update is "
                  "dropped), or ignore; default stop")
      ->check(CLI::IsMember({"stop", "skip", "ignore"}));
  cmd->add_option("--eval-every", f->eval_every,
                  "evaluate on the held-out split every K steps; 0 = never (no evaluation at all); default: 10 times a run");
  cmd->add_option("--eval-samples", f->eval_samples,
                  "held-out samples per evaluation (the first N); default all (images) or 256 windows (text)");
  cmd->add_option("--eval-batch", f->eval_batch, "samples per evaluation forward pass, default 4 x batch size");
  cmd->add_option("--save", f->save, "write a checkpoint to this folder at the end (and every --save-every steps)");
  cmd->add_option("--save-every", f->save_every, "also checkpoint every K steps; default 0 (only at the end)");
  cmd->add_flag("--overwrite", f->overwrite,
                "let --save replace a checkpoint that this run does not resume from (without it, such a run is "
                "refused before it trains: a forgotten --resume lost the checkpoint at the first save)");
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
  cmd->add_option("--rank-memory", f->rank_memory,
                  "memory one rank may use, in GiB: a model and batch whose rank needs more than a lower bound "
                  "(its share of the 4-byte parameters and one layer's activations of a micro-batch; gradients, "
                  "optimizer state and micro-batches in flight come on top: --memory measures them) are refused "
                  "before training (the gpt's ranks build only their own layers, so more --stages fit a larger "
                  "gpt); default: only this host's memory (or cgroup limit) is checked");
  cmd->add_flag("--memory", f->memory,
                "measure each rank's peak heap growth during a step (activations, buffers, gradients; on a GPU "
                "whose LibTorch reports it, the GPU's), next to the heap model's prediction from a profile "
                "(--profile's, else rank 0 measures one before training); with --transport local all ranks share "
                "one heap");
}

constexpr const char* kTrainExamples =
      "Without a launcher, --stages P starts P local processes over shared memory (--transport shm; use --transport\n"
      "local for threads, gloo for TCP).\n"
      "Examples:\n"
      "  pipetrain train                                   # the gpt on the King James Bible, 2 stages, 1f1b\n"
      "  pipetrain train --model mlp --epochs 2 --stages 2 # Fashion-MNIST\n"
      "  pipetrain train --model cnn --stages 4 --schedule zb-h1 --microbatches 8 --svg run.svg --trace run.json\n"
      "  pipetrain train --model mlp --stages 4 --schedule pipedream --epochs 1  # asynchronous, weight stashing\n"
      "  pipetrain train --model mlp --stages 4 --schedule 2bw --microbatches 4 --epochs 1\n"
      "  pipetrain train --text my.txt --layers 6 --steps 1000 --save ckpt --save-every 100\n"
      "  pipetrain train --resume ckpt --steps 2000 --stages 4   # continue (its model and data), in 4 stages\n"
      "  pipetrain train --config flags.json --lr 1e-3         # flags from a file, one overridden\n"
      "  pipetrain launch -n 2 -- pipetrain train --stages 2 --transport gloo\n"
      "  mpirun -n 2 pipetrain train --stages 2 --transport mpi";

// The run's own flags (steps, evaluation, checkpoints, sampling), before any rank starts.
void check_run_flags(const TrainFlags* f, const CLI::App* cmd) {
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
  if (!(f->temperature > 0) || !std::isfinite(f->temperature))
    throw UsageError("--temperature must be a finite number > 0, got " + fmt::format("{}", f->temperature));
  // -1 is "not given" inside (5% of the steps); given, it is refused like any other negative count.
  if (f->warmup < -1 || (f->warmup == -1 && cmd->get_option("--warmup")->count() > 0))
    throw UsageError("--warmup must be >= 0, got " + std::to_string(f->warmup) + " (drop it for 5% of the steps)");
  // Finite numbers only: NaN passed `< 0` checks (--clip nan turned clipping off) and inf reached LibTorch.
  for (const auto& [flag, v, fix] : {std::tuple<const char*, double, const char*>{"--lr", f->lr, "e.g. --lr 3e-4"},
                                     {"--clip", f->clip, "0 turns clipping off"},
                                     {"--momentum", f->momentum, "e.g. --momentum 0.9"},
                                     {"--weight-decay", f->weight_decay, "0 turns it off"}})
    if (!std::isfinite(v) || v < 0 || (v == 0 && std::string(flag) == "--lr"))
      throw UsageError(fmt::format("{} must be a finite number {} 0, got {}: {}", flag,
                                   std::string(flag) == "--lr" ? ">" : ">=", v, fix));
  // Output files are checked now, not after training (--trace / was found only at the end).
  check_output_path(f->trace, "--trace");
  check_output_path(f->svg, "--svg");
  check_output_path(f->log, "--log");
  if (f->lr_schedule != "constant" && f->lr_schedule != "cosine" && f->lr_schedule != "linear")
    throw UsageError("unknown --lr-schedule '" + f->lr_schedule + "': use constant, cosine or linear");
}

// The model, data and pipeline flags, before any rank starts, so bad input is exit 2 with one message.
void check_pipeline_flags(TrainFlags* f, const CLI::App* cmd) {
  // A plan's mini-batch: what its prediction is for (and what its replicas and micro-batches divide).
  if (f->pipe.plan_batch_size > 0 && cmd->get_option("--batch-size")->count() == 0)
    f->batch_size = f->pipe.plan_batch_size;
  f->model.prepare();
  // Flags that ran without a word and changed nothing (their siblings are refused).
  if (cmd->get_option("--momentum")->count() > 0 && f->optimizer != "sgd")
    throw UsageError("--momentum is SGD's; --optimizer " + f->optimizer + " has fixed betas (0.9, 0.999): drop "
                     "--momentum, or use --optimizer sgd");
  if (cmd->get_option("--data-dir")->count() > 0 && f->model.data != "fashion-mnist")
    throw UsageError("--data-dir is the folder of Fashion-MNIST's files, and this run trains on --data " +
                     f->model.data + ": drop --data-dir");
  if (!(f->model.model == "gpt" && f->model.is_text()))  // generation needs the gpt and a text's characters
    for (const char* flag : {"--sample", "--temperature"})
      if (cmd->get_option(flag)->count() > 0 && !(std::string(flag) == "--sample" && f->sample == 0))
        throw UsageError(std::string(flag) + " is for the gpt trained on a text (it generates characters at the end), "
                         "and this run trains --model " + f->model.model + " on --data " + f->model.data +
                         ": drop " + flag);
  if (f->model.data == "synthetic")  // random samples have no held-out split: these evaluated nothing
    for (const char* flag : {"--eval-every", "--eval-samples", "--eval-batch"})
      if (cmd->get_option(flag)->count() > 0 && !(std::string(flag) == "--eval-every" && f->eval_every == 0))
        throw UsageError(std::string(flag) + " evaluates on the data's held-out split, and --data synthetic has no "
                         "held-out split (nothing would be evaluated): drop " + flag + ", or train on kjv, text or fashion-mnist");
  // Flags of an evaluation or a sample the run does not make (after the data's own refusals above).
  if (f->eval_every == 0)
    for (const char* flag : {"--eval-samples", "--eval-batch"})
      if (cmd->get_option(flag)->count() > 0)
        throw UsageError(std::string(flag) + " shapes the held-out evaluation, and --eval-every 0 makes none: drop " +
                         flag + ", or give --eval-every N");
  if (f->sample == 0 && cmd->get_option("--temperature")->count() > 0)
    throw UsageError("--temperature shapes the sample, and --sample 0 generates none: drop --temperature, or give "
                     "--sample N");
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
  if (f->model.gpt.tie_embeddings && (is_async(f->pipe.schedule) || !f->pipe.replication.empty()))
    throw UsageError("--tie-embeddings sums the tied copies' gradients at the flush: it runs with the synchronous "
                     "schedules (gpipe, 1f1b, interleaved, zb-*) without --replication, not --schedule " +
                     f->pipe.schedule + (f->pipe.replication.empty() ? "" : " --replication " + f->pipe.replication));
  // --variable-length divides the step's summed token losses by the mini-batch's token count at the flush
  // (ModelFlags::loss): 2bw's stages step at different times, and UMPIPE scales each chunk's mean.
  if (f->model.gpt.variable_length && (f->pipe.umpipe_chosen || f->pipe.schedule == "2bw"))
    throw UsageError(std::string("--variable-length averages the loss over the mini-batch's real tokens, which ") +
                     (f->pipe.umpipe_chosen ? "UMPIPE (--plan " + f->pipe.plan_file + ") does not (it scales each chunk's mean): "
                                                  "use --umpipe off or drop --variable-length"
                                            : "--schedule 2bw does not (its stages step at different times): use a "
                                              "synchronous schedule, pipedream or spectrain, or drop --variable-length"));
  // UMPIPE's passes (umpipe_pass.cpp) run the stages' forwards themselves: without autocast, without the
  // schedule's re-materialisation choice, split backward or the reference executor. These trained exactly
  // as without them, under a header that named them.
  if (f->pipe.umpipe_chosen) {
    const std::pair<bool, const char*> unused[] = {
        {f->pipe.precision != "fp32", "--precision bf16"},
        {cmd->get_option("--checkpoint")->count() > 0 && f->pipe.checkpoint != "never", "--checkpoint"},
        {cmd->get_option("--backward-split")->count() > 0, "--backward-split"},
        {f->pipe.reference, "--reference"}};
    for (const auto& [given, flag] : unused)
      if (given)
        throw UsageError(std::string(flag) + " does nothing on UMPIPE's plan (--plan " + f->pipe.plan_file +
                         "): its passes run the stages' forwards and backwards themselves (every backward chunk "
                         "re-materialises its forward): drop " + flag + ", or train the plan's straight pipeline "
                         "with --umpipe off");
  }
  if (!(f->lr > 0)) throw UsageError("--lr must be > 0, got " + std::to_string(f->lr));
  // Before the model is built below: ranks started by a launcher are one per process; otherwise this
  // command starts them all on this host.
  const bool launched = std::getenv("RANK") || std::getenv("OMPI_COMM_WORLD_RANK");
  // (More ranks than one host runs are refused with the user's flag when the ranks start: counted here as
  // that maximum, so this check does not pre-empt that message.)
  if (!(f->rank_memory >= 0) || !std::isfinite(f->rank_memory))
    throw UsageError(fmt::format("--rank-memory must be a finite number of GiB >= 0, got {}", f->rank_memory));
  f->model.check_fits(f->batch_size, std::max(1, f->pipe.microbatches),
                      launched ? 1 : std::min(f->pipe.world_size(), kMaxLocalRanks),
                      f->pipe.umpipe_chosen ? 1  // UMPIPE's ranks build the whole model
                      : f->pipe.replication.empty() ? f->pipe.stages
                                                    : static_cast<int>(f->pipe.replication_counts().size()),
                      f->rank_memory * 1073741824.0);
  if (!f->model.layerwise()) f->model.factory()();  // the gpt is not built here: its ranks build their own layers
  try {
    check_balance_flags(f->pipe, f->model);
  } catch (const UsageError& e) {
    if (f->pipe.plan_file.empty() || cmd->get_option("--balance")->count() > 0) throw;
    // The balance came from the plan: say so (a plan made for another model read "balance 6 sums to 6
    // but the model has 4 layers" with no word of the plan).
    throw UsageError("--plan " + f->pipe.plan_file + " (its balance): " + e.what() +
                     ": make a plan from this model's profile (pipetrain profile with the same model flags)");
  }
  if (f->pipe.replicas < 1) throw UsageError("--replicas must be >= 1, got " + std::to_string(f->pipe.replicas));
  if (f->pipe.plan_use != "pipeline" && f->pipe.plan_file.empty())
    throw UsageError("--plan-use " + f->pipe.plan_use + " picks a part of a plan file: pass --plan FILE too");
  if (f->pipe.replicas > 1 && !f->pipe.replication.empty())
    throw UsageError("--replication " + f->pipe.replication + " (replicated stages) and --replicas " +
                     std::to_string(f->pipe.replicas) + " (copies of the whole pipeline) do not combine: use one");
  if (f->pipe.replicas > 1) {
    if (f->batch_size % f->pipe.replicas != 0)
      throw UsageError("--batch-size " + std::to_string(f->batch_size) + " does not split evenly over " +
                       (f->pipe.plan_file.empty() || cmd->get_option("--replicas")->count() > 0
                            ? "--replicas " + std::to_string(f->pipe.replicas)
                            : "the " + std::to_string(f->pipe.replicas) + " replicas of --plan " + f->pipe.plan_file) +
                       ": use a multiple of " + std::to_string(f->pipe.replicas) +
                       (f->pipe.plan_file.empty() ? "" : " (or drop --batch-size to run the plan's)"));
    if (is_async(f->pipe.schedule))
      throw UsageError("--replicas runs with the synchronous schedules (gpipe, 1f1b, interleaved, zb-*), not '" +
                       f->pipe.schedule + "'");
    split_equal(f->batch_size / f->pipe.replicas, o.microbatches);
  }
  split_equal(f->batch_size, o.microbatches);
  o.optimizer.name = f->optimizer;
  o.optimizer.lr = f->lr;
  o.optimizer.momentum = f->optimizer == "sgd" ? f->momentum : 0.0;
  o.optimizer.clip_grad_norm = f->clip;
  o.optimizer.weight_decay = f->weight_decay;
  o.optimizer.nonfinite = f->nonfinite;
  o.vertical_sync = f->vertical_sync;
  o.weight_stashing = !f->no_stash;
  o.tied = f->model.ties();
  // What each rank's PipelineRank will check, checked once here (schedule against m and p, the weight
  // policy, the optimizer, ties): bad combinations are exit 2 with one message, before any rank starts.
  check_pipeline_options(o, o.replication.empty() ? f->pipe.stages : f->pipe.world_size());
}

// What train writes may not be what it reads, or a checkpoint folder, or another of its outputs: `--log
// my.txt` with `--text my.txt` replaced the training text, `--log ck/manifest.json` ruined the only
// checkpoint, `--log x --trace x` kept only the trace; each ran to the end and exited 0.
void check_paths_apart(const TrainFlags& f, const CLI::App* cmd) {
  refuse_empty_names(cmd, {"--save", "--resume", "--log", "--trace", "--svg", "--text", "--plan", "--profile",
                           "--data-dir", "--config"});
  const std::vector<std::pair<const char*, std::string>> outputs{{"--log", f.log}, {"--trace", f.trace}, {"--svg", f.svg}};
  check_outputs_apart(outputs, {{"--text", f.model.text_file},
                                {"--plan", f.pipe.plan_file},
                                {"--profile", f.pipe.profile_file},
                                {"--config", f.config}});
  std::vector<std::pair<const char*, std::string>> folders{{"--save", f.save}, {"--resume", f.resume}};
  if (f.model.data == "fashion-mnist") folders.emplace_back("--data-dir", f.model.data_dir);
  for (const auto& [flag, path] : outputs) {
    if (path.empty() || path.rfind("/dev/", 0) == 0) continue;  // /dev/stdout, /dev/null: not files of the run's
    for (const auto& [dir_flag, dir] : folders)
      if (!dir.empty() && inside(path, dir))
        throw UsageError(std::string(flag) + " " + path + " lies in the " + dir_flag + " folder " + dir +
                         (std::string(dir_flag) == "--data-dir" ? ", which holds the data"
                                                                 : ", which holds a checkpoint and nothing else") +
                         ": write " + flag + " elsewhere");
  }
}

// --save is ours to write and --resume matches this run's model, data and optimizer.
// --resume DIR without the model and data flags the checkpoint was trained with: they come from its
// manifest (the help's `train --resume ckpt --steps 2000 --stages 4` was refused for the default model).
// Flags given still win, and check_checkpoint_flags refuses them where they disagree with the checkpoint.
// Runs before the model flags are prepared.
void adopt_checkpoint_model(TrainFlags* f, const CLI::App* cmd) {
  if (f->resume.empty()) return;
  nlohmann::json saved;
  try {
    saved = read_checkpoint(f->resume).value("run", nlohmann::json());
  } catch (const std::exception&) {
    return;  // check_checkpoint_flags reports the folder's problem with the fix
  }
  if (!saved.is_object()) return;
  const auto given = [cmd](const char* flag) { return cmd->get_option(flag)->count() > 0; };
  const nlohmann::json m = saved.value("model", nlohmann::json::object());
  const nlohmann::json d = saved.value("data", nlohmann::json::object());
  ModelFlags& mf = f->model;
  if (!given("--model") && m.contains("name") && m["name"].is_string()) mf.model = m["name"].get<std::string>();
  if (!m.contains("name") || m["name"] != mf.model) return;  // another model asked for: compared, and refused
  // Each recorded number or switch where its flag is not given (the model's own fields only).
  const auto take = [&](const char* flag, const char* key, auto& field) {
    if (!given(flag) && m.contains(key) && !m[key].is_null()) field = m[key].get<std::decay_t<decltype(field)>>();
  };
  if (mf.model == "gpt") {
    if (!given("--layers") && m.contains("layers")) mf.layers = m["layers"].get<int>();
    take("--d-model", "d_model", mf.gpt.d_model);
    take("--heads", "heads", mf.gpt.heads);
    take("--seq-len", "seq_len", mf.gpt.seq_len);
    take("--dropout", "dropout", mf.gpt.dropout);
    if (!given("--tie-embeddings")) mf.gpt.tie_embeddings = m.value("tie_embeddings", false);
    if (!given("--variable-length")) mf.gpt.variable_length = m.value("variable_length", false);
  } else if (mf.model == "mlp") {
    if (!given("--layers") && m.contains("layers")) mf.layers = m["layers"].get<int>();
    take("--hidden", "hidden", mf.mlp.hidden);
  } else if (mf.model == "cnn") {
    take("--width", "width", mf.cnn.width);
    take("--hidden", "hidden", mf.cnn.hidden);
  } else if (mf.model == "resnet") {
    take("--width", "width", mf.resnet.width);
    take("--blocks", "blocks", mf.resnet.blocks);
  } else if (mf.model == "unet") {
    take("--width", "width", mf.unet.width);
    take("--depth", "depth", mf.unet.depth);
  }
  if (!given("--data") && !given("--text") && d.contains("name") && d["name"].is_string()) {
    mf.data = d["name"].get<std::string>();
    if (mf.data == "text") {  // the text it trained on, where the checkpoint recorded its name as text
      if (!d.contains("file") || !d["file"].is_string())
        throw UsageError("checkpoint " + f->resume + " was trained on a text whose name it cannot give back: pass "
                         "--text FILE (the same text)");
      mf.text_file = d["file"].get<std::string>();
      std::error_code ec;
      if (!std::filesystem::is_regular_file(mf.text_file, ec))  // named as that run was started, maybe relatively
        throw UsageError("checkpoint " + f->resume + " was trained on the text " + excerpt(mf.text_file) +
                         (std::filesystem::path(mf.text_file).is_relative()
                              ? " (a name relative to the folder that run started in)"
                              : std::string()) +
                         ", which is not there from here: pass --text FILE (the same text, recognised by its content)");
    }
  }
  // The images' folder it was trained on (recorded since 2026-11-28), where --data-dir is not given.
  if (mf.data == "fashion-mnist" && !given("--data-dir") && d.contains("dir") && d["dir"].is_string())
    mf.data_dir = d["dir"].get<std::string>();
  if (mf.data == "synthetic" && mf.model == "gpt") take("--vocab", "vocab", mf.gpt.vocab);
  // The synthetic data and the data order come from the seed; the optimizer's state is its own.
  if (!given("--seed") && saved.contains("seed") && saved["seed"].is_number_unsigned()) mf.seed = saved["seed"].get<uint64_t>();
  if (!given("--optimizer") && saved.contains("optimizer") && saved["optimizer"].is_object() &&
      saved["optimizer"].contains("name") && saved["optimizer"]["name"].is_string())
    f->optimizer = saved["optimizer"]["name"].get<std::string>();
  // The training's own settings, so that a resume continues the same training (check_checkpoint_flags
  // refuses given ones that differ): the optimizer's, the mini-batch, and, unless a plan or a schedule is
  // given, the schedule and its micro-batches (a resume at other --stages keeps them too).
  const auto take_run = [&](const char* flag, const nlohmann::json& from, const char* key, auto& field) {
    if (!given(flag) && from.is_object() && from.contains(key) && !from[key].is_null())
      field = from[key].get<std::decay_t<decltype(field)>>();
  };
  const nlohmann::json o = saved.value("optimizer", nlohmann::json::object());
  take_run("--lr", o, "lr", f->lr);
  take_run("--lr-schedule", o, "lr_schedule", f->lr_schedule);
  take_run("--warmup", o, "warmup", f->warmup);
  take_run("--clip", o, "clip", f->clip);
  take_run("--weight-decay", o, "weight_decay", f->weight_decay);
  take_run("--momentum", o, "momentum", f->momentum);
  take_run("--precision", saved, "precision", f->pipe.precision);
  take_run("--nonfinite", saved, "nonfinite", f->nonfinite);
  if (!given("--plan")) {
    take_run("--batch-size", saved, "batch_size", f->batch_size);
    // The schedule, its micro-batches and virtual stages, where the pipeline keeps its shape (no --schedule,
    // --stages, --replicas or --replication given: at another shape the checkpoint's interleaved or zb-v
    // counts need not fit, and another synchronous schedule is the same training). An asynchronous
    // schedule is its own training: it is taken whatever the shape. A manifest from before virtual stages
    // were recorded keeps the command line's schedule (its interleaved was refused for want of a --virtual
    // the user never gave).
    const std::string was = saved.contains("schedule") && saved["schedule"].is_string() ? saved["schedule"].get<std::string>()
                                                                                        : std::string();
    const bool shape_recorded = saved.contains("virtual_stages") || was.empty() || !schedule_traits(was).virtual_stages;
    const bool same_shape = !given("--stages") && !given("--replicas") && !given("--replication");
    if (!given("--schedule") && !was.empty() && shape_recorded && (same_shape || is_async(was))) {
      take_run("--schedule", saved, "schedule", f->pipe.schedule);
      take_run("--microbatches", saved, "microbatches", f->pipe.microbatches);
      if (same_shape) take_run("--virtual", saved, "virtual_stages", f->pipe.virtual_stages);
    }
  }
  // An asynchronous run's weight policy and call length (where it drains), when it goes on with its
  // schedule: another is another training. (With another schedule asked for, the change is refused as
  // such, not as a --no-stash the user never gave.)
  const nlohmann::json a = saved.value("asynchronous", nlohmann::json::object());
  if (saved.value("schedule", std::string()) == f->pipe.schedule && is_async(f->pipe.schedule)) {
    if (!given("--vertical-sync") && !given("--no-stash")) {  // one weight policy: both, or the one given
      take_run("--vertical-sync", a, "vertical_sync", f->vertical_sync);
      take_run("--no-stash", a, "no_stash", f->no_stash);
    }
    take_run("--steps-per-call", a, "steps_per_call", f->steps_per_call);
  }
}

// Where a resumed run's training settings differ from its checkpoint's (given otherwise: they win, and
// check_checkpoint_flags names them in a note): the optimizer's settings, the mini-batch, the precision
// and non-finite policy, an asynchronous run's weight policy, and the kind of schedule (synchronous, or
// which asynchronous one; a synchronous schedule may change to another). One line per difference, as
// run_differences writes them.
std::vector<std::string> training_differences(const nlohmann::json& saved, const TrainFlags& f, int total_steps) {
  const nlohmann::json now = run_json(f, total_steps);
  std::vector<std::string> out;
  nlohmann::json then_opt = saved.value("optimizer", nlohmann::json::object()), now_opt = now["optimizer"];
  if (!then_opt.is_object()) return out;
  nlohmann::json a = nlohmann::json::object(), b = nlohmann::json::object();
  for (const char* key : {"lr", "lr_schedule", "warmup", "clip", "weight_decay", "momentum"})
    if (then_opt.contains(key)) {
      a[key] = then_opt[key];
      b[key] = now_opt[key];
    }
  for (const auto& d : run_differences({{"optimizer", a}}, {{"optimizer", b}}, {"optimizer"})) out.push_back(d);
  if (saved.contains("batch_size"))
    for (const auto& d : run_differences({{"batch_size", saved["batch_size"]}}, {{"batch_size", f.batch_size}}, {"batch_size"}))
      out.push_back(d);
  for (const char* key : {"precision", "nonfinite"})
    if (saved.contains(key))
      for (const auto& d : run_differences({{key, saved[key]}}, {{key, now[key]}}, {key})) out.push_back(d);
  if (saved.contains("asynchronous") && now.contains("asynchronous"))
    for (const auto& d : run_differences({{"asynchronous", saved["asynchronous"]}}, {{"asynchronous", now["asynchronous"]}},
                                         {"asynchronous"}))
      out.push_back(d);
  if (saved.contains("schedule") && saved["schedule"].is_string()) {
    const std::string was = saved["schedule"].get<std::string>();
    if ((is_async(was) || is_async(f.pipe.schedule)) && was != f.pipe.schedule)
      out.push_back("schedule: " + was + " in the checkpoint, " + f.pipe.schedule + " in this run (" +
                    (is_async(was) ? was + " trains asynchronously" : f.pipe.schedule + " trains asynchronously") +
                    ": it trains on differently from here)");
  }
  return out;
}

void check_checkpoint_flags(TrainFlags* f, const CLI::App* cmd) {
  check_paths_apart(*f, cmd);
  if (!f->save.empty()) {
    f->save = prepare_checkpoint_dir(f->save, "--save");  // before any step
    // A checkpoint there that this run does not continue: its first save would replace it (the classic
    // loss: a restart without --resume).
    const std::filesystem::path manifest = std::filesystem::path(f->save) / "manifest.json";
    std::error_code ec;
    if (!f->overwrite && std::filesystem::is_regular_file(manifest, ec) &&
        (f->resume.empty() || !same_path(f->save, f->resume))) {
      std::string at;
      try {
        at = " at step " + std::to_string(read_checkpoint(f->save).at("step").get<int>());
      } catch (const std::exception&) {
      }
      throw UsageError("--save " + f->save + " holds a checkpoint" + at + " that this run does not resume from: "
                       "its first save would replace it. Continue it with --resume " + f->save +
                       ", save to another folder, or give --overwrite to replace it");
    }
  }
  if (!f->resume.empty()) {
    const nlohmann::json manifest = read_checkpoint(f->resume);
    const nlohmann::json saved = manifest.value("run", nlohmann::json());
    if (!saved.is_object())
      throw UsageError("checkpoint " + f->resume + " has no run description (its manifest.json lacks a \"run\" object): "
                       "it was not written by pipetrain train, so its model and data cannot be checked; resume it from "
                       "your own program with load_checkpoint");
    nlohmann::json now = run_json(*f, 0);
    nlohmann::json then = saved;
    // A text recorded by its content (checkpoints from before recorded only its path) matches by content.
    if (then["data"].is_object() && then["data"].contains("file_fnv1a") && now["data"].contains("file_fnv1a")) {
      then["data"].erase("file");
      now["data"].erase("file");
    }
    // Checkpoints from before recorded no images' folder: nothing to compare it with.
    if (then["data"].is_object() && !then["data"].contains("dir") && now["data"].is_object()) now["data"].erase("dir");
    std::vector<std::string> diffs = run_differences(then, now, {"model", "data"});
    for (const auto& d : run_differences({{"optimizer", {{"name", saved.value("optimizer", nlohmann::json::object())
                                                                          .value("name", std::string())}}}},
                                         {{"optimizer", {{"name", f->optimizer}}}}, {"optimizer"}))
      diffs.push_back(d);
    if (!diffs.empty()) {
      std::string msg = "checkpoint " + f->resume + " does not match this run:";
      for (const auto& d : diffs) msg += "\n  " + d;
      throw UsageError(msg + "\npass the flags it was saved with (see its manifest.json), or start without --resume");
    }
    // Synthetic data is drawn from the seed: another seed is another data set, not a continuation.
    if (f->model.data == "synthetic" && saved.contains("seed") && saved["seed"] != nlohmann::json(f->model.seed))
      throw UsageError("checkpoint " + f->resume + " was trained with --seed " + saved["seed"].dump() +
                       ", and --data synthetic draws its samples from the seed: resuming with --seed " +
                       std::to_string(f->model.seed) + " would train on other data. Pass --seed " +
                       saved["seed"].dump() + ", or start without --resume");
    // The training's settings given otherwise than the checkpoint's (a lower learning rate after a spike,
    // another seed's data order): the flags given win, and the run says so, once, before it starts (the
    // settings not given are the checkpoint's, adopt_checkpoint_model).
    {
      const bool length_given = cmd->get_option("--steps")->count() > 0 || cmd->get_option("--epochs")->count() > 0;
      const int total = length_given || saved.value("steps", 0) <= 0 ? std::max(f->steps, 0) : saved.value("steps", 0);
      std::vector<std::string> changed = training_differences(saved, *f, total);
      if (saved.contains("seed") && saved["seed"] != nlohmann::json(f->model.seed))
        changed.push_back("seed: " + saved["seed"].dump() + " in the checkpoint, " + std::to_string(f->model.seed) +
                          " in this run (the data order and the dropout masks follow it)");
      const char* rank = std::getenv("RANK");
      if (!changed.empty() && (!rank || std::string(rank) == "0")) {
        std::string msg = "pipetrain train: note: resuming " + f->resume + " with other settings than it was trained "
                          "with (the flags given win; those not given are the checkpoint's):";
        for (const auto& d : changed) msg += "\n  " + d;
        std::cerr << msg << "\n";
      }
    }
    // Without --steps or --epochs, the run the checkpoint belongs to: its length (and with it the
    // learning-rate schedule's), not the default 600 steps.
    const bool length_given = cmd->get_option("--steps")->count() > 0 || cmd->get_option("--epochs")->count() > 0;
    const int saved_steps = saved.value("steps", 0);
    if (!length_given && saved_steps > 0) f->steps = saved_steps;
    // A run already past its end is refused here, before any rank starts (exit 2 every time).
    const int at = manifest.value("step", 0);
    if (f->steps > 0 && at >= f->steps)
      throw UsageError("checkpoint " + f->resume + " is at step " + std::to_string(at) + " and the run has " +
                       std::to_string(f->steps) + " steps: give more than " + std::to_string(at) + " steps (--steps)");
  }
}

}  // namespace

void add_train_command(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<TrainFlags>();
  CLI::App* cmd = app.add_subcommand("train", "train a model on real data with a pipeline schedule across ranks");
  add_train_flags(cmd, f);
  cmd->footer(kTrainExamples);
  cmd->callback([f, cmd, &exit_code] {
    exit_code = guarded("train", [&] {
      check_run_flags(f.get(), cmd);
      try {
        adopt_checkpoint_model(f.get(), cmd);
        check_pipeline_flags(f.get(), cmd);
        check_checkpoint_flags(f.get(), cmd);
      } catch (const nlohmann::json::exception& e) {
        // read_manifest checks the manifest's own fields; its "run" section (the flags a resume adopts and
        // compares) was read as a save writes it: a hand-edited type stopped the run with a bare
        // "[json.exception.type_error.302] type must be number, but is string", exit 1.
        if (f->resume.empty()) throw;
        throw UsageError("checkpoint manifest " + (std::filesystem::path(f->resume) / "manifest.json").string() +
                         ": its \"run\" section (the run's flags) holds a value of another type than a save writes (" +
                         e.what() + "): the file was edited or damaged; restore it, or resume another checkpoint");
      }
      StopSignalScope stop_signals;  // process-wide (a launcher parent installs its own while it runs)
      return run_ranks(f->pipe, cli_argc(), cli_argv(), [&](std::shared_ptr<Transport> t) { return train_rank(*f, t); });
    });
  });
}

}  // namespace pipetrain::cli

// The training loop (trainer.h).
#include "pipetrain/runtime/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <limits>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/device.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/runtime/checkpoint.h"

namespace pipetrain {

int LrSchedule::warmup_steps(int total) const { return warmup >= 0 ? warmup : std::min(100, total / 20); }

double LrSchedule::at(int k, int total) const {
  const int w = warmup_steps(total);
  if (w > 0 && k < w) return peak * (k + 1) / w;
  if (kind == "constant") return peak;
  const double span = std::max(1, total - w - 1);
  const double progress = std::min(1.0, (k - w) / span);
  if (kind == "linear") return peak * (1.0 - 0.9 * progress);
  return peak * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

double TrainResult::median_step_ms() const {
  if (step_ms.empty()) return 0;
  std::vector<double> sorted = step_ms;
  std::sort(sorted.begin(), sorted.end());
  return sorted[sorted.size() / 2];
}

int steps_for_epochs(double epochs, int64_t train_size, int64_t batch_size) {
  const double steps = std::ceil(epochs * static_cast<double>(train_size) / static_cast<double>(batch_size));
  if (!(steps <= 1e9))
    throw UsageError(fmt::format("--epochs {} is {} steps of --batch-size {}, over the limit of 1e9: give fewer epochs",
                                 epochs, steps, batch_size));
  return static_cast<int>(steps);
}

namespace {

bool holds(const std::vector<int>& stages, int s) { return std::find(stages.begin(), stages.end(), s) != stages.end(); }

// The stop code some rank saw (0: none), the same on every rank: a collective.
int agreed_stop(Transport& world, int mine) {
  // The number of ranks that were asked to stop and the sum of their codes: every rank then reports the
  // same code (a SIGTERM sent to rank 1 alone was reported by rank 0 as SIGINT), the common one, or
  // SIGTERM when ranks got different signals.
  const double m = static_cast<double>(mine);
  torch::Tensor t = torch::tensor({mine != 0 ? 1.0 : 0.0, m, m * m}, torch::kDouble);
  world.all_reduce_sum(t);
  const double* v = t.data_ptr<double>();
  if (v[0] == 0) return 0;
  const double code = v[1] / v[0];
  const bool same = v[2] == v[0] * code * code;  // every code equal to their mean
  return same ? static_cast<int>(code) : SIGTERM;
}

double peak_rss_mib() {
  struct rusage u {};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

}  // namespace

Trainer::Trainer(PipelineRank& rank, std::shared_ptr<Transport> world, std::shared_ptr<Transport> pipeline,
                 const TrainData* data, TrainerOptions options, TrainerCallbacks callbacks)
    : rank_(rank), world_(std::move(world)), pipeline_(std::move(pipeline)), data_(data), o_(std::move(options)),
      cb_(std::move(callbacks)) {
  if (!world_ || !pipeline_)
    throw std::invalid_argument("Trainer: the world and pipeline transports must be given (pass the same one twice "
                                "for a single pipeline)");
  if (world_->world_size() % pipeline_->world_size() != 0)
    throw std::invalid_argument(fmt::format(
        "Trainer: the world's {} ranks are not whole copies of the {}-rank pipeline: give a pipeline transport whose "
        "size divides the world's (make_group_transport over one copy's ranks), or the world itself",
        world_->world_size(), pipeline_->world_size()));
  const int copies = world_->world_size() / pipeline_->world_size();
  if (o_.batch_size <= 0 || o_.batch_size % copies != 0)
    throw UsageError(fmt::format("batch size {} must be a positive multiple of the {} copies of the pipeline",
                                 o_.batch_size, copies));
  if (o_.steps < 0) throw UsageError(fmt::format("steps {} must be at least 1 (or 0 to take them from epochs)", o_.steps));
  if (o_.lr.kind != "constant" && o_.lr.kind != "cosine" && o_.lr.kind != "linear")
    throw UsageError("learning-rate schedule '" + o_.lr.kind + "' must be constant, cosine or linear");
  const std::vector<int> mine = rank_.local_stages();
  const bool needs_data = holds(mine, 0) || holds(mine, rank_.schedule().stages - 1) || world_->rank() == 0;
  if (needs_data && (!data_ || !data_->batch))
    throw std::invalid_argument(fmt::format(
        "Trainer on rank {}: this rank holds the first or last stage (or is rank 0) and needs TrainData with a batch "
        "function",
        world_->rank()));
}

void Trainer::prepare() {
  if (prepared_) return;
  // Rank 0 leads the saves: it holds the save folder's run lock for the whole run, so a second run saving
  // there is refused now, before it trains (every rank learns of it in the collective below).
  std::string lock_error;
  if (!o_.save_dir.empty() && world_->rank() == 0 && !save_lock_) {
    try {
      save_lock_ = std::make_shared<CheckpointDirLock>(o_.save_dir);
    } catch (const UsageError& e) {
      lock_error = e.what();
    }
  }
  // Rank 0 holds stage 0, so it has the data; it tells the others the sizes of the splits.
  torch::Tensor sizes = torch::zeros({3}, torch::kDouble);
  sizes[2] = lock_error.empty() ? 0.0 : 1.0;
  if (world_->rank() == 0) {
    sizes[0] = static_cast<double>(data_->train_size);
    sizes[1] = static_cast<double>(data_->eval_batch ? data_->eval_size : 0);
  }
  world_->all_reduce_sum(sizes);
  train_size_ = static_cast<int64_t>(sizes[0].item<double>());
  eval_size_ = static_cast<int64_t>(sizes[1].item<double>());
  if (sizes[2].item<double>() > 0) {
    if (!lock_error.empty()) throw UsageError(lock_error);
    // The other ranks name the other run too where they see the lock file (one host, a shared mount).
    check_checkpoint_dir_unlocked(o_.save_dir);
    throw UsageError("checkpoint folder " + o_.save_dir + ": rank 0 could not lock it (another run is saving there; "
                     "rank 0 names it)");
  }
  total_ = o_.steps;
  if (total_ == 0) {
    if (!(o_.epochs > 0)) throw UsageError("give the run's steps (--steps), or its epochs (--epochs, a positive number)");
    if (train_size_ == 0) throw UsageError("--epochs needs a finite data set; this one is endless: give the steps (--steps)");
    total_ = steps_for_epochs(o_.epochs, train_size_, o_.batch_size);
  }
  if (!o_.resume_dir.empty()) load_checkpoint(rank_, o_.resume_dir);
  start_ = rank_.step();
  if (start_ >= total_)
    throw UsageError("checkpoint " + o_.resume_dir + " is at step " + std::to_string(start_) + " and the run has " +
                     std::to_string(total_) + " steps: give more than " + std::to_string(start_) + " steps (--steps)");
  prepared_ = true;
}

EvalResult Trainer::evaluate(int64_t count) {
  if (!prepared_) prepare();
  count = count <= 0 ? eval_size_ : std::min(count, eval_size_);
  const int64_t chunk = o_.eval_batch > 0 ? o_.eval_batch : 4 * o_.batch_size;
  EvalResult r;
  // Each chunk's means weighted by what they are means over (EvalStats): samples, or the tokens of a
  // per-token loss (chunks of short lines hold fewer), and the predictions accuracy counted; so the
  // result does not depend on the chunk size.
  double loss = 0, units = 0, correct = 0, predictions = 0;
  bool has_accuracy = false;
  for (int64_t begin = 0; begin < count; begin += chunk) {
    const int64_t n = std::min(chunk, count - begin);
    std::pair<Bundle, torch::Tensor> b;
    if (data_ && data_->eval_batch) b = data_->eval_batch(begin, n);
    const EvalStats e = rank_.evaluate(b.first, b.second, n);
    if (e.loss_units > 0) {
      loss += e.loss * e.loss_units;
      units += e.loss_units;
    }
    if (!std::isnan(e.accuracy)) has_accuracy = true;
    if (e.predictions > 0) {
      correct += e.accuracy * e.predictions;
      predictions += e.predictions;
    }
    r.samples += n;
  }
  r.loss = units > 0 ? loss / units : 0.0;
  r.accuracy = !has_accuracy ? std::numeric_limits<double>::quiet_NaN() : predictions > 0 ? correct / predictions : 0.0;
  return r;
}

// The first step after `step` at which an asynchronous run drains its pipeline: the next evaluation
// (`eval_every`; 0 where none runs), checkpoint, multiple of steps_per_call (default kMaxStepsPerCall),
// or the end. A pure function of the step, so a resumed run (which starts at such a boundary) cuts the
// remaining steps into the same calls.
int Trainer::next_boundary(int step, int eval_every) const {
  int b = total_;
  auto up_to = [&](int every) {
    if (every > 0) b = std::min(b, (step / every + 1) * every);
  };
  up_to(eval_every);
  if (!o_.save_dir.empty()) up_to(o_.save_every);
  up_to(o_.steps_per_call > 0 ? o_.steps_per_call : kMaxStepsPerCall);
  return b;
}

TrainResult Trainer::run() {
  prepare();
  const int p = pipeline_->world_size();
  const int copies = world_->world_size() / p;
  const int replica = world_->rank() / p;
  const int64_t share = o_.batch_size / copies;  // samples per copy and step
  const bool async = !rank_.schedule().synchronous;
  const std::vector<int> mine = rank_.local_stages();
  const int stages = rank_.schedule().stages;
  const bool first_stage = holds(mine, 0), last_stage = holds(mine, stages - 1);
  const int eval_every = o_.eval_every > 0 ? o_.eval_every : o_.eval_every == 0 ? total_ : std::max(1, total_ / 10);
  const int64_t eval_count = o_.eval_every == 0 || eval_size_ == 0 ? 0 : o_.eval_samples > 0 ? o_.eval_samples : eval_size_;
  // Asynchronous calls end at evaluations only where evaluations run (data without a held-out split has
  // none: cutting its calls there drained the pipeline for nothing).
  const int boundary_every = eval_count > 0 ? eval_every : 0;
  auto run_eval = [&](int step) -> std::optional<EvalResult> {
    if (eval_count == 0) return std::nullopt;
    const EvalResult e = evaluate(eval_count);
    if (cb_.on_eval) cb_.on_eval(step, e);
    return e;
  };
  auto save = [&](int step, TrainResult& r) {
    if (replica == 0)  // the copies are equal
      save_checkpoint(rank_, *pipeline_, o_.save_dir, o_.run_description ? o_.run_description(total_) : nlohmann::json::object());
    world_->barrier();
    r.last_saved = step;
    if (cb_.on_checkpoint) cb_.on_checkpoint(step, o_.save_dir);
  };

  TrainResult r;
  r.start = start_;
  r.total = total_;
  r.reached = start_;
  r.last_saved = start_;
  if (start_ == 0) r.first_eval = run_eval(0);
  // Synchronous schedules: a call per step. Asynchronous ones: a call per run of steps between
  // evaluations and checkpoints (next_boundary), during which the pipeline never drains.
  for (int step = start_; step < total_;) {
    const int calls_steps = async ? next_boundary(step, boundary_every) - step : 1;
    Bundle input;
    torch::Tensor target;
    std::vector<double> units(static_cast<std::size_t>(calls_steps), 0.0);  // StepRecord::units
    if (data_ && (first_stage || last_stage)) {
      std::vector<Bundle> inputs;
      std::vector<torch::Tensor> targets;
      for (int k = 0; k < calls_steps; ++k) {
        auto [x, y] = data_->batch(step + k, o_.batch_size);
        units[static_cast<std::size_t>(k)] = y.defined() && !y.is_floating_point() && y.dim() > 0
                                                 ? (y >= 0).sum().item<double>()
                                                 : static_cast<double>(o_.batch_size);
        if (copies > 1) {  // this copy's share of the mini-batch
          x = x.slice(replica * share, (replica + 1) * share);
          y = y.slice(0, replica * share, (replica + 1) * share);
        }
        inputs.push_back(x);
        targets.push_back(y);
      }
      if (calls_steps == 1) {
        input = inputs[0];
        target = targets[0];
      } else {  // the first stage's rank needs the inputs, the last stage's the targets
        if (first_stage)  // entry by entry
          for (const auto& [name, t] : inputs.front().items()) {
            std::vector<torch::Tensor> parts;
            for (const Bundle& b : inputs) parts.push_back(b.at(name));
            input.set(name, torch::cat(parts, 0));
          }
        if (last_stage) target = torch::cat(targets, 0);
      }
    }
    // The stop vote is a collective, so it is also the barrier that starts the steps together (step
    // times are then comparable across ranks): one collective before a step instead of two. The batch
    // is read first (a pure function of the step), so that its time is not in the step's.
    if (const int code = agreed_stop(*world_, o_.stop_requested ? o_.stop_requested() : 0)) {
      if (o_.save_on_interrupt && !o_.save_dir.empty() && step > r.last_saved) save(step, r);
      r.stopped_by = code;
      return r;
    }
    rank_.set_learning_rate(o_.lr.at(step, total_));
    const auto t0 = std::chrono::steady_clock::now();
    r.last = rank_.train_steps(input, target, share * calls_steps, calls_steps);
    world_->barrier();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / calls_steps;
    for (const WeightMemory& w : r.last.weight_memory) {
      WeightMemory& m = r.weight_memory[w.stage];
      m.stage = w.stage;
      m.set_bytes = w.set_bytes;
      m.peak_extra_sets = std::max(m.peak_extra_sets, w.peak_extra_sets);
    }
    std::vector<double> busy, heap_mib, device_mib;
    double pass_ms = 0;
    if (o_.stage_times) {  // the same on every rank of the pipeline: one collective
      // Entries [0, stages): the busy time of each stage in this call (its compute actions), per step.
      // Then per rank its first and last event: the pipeline's own time in this call, per step, is from
      // the first event to the last over all ranks (without the barriers; with UMPIPE also without the
      // optimizer step, as its prediction). Then per rank its memory: the heap growth of this call (with
      // PipelineOptions::measure_memory) and its device's peak allocated MiB so far (-1: not measured).
      std::vector<double> v(static_cast<std::size_t>(stages + 4 * p), 0.0);
      {
        const auto me = static_cast<std::size_t>(stages + 2 * p + 2 * pipeline_->rank());
        v[me] = r.last.peak_heap_growth / 1048576.0;
        const std::optional<DeviceMemory> device = device_memory_peak(rank_.device());
        v[me + 1] = device ? static_cast<double>(device->peak_allocated) / 1048576.0 : -1.0;
      }
      double lo = 1e300, hi = -1e300;
      for (const TimedAction& e : r.last.timeline.events) {
        if (is_compute(e.action.kind)) v[static_cast<std::size_t>(e.action.stage)] += (e.end - e.start) / calls_steps;
        lo = std::min(lo, e.start);
        hi = std::max(hi, e.end);
      }
      const auto at = [&](int q, int k) { return static_cast<std::size_t>(stages + 2 * q + k); };
      if (hi >= lo) {
        v[at(pipeline_->rank(), 0)] = lo;
        v[at(pipeline_->rank(), 1)] = hi;
      }
      torch::Tensor t = torch::tensor(v, torch::kDouble);
      pipeline_->all_reduce_sum(t);
      const double* sum = t.data_ptr<double>();
      busy.assign(sum, sum + stages);
      lo = 1e300, hi = -1e300;
      for (int q = 0; q < p; ++q)
        if (sum[at(q, 1)] > 0) {
          lo = std::min(lo, sum[at(q, 0)]);
          hi = std::max(hi, sum[at(q, 1)]);
        }
      pass_ms = hi > lo ? (hi - lo) / calls_steps : 0.0;
      for (int q = 0; q < p; ++q) {
        heap_mib.push_back(sum[stages + 2 * p + 2 * q]);
        device_mib.push_back(sum[stages + 2 * p + 2 * q + 1]);
      }
    }
    for (int k = 0; k < calls_steps; ++k, ++step) {
      StepRecord rec;
      rec.step = step + 1;
      rec.loss = r.last.losses[static_cast<std::size_t>(k)];
      rec.grad_norm = r.last.grad_norms[static_cast<std::size_t>(k)];
      rec.lr = o_.lr.at(step, total_);
      rec.units = units[static_cast<std::size_t>(k)];
      r.units += rec.units;
      rec.ms = ms;
      rec.busy_ms = busy;
      rec.pass_ms = pass_ms;
      rec.heap_growth_mib = heap_mib;
      rec.device_peak_allocated_mib = device_mib;
      r.step_ms.push_back(ms);
      if (step == start_) r.first_loss = rec.loss;
      r.last_loss = rec.loss;
      if ((step + 1) % eval_every == 0 || step + 1 == total_) {  // only at a call's last step (next_boundary)
        if (auto e = run_eval(step + 1)) r.last_eval = rec.eval = e;
      }
      r.reached = step + 1;
      if (cb_.on_step) cb_.on_step(rec);
      if (!o_.save_dir.empty() && ((o_.save_every > 0 && (step + 1) % o_.save_every == 0) || step + 1 == total_))
        save(step + 1, r);
    }
  }
  // A stop asked for during the last call is reported too (an asynchronous call may hold all the run's
  // steps, so the vote before each call never saw it): the run says it was stopped, after the end's
  // checkpoint. One more collective, after the last step: the steps and their losses are unchanged.
  if (const int code = agreed_stop(*world_, o_.stop_requested ? o_.stop_requested() : 0)) r.stopped_by = code;
  return r;
}

RunReport Trainer::report(const TrainResult& result) {
  Transport& t = *pipeline_;
  const int p = t.world_size();
  RunReport rep;
  rep.timeline = gather_timeline(result.last.timeline, t);
  torch::Tensor memory = torch::zeros({6, std::max(p, rank_.schedule().stages)}, torch::kDouble);
  memory[0][t.rank()] = result.last.peak_heap_growth;
  memory[1][t.rank()] = peak_rss_mib();
  const std::optional<DeviceMemory> device = device_memory_peak(rank_.device());
  memory[4][t.rank()] = device ? static_cast<double>(device->peak_allocated) / 1048576.0 : -1.0;
  memory[5][t.rank()] = device ? static_cast<double>(device->peak_reserved) / 1048576.0 : -1.0;
  for (const auto& [s, w] : result.weight_memory) {
    memory[2][s] = w.peak_extra_sets;
    memory[3][s] = w.set_bytes;
  }
  t.all_reduce_sum(memory);
  for (int q = 0; q < p; ++q) {
    rep.heap_growth_bytes.push_back(memory[0][q].item<double>());
    rep.peak_rss_mib.push_back(memory[1][q].item<double>());
    rep.device_peak_allocated_mib.push_back(memory[4][q].item<double>());
    rep.device_peak_reserved_mib.push_back(memory[5][q].item<double>());
  }
  for (int s = 0; s < rank_.schedule().stages; ++s) {
    rep.extra_weight_sets.push_back(memory[2][s].item<double>());
    rep.weight_set_bytes.push_back(memory[3][s].item<double>());
  }
  double t0 = 1e300;
  for (const auto& e : rep.timeline.events) t0 = std::min(t0, e.start);
  for (auto& e : rep.timeline.events) {
    e.start -= t0;
    e.end -= t0;
  }
  rep.measured = compute_metrics(rep.timeline);
  const Schedule plain = strip_communication(rank_.schedule_for(std::max(1, result.last.steps)));
  rep.predicted = simulate(plain, measured_costs(rep.timeline, plain.stages));
  rep.runtime = measured_runtime(rep.timeline);
  rep.predicted_with_runtime = simulate(plain, measured_costs_with_runtime(rep.timeline, plain.stages));
  return rep;
}

std::vector<int64_t> generate_tokens(PipelineRank& rank, Transport& pipeline, torch::Tensor context, int n,
                                     double temperature, uint64_t seed) {
  const bool first = pipeline.rank() == rank.schedule().rank_of(0);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<int64_t> tokens;
  for (int k = 0; k < n; ++k) {
    torch::Tensor out = rank.forward_only(first ? context : torch::Tensor(), 1, 1);
    torch::Tensor token = torch::zeros({1}, torch::kDouble);
    if (out.defined()) {
      torch::Tensor logits = out[0][-1].to(torch::kCPU, torch::kDouble) / std::max(1e-3, temperature);
      torch::Tensor probs = torch::softmax(logits, -1);
      token[0] = static_cast<double>(torch::multinomial(probs, 1, false, gen).item<int64_t>() + 1);
    }
    pipeline.all_reduce_sum(token);
    const auto id = static_cast<int64_t>(token.item<double>()) - 1;
    tokens.push_back(id);
    if (first) context = torch::cat({context.slice(1, 1), torch::full({1, 1}, id, torch::kLong)}, 1);
  }
  return tokens;
}

}  // namespace pipetrain

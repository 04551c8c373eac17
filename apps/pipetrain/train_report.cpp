// What the train command prints and checks around a run (train_report.h).
#include "train_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (fmt 11 has it only here)

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string_view>
#include <vector>

#include "cli_common.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/plan/costs.h"
#include "pipetrain/runtime/device.h"
#include "pipetrain/runtime/info.h"
#include "train_support.h"

namespace pipetrain::cli {

bool is_async(const std::string& schedule) {
  return !schedule_traits(schedule).synchronous;
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

LrSchedule lr_schedule(const TrainFlags& f) {
  LrSchedule l;
  l.peak = f.lr;
  l.kind = f.lr_schedule;
  l.warmup = f.warmup;
  return l;
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
            {"warmup", lr_schedule(f).warmup_steps(total_steps)}}},
          {"seed", f.model.seed},
          {"batch_size", f.batch_size},
          {"schedule", f.pipe.schedule},
          {"microbatches", f.pipe.microbatches},
          {"virtual_stages", f.pipe.virtual_stages},
          {"precision", f.pipe.precision},
          {"nonfinite", f.nonfinite},
          {"steps", total_steps}};
  if (is_async(f.pipe.schedule))
    j["asynchronous"] = {
        {"vertical_sync", f.vertical_sync}, {"no_stash", f.no_stash}, {"steps_per_call", f.steps_per_call}};
  return j;
}

std::string eval_text(const TrainFlags& f, const EvalResult& e) {
  if (f.model.is_text() || (f.model.model == "gpt"))
    return fmt::format("loss {:.4f}, perplexity {:.2f}, next-character accuracy {:.1f}%", e.loss, std::exp(e.loss),
                       100 * e.accuracy);
  return fmt::format("loss {:.4f}, accuracy {:.2f}%", e.loss, 100 * e.accuracy);
}

// Generates --sample characters after the first held-out window (collective). Returns the prompt and
// the continuation on the first stage's rank (which holds the data).
std::pair<std::string, std::string> generate_text(const TrainFlags& f, PipelineRank& rank, Transport& t,
                                                  zoo::Dataset* data) {
  torch::Tensor context;
  if (data) {
    const zoo::Batch first = data->eval_batch(0, 1);
    context = first.input;  // [1, T]
    if (first.mask.defined()) {
      // Variable-length lines are padded to T (padding decodes as newlines the text does not have) and may
      // be short (a one-character prompt generated from a one-token window): the prompt is the held-out
      // lines as they are in the text, one after another, their last T characters.
      const int64_t T = first.input.size(1);
      const zoo::Batch b = data->eval_batch(0, std::min<int64_t>(data->eval_size(), T));
      std::vector<int64_t> text;
      for (int64_t r = 0; r < b.input.size(0); ++r) {
        const int64_t n = b.mask[r].sum().item<int64_t>();
        for (int64_t j = 0; j < n; ++j) text.push_back(b.input[r][j].item<int64_t>());
        if (n > 0) text.push_back(b.target[r][n - 1].item<int64_t>());  // the piece's last character
      }
      if (text.size() > static_cast<std::size_t>(T)) text.erase(text.begin(), text.end() - T);
      if (text.empty()) text.push_back(first.input[0][0].item<int64_t>());
      context = torch::tensor(text, torch::kLong).unsqueeze(0);
    }
  }
  const std::vector<int64_t> tokens =
      generate_tokens(rank, t, context, f.sample, f.temperature, static_cast<uint64_t>(f.model.seed) + 7);
  if (!data || t.rank() != rank.schedule().rank_of(0)) return {};
  return {zoo::decode_text(data->vocabulary(), context), zoo::decode_text(data->vocabulary(), torch::tensor(tokens, torch::kLong))};
}

// ", peak GPU memory A MiB allocated, R MiB reserved" for a rank of a run on GPUs (`device`: this
// rank's); where it could not be read, said so.
static std::string device_memory_text(const RunReport& rep, int rank, const torch::Device& device) {
  if (device.is_cpu()) return "";
  const std::size_t r = static_cast<std::size_t>(rank);
  if (r >= rep.device_peak_allocated_mib.size() || rep.device_peak_allocated_mib[r] < 0)
    return ", peak GPU memory not measured (this LibTorch's allocator offers no statistics through c10)";
  return fmt::format(", peak GPU memory {:.0f} MiB allocated, {:.0f} MiB reserved", rep.device_peak_allocated_mib[r],
                     rep.device_peak_reserved_mib[r]);
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

namespace {

// A file's bytes as a hash ("" when it cannot be read: the run reports that itself, later).
std::string content_hash(const std::string& path) {
  if (path.empty()) return {};
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return fmt::format("{:016x}", fnv1a(bytes.str()));
}

}  // namespace

// Ranks started by hand (torchrun, mpirun, RANK=... by hand) with different settings would wait for
// each other in different collectives (a hang: --log on one rank only adds collectives to every step),
// or silently train a mixture (ranks resuming different checkpoints, balancing by different profiles).
// So the first collective of a run compares a hash of each setting that shapes the run's collectives
// and model, and names the ones that differ; output files count only by whether they are given, so each
// rank may name its own; the files read (--resume's manifest, --profile) count by their content, so
// each rank may read its own copy.
void check_same_settings(const TrainFlags& f, Transport& world) {
  const PipelineFlags& p = f.pipe;
  // name -> value, the same names on every rank whatever its flags (the model's and data's keys vary
  // with the model: each counts as one setting; "asynchronous" repeats flags of `run` below).
  nlohmann::json settings = nlohmann::json::object();
  const nlohmann::json described = run_json(f, 0);  // named: items() of a temporary would outlive it
  for (const auto& [key, value] : described.items()) {
    if (key == "optimizer")
      for (const auto& [k, v] : value.items()) settings["optimizer " + k] = v;
    else if (key == "model")
      settings["--model and its flags"] = value;
    else if (key == "data" && value.is_object()) {  // a text by its content, not its path; each rank's own folders
      nlohmann::json data = value;
      data.erase("file");
      data.erase("dir");
      settings[key] = data;
    }
    else if (key != "asynchronous")
      settings[key] = value;
  }
  const nlohmann::json pipeline = {
      {"--stages", p.stages},         {"--replicas", p.replicas},
      {"--virtual", p.virtual_stages}, {"--balance", p.balance},
      {"--balance-solver", p.balance_solver}, {"--checkpoint", p.checkpoint},
      {"--replication", p.replication}, {"--plan-use", p.plan_use},
      {"--plan (given)", !p.plan_file.empty()}, {"--profile (its content)", content_hash(p.profile_file)},
      {"--profile (given)", !p.profile_file.empty()}, {"--placement", p.placement},
      {"--precision", p.precision},   {"--backward-split", p.backward_split}};
  const nlohmann::json run = {
      {"--steps", f.steps}, {"--epochs", f.epochs}, {"--eval-every", f.eval_every},
      {"--eval-samples", f.eval_samples}, {"--eval-batch", f.eval_batch}, {"--save-every", f.save_every},
      {"--sample", f.sample}, {"--save-on-interrupt", f.save_on_interrupt}, {"--memory", f.memory},
      {"--steps-per-call", f.steps_per_call}, {"--vertical-sync", f.vertical_sync}, {"--no-stash", f.no_stash},
      {"--nonfinite", f.nonfinite}, {"--save (given)", !f.save.empty()}, {"--resume (given)", !f.resume.empty()},
      {"--resume (its checkpoint)", f.resume.empty() ? std::string() : content_hash(f.resume + "/manifest.json")},
      {"--log (given)", !f.log.empty()}, {"--trace (given)", !f.trace.empty()}, {"--svg (given)", !f.svg.empty()}};
  for (const auto& part : {pipeline, run})
    for (const auto& [k, v] : part.items()) settings[k] = v;
  check_same_on_every_rank(settings, world);
}

// The banner rank 0 prints before the first step.
std::string banner(const TrainFlags& f, const Trainer& trainer, PipelineRank& rank, const Transport& transport,
                   int threads) {
  const bool async = is_async(f.pipe.schedule);
  const int warmup = lr_schedule(f).warmup_steps(trainer.total());
  return fmt::format(
      "pipetrain train: {}\n  {} over {} ({} threads per rank), schedule {}, m={}, batch {}, balance {}, "
      "re-materialisation {}{}\n  optimizer {} lr {} ({}{}), clip {}, {} steps{}{}\n  {}",
      f.model.describe(),
      f.pipe.replicas > 1 ? fmt::format("{} stages x {} replicas{}", f.pipe.stages, f.pipe.replicas,
                                        f.pipe.placement == "replicas-inner" && f.pipe.stages > 1
                                            ? " (replicas-inner: a stage's copies on neighbouring ranks)"
                                            : "")
      : !f.pipe.replication.empty()
          ? fmt::format("{} stages replicated {} (1F1B-RR, {} ranks)", f.pipe.stages, f.pipe.replication,
                        f.pipe.world_size())
          : fmt::format("{} stages", f.pipe.stages),
      transport.name(), threads,
      async ? fmt::format("{} (weights: {}{})", f.pipe.schedule, to_string(rank.weight_policy()),
                          schedule_traits(f.pipe.schedule).one_microbatch_per_step ? ", a step per micro-batch" : "")
            : f.pipe.schedule,
      f.pipe.microbatches, f.batch_size, comma_list(rank.balance()), f.pipe.checkpoint,
      f.pipe.precision == "fp32" ? "" : ", precision " + f.pipe.precision, f.optimizer, f.lr,
      f.lr_schedule, warmup > 0 ? fmt::format(", warm-up {}", warmup) : "", f.clip, trainer.total(),
      trainer.train_size() > 0
          ? fmt::format(" ({:.2f} epochs)", static_cast<double>(trainer.total()) * f.batch_size / trainer.train_size())
          : "",
      trainer.start() > 0 ? fmt::format(", resuming at step {} from {}", trainer.start(), f.resume) : "",
      [&] {  // the ranks' intra-op threads (the executor sets them at each call), not LibTorch's default
        RuntimeInfo info = runtime_info();
        info.intra_op_threads = threads;
        return describe(info);
      }());
}

std::string heap_model_missing(const TrainFlags& f) {
  if (is_async(f.pipe.schedule)) return "it does not count the weight sets " + f.pipe.schedule + " keeps";
  if (f.pipe.umpipe_chosen) return "it does not model UMPIPE's unequal micro-batches";
  if (const std::string b = f.model.bundle_layers(); !b.empty())  // the profiler times one-tensor layers
    return "the profiler does not measure layers that pass bundles, and " + b;
  if (f.pipe.checkpoint != "never")
    return "it does not model re-materialisation (--checkpoint " + f.pipe.checkpoint + ")";
  if (f.pipe.precision != "fp32")
    return "the profile's bytes are float32's, and the run computes in " + f.pipe.precision;
  return {};
}

HeapPrediction predict_run_heap(const TrainFlags& f, const PipelineRank& rank, const PipelineOptions& o,
                                const std::optional<Profile>& profile) {
  HeapPrediction h;
  h.missing = heap_model_missing(f);
  if (h.missing.empty() && !profile) h.missing = "no profile of the model";
  if (!h.missing.empty()) return h;
  try {
    StageCostOptions so;  // the run's largest micro-batch (split_equal gives the first ones the remainder)
    const int64_t share = f.batch_size / std::max(1, f.pipe.replicas);
    so.micro_batch = static_cast<double>((share + f.pipe.microbatches - 1) / std::max(1, f.pipe.microbatches));
    const CostModel costs = stage_costs(*profile, rank.balance(), so);
    h.ranks = predict_heap(rank.schedule(), costs,
                           o.reference ? HeapOptions::reference() : HeapOptions::fast_path(o.prefetch));
  } catch (const UsageError& e) {
    h.missing = e.what();
  }
  return h;
}

// The summary rank 0 prints after the run, from the trainer's report.
void print_summary(const TrainFlags& f, PipelineRank& rank, const Transport& transport, const TrainResult& r,
                   const RunReport& rep, const HeapPrediction* heap) {
  const bool text = f.model.model == "gpt";
  const double median = r.median_step_ms();
  // Text: the mean real tokens of a step (padding of --variable-length lines not counted) per median step.
  const double per_s = 1000.0 *
                       (text ? r.units / static_cast<double>(std::max<std::size_t>(1, r.step_ms.size()))
                             : static_cast<double>(f.batch_size)) /
                       median;
  std::cout << fmt::format("summary: training loss {:.4f} -> {:.4f} over steps {}..{}; median step {:.1f} ms, {} {}/s\n",
                           r.first_loss, r.last_loss, r.start + 1, r.total, median, rate_text(per_s),
                           text ? "tokens" : "samples");
  if (r.last_eval)
    std::cout << fmt::format("  held-out: {}{}\n", eval_text(f, *r.last_eval),
                             r.first_eval ? fmt::format(" (at step 0: loss {:.4f})", r.first_eval->loss) : "");
  const Metrics& measured = rep.measured;
  if (f.pipe.umpipe_chosen)  // the plan's own prediction: the simulator's schedules do not cut unequally
    std::cout << fmt::format(
        "  last step: measured makespan {:.1f} ms, bubble fraction {:.3f}; UMPIPE {} plan predicted {:.1f} ms per step "
        "(compute and transfers, no optimizer step) against the measured median step {:.1f} ms: predicted/measured "
        "{:.2f}\n",
        measured.makespan, measured.bubble_fraction, f.pipe.umpipe_chosen->planner, f.pipe.umpipe_chosen->step_ms, median,
        median > 0 ? f.pipe.umpipe_chosen->step_ms / median : 0.0);
  else {
    std::cout << fmt::format(
        "  last {}: measured makespan {:.1f} ms, bubble fraction {:.3f}; simulated from measured stage costs: "
        "makespan {:.1f} ms, bubble fraction {:.3f}; efficiency (predicted/measured) {:.2f}\n",
        r.last.steps == 1 ? std::string("step") : fmt::format("call ({} steps, one pipeline fill and drain)", r.last.steps),
        measured.makespan, measured.bubble_fraction, rep.predicted.metrics.makespan,
        rep.predicted.metrics.bubble_fraction,
        measured.makespan > 0 ? rep.predicted.metrics.makespan / measured.makespan : 0.0);
    // The same simulation with the run's own transfer, overhead and step terms (docs/BENCHMARKS.md, issue 15).
    const Metrics& full = rep.predicted_with_runtime.metrics;
    std::cout << fmt::format(
        "  with measured transfers {:.3f} ms ({} waiting receives), overhead {:.3f} ms per action and step {:.3f} ms: "
        "makespan {:.1f} ms, bubble fraction {:.3f}; efficiency (predicted/measured) {:.2f}\n",
        rep.runtime.transfer, rep.runtime.transfer_samples, rep.runtime.overhead, rep.runtime.step, full.makespan,
        full.bubble_fraction, measured.makespan > 0 ? full.makespan / measured.makespan : 0.0);
  }
  const bool shared = transport.shares_process();
  // --memory: each rank's growth in a step, on a GPU with allocator statistics its device's (device.h),
  // next to the heap model's prediction.
  const std::string grew =
      device_memory_measured(rank.device()) ? "peak GPU memory growth in a step" : "peak heap growth in a step";
  auto memory_text = [&](int r) {
    if (!f.memory) return std::string();
    const double mib = rep.heap_growth_bytes[static_cast<std::size_t>(r)] / 1048576.0;
    std::string text = fmt::format(", {} {:.2f} MiB", grew, mib);
    if (heap && static_cast<std::size_t>(r) < heap->ranks.size()) {
      const HeapPeak& p = heap->ranks[static_cast<std::size_t>(r)];
      const double mi = 1048576.0;
      // Ranks that share a process grow one heap (and one allocator per GPU), so a rank's measurement
      // holds the others' too: no ratio then.
      const bool one_heap = shared;
      double sum = 0;
      for (const HeapPeak& q : heap->ranks) sum += q.total();
      text += fmt::format(" against the heap model's {:.2f} (activations {:.2f} + gradients {:.2f} + transfers {:.2f}){}",
                          p.total() / mi, p.activations / mi, p.gradients / mi, p.transfers / mi,
                          one_heap ? fmt::format(" for this rank alone (all ranks grow one heap; their predictions sum "
                                                 "to {:.2f})", sum / mi)
                          : p.total() > 0 ? fmt::format(", measured/predicted {:.2f}", mib * mi / p.total())
                                          : std::string());
    }
    return text;
  };
  for (const RankMetrics& m : measured.per_rank)
    std::cout << fmt::format("  {}: busy {:.1f} ms, span {:.1f} ms, bubble {:.1f} ms; peak RSS {:.0f} MiB{}{}{}\n",
                             rank_label(rank.schedule(), m.rank), m.busy, m.span, m.bubble,
                             rep.peak_rss_mib[static_cast<std::size_t>(m.rank)],
                             shared ? " (one process for all ranks)" : "",
                             device_memory_text(rep, m.rank, rank.device()), memory_text(m.rank));
  if (f.memory && heap && !heap->missing.empty())
    std::cout << "  heap model: no prediction: " << heap->missing << "\n";
  if (is_async(f.pipe.schedule)) {
    std::string list;
    for (std::size_t s = 0; s < rep.extra_weight_sets.size(); ++s)
      list += fmt::format("{}stage {} {} ({:.1f} KiB)", s ? ", " : "", s, static_cast<int>(rep.extra_weight_sets[s]),
                          rep.extra_weight_sets[s] * rep.weight_set_bytes[s] / 1024.0);
    std::cout << fmt::format("  weights ({}): extra weight sets kept at most, per stage: {}\n",
                             to_string(rank.weight_policy()), list);
  }
}

}  // namespace pipetrain::cli

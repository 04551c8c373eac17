// The train command's flags and what it prints (internal to apps/pipetrain): TrainFlags, the run's
// description for checkpoints and the settings check, the banner, the evaluation and the summary lines,
// and the text sample for language models. cmd_train.cpp parses the flags and runs the ranks.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pipetrain/core/heap.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/runtime/trainer.h"
#include "run_common.h"

namespace pipetrain::cli {

constexpr int kDefaultSteps = 600;  // the demo: about 1.5 minutes on 2 cores

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
  double rank_memory = 0;  // --rank-memory GiB: what one rank may use, for the memory check; 0: not given
  std::string nonfinite = "stop";  // stop | skip | ignore: a step whose loss or gradient norm is not finite
  std::string lr_schedule = "cosine";  // constant | cosine | linear
  int warmup = -1;  // -1: 5% of the steps, at most 100
  int eval_every = -1;       // -1: ten evaluations per run; 0: none
  int64_t eval_samples = 0;  // 0: all of the held-out split (images), 256 windows (text)
  int64_t eval_batch = 0;    // 0: 4 x batch size
  std::string save, resume;
  int save_every = 0;
  bool save_on_interrupt = false;  // SIGINT/SIGTERM: write one more checkpoint (at the step reached) before stopping
  bool overwrite = false;          // --save may replace a checkpoint this run did not resume from
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

bool is_async(const std::string& schedule);
std::string comma_list(const std::vector<int>& v);
// The line that says which UMPIPE plan runs (empty without one).
std::string umpipe_banner(const PipelineFlags& pipe);
LrSchedule lr_schedule(const TrainFlags& f);
// The run as checkpoints store it (what must match to resume).
nlohmann::json run_json(const TrainFlags& f, int total_steps);
std::string eval_text(const TrainFlags& f, const EvalResult& e);
// Generates --sample characters after the first held-out window (collective); the prompt and the
// continuation on the first stage's rank.
std::pair<std::string, std::string> generate_text(const TrainFlags& f, PipelineRank& rank, Transport& t,
                                                  zoo::Dataset* data);
// "stage 1" / "ranks of stage 0" ...: how the summary names rank `rank`'s share.
std::string rank_label(const Schedule& s, int rank);
// The first collective of a run: refuses ranks started with different settings (see the definition).
void check_same_settings(const TrainFlags& f, Transport& world);
std::string banner(const TrainFlags& f, const Trainer& trainer, PipelineRank& rank, const Transport& transport,
                   int threads);
// The heap model's prediction (core/heap.h) of what a step adds to each pipeline rank's memory (the host
// heap; a GPU's allocator where --memory measures it), from a profile of the model (its memory columns)
// cut as the run cuts it, at the run's micro-batch size: per pipeline rank, or why there is none.
struct HeapPrediction {
  std::vector<HeapPeak> ranks;
  std::string missing;  // why there is no prediction; empty when there is one
};
// Why the heap model cannot predict this run (empty: it can); the same on every rank.
std::string heap_model_missing(const TrainFlags& f);
HeapPrediction predict_run_heap(const TrainFlags& f, const PipelineRank& rank, const PipelineOptions& o,
                                const std::optional<Profile>& profile);
// `heap`: the prediction next to --memory's measurement (null: none asked).
void print_summary(const TrainFlags& f, PipelineRank& rank, const Transport& transport, const TrainResult& r,
                   const RunReport& rep, const HeapPrediction* heap = nullptr);

}  // namespace pipetrain::cli

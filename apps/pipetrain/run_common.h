// Flags and plumbing shared by the commands that run a real pipeline (`train`, `selftest`): the model,
// the data, the pipeline options, and how ranks come to exist (threads, a launcher, or self-launch).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "pipetrain/plan/profile.h"
#include "pipetrain/plan/umpipe.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/transport.h"
#include "pipetrain/zoo/data.h"
#include "pipetrain/zoo/models.h"

namespace pipetrain::cli {

// The model and its data. Data kinds: kjv (the King James Bible, Debian's bible-kjv), text (--text
// FILE), fashion-mnist (Debian's dataset-fashion-mnist, or --data-dir), synthetic (generated); "auto"
// picks kjv for the gpt and fashion-mnist for the others. Text data fixes the gpt's vocabulary.
struct ModelFlags {
  std::string model = "gpt";  // gpt | mlp | cnn | resnet | unet
  std::string data = "auto";  // auto | kjv | text | fashion-mnist | synthetic
  std::string text_file;      // --text FILE
  std::string data_dir = zoo::kFashionMnistDir;
  zoo::GptConfig gpt;
  zoo::MlpConfig mlp;
  zoo::CnnConfig cnn;
  zoo::ResNetConfig resnet;
  zoo::UNetConfig unet;
  int layers = 0;  // --layers: gpt blocks / mlp Linear layers; 0 = the model's default
  uint64_t seed = 0;
  CLI::Option* vocab_option = nullptr;

  void add_to(CLI::App& app);
  // Resolves "auto", checks the combination and, for text data, reads the text and sets the gpt's
  // vocabulary from it. Call once before factory(), dataset() or describe(). Throws UsageError.
  void prepare();
  // Refuses (UsageError, with the estimate and the fix) a model and batch that cannot fit this host's
  // memory (physical, or the cgroup's limit), or one rank's `rank_memory` bytes (--rank-memory; 0: not
  // given): `ranks_here` ranks on this host each hold one micro-batch of `batch_size / microbatches`
  // samples and the parameters they build: the gpt's ranks their own layers only (1/`pipeline_ranks` of
  // the model at least, layerwise()), the other models' ranks the whole model. A lower bound, so nothing
  // that fits is refused; it catches --layers 1000000 or --d-model 1e9 before any memory is taken.
  // `batch` names the flag that sets the batch in the message's fix (profile's --microbatch-size).
  void check_fits(int64_t batch_size, int microbatches, int ranks_here, int pipeline_ranks = 1,
                  double rank_memory = 0, const std::string& batch = "--batch-size") const;
  // A factory that builds the same model on every call (seeded). The gpt's is build_all(layerwise()).
  std::function<torch::nn::Sequential()> factory() const;
  // The model layer by layer, for ranks that build only their own layers (runtime/layers.h): the gpt's;
  // none for the other models.
  std::optional<LayerwiseModel> layerwise() const;
  // Pipeline layers, and choose_balance (stage.h) for the model, without building it where layerwise().
  int layer_count() const;
  std::vector<int> choose_balance(int stages, const std::string& kind, const std::string& solver) const;
  // The training loss: cross entropy, a micro-batch's mean; with --variable-length per real token over
  // the whole mini-batch (Loss::per_token: padding excluded, exact for any split into micro-batches
  // and replicas).
  Loss loss() const;
  // Cross entropy as a micro-batch's mean (a tensor loss), for the profiler, whose last layer's times
  // include the loss.
  LossFn mean_loss() const;
  std::vector<std::vector<ParameterRef>> ties() const;  // PipelineOptions::tied for the model
  std::unique_ptr<zoo::Dataset> dataset() const;
  std::string describe() const;
  bool is_text() const { return data == "kjv" || data == "text"; }
  // Why the model's layers pass bundles (runtime/bundle.h) that the profiler cannot time, e.g. "the unet's
  // layers pass its skips"; empty when they pass one tensor.
  std::string bundle_layers() const;
  // The model and data as JSON, for checkpoint manifests: what must match to resume.
  nlohmann::json model_json() const;
  nlohmann::json data_json() const;

 private:
  // The options that only some models take (refused with another --model) and the two shared ones.
  std::vector<std::pair<CLI::Option*, std::vector<std::string>>> model_options_;
  CLI::Option* width_option_ = nullptr;
  CLI::Option* hidden_option_ = nullptr;
  std::shared_ptr<const std::string> text_;  // the corpus, for text data
  std::string vocabulary_;
};

// The device a --device flag names for the rank with this local rank (cuda: GPU local_rank mod the GPU
// count); UsageError naming the value and the fix for anything else, and for CUDA without a GPU.
torch::Device device_of_flag(const std::string& device, int local_rank = 0);
// The index that --device cuda maps to a GPU (local rank mod the GPU count) for rank `world_rank` of a
// run over `transport`: LOCAL_RANK where a launcher set it for this process (pipetrain launch, torchrun),
// else the world rank (the threads of --transport local; ranks started by hand on one host each).
int device_rank(const std::string& transport, int world_rank);

struct PipelineFlags {
  int stages = 2;
  int replicas = 1;  // data-parallel copies of the pipeline
  std::string schedule = "1f1b";
  int microbatches = 4;
  int virtual_stages = 1;
  std::string balance = "uniform";          // see choose_balance; time and memory use a profile
  std::string balance_solver = "min-max";   // min-max | block-partition
  std::string profile_file;                 // --profile: a saved profile for time/memory balancing
  std::string plan_file;                    // --plan: balance, schedule and micro-batches from pipetrain plan
  std::string checkpoint = "never";
  std::string backward_split = "auto";
  std::string transport = "auto";  // local | gloo | mpi | auto
  int threads = 0;
  std::string threads_from;  // where `threads` came from when not --threads: "the plan FILE" (its profile's)
  bool reference = false;
  std::string device = "cpu";  // cpu | cuda | cuda:N
  std::string precision = "fp32";  // fp32 | bf16 (autocast)
  CLI::Option* stages_option = nullptr;
  std::string replication;  // --replication 3,1: replicas per stage (1F1B-RR); empty: one rank per stage
  std::string plan_use = "pipeline";  // --plan-use: pipeline | pipedream
  // Where the replicas' ranks are (a plan's "placement"): pipeline-inner (the default: world rank r is
  // stage r mod stages of copy r / stages) or replicas-inner (a stage's copies side by side: world rank
  // s x replicas + k is stage s of copy k).
  std::string placement = "pipeline-inner";
  std::vector<int> replication_counts() const;  // parsed --replication (UsageError naming the bad count)
  int world_size() const;  // ranks: stages x replicas, or the sum of --replication
  // Hybrid layout: world rank r is stage r mod stages of pipeline replica r / stages. The pipeline's own
  // group (its stages' transfers and collectives) and the stage's group across replicas (the gradient
  // all-reduce); with one replica the pipeline group is the world.
  // With placement replicas-inner and replicas > 1: the world renumbered into the pipeline-inner order
  // above (a group over every rank), so that the groups below, the trainer's copy index and its data
  // share follow the plan's placement; otherwise `world` itself.
  std::shared_ptr<Transport> placed_world(const std::shared_ptr<Transport>& world) const;
  std::shared_ptr<Transport> pipeline_group(const std::shared_ptr<Transport>& world) const;
  std::shared_ptr<Transport> replica_group(const std::shared_ptr<Transport>& world) const;
  // Applies --plan FILE: sets the stages, balance, schedule and micro-batches the plan chose, except
  // those given on the command line (a mismatching --stages is an error). Called by the --plan option.
  void apply_plan(const std::string& path, const CLI::App& app);
  void add_to(CLI::App& app);
  // `local_rank` picks the GPU for --device cuda (rank r uses GPU r mod the GPU count).
  PipelineOptions options(uint64_t seed, int local_rank = 0) const;
  // UMPIPE (docs/UMPIPE.md): a plan with an "umpipe" section runs its unequal micro-batches per stage
  // unless --umpipe off. apply_plan keeps the section, the plan's batch size and balance; prepare_umpipe
  // picks the partitions and checks the run against them.
  nlohmann::json umpipe_section;  // the plan's "umpipe" object; null when it has none
  int64_t plan_batch_size = 0;    // the plan's "batch_size" (0: none)
  std::string plan_model;         // the plan's "model": its profile's description of the model measured
  bool plan_fits_memory = true;   // false: the plan's "fits_memory_limit" says it fits no rank's --memory
  double plan_peak_bytes = 0;     // the plan's "predicted_peak_bytes" per rank (0: not recorded)
  std::vector<int> plan_balance;  // the plan's balance
  std::string umpipe = "auto";    // --umpipe: auto (dgap when the plan has partitions), off, equal, local-greedy, global-dp, dgap
  std::shared_ptr<const UmpipeResult> umpipe_chosen;  // after prepare_umpipe: the partitions to run, or null
  // Adds --umpipe (train).
  void add_umpipe_to(CLI::App& app);
  // Chooses the partitions (umpipe_chosen) and checks the combination before any rank starts: the plan's
  // partitions must have been made with re-materialisation (the runtime always re-materialises) for the
  // plan's stages and --batch-size; schedule gpipe (set here), no replicas or virtual stages, the plan's
  // balance. Throws UsageError naming the values and the fix.
  void prepare_umpipe(const CLI::App& app, int64_t batch_size);
};

// The balance every rank uses (PipelineOptions::layers_per_stage), for the kinds that need a profile
// ("time", "memory") or the block-partition solver: from --profile when given (every rank reads it),
// else rank 0 measures the model (runtime/profiler.h) on a micro-batch of its data and all ranks receive
// the result (collective over `transport`). Empty for the other kinds: PipelineOptions::balance (the
// kind) cuts the model. `micro_batch` sizes the measurement. With `profile` given (the same on every
// rank: it adds a collective), rank 0 keeps the profile the balance came from (--profile's or the
// measured one) in it, or, where the balance needed none, measures one for its memory columns (one
// timed run per layer) while the other ranks wait; the other ranks leave it empty.
std::vector<int> resolve_balance(const PipelineFlags& pipe, const ModelFlags& model, int64_t micro_batch,
                                 Transport& transport, std::optional<Profile>* profile = nullptr);
// Checks --balance, --balance-solver and --profile before any rank starts (no measuring).
void check_balance_flags(const PipelineFlags& pipe, const ModelFlags& model);

// Runs `body` on every rank. transport "local": one thread per rank in this process, body called once
// per rank concurrently. Otherwise with the rendezvous environment set (a launcher started us): this
// process is one rank. Without it: relaunches this command as `stages` local processes (gloo, or mpirun
// is required for mpi) and returns their combined exit code.
// The first collective of ranks started by hand (torchrun, mpirun, RANK=...): compares `settings` (an
// object of name -> value, the same names on every rank) and throws UsageError on every rank naming the
// first rank that differs from rank 0 and the settings that differ. Ranks with other settings would wait
// in different collectives (a hang) or silently compute a mixture.
void check_same_on_every_rank(const nlohmann::json& settings, Transport& world);
// FNV-1a, 64 bits: the checkpoint manifest's text hash and the ranks' settings comparison.
uint64_t fnv1a(std::string_view bytes);

int run_ranks(const PipelineFlags& flags, int argc, char** argv,
              const std::function<int(std::shared_ptr<Transport>)>& body);

}  // namespace pipetrain::cli

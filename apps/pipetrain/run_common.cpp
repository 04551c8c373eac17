#include "run_common.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include <torch/cuda.h>

#include "pipetrain/core/read_file.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/planner.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/plan/search.h"
#include "pipetrain/runtime/launch.h"
#include "pipetrain/runtime/profiler.h"

namespace pipetrain::cli {

void ModelFlags::add_to(CLI::App& app) {
  app.add_option("--model", model,
                 "gpt (character language model), mlp, cnn (VGG-16 style), resnet or unet (a U-Net classifier "
                 "whose skips cross stage cuts); default gpt")
      ->check(CLI::IsMember({"gpt", "mlp", "cnn", "resnet", "unet"}));
  app.add_option("--data", data,
                 "kjv (King James Bible), text (with --text FILE), fashion-mnist or synthetic; default: kjv for the "
                 "gpt, fashion-mnist for the others");
  app.add_option("--text", text_file, "train the gpt on this text file (character level)");
  app.add_option("--data-dir", data_dir, "folder of the Fashion-MNIST IDX files (plain or .gz)");
  app.add_option("--layers", layers,
                 "gpt: transformer blocks (the model has layers+2 pipeline layers, default 4); mlp: Linear layers "
                 "(default 4)");
  app.add_option("--d-model", gpt.d_model, "gpt width, default 128");
  app.add_option("--heads", gpt.heads, "gpt attention heads, default 4");
  vocab_option = app.add_option("--vocab", gpt.vocab, "gpt vocabulary with synthetic data (text data sets it), default 96");
  app.add_option("--seq-len", gpt.seq_len, "gpt context length, default 64");
  app.add_option("--dropout", gpt.dropout, "gpt dropout, default 0");
  app.add_flag("--tie-embeddings", gpt.tie_embeddings,
               "gpt: the output head's weight is the token embedding (one weight, a copy on each stage that "
               "holds it, gradients summed at every step; synchronous schedules)");
  app.add_flag("--variable-length", gpt.variable_length,
               "gpt on text: samples are lines (verses) of differing length, padded with a mask that travels with "
               "the activations; each micro-batch is trimmed to its longest line");
  app.add_option("--hidden", mlp.hidden, "mlp width and the cnn's fully connected width; default 256 (mlp), 128 (cnn)");
  app.add_option("--width", cnn.width, "cnn channels of the first group (VGG-16: 64), resnet stem width; default 8 / 16");
  app.add_option("--blocks", resnet.blocks, "resnet residual blocks per stage, default 2");
  app.add_option("--depth", unet.depth, "unet levels (each halves the image and has a skip), default 2");
  app.add_option("--seed", seed, "seed for the model, the data order and dropout, 0 to 2^64-1; default 0")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            // CLI11 reads -1 (and anything past 2^64) as 18446744073709551615: accept plain digits only.
            const bool digits = !v.empty() && v.size() <= 20 &&
                                v.find_first_not_of("0123456789") == std::string::npos;
            if (!digits || (v.size() == 20 && v > "18446744073709551615"))
              return "--seed " + v + " is not a whole number from 0 to 18446744073709551615 (2^64-1): give one in that range";
            return {};
          },
          "SEED", "seed"));
}

void ModelFlags::prepare() {
  if (!text_file.empty() && data == "auto") data = "text";
  if (data == "auto") data = model == "gpt" ? "kjv" : "fashion-mnist";
  static const std::vector<std::string> kinds{"kjv", "text", "fashion-mnist", "synthetic"};
  if (std::find(kinds.begin(), kinds.end(), data) == kinds.end())
    throw UsageError("unknown data '" + data + "': use kjv, text (with --text FILE), fashion-mnist or synthetic");
  if (data == "text" && text_file.empty()) throw UsageError("--data text needs --text FILE (the text to train on)");
  if (!text_file.empty() && data != "text")
    throw UsageError("--text " + text_file + " is for --data text, not --data " + data + ": drop one of them");
  if (is_text() && model != "gpt")
    throw UsageError("--data " + data + " is text: train it with --model gpt (the " + model + " takes images)");
  if (data == "fashion-mnist" && model == "gpt")
    throw UsageError("--data fashion-mnist holds images: use --model mlp, cnn, resnet or unet (the gpt takes text)");
  if (is_text() && vocab_option && vocab_option->count() > 0)
    throw UsageError("--vocab is set by the text's characters with --data " + data + ": drop --vocab");
  if (gpt.variable_length && (model != "gpt" || !is_text()))
    throw UsageError("--variable-length trains the gpt on the lines of a text (--data kjv or --data text), not --model " +
                     model + " --data " + data + ": drop --variable-length or use those");
  if (gpt.tie_embeddings && model != "gpt")
    throw UsageError("--tie-embeddings ties the gpt's token embedding and output head; the " + model +
                     " has no embedding: drop --tie-embeddings");
  if (cnn.width != zoo::CnnConfig{}.width) resnet.width = unet.width = cnn.width;
  if (mlp.hidden != zoo::MlpConfig{}.hidden) cnn.hidden = mlp.hidden;
  if (layers < 0) throw UsageError("--layers must be >= 1, got " + std::to_string(layers));
  gpt.layers = layers > 0 ? layers : zoo::GptConfig{}.layers;
  mlp.layers = layers > 0 ? layers : zoo::MlpConfig{}.layers;
  mlp.inputs = data == "synthetic" ? 64 : 28 * 28;
  if (data == "fashion-mnist")  // checked here, before any rank starts, so a missing file is one clear error
    for (const char* name : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                             "t10k-labels-idx1-ubyte"}) {
      const std::string plain = data_dir + "/" + name;
      if (!std::filesystem::exists(plain) && !std::filesystem::exists(plain + ".gz"))
        throw UsageError("Fashion-MNIST file " + plain + "(.gz) is missing: install the Debian package "
                         "dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or pass --data-dir with the "
                         "folder of the four IDX files");
    }
  if (is_text()) {
    if (!text_) text_ = std::make_shared<const std::string>(data == "kjv" ? zoo::load_kjv() : zoo::read_text_file(text_file));
    std::array<bool, 256> seen{};
    for (unsigned char ch : *text_) seen[ch] = true;
    vocabulary_.clear();
    for (int ch = 0; ch < 256; ++ch)
      if (seen[static_cast<std::size_t>(ch)]) vocabulary_ += static_cast<char>(ch);
    gpt.vocab = static_cast<int64_t>(vocabulary_.size());
  }
}

std::function<torch::nn::Sequential()> ModelFlags::factory() const {
  const uint64_t s = seed;
  // Seeding and drawing the weights happen under the default generator's lock: ranks that are threads
  // of one process would otherwise race with each other's seeded forwards.
  auto seeded = [s](auto make) {
    return [s, make] {
      std::lock_guard<std::mutex> lock(default_generator_mutex());
      torch::manual_seed(s);
      return make();
    };
  };
  if (model == "mlp") {
    zoo::check(mlp);
    return seeded([c = mlp] { return zoo::make_mlp(c); });
  }
  if (model == "cnn") {
    zoo::check(cnn);
    return seeded([c = cnn] { return zoo::make_cnn(c); });
  }
  if (model == "resnet") {
    zoo::check(resnet);
    return seeded([c = resnet] { return zoo::make_resnet(c); });
  }
  if (model == "unet") {
    zoo::check(unet);
    return seeded([c = unet] { return zoo::make_unet(c); });
  }
  zoo::check(gpt);
  return seeded([c = gpt] { return zoo::make_gpt(c); });
}

LossFn ModelFlags::loss() const { return zoo::cross_entropy; }

std::unique_ptr<zoo::Dataset> ModelFlags::dataset() const {
  if (data == "synthetic") {
    if (model == "gpt") return zoo::make_synthetic_tokens(gpt.vocab, gpt.seq_len, seed + 1);
    if (model == "mlp") return zoo::make_synthetic_classes(64, mlp.classes, seed + 1);
    throw UsageError("--data synthetic is for the gpt and the mlp: use --data fashion-mnist with --model " + model);
  }
  if (data == "fashion-mnist") return zoo::make_fashion_mnist(data_dir, seed + 1);
  if (!text_) throw std::logic_error("ModelFlags::prepare() was not called");
  if (gpt.variable_length) return zoo::make_text_lines(*text_, data == "kjv" ? "kjv" : text_file, gpt.seq_len, seed + 1);
  return zoo::make_text(*text_, data == "kjv" ? "kjv" : text_file, gpt.seq_len, seed + 1);
}

std::string ModelFlags::describe() const {
  std::string what;
  if (model == "mlp")
    what = fmt::format("mlp: {} Linear layers, width {}, {} inputs, {} classes", mlp.layers, mlp.hidden, mlp.inputs,
                       mlp.classes);
  else if (model == "cnn")
    what = fmt::format("cnn (VGG-16 style): 13 conv + 3 fc layers, width {}, fc {}", cnn.width, cnn.hidden);
  else if (model == "resnet")
    what = fmt::format("resnet: {} stages x {} blocks, width {}", resnet.stages, resnet.blocks, resnet.width);
  else if (model == "unet")
    what = fmt::format("unet: {} levels with skips, width {}", unet.depth, unet.width);
  else
    what = fmt::format("gpt: {} blocks, d_model {}, {} heads, vocab {}, context {}{}{}", gpt.layers, gpt.d_model,
                       gpt.heads, gpt.vocab, gpt.seq_len, gpt.tie_embeddings ? ", tied embeddings" : "",
                       gpt.variable_length ? ", variable-length lines" : "");
  std::string on = data;
  if (data == "kjv") on = fmt::format("the King James Bible ({:.1f} MB)", text_ ? text_->size() / 1e6 : 0.0);
  if (data == "text") on = fmt::format("{} ({:.1f} MB)", text_file, text_ ? text_->size() / 1e6 : 0.0);
  if (data == "fashion-mnist") on = "Fashion-MNIST (" + data_dir + ")";
  if (data == "synthetic") on = "synthetic data";
  return what + " on " + on;
}

nlohmann::json ModelFlags::model_json() const {
  if (model == "mlp")
    return {{"name", model}, {"layers", mlp.layers}, {"hidden", mlp.hidden}, {"inputs", mlp.inputs}, {"classes", mlp.classes}};
  if (model == "cnn")
    return {{"name", model}, {"width", cnn.width}, {"hidden", cnn.hidden}, {"image_size", cnn.image_size},
            {"classes", cnn.classes}};
  if (model == "resnet")
    return {{"name", model}, {"width", resnet.width}, {"stages", resnet.stages}, {"blocks", resnet.blocks},
            {"classes", resnet.classes}};
  if (model == "unet") return {{"name", model}, {"width", unet.width}, {"depth", unet.depth}, {"classes", unet.classes}};
  nlohmann::json j{{"name", model},    {"layers", gpt.layers},   {"d_model", gpt.d_model}, {"heads", gpt.heads},
                   {"vocab", gpt.vocab}, {"seq_len", gpt.seq_len}, {"dropout", gpt.dropout}};
  if (gpt.tie_embeddings) j["tie_embeddings"] = true;  // absent when off, as in checkpoints made before the flag
  if (gpt.variable_length) j["variable_length"] = true;
  return j;
}

std::vector<std::vector<ParameterRef>> ModelFlags::ties() const {
  return model == "gpt" ? zoo::gpt_ties(gpt) : std::vector<std::vector<ParameterRef>>{};
}

namespace {
// A byte string for a JSON document (a checkpoint manifest): as text when it is valid UTF-8 (so ASCII
// vocabularies read as before), else as the list of its byte values (a byte vocabulary of UTF-8 text
// holds lead and continuation bytes apart, which JSON text cannot carry).
nlohmann::json bytes_json(const std::string& s) {
  try {
    nlohmann::json(s).dump();  // nlohmann's own UTF-8 check: what it writes, it reads back
    return s;
  } catch (const nlohmann::json::type_error&) {
  }
  nlohmann::json a = nlohmann::json::array();
  for (char c : s) a.push_back(static_cast<int>(static_cast<unsigned char>(c)));
  return a;
}
}  // namespace

nlohmann::json ModelFlags::data_json() const {
  nlohmann::json j{{"name", data}};
  if (is_text()) j["vocabulary"] = bytes_json(vocabulary_);
  if (data == "text") j["file"] = bytes_json(text_file);
  return j;
}

void PipelineFlags::add_to(CLI::App& app) {
  stages_option = app.add_option("--stages,-p", stages, "pipeline stages = ranks, default 2");
  app.add_option("--schedule,-s", schedule, "gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-auto, zb-v, v-half, v-min, interleaved-zb, looped-bfs, or "
                 "the asynchronous pipedream, 2bw, spectrain; "
                 "default 1f1b");
  app.add_option("--microbatches,-m", microbatches, "micro-batches per step, default 4");
  app.add_option("--virtual,-v", virtual_stages, "virtual stages per rank (interleaved, interleaved-zb, looped-bfs), default 1");
  app.add_option("--balance", balance,
                 "uniform, parameters, time, memory (measured), type:REGEX (layers whose type matches), or layer "
                 "counts per stage such as 3,2,2; default uniform");
  app.add_option("--balance-solver", balance_solver,
                 "min-max (optimal contiguous partition, default) or block-partition (torchgpipe's heuristic)");
  app.add_option_function<std::string>(
         "--replication",
         [this](const std::string& text) {
           replication = text;
           try {
             const auto counts = replication_counts();
             if (stages_option->count() > 0 && static_cast<int>(counts.size()) != stages)
               throw UsageError("--replication " + text + " names " + std::to_string(counts.size()) +
                                " stages but --stages is " + std::to_string(stages) + ": give one count per stage");
             stages = static_cast<int>(counts.size());
           } catch (const UsageError& e) {
             throw CLI::ValidationError("--replication", e.what());
           }
         },
         "replicas per stage, e.g. 3,1 (PipeDream's 1F1B-RR: micro-batches round robin over a stage's replicas, "
                 "gradients summed before the step; the ranks are their sum); gpipe or 1f1b");
  app.add_option("--plan-use", plan_use,
                 "which plan of a --plan file to run: pipeline (the chosen straight pipeline, default) or pipedream "
                 "(the PipeDream planner's, with its stage replication)")
      ->check(CLI::IsMember({"pipeline", "pipedream"}));
  app.add_option_function<std::string>(
      "--plan", [this, &app](const std::string& path) { apply_plan(path, app); },
      "a plan from pipetrain plan: its balance, schedule, micro-batch count and (equal) replication "
      "(flags given here win)");
  app.add_option("--profile", profile_file,
                 "a profile from pipetrain profile (JSON) to balance by time or memory; default: measure the model");
  app.add_option("--checkpoint", checkpoint, "re-materialisation: always, except_last or never; default never");
  app.add_option("--transport", transport,
                 "local (threads in this process), shm (processes on this host, over shared memory), gloo, mpi "
                 "(under mpirun), or auto: mpi under mpirun, gloo otherwise; default auto");
  app.add_option("--threads", threads, "intra-op threads per rank; default: cores / ranks");
  app.add_option("--replicas", replicas,
                 "data parallelism across pipelines: R copies of the pipeline (R x stages ranks), each on 1/R of the "
                 "mini-batch, gradients averaged per stage before the step; default 1");
  app.add_flag("--reference", reference, "use the blocking reference executor instead of the fast path");
  app.add_option("--device", device,
                 "cpu (default), cuda (rank r on GPU r mod the GPU count) or cuda:N; cuda needs a CUDA LibTorch");
}

std::vector<int> PipelineFlags::replication_counts() const {
  if (replication.empty()) return {};
  std::vector<int> out;
  std::stringstream in(replication);
  std::string item;
  while (std::getline(in, item, ',')) {
    std::size_t used = 0;
    int r = 0;
    try {
      r = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || r < 1)
      throw UsageError("--replication " + replication + ": '" + item +
                       "' is not a replica count >= 1; give one count per stage, e.g. 3,1");
    out.push_back(r);
  }
  return out;
}

int PipelineFlags::world_size() const {
  if (replication.empty()) return stages * replicas;
  int total = 0;
  for (int r : replication_counts()) total += r;
  return total;
}

void PipelineFlags::apply_plan(const std::string& path, const CLI::App& app) {
  plan_file = path;
  auto given = [&](const char* name) { return app.get_option(name)->count() > 0; };
  // The part of the file that runs: its top level (the chosen plan), or the PipeDream planner's section.
  PlanFile file;
  Plan plan;
  std::string file_schedule;
  int file_microbatches = 0;
  try {
    if (plan_use != "pipeline" && plan_use != "pipedream")
      throw UsageError("--plan-use " + plan_use + " is not a part of a plan: use pipeline (the default) or pipedream");
    file = read_plan_file(path);  // checks the file, its plan and its sections
    plan = file.plan;
    file_schedule = file.schedule;
    file_microbatches = file.microbatches;
    if (plan_use == "pipedream") {
      if (!file.pipedream)
        throw UsageError(path + " holds no PipeDream plan (no \"pipedream\" section): make it with pipetrain plan, "
                         "which writes one when the PipeDream planner finds a feasible plan, or drop --plan-use");
      plan = *file.pipedream;
      file_schedule = file.pipedream_schedule;
      file_microbatches = file.pipedream_microbatches;
    }
  } catch (const std::exception& e) {  // parse time: report as a usage error (exit 2)
    throw CLI::ValidationError("--plan", e.what());
  }
  // Replication: unequal (PipeDream's plans, e.g. 3,1) runs as 1F1B-RR over each stage's replicas
  // (--replication); equal replication R > 1 as R copies of the pipeline (--replicas).
  const bool unequal = std::any_of(plan.replication.begin(), plan.replication.end(),
                                   [&](int r) { return r != plan.replication.front(); });
  std::string counts;
  int workers = 0, lcm = 1;
  for (int r : plan.replication) {
    counts += (counts.empty() ? "" : ",") + std::to_string(r);
    workers += r;
    lcm = std::lcm(lcm, r);
  }
  if (unequal) {
    if (given("--replication") && replication_counts() != plan.replication)
      throw CLI::ValidationError("--plan", path + " replicates its stages " + counts + " but --replication is " +
                                                 replication + ": drop --replication");
    if (given("--replicas") && replicas != 1)
      throw CLI::ValidationError("--plan", path + " replicates its stages unequally (" + counts +
                                                 "), which does not combine with --replicas: drop --replicas");
    replication = counts;
  } else {
    if (given("--replication"))
      throw CLI::ValidationError("--plan", path + " does not replicate its stages unequally, but --replication " +
                                                 replication + " does: drop --replication (or --plan)");
    if (!plan.replication.empty() && plan.replication.front() > 1) {
      if (given("--replicas") && replicas != plan.replication.front())
        throw CLI::ValidationError("--plan", path + " replicates every stage " +
                                                   std::to_string(plan.replication.front()) + " times but --replicas is " +
                                                   std::to_string(replicas));
      replicas = plan.replication.front();
    }
  }
  const int p = static_cast<int>(plan.balance.size());
  if (given("--stages") && stages != p)
    throw CLI::ValidationError("--plan", path + " has " + std::to_string(p) + " stages but --stages is " +
                                             std::to_string(stages) + ": drop --stages or plan for " +
                                             std::to_string(stages) + " ranks");
  stages = p;
  if (!given("--balance")) {
    balance.clear();
    for (int n : plan.balance) balance += (balance.empty() ? "" : ",") + std::to_string(n);
  }
  // The schedule and micro-batches the file records (pipetrain plan writes them for both parts). A
  // replicated plan without them runs 1F1B-RR with a multiple of every replica count (equal shares)
  // that is at least twice the ranks, so the pipeline fills.
  if (!given("--schedule")) {
    if (!file_schedule.empty())
      schedule = file_schedule;
    else if (unequal)
      schedule = "1f1b";
  }
  if (!given("--microbatches")) {
    if (file_microbatches > 0)
      microbatches = file_microbatches;
    else if (unequal)
      microbatches = (2 * workers + lcm - 1) / lcm * lcm;
  }
  // UMPIPE partitions, if the chosen plan has them (not the PipeDream section: the partitions belong to
  // the top-level balance); prepare_umpipe decides whether they run (--umpipe).
  umpipe_section = nlohmann::json();
  plan_batch_size = 0;
  plan_balance = plan.balance;
  if (plan_use != "pipedream") {
    plan_batch_size = file.batch_size;
    umpipe_section = file.umpipe;
  }
}

void PipelineFlags::add_umpipe_to(CLI::App& app) {
  app.add_option("--umpipe", umpipe,
                 "with a plan from pipetrain plan --planner umpipe: whose unequal micro-batches per stage to run, dgap "
                 "(the default), equal, local-greedy or global-dp; off runs the plan as a normal pipeline");
}

void PipelineFlags::prepare_umpipe(const CLI::App& app, int64_t batch_size) {
  umpipe_chosen.reset();
  static const std::vector<std::string> planners{"dgap", "equal", "local-greedy", "global-dp"};
  if (umpipe != "auto" && umpipe != "off" && std::find(planners.begin(), planners.end(), umpipe) == planners.end())
    throw UsageError("unknown --umpipe '" + umpipe + "': use dgap, equal, local-greedy, global-dp or off");
  if (umpipe == "off") return;
  if (umpipe_section.is_null()) {
    if (umpipe == "auto") return;
    if (plan_file.empty())
      throw UsageError("--umpipe " + umpipe + " runs the partitions of a plan: pass --plan FILE from pipetrain plan "
                       "--planner umpipe");
    throw UsageError("--plan " + plan_file + " has no UMPIPE partitions: make it with pipetrain plan --planner umpipe, "
                     "or drop --umpipe");
  }
  const std::string name = umpipe == "auto" ? "dgap" : umpipe;
  nlohmann::json chosen;
  const nlohmann::json& all = umpipe_section.contains("planners") ? umpipe_section["planners"] : nlohmann::json();
  if (all.is_object() && all.contains(name))
    chosen = all[name];
  else if (umpipe_section.value("planner", std::string()) == name)
    chosen = umpipe_section;
  if (chosen.is_null()) {
    std::string have;
    if (all.is_object())
      for (const auto& item : all.items()) have += (have.empty() ? "" : ", ") + item.key();
    if (have.empty()) have = umpipe_section.value("planner", std::string("?"));
    throw UsageError("--plan " + plan_file + " holds no '" + name + "' UMPIPE partitions (it has " + have +
                     "): pick one of those with --umpipe, or plan again with pipetrain plan --planner umpipe");
  }
  auto result = std::make_shared<UmpipeResult>(umpipe_result_from_json(chosen, plan_file + ": umpipe " + name));
  if (!umpipe_section.value("rematerialise", false))
    throw UsageError("--plan " + plan_file + ": its UMPIPE partitions were planned without re-materialisation (the "
                     "backward times leave out the recompute), but the runtime always re-materialises: plan again "
                     "without --no-rematerialise, or pass --umpipe off");
  int64_t samples = 0;
  for (int b : result->plan.forward.front()) samples += b;
  if (static_cast<int>(result->plan.forward.size()) != stages)
    throw UsageError(fmt::format("--plan {}: its UMPIPE partitions are for {} stages but the run has {}: drop --stages "
                                 "or plan for {} ranks",
                                 plan_file, result->plan.forward.size(), stages, stages));
  if (samples != batch_size)
    throw UsageError(fmt::format("--plan {} cuts mini-batches of {} samples (its UMPIPE partitions) but --batch-size is "
                                 "{}: pass --batch-size {}, plan with --batch-size {}, or pass --umpipe off",
                                 plan_file, samples, batch_size, samples, batch_size));
  if (replicas != 1)
    throw UsageError("UMPIPE partitions run on one pipeline, but --replicas is " + std::to_string(replicas) +
                     ": drop --replicas or pass --umpipe off");
  if (virtual_stages != 1)
    throw UsageError("UMPIPE partitions run one stage per rank, but --virtual is " + std::to_string(virtual_stages) +
                     ": drop --virtual or pass --umpipe off");
  if (app.get_option("--schedule")->count() > 0 && schedule != "gpipe")
    throw UsageError("UMPIPE partitions run in GPipe order (all forwards, then all backwards), not --schedule " +
                     schedule + ": drop --schedule or pass --umpipe off");
  schedule = "gpipe";
  std::string planned;
  for (int n : plan_balance) planned += (planned.empty() ? "" : ",") + std::to_string(n);
  if (balance != planned)
    throw UsageError("--plan " + plan_file + "'s UMPIPE partitions were planned for balance " + planned +
                     ", not --balance " + balance + ": drop --balance or pass --umpipe off");
  umpipe_chosen = result;
}

PipelineOptions PipelineFlags::options(uint64_t seed, int local_rank) const {
  PipelineOptions o;
  if (device == "cpu") {
    o.device = torch::kCPU;
  } else if (device.rfind("cuda", 0) == 0) {
    if (!torch::cuda::is_available())
      throw UsageError("--device " + device + ": this LibTorch has no CUDA device; build against a CUDA LibTorch "
                       "(make build TORCH_DIR=...) on a machine with a GPU, or use --device cpu");
    const int gpus = static_cast<int>(torch::cuda::device_count());
    try {
      o.device = device == "cuda" ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % gpus))
                                  : torch::Device(device);
    } catch (const std::exception&) {
      throw UsageError("--device " + device + " is not a device: use cpu, cuda or cuda:N");
    }
    if (o.device.index() >= gpus)
      throw UsageError("--device " + device + ": there are only " + std::to_string(gpus) + " GPUs (0.." +
                       std::to_string(gpus - 1) + ")");
  } else {
    throw UsageError("--device " + device + " is not a device: use cpu, cuda or cuda:N");
  }
  o.schedule = schedule;
  o.microbatches = microbatches;
  o.virtual_stages = virtual_stages;
  o.replication = replication_counts();
  o.balance = balance;
  o.checkpoint = parse_checkpoint(checkpoint);
  o.seed = seed;
  o.reference = reference;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (threads < 0) throw UsageError("--threads must be >= 0, got " + std::to_string(threads));
  o.threads = threads > 0 ? threads : std::max(1, cores / std::max(1, world_size()));
  return o;
}

namespace {
bool measured_kind(const std::string& kind) { return kind == "time" || kind == "memory"; }
}  // namespace

void check_balance_flags(const PipelineFlags& pipe, const ModelFlags& model) {
  parse_balance_solver(pipe.balance_solver);
  const int stages = pipe.stages * stages_per_rank(pipe.schedule, pipe.virtual_stages);
  {  // each (virtual) stage needs a layer: the fix is more layers or fewer stages, said in the model's terms
    const int layers = layer_count(model.factory()());
    if (stages > layers) {
      const std::string asked = stages > pipe.stages
                                    ? fmt::format("--stages {} x {} stages per rank = {} stages", pipe.stages,
                                                  stages / pipe.stages, stages)
                                    : fmt::format("--stages {}", stages);
      std::string more;
      if (model.model == "gpt")
        more = fmt::format("give the gpt --layers {} or more (it has --layers + 2 pipeline layers)", stages - 2);
      else if (model.model == "mlp")
        more = fmt::format("give the mlp --layers {} or more", stages);
      else
        more = "use a model with more layers";
      throw UsageError(fmt::format("{} but the {} has {} pipeline layers, and every stage needs at least one: {}, or "
                                   "use fewer stages",
                                   asked, model.model, layers, more));
    }
  }
  if (!pipe.profile_file.empty()) {
    const Profile p = load_profile(pipe.profile_file);
    const int layers = layer_count(model.factory()());
    if (static_cast<int>(p.layers.size()) != layers)
      throw UsageError("--profile " + pipe.profile_file + " has " + std::to_string(p.layers.size()) +
                       " layers but the model has " + std::to_string(layers) +
                       ": profile this model (pipetrain profile with the same model flags)");
    plan_balance(p, stages, pipe.balance, parse_balance_solver(pipe.balance_solver));
  } else if (!measured_kind(pipe.balance)) {
    choose_balance(model.factory()(), stages, pipe.balance, pipe.balance_solver);
  }
}

std::vector<int> resolve_balance(const PipelineFlags& pipe, const ModelFlags& model, int64_t micro_batch,
                                 Transport& transport) {
  const int stages = pipe.stages * stages_per_rank(pipe.schedule, pipe.virtual_stages);
  const BalanceSolver solver = parse_balance_solver(pipe.balance_solver);
  std::vector<int> balance;
  if (!pipe.profile_file.empty()) {
    balance = plan_balance(load_profile(pipe.profile_file), stages, pipe.balance, solver);
  } else if (!measured_kind(pipe.balance)) {
    if (solver == BalanceSolver::min_max) return {};  // PipelineOptions::balance (the kind) does it
    balance = choose_balance(model.factory()(), stages, pipe.balance, pipe.balance_solver);
  } else {
    // Measured on rank 0 only, so every rank cuts the model the same way.
    torch::Tensor counts = torch::zeros({stages}, torch::kDouble);
    if (transport.rank() == 0) {
      auto m = model.factory()();
      const zoo::Batch b = model.dataset()->batch(0, std::max<int64_t>(1, micro_batch));
      ProfilerOptions o;
      o.repeats = 5;
      o.warmup = 1;
      o.loss = model.loss();
      o.target = b.target;
      const Profile p = profile_model(m, b.input, o);
      const auto mine = plan_balance(p, stages, pipe.balance, solver);
      for (int s = 0; s < stages; ++s) counts[s] = mine[static_cast<std::size_t>(s)];
    }
    transport.all_reduce_sum(counts);
    for (int s = 0; s < stages; ++s) balance.push_back(static_cast<int>(counts[s].item<double>()));
  }
  return balance;
}

std::shared_ptr<Transport> PipelineFlags::pipeline_group(const std::shared_ptr<Transport>& world) const {
  if (replicas == 1) return world;
  const int k = world->rank() / stages;
  std::vector<int> members;
  for (int s = 0; s < stages; ++s) members.push_back(k * stages + s);
  return make_group_transport(world, members);
}

std::shared_ptr<Transport> PipelineFlags::replica_group(const std::shared_ptr<Transport>& world) const {
  if (replicas == 1) return nullptr;
  const int s = world->rank() % stages;
  std::vector<int> members;
  for (int k = 0; k < replicas; ++k) members.push_back(k * stages + s);
  return make_group_transport(world, members);
}

namespace {
bool launched() { return std::getenv("RANK") || std::getenv("OMPI_COMM_WORLD_RANK"); }
}  // namespace

int run_ranks(const PipelineFlags& flags, int argc, char** argv,
              const std::function<int(std::shared_ptr<Transport>)>& body) {
  if (flags.stages < 1) throw UsageError("--stages must be >= 1, got " + std::to_string(flags.stages));
  if (flags.replicas < 1) throw UsageError("--replicas must be >= 1, got " + std::to_string(flags.replicas));
  const int world = flags.world_size();
  const std::string& t = flags.transport;
  if (t != "local" && t != "shm" && t != "gloo" && t != "mpi" && t != "auto")
    throw UsageError("unknown transport '" + t + "': use local, shm, gloo, mpi or auto");
  if (t == "local") {
    auto transports = make_local_transports(world);
    std::vector<int> codes(static_cast<std::size_t>(world), 0);
    run_on_threads(
        world, [&](int r) { codes[static_cast<std::size_t>(r)] = body(transports[static_cast<std::size_t>(r)]); },
        [&](int r) { transports[static_cast<std::size_t>(r)]->abort("rank " + std::to_string(r) + " failed"); });
    for (int c : codes)
      if (c != 0) return c;
    return 0;
  }
  if (!launched()) {
    if (t == "mpi")
      throw UsageError("--transport mpi needs ranks started by mpirun, e.g. mpirun -n " + std::to_string(world) +
                       " pipetrain ...; or use --transport gloo");
    std::vector<std::string> args{"/proc/self/exe"};
    for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
    return launch_local(world, args);  // the ranks see no mpirun variables, so "auto" means gloo
  }
  auto transport = make_process_transport(t);
  if (transport->world_size() != world) {
    const std::string msg =
        "the launcher started " + std::to_string(transport->world_size()) + " ranks but --stages is " +
        std::to_string(flags.stages) + (flags.replicas > 1 ? " x --replicas " + std::to_string(flags.replicas) : "") +
        (flags.replication.empty() ? "" : " replicated " + flags.replication + " (their sum)") + ": launch " +
        std::to_string(world) + " ranks" +
        (flags.replication.empty() ? " or pass --stages " + std::to_string(transport->world_size()) : "");
    transport->abort(msg);
    throw UsageError(msg);
  }
  try {
    return body(transport);
  } catch (const RemoteFailure&) {
    throw;
  } catch (const std::exception& e) {
    transport->abort(e.what());
    throw;
  }
}

}  // namespace pipetrain::cli

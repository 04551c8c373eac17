// The model and data flags (ModelFlags, run_common.h): the zoo's models and data sets from the
// command line, the checkpoint manifest's description of them, and the tie groups of the model.
#include "run_common.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>

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
  const auto for_models = [this](CLI::Option* option, std::vector<std::string> models) {
    model_options_.emplace_back(option, std::move(models));
    return option;
  };
  for_models(app.add_option("--layers", layers,
                            "gpt: transformer blocks (the model has layers+2 pipeline layers, default 4); mlp: Linear "
                            "layers (default 4)"),
             {"gpt", "mlp"});
  for_models(app.add_option("--d-model", gpt.d_model, "gpt width, default 128"), {"gpt"});
  for_models(app.add_option("--heads", gpt.heads, "gpt attention heads, default 4"), {"gpt"});
  vocab_option = for_models(
      app.add_option("--vocab", gpt.vocab, "gpt vocabulary with synthetic data (text data sets it), default 96"), {"gpt"});
  for_models(app.add_option("--seq-len", gpt.seq_len, "gpt context length, default 64"), {"gpt"});
  for_models(app.add_option("--dropout", gpt.dropout, "gpt dropout, default 0"), {"gpt"});
  app.add_flag("--tie-embeddings", gpt.tie_embeddings,
               "gpt: the output head's weight is the token embedding (one weight, a copy on each stage that "
               "holds it, gradients summed at every step; synchronous schedules)");
  app.add_flag("--variable-length", gpt.variable_length,
               "gpt on text: samples are lines (verses) of differing length, padded with a mask that travels with "
               "the activations; each micro-batch is trimmed to its longest line; the loss is the mean per real "
               "token, whatever the split (2bw and UMPIPE cannot train it)");
  hidden_option_ = for_models(
      app.add_option("--hidden", mlp.hidden, "mlp width and the cnn's fully connected width; default 256 (mlp), 128 (cnn)"),
      {"mlp", "cnn"});
  width_option_ = for_models(
      app.add_option("--width", cnn.width, "channels of the first group: cnn (VGG-16: 64; default 8), resnet stem and first stage (default 16), "
                     "unet first level (default 8)"),
      {"cnn", "resnet", "unet"});
  for_models(app.add_option("--blocks", resnet.blocks, "resnet residual blocks in each of its 3 ResNet stages (not pipeline stages; each block is one "
                     "pipeline layer), default 2"), {"resnet"});
  for_models(app.add_option("--depth", unet.depth, "unet levels (each halves the image and has a skip), default 2"),
             {"unet"});
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
  // A flag of another model changed nothing: refused, as a user who wrote it expects it to count.
  for (const auto& [option, models] : model_options_)
    if (option->count() > 0 && std::find(models.begin(), models.end(), model) == models.end()) {
      std::string which;
      for (std::size_t i = 0; i < models.size(); ++i)
        which += (i == 0 ? "" : i + 1 == models.size() ? " and " : ", ") + ("--model " + models[i]);
      throw UsageError(option->get_name() + " " + option->as<std::string>() + " is for " + which + ", not --model " +
                       model + ": drop " + option->get_name() + " (" + model + " takes none)");
    }
  // --width and --hidden are one flag for several models, each with its own default: a value given counts
  // (whether or not it equals the cnn's or mlp's default; --model resnet --width 8 built width 16).
  if (width_option_ && width_option_->count() > 0) resnet.width = unet.width = cnn.width;
  if (hidden_option_ && hidden_option_->count() > 0) cnn.hidden = mlp.hidden;
  if (layers < 0) throw UsageError("--layers must be >= 1, got " + std::to_string(layers));
  // 0 is "not given" inside; given, it built the default depth (train, profile and selftest alike).
  for (const auto& [option, models] : model_options_)
    if (option->get_name() == "--layers" && option->count() > 0 && layers == 0)
      throw UsageError("--layers must be >= 1, got 0 (it built the default depth): give the layers, or drop --layers");
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
  // The model's own checks, here before anything is drawn or built: `profile --vocab 0` drew a batch
  // first and failed in LibTorch's random_ with a stack trace (exit 1).
  if (model == "gpt") zoo::check(gpt);
  else if (model == "mlp") zoo::check(mlp);
}

namespace {

// This host's memory for the run: physical memory, or the cgroup's limit where that is lower.
double host_memory_bytes() {
  double bytes = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  std::ifstream in("/sys/fs/cgroup/memory.max");
  std::string limit;
  if (in >> limit && limit != "max") {
    try {
      bytes = std::min(bytes, std::stod(limit));
    } catch (const std::exception&) {
    }
  }
  return bytes;
}

std::string gib(double bytes) { return fmt::format("{:.3g} GiB", bytes / (1024.0 * 1024.0 * 1024.0)); }

}  // namespace

void ModelFlags::check_fits(int64_t batch_size, int microbatches, int ranks_here, int pipeline_ranks,
                            double rank_memory, const std::string& batch) const {
  // The flag that sets the batch, and more micro-batches where the command takes them (train, selftest).
  const std::string more = batch == "--batch-size" ? ", or more --microbatches" : "";
  const double b = static_cast<double>(batch_size), mb = std::ceil(b / std::max(1, microbatches));
  const double ranks = std::max(1, ranks_here);
  // Lower bounds, in bytes: every rank here builds the whole model (4-byte parameters); each holds at
  // least one micro-batch's activations of one layer; the last stage's logits and the batch exist once.
  double params = 0, layer_activations = 0, once = 0;
  std::string fix;
  if (model == "gpt") {
    const double d = static_cast<double>(gpt.d_model), t = static_cast<double>(gpt.seq_len),
                 v = static_cast<double>(gpt.vocab), h = static_cast<double>(gpt.heads), l = gpt.layers;
    params = l * 12 * d * d + v * d * (gpt.tie_embeddings ? 1 : 2) + t * d;
    // A block keeps its input, q, k, v, the MLP's 4d hidden activations, the attention scores and
    // probabilities.
    layer_activations = mb * (t * d * 8 + 2 * h * t * t) * 4;
    once = mb * t * v * 4 + b * t * 8 * 2;  // logits; token ids and targets
    fix = "use fewer --layers, a smaller --d-model, --seq-len, --vocab or " + batch + more;
  } else if (model == "mlp") {
    const double w = static_cast<double>(mlp.hidden);
    params = static_cast<double>(mlp.inputs) * w + std::max(0, mlp.layers - 2) * w * w + w * static_cast<double>(mlp.classes);
    layer_activations = mb * w * 4;
    once = b * static_cast<double>(mlp.inputs) * 4;
    fix = "use fewer --layers, a smaller --hidden or " + batch;
  } else {
    // Lower bounds from the models' shapes (zoo/models.h) for 28x28 images: the 3x3 convs' weights, and the
    // first layer's output map, the largest one layer holds (--width 65536 asked 144 GiB of LibTorch, which
    // failed with a stack trace; --blocks 100000 grew for 30 s to bad_alloc).
    const double px = 28.0 * 28.0;
    if (model == "cnn") {
      const double w = static_cast<double>(cnn.width), h = static_cast<double>(cnn.hidden);
      // conv1 (1->w), w->w, w->2w, 2w->2w, 2w->4w, 2 x 4w->4w, 4w->8w, 5 x 8w->8w; fc6, fc7.
      params = 9 * (w + w * w + 2 * w * w + 4 * w * w + 8 * w * w + 2 * 16 * w * w + 32 * w * w + 5 * 64 * w * w) +
               8 * w * h + h * h + h * static_cast<double>(cnn.classes);
      layer_activations = mb * w * px * 4;
      fix = "use a smaller --width, --hidden or " + batch;
    } else if (model == "resnet") {
      // The stem (1 -> w); per stage s of c = w 2^s channels, blocks x two 3x3 convs c -> c, except that the
      // first conv of a later stage's first block comes from c / 2 (shortcuts and BatchNorms left out).
      double conv = 9 * static_cast<double>(resnet.width);
      for (int st = 0; st < resnet.stages; ++st) {
        const double c = static_cast<double>(resnet.width) * std::pow(2.0, st);
        conv += (static_cast<double>(resnet.blocks) * 2 * 9 * c * c) - (st > 0 && resnet.blocks > 0 ? 4.5 * c * c : 0.0);
      }
      params = conv;
      layer_activations = mb * static_cast<double>(resnet.width) * px * 4;
      fix = "use a smaller --width, fewer --blocks or a smaller " + batch;
    } else if (model == "unet") {
      // The down convs of levels 1 .. depth - 1 and the bottom's, each from c / 2 to c = w 2^k channels
      // (level 0's from the input, the up convs and the head left out).
      double conv = 0;
      for (int k = 1; k <= unet.depth; ++k) {
        const double c = static_cast<double>(unet.width) * std::pow(2.0, k);
        conv += 9 * (c / 2) * c;
      }
      params = conv;
      layer_activations = mb * static_cast<double>(unet.width) * px * 4;
      fix = "use a smaller --width or " + batch;
    }
    once = b * px * 4;
    if (fix.empty()) fix = "use a smaller " + batch;
  }
  // The gpt's ranks build their own layers only (layerwise()): a rank holds at least its share.
  const bool own_layers = layerwise().has_value();
  const double share = own_layers ? params / std::max(1, pipeline_ranks) : params;
  const std::string built = own_layers ? fmt::format("building only its own layers, at least 1/{} of the model's {:.3g} "
                                                     "parameters", std::max(1, pipeline_ranks), params)
                                       : fmt::format("building the whole model of {:.3g} parameters", params);
  const double per_rank = share * 4 + layer_activations;
  if (rank_memory > 0 && per_rank > rank_memory)
    throw UsageError(fmt::format(
        "one rank of this model and batch needs at least {} of memory ({}, 4 bytes each, and {} of one layer's "
        "activations), more than --rank-memory {}: {}{}",
        gib(per_rank), built, gib(layer_activations), gib(rank_memory),
        own_layers ? "use more --stages (each rank builds only its share), or " : "", fix));
  const double need = ranks * per_rank + once, have = host_memory_bytes();
  if (need > have)
    throw UsageError(fmt::format(
        "this model and batch need at least {} of memory ({:g} rank(s) here, each {}, 4 bytes each, and holding {} of "
        "one layer's activations; {} of batch and logits), more than this host's {}: {}",
        gib(need), ranks, built, gib(layer_activations), gib(once), gib(have), fix));
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
  // The gpt layer by layer, each layer from its own seed: the weights its ranks build for themselves.
  const LayerwiseModel layers = *layerwise();
  return [layers] { return build_all(layers); };
}

std::optional<LayerwiseModel> ModelFlags::layerwise() const {
  if (model != "gpt") return std::nullopt;
  return zoo::gpt_layers(gpt, seed);
}

int ModelFlags::layer_count() const {
  if (const auto l = layerwise()) return l->layers;
  return pipetrain::layer_count(factory()());
}

std::vector<int> ModelFlags::choose_balance(int stages, const std::string& kind, const std::string& solver) const {
  if (const auto l = layerwise()) {
    std::vector<std::string> types;
    std::vector<double> counts;
    for (const LayerInfo& info : layer_infos(*l)) {
      types.push_back(info.type);
      counts.push_back(info.parameters);
    }
    return pipetrain::choose_balance(types, counts, stages, kind, solver);
  }
  return pipetrain::choose_balance(factory()(), stages, kind, solver);
}

std::string ModelFlags::bundle_layers() const {
  if (model == "unet") return "the unet's layers pass its skips";
  if (model == "gpt" && gpt.variable_length) return "with --variable-length the gpt's layers pass the padding mask";
  return {};
}

Loss ModelFlags::loss() const {
  if (!gpt.variable_length) return zoo::cross_entropy;
  // Lines of differing length: the mean of each micro-batch's own tokens, weighted by its share of the
  // samples, changed with --microbatches and --replicas. The sum over real tokens (targets -1 are
  // padding) and their count instead: the step divides the sums by the mini-batch's total count.
  return Loss::per_token([](const torch::Tensor& logits, const torch::Tensor& target) {
    torch::Tensor t = target;
    if (logits.dim() == 3 && t.dim() == 2 && logits.size(1) < t.size(1)) t = t.slice(1, 0, logits.size(1));
    const torch::Tensor sum = torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}), t.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1).reduction(torch::kSum));
    return LossTerm(sum, (t >= 0).sum());
  });
}

LossFn ModelFlags::mean_loss() const { return zoo::cross_entropy; }

std::unique_ptr<zoo::Dataset> ModelFlags::dataset() const {
  if (data == "synthetic") {
    if (model == "gpt") return zoo::make_synthetic_tokens(gpt.vocab, gpt.seq_len, seed + 1);
    if (model == "mlp") return zoo::make_synthetic_classes(64, mlp.classes, seed + 1);
    throw UsageError("--data synthetic is for the gpt and the mlp: use --data fashion-mnist with --model " + model);
  }
  if (data == "fashion-mnist") {
    auto d = zoo::make_fashion_mnist(data_dir, seed + 1);
    // The zoo's image models take 28 x 28 (a 32 x 32 file failed in the first forward, naming a matmul).
    const auto sizes = d->eval_batch(0, 1).input.sizes();
    if (sizes.size() != 4 || sizes[2] != 28 || sizes[3] != 28)
      throw UsageError("--data-dir " + data_dir + " holds images of " + std::to_string(sizes.back()) + " x " +
                       std::to_string(sizes[sizes.size() - 2]) + " pixels, and Fashion-MNIST's (what --model " + model +
                       " takes) are 28 x 28: give the folder of Fashion-MNIST's four IDX files");
    return d;
  }
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
  if (data == "fashion-mnist") {
    // The images' folder, absolute: a resume without --data-dir took the default folder's 60,000 images
    // for a run trained on another folder's, without a word.
    std::error_code ec;
    const std::filesystem::path absolute = std::filesystem::absolute(data_dir, ec);
    j["dir"] = bytes_json(ec ? data_dir : absolute.lexically_normal().string());
  }
  if (data == "text") {
    // Absolute: a resume from another folder looked for a relative name where it was not.
    std::error_code ec;
    const std::filesystem::path absolute = std::filesystem::absolute(text_file, ec);
    j["file"] = bytes_json(ec ? text_file : absolute.lexically_normal().string());
    // What the text is, wherever it lies: a resume compares these, not the path (./my.txt and my.txt
    // were refused as different files, and another file of the same name and characters accepted).
    if (text_) {
      j["file_bytes"] = text_->size();
      j["file_fnv1a"] = fmt::format("{:016x}", fnv1a(*text_));
    }
  }
  return j;
}

}  // namespace pipetrain::cli

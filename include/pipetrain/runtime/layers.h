// Models given layer by layer, so that each rank builds only its own layers (a model that does not fit
// one rank's memory can then be pipelined): PipelineRank(LayerwiseModel, ...) builds, initialises and
// holds the layers of its stages only.
//
// Layer i is built by `build(i)` with LibTorch's default CPU generator seeded from (seed, i) (and put
// back afterwards), so its initial weights depend neither on how the model is cut nor on which rank
// builds it: build_all gives the whole model with the very weights the ranks build, for a reference, a
// single process, or the PipelineRank(Sequential) constructor. Checkpoints (checkpoint.h) address layers
// by index, so a run saved at one stage count resumes at another whichever way its ranks were built.
//
// A rank must know a few things of the layers it does not build: the type and parameter count (for the
// balance kinds that use them) and a BundleModule's skip declarations (stashes, pops). `info` gives them
// without building anything; without `info`, the constructor builds each other layer once, reads them
// and drops it (peak memory: the rank's own layers and one more).
//
// Tied weights (PipelineOptions::tied) whose members live on different ranks: the first pass (a
// collective) copies the value of the group's lowest-layer member from the rank holding it into every
// other member, as the Sequential constructor copies it within a whole model.
//
//   pipetrain::LayerwiseModel model;
//   model.layers = 8;
//   model.seed = 1;
//   model.build = [](int i) { return torch::nn::AnyModule(torch::nn::Linear(64, 64)); };
//   pipetrain::PipelineRank rank(model, loss, transport, options);   // only this rank's layers
#pragma once

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace pipetrain {

// What a rank knows of a layer it does not build.
struct LayerInfo {
  std::string type;                        // module type name, as layer_type_names gives it
  double parameters = 0;                   // trainable parameter count
  std::vector<std::string> stashes, pops;  // a BundleModule's skip declarations (bundle.h)
};

// The info of a built layer.
LayerInfo layer_info(const torch::nn::Module& layer);

struct LayerwiseModel {
  int layers = 0;
  // Builds layer i (0 <= i < layers) on the CPU: a plain one-tensor module or a BundleModule, e.g.
  // torch::nn::AnyModule(torch::nn::Linear(4, 4)) or torch::nn::AnyModule(std::make_shared<Mine>()).
  // It runs under default_generator_mutex() (build_layer), so it must not take that lock itself.
  std::function<torch::nn::AnyModule(int layer)> build;
  uint64_t seed = 0;  // layer i's initial weights come from (seed, i)
  // Optional: what layer i is, without building it (see the file comment).
  std::function<LayerInfo(int layer)> info;
  // Optional: the layers' names (all of them, unique, without '.'), for ties by path
  // (ParameterRef::path) and as build_all's child names; empty: layer i is named "i".
  std::vector<std::string> names;
};

// Layer `layer` built with its own seed, under default_generator_mutex (executor.h), the default
// generator restored afterwards. Throws UsageError for an index outside the model or a build that
// returns no module.
torch::nn::AnyModule build_layer(const LayerwiseModel& model, int layer);
// The layers' names: `names`, checked (one per layer, unique, non-empty, without '.'; UsageError naming
// the bad one otherwise), or "0", "1", ... when it is empty.
std::vector<std::string> layer_names(const LayerwiseModel& model);
// The whole model, layer by layer (the same weights as the ranks' own layers), its children named by
// layer_names.
torch::nn::Sequential build_all(const LayerwiseModel& model);
// info(i) of every layer: from `info`, or by building each layer in turn and dropping it.
std::vector<LayerInfo> layer_infos(const LayerwiseModel& model);

}  // namespace pipetrain

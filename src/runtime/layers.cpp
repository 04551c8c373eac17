#include "pipetrain/runtime/layers.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <mutex>
#include <set>

#include "pipetrain/core/error.h"
#include "pipetrain/core/random.h"
#include "pipetrain/runtime/bundle.h"
#include "pipetrain/runtime/executor.h"
#include "seeded_generator.h"

namespace pipetrain {

LayerInfo layer_info(const torch::nn::Module& layer) {
  LayerInfo info;
  std::string n = layer.name();
  const auto colon = n.rfind("::");
  if (colon != std::string::npos) n = n.substr(colon + 2);
  if (n.size() > 4 && n.compare(n.size() - 4, 4, "Impl") == 0) n = n.substr(0, n.size() - 4);
  info.type = n;
  for (const auto& p : layer.parameters())
    if (p.requires_grad()) info.parameters += static_cast<double>(p.numel());
  if (const auto* bm = dynamic_cast<const BundleModule*>(&layer)) {
    info.stashes = bm->stashes();
    info.pops = bm->pops();
  }
  return info;
}

namespace {

void check_index(const LayerwiseModel& model, int layer) {
  if (model.layers < 1) throw UsageError("a layerwise model needs layers >= 1, got " + std::to_string(model.layers));
  if (!model.build) throw UsageError("a layerwise model needs its build function (LayerwiseModel::build)");
  if (layer < 0 || layer >= model.layers)
    throw UsageError("layer " + std::to_string(layer) + " is outside the layerwise model's layers 0.." +
                     std::to_string(model.layers - 1));
}

}  // namespace

torch::nn::AnyModule build_layer(const LayerwiseModel& model, int layer) {
  check_index(model, layer);
  // splitmix64 of both (ATen's CPU generator keeps the low 32 bits of its seed only).
  const uint64_t seed = splitmix64(model.seed ^ splitmix64(0x6c61796572ULL + static_cast<uint64_t>(layer)));
  std::lock_guard<std::mutex> lock(default_generator_mutex());
  auto gen = at::detail::getDefaultCPUGenerator();
  SeededCpuGenerator seeded(gen, seed);  // put back as it was on return
  torch::nn::AnyModule m = model.build(layer);
  if (m.is_empty())
    throw UsageError("the layerwise model's build(" + std::to_string(layer) + ") returned an empty module");
  return m;
}

std::vector<std::string> layer_names(const LayerwiseModel& model) {
  std::vector<std::string> out;
  if (model.names.empty()) {
    for (int i = 0; i < model.layers; ++i) out.push_back(std::to_string(i));
    return out;
  }
  if (static_cast<int>(model.names.size()) != model.layers)
    throw UsageError("LayerwiseModel::names has " + std::to_string(model.names.size()) + " names for " +
                     std::to_string(model.layers) + " layers: give one name per layer, or none");
  std::set<std::string> seen;
  for (std::size_t i = 0; i < model.names.size(); ++i) {
    const std::string& n = model.names[i];
    if (n.empty() || n.find('.') != std::string::npos)
      throw UsageError("LayerwiseModel::names[" + std::to_string(i) + "] = '" + n +
                       "' is not a layer name: use a non-empty name without '.'");
    if (!seen.insert(n).second)
      throw UsageError("LayerwiseModel::names[" + std::to_string(i) + "] = '" + n +
                       "' names another layer too: layer names must be unique");
  }
  return model.names;
}

torch::nn::Sequential build_all(const LayerwiseModel& model) {
  torch::nn::Sequential out;
  const std::vector<std::string> names = layer_names(model);
  for (int i = 0; i < model.layers; ++i) out->push_back(names[static_cast<std::size_t>(i)], build_layer(model, i));
  if (model.layers < 1) check_index(model, 0);
  return out;
}

std::vector<LayerInfo> layer_infos(const LayerwiseModel& model) {
  std::vector<LayerInfo> out;
  for (int i = 0; i < model.layers; ++i) {
    check_index(model, i);
    if (model.info) {
      out.push_back(model.info(i));
    } else {
      torch::NoGradGuard no_grad;
      out.push_back(layer_info(*build_layer(model, i).ptr()));
    }
  }
  if (model.layers < 1) check_index(model, 0);
  return out;
}

}  // namespace pipetrain

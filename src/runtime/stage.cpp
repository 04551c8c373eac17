#include "pipetrain/runtime/stage.h"

#include <algorithm>
#include <cctype>
#include <map>

#include "pipetrain/core/error.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/profile.h"

namespace pipetrain {

Checkpoint parse_checkpoint(const std::string& text) {
  if (text == "always") return Checkpoint::Always;
  if (text == "except_last") return Checkpoint::ExceptLast;
  if (text == "never") return Checkpoint::Never;
  throw UsageError("unknown checkpoint mode '" + text + "': use always, except_last or never");
}

std::string to_string(Checkpoint c) {
  switch (c) {
    case Checkpoint::Always: return "always";
    case Checkpoint::ExceptLast: return "except_last";
    default: return "never";
  }
}

int layer_count(const torch::nn::Sequential& model) { return static_cast<int>(model->size()); }

std::vector<double> layer_parameter_counts(const torch::nn::Sequential& model) {
  std::vector<double> out;
  for (std::size_t i = 0; i < model->size(); ++i) {
    double n = 0;
    for (const auto& p : model->ptr(i)->parameters())
      if (p.requires_grad()) n += static_cast<double>(p.numel());
    out.push_back(n);
  }
  return out;
}

namespace {

// A module's type name without namespace or "Impl".
std::string type_name_of(const torch::nn::Module& module) {
  std::string n = module.name();
  const auto colon = n.rfind("::");
  if (colon != std::string::npos) n = n.substr(colon + 2);
  if (n.size() > 4 && n.compare(n.size() - 4, 4, "Impl") == 0) n = n.substr(0, n.size() - 4);
  return n;
}

}  // namespace

std::vector<std::string> layer_type_names(const torch::nn::Sequential& model) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < model->size(); ++i) out.push_back(type_name_of(*model->ptr(i)));
  return out;
}

std::vector<std::vector<ParameterRef>> resolve_parameter_paths(const std::vector<std::vector<ParameterRef>>& groups,
                                                               const std::vector<std::string>& layer_names) {
  std::map<std::string, int> index;
  for (std::size_t l = 0; l < layer_names.size(); ++l)
    if (!index.emplace(layer_names[l], static_cast<int>(l)).second)
      throw UsageError("two layers are named '" + layer_names[l] + "': parameters given by path need unique layer names");
  auto known = [&] {
    std::string s;
    const std::size_t shown = std::min<std::size_t>(layer_names.size(), 12);
    for (std::size_t l = 0; l < shown; ++l) s += (l ? ", " : "") + layer_names[l];
    return s + (shown < layer_names.size() ? ", ... (" + std::to_string(layer_names.size()) + " layers)" : "");
  };
  std::vector<std::vector<ParameterRef>> out = groups;
  for (std::size_t g = 0; g < out.size(); ++g)
    for (ParameterRef& ref : out[g]) {
      if (ref.layer != ParameterRef::kByPath) continue;
      const std::string what = "tie group " + std::to_string(g) + " member '" + ref.name + "'";
      const auto dot = ref.name.find('.');
      if (dot == std::string::npos || dot == 0 || dot + 1 == ref.name.size())
        throw UsageError(what + " is not a path LAYER.PARAMETER (e.g. 'head.weight'): name the layer, then its parameter");
      const auto it = index.find(ref.name.substr(0, dot));
      if (it == index.end())
        throw UsageError(what + ": no layer is named '" + ref.name.substr(0, dot) + "'; the layers are: " + known());
      ref = ParameterRef{it->second, ref.name.substr(dot + 1)};
    }
  return out;
}

std::vector<int> choose_balance(const torch::nn::Sequential& model, int stages, const std::string& kind,
                                const std::string& solver) {
  return choose_balance(layer_type_names(model), layer_parameter_counts(model), stages, kind, solver);
}

std::vector<int> choose_balance(const std::vector<std::string>& types, const std::vector<double>& counts, int stages,
                                const std::string& kind, const std::string& solver) {
  const int layers = static_cast<int>(types.size());
  if (stages < 1) throw UsageError("stages must be >= 1, got " + std::to_string(stages));
  if (stages > layers)
    throw UsageError(std::to_string(stages) + " stages but the model has " + std::to_string(layers) +
                     " layers: use --stages <= " + std::to_string(layers));
  if (kind == "time" || kind == "memory")
    throw UsageError("balance '" + kind + "' needs a measured profile: pass --profile FILE (from pipetrain profile), "
                     "or let pipetrain train measure the model");
  // The static kinds through the plan layer, on a profile holding what the model tells without running.
  if (kind == "parameters" || kind.rfind("type:", 0) == 0 || (kind == "uniform" && solver != "min-max")) {
    Profile p;
    p.model = "model";
    for (int i = 0; i < layers; ++i) {
      LayerProfile l;
      l.name = std::to_string(i);
      l.type = types[static_cast<std::size_t>(i)];
      l.parameter_bytes = counts[static_cast<std::size_t>(i)];
      p.layers.push_back(l);
    }
    return plan_balance(p, stages, kind, parse_balance_solver(solver));
  }
  std::vector<int> balance;
  if (kind == "uniform") {
    balance = balance_uniform(layers, stages);
  } else if (!kind.empty() && std::isdigit(static_cast<unsigned char>(kind[0]))) {
    balance = parse_balance(kind);
    if (static_cast<int>(balance.size()) != stages)
      throw UsageError("balance " + kind + " lists " + std::to_string(balance.size()) + " stages but " +
                       std::to_string(stages) + " are needed: give one layer count per stage");
  } else {
    throw UsageError("unknown balance '" + kind +
                     "': use uniform, parameters, time, memory, type:REGEX, or layer counts such as 3,2,2");
  }
  check_balance(balance, layers);
  return balance;
}

Stage::Stage(const torch::nn::Sequential& layers, int first_layer)
    : Stage(layers, 0, static_cast<int>(layers->size())) {
  first_ = first_layer;
}

Stage::Stage(const torch::nn::Sequential& model, int first_layer, int num_layers)
    : first_(first_layer), count_(num_layers) {
  // AnyModule copies share the underlying module, so the stage trains the model's own parameters.
  auto it = model->begin() + first_layer;
  for (int i = first_layer; i < first_layer + num_layers; ++i, ++it) {
    slice_->push_back(std::to_string(i), *it);
    bundle_layers_.push_back(std::dynamic_pointer_cast<BundleModule>(it->ptr()));
  }
}

Bundle Stage::forward(Bundle b) {
  int k = 0;
  for (auto it = slice_->begin(); it != slice_->end(); ++it, ++k) {
    const auto& bundle_layer = bundle_layers_[static_cast<std::size_t>(k)];
    // A bundle layer takes the bundle itself; a shallow copy (the entries' handles) keeps what it got for
    // its errors.
    Bundle given;
    if (bundle_layer) given = b;
    auto context = [&] {
      const std::string layer = "layer " + std::to_string(first_ + k) + " (" + type_name_of(*it->ptr()) + ")";
      return layer + " on " + describe(bundle_layer ? given : b);
    };
    if (!bundle_layer && !b.has(kMainTensor))
      throw UsageError(context() + ": a one-tensor layer reads the entry \"" + std::string(kMainTensor) +
                       "\", which the bundle lacks; name the activation \"x\" or make the layer a BundleModule");
    try {
      if (bundle_layer)
        b = bundle_layer->forward(std::move(b));
      else
        b.set(kMainTensor, it->forward<torch::Tensor>(b.at(kMainTensor)));
    } catch (const c10::Error& e) {
      throw std::runtime_error(context() + ": " + e.what_without_backtrace());
    } catch (const UsageError& e) {  // e.g. an entry the layer reads that no one gave or added
      throw UsageError(context() + ": " + e.what());
    }
  }
  return b;
}

torch::Tensor Stage::forward(const torch::Tensor& input) { return forward(Bundle(input)).at(kMainTensor); }

std::vector<torch::Tensor> Stage::parameters() const { return slice_->parameters(); }

void Stage::to(const torch::Device& device) { slice_->to(device); }

void Stage::train(bool on) { slice_->train(on); }

std::shared_ptr<torch::nn::Module> Stage::layer(int k) const { return slice_->ptr(static_cast<std::size_t>(k)); }

std::vector<Stage> cut(const torch::nn::Sequential& model, const std::vector<int>& balance) {
  check_balance(balance, layer_count(model));
  std::vector<Stage> out;
  int at = 0;
  for (int n : balance) {
    out.emplace_back(model, at, n);
    at += n;
  }
  return out;
}

}  // namespace pipetrain

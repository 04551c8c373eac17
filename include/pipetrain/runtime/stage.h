// Stages: contiguous slices of a torch::nn::Sequential. The model is cut by a balance (layers per
// stage, plan/balance.h); stage s holds layers [offset_s, offset_s + n_s). A stage shares its modules
// (and so its parameters) with the model it was cut from.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pipetrain/runtime/bundle.h"
#include "pipetrain/runtime/loss.h"

namespace pipetrain {

// How each micro-batch's activations are kept between its forward and backward (torchgpipe's modes):
// Always recomputes every micro-batch's forward before its backward, ExceptLast all but the last one
// of each step (its backward follows at once, so recomputing it saves no memory), Never keeps them.
enum class Checkpoint { Always, ExceptLast, Never };
Checkpoint parse_checkpoint(const std::string& text);  // "always" | "except_last" | "never"
std::string to_string(Checkpoint c);

// LossFn, Loss: runtime/loss.h.

// Number of layers (top-level children) of a Sequential.
int layer_count(const torch::nn::Sequential& model);

// Trainable parameter count of each layer.
std::vector<double> layer_parameter_counts(const torch::nn::Sequential& model);

// Module type name of each layer, without namespace or "Impl" ("Linear", "Conv2d", "Block"): what
// balance kind type:REGEX matches and what profiles record.
std::vector<std::string> layer_type_names(const torch::nn::Sequential& model);

// The balance for `stages` stages from what the model itself tells: "uniform" (layer counts),
// "parameters" (parameter counts), "type:REGEX" (equal numbers of layers whose type matches, as
// DeepSpeed's partition_method), or a manual list "3,2,2"; parameters and type are solved by `solver`
// ("min-max", the optimal contiguous partition, or "block-partition", torchgpipe's heuristic). The
// measured kinds "time" and "memory" need a profile (plan/balance.h plan_balance): they are refused here
// with that fix. Throws UsageError with the numbers and the fix when the kind is unknown or the
// balance does not fit the model.
std::vector<int> choose_balance(const torch::nn::Sequential& model, int stages, const std::string& kind,
                                const std::string& solver = "min-max");
// The same from each layer's type name and trainable parameter count (a model given layer by layer,
// layers.h, whose layers are not all built here).
std::vector<int> choose_balance(const std::vector<std::string>& types, const std::vector<double>& counts, int stages,
                                const std::string& kind, const std::string& solver = "min-max");

// A parameter of the model: its layer (top-level child of the Sequential) and its name within that
// layer as named_parameters() gives it ("weight", "out.weight"). Tied weights name their members so:
// by index, {3, "weight"}, or by path, ParameterRef::path("head.weight"): parameter "weight" of the layer
// named "head" (its name in the Sequential, or LayerwiseModel::names; a layer given no name is named by
// its index, so "3.weight" is {3, "weight"}). A path stays valid when layers are added in front.
struct ParameterRef {
  static constexpr int kByPath = -1;  // `layer` of a ref given by path: `name` is the path
  int layer = 0;
  std::string name;
  static ParameterRef path(std::string layer_dot_parameter) { return {kByPath, std::move(layer_dot_parameter)}; }
};

// `groups` with every ref given by path turned into {layer index, parameter name}, given the model's
// layer names in order. Throws UsageError naming the path and the layers there are when a path has no
// '.', names no layer, or the names are not unique.
std::vector<std::vector<ParameterRef>> resolve_parameter_paths(const std::vector<std::vector<ParameterRef>>& groups,
                                                               const std::vector<std::string>& layer_names);

class Stage {
 public:
  Stage(const torch::nn::Sequential& model, int first_layer, int num_layers);
  // All of `layers`, which are the model's layers first_layer, first_layer + 1, ... (a rank that built
  // only its own layers, layers.h).
  Stage(const torch::nn::Sequential& layers, int first_layer);
  // Runs the stage's layers in order on a bundle (bundle.h: plain layers read and write "x",
  // BundleModules the whole bundle). A LibTorch error inside a layer comes back naming the layer, its
  // type and the bundle it got.
  Bundle forward(Bundle input);
  torch::Tensor forward(const torch::Tensor& input);  // the one-tensor form: forward(Bundle(x)).at("x")
  std::vector<torch::Tensor> parameters() const;
  // Moves the stage's modules (and so the model's parameters they share) to `device`.
  void to(const torch::Device& device);
  // Training mode on (dropout active, batch norm updates its statistics) or off (evaluation).
  void train(bool on);
  // The module of layer `first_layer() + k`.
  std::shared_ptr<torch::nn::Module> layer(int k) const;
  int first_layer() const { return first_; }
  int num_layers() const { return count_; }
  const torch::nn::Sequential& module() const { return slice_; }

 private:
  torch::nn::Sequential slice_;
  std::vector<std::shared_ptr<BundleModule>> bundle_layers_;  // per layer; null for a plain layer
  int first_;
  int count_;
};

// Cuts `model` into stages by `balance` (checked first: no layer is ever dropped or repeated).
std::vector<Stage> cut(const torch::nn::Sequential& model, const std::vector<int>& balance);

}  // namespace pipetrain

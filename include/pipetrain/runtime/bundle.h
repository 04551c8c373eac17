// Bundles: the named tensors that flow through a pipeline. A stage takes a bundle and returns one, so
// an activation can travel with an attention mask, position ids or anything else the later layers need.
//
// A layer is either
//   - a plain one-tensor module (Linear, Conv2d, the zoo's blocks): it reads the entry named "x"
//     (kMainTensor) and writes its result back under that name; every other entry passes it unchanged;
//   - a BundleModule: it maps the whole bundle to a bundle (reads a mask, adds or drops entries).
// A model whose every layer is plain is exactly today's single-tensor pipeline.
//
// At a stage boundary every entry of the bundle goes to the next stage (one message per transfer; with
// several entries they are packed into one buffer). Its dtype and shape are agreed at first use, as for
// a single tensor. Only entries that carry a gradient get one back: floating-point entries the stage
// computed, or received with a gradient and passed on. An entry that is the very tensor the stage got
// without a gradient (the user's mask or ids, passed along) never gets a gradient transfer, whatever
// its dtype.
//
// Inputs: every entry of the batch bundle given to train_step is cut along dimension 0 into the
// micro-batches, so each entry holds one row per sample (expand per-sequence data such as position ids
// to [N, ...]). A tensor loss receives the last stage's "x", a bundle loss (loss.h) its whole bundle.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace pipetrain {

// The entry a plain one-tensor layer reads and writes, and the one a tensor loss (loss.h) receives.
inline constexpr const char* kMainTensor = "x";

class Bundle {
 public:
  using Item = std::pair<std::string, torch::Tensor>;

  Bundle() = default;
  // The bundle of one tensor named "x" (implicit: a tensor goes wherever a bundle is expected).
  Bundle(torch::Tensor x);  // NOLINT(google-explicit-constructor)
  Bundle(std::initializer_list<Item> items);

  bool has(const std::string& name) const;
  // The entry `name`; throws UsageError naming the entries the bundle holds.
  const torch::Tensor& at(const std::string& name) const;
  // Adds `name`, or replaces it in place (its position in the bundle is kept).
  void set(const std::string& name, torch::Tensor t);
  // Removes `name` and returns it (undefined if absent).
  torch::Tensor take(const std::string& name);

  std::size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  std::vector<std::string> names() const;
  const std::vector<Item>& items() const { return items_; }
  std::vector<Item>& items() { return items_; }

  // Every entry's rows [begin, end) along dimension 0 (views).
  Bundle slice(int64_t begin, int64_t end) const;
  // Every entry moved to `device`.
  Bundle to(const torch::Device& device) const;

 private:
  std::vector<Item> items_;
};

// "{x: [8, 16] Float, mask: [8, 16] Bool}", for messages.
std::string describe(const Bundle& b);

// A layer that maps a bundle to a bundle. Derive from it and implement forward; push the module into
// the model's torch::nn::Sequential like any other layer (model->push_back(std::make_shared<Mine>())).
//
// Skip connections (torchgpipe's stash and pop): a layer that adds an entry for a later layer declares
// it in stashes(), the layer that takes it in pops(). When the two layers are more than one stage
// apart, the entry does not pass through the stages in between: the runtime sends it straight from the
// stashing stage to the popping one, and its gradient straight back (on one rank it is handed over in
// memory). Each name is stashed once and popped once, by a later layer; the pipeline's constructor
// refuses other declarations naming the layers. Such a route is a skip edge of the schedule the pipeline
// runs (PipelineRank::schedule), and the measured timeline shows its transfers (`0SF2@2`, `2RF2@0`).
class BundleModule : public torch::nn::Module {
 public:
  BundleModule() = default;  // named after the derived type, as any module
  explicit BundleModule(std::string name) : torch::nn::Module(std::move(name)) {}
  virtual Bundle forward(Bundle in) = 0;
  virtual std::vector<std::string> stashes() const { return {}; }
  virtual std::vector<std::string> pops() const { return {}; }
};

}  // namespace pipetrain

// Zero-bubble backward splitting for linear layers (docs/ALGORITHMS.md §4.4.1).
//
// pipetrain::nn::Linear is a drop-in for torch::nn::Linear (same parameters, same initialisation, same
// forward) whose backward can defer the weight gradient. While a WeightGradStore is active on the
// calling thread (WeightGradStore::Scope), the backward computes only dL/dX = dL/dY A and queues the
// pair (X, dL/dY); WeightGradStore::run() later computes dL/dA = dL/dY^T X and dL/db = sum dL/dY and
// accumulates them into the parameters' .grad. Without an active store the backward is the ordinary
// fused one. Modules without such a split (torch::nn::Linear, LayerNorm, embeddings, convolutions,
// attention, ...) get theirs through autograd instead (autograd_split.h): the executor's B asks autograd
// for the stage input's gradient only and queues on the same store the W that later computes the
// parameters' gradients from the kept graph.
//
// Thread use: a store belongs to one (stage, micro-batch) and is filled and run by one thread; the
// Scope is thread-local, so ranks running as threads do not see each other's stores.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace pipetrain {

class WeightGradStore {
 public:
  // Makes `store` the destination of deferred weight gradients on this thread until destroyed.
  class Scope {
   public:
    explicit Scope(WeightGradStore* store);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    WeightGradStore* previous_;
  };

  // The store active on this thread, or nullptr.
  static WeightGradStore* current();

  void push(std::function<void()> work) { work_.push_back(std::move(work)); }
  // Runs the queued weight-gradient computations in the order they were queued, then empties the store.
  void run();
  bool empty() const { return work_.empty(); }
  std::size_t size() const { return work_.size(); }
  // Set while a backward that asks autograd for input gradients only runs under this store (B through
  // autograd_split.h): split layers then queue their weight gradients although the engine does not ask
  // for them (it asks only for what leads to the stage input).
  bool queue_all() const { return queue_all_; }
  void set_queue_all(bool on) { queue_all_ = on; }

 private:
  std::vector<std::function<void()>> work_;
  bool queue_all_ = false;
};

namespace nn {

class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias = true);
  explicit LinearImpl(const torch::nn::LinearOptions& options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  torch::Tensor forward(const torch::Tensor& input);

  torch::nn::LinearOptions options;
  torch::Tensor weight;  // [out, in]
  torch::Tensor bias;    // [out] or undefined
};
TORCH_MODULE(Linear);

}  // namespace nn

// y = x A^T + b with a backward that defers dA and db to the active WeightGradStore, if any.
torch::Tensor split_linear(const torch::Tensor& input, const torch::Tensor& weight, const torch::Tensor& bias);

// Whether `node` is the backward of split_linear (whose weight gradients the store takes).
bool is_split_linear_node(const torch::autograd::Node& node);

}  // namespace pipetrain

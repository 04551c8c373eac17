// Zero-bubble backward splitting for linear layers (docs/ALGORITHMS.md §4.4.1).
//
// pipetrain::nn::Linear is a drop-in for torch::nn::Linear (same parameters, same initialisation, same
// forward) whose backward can defer the weight gradient. While a WeightGradStore is active on the
// calling thread (WeightGradStore::Scope), the backward computes only dL/dX = dL/dY A and queues the
// pair (X, dL/dY); WeightGradStore::run() later computes dL/dA = dL/dY^T X and dL/db = sum dL/dY and
// accumulates them into the parameters' .grad. Without an active store the backward is the ordinary
// fused one. Modules that are not split (LayerNorm, embeddings, convolutions, ...) always compute their
// weight gradients during B, so a stage made of them runs a full backward in B and an empty W.
//
// Thread use: a store belongs to one (stage, micro-batch) and is filled and run by one thread; the
// Scope is thread-local, so ranks running as threads do not see each other's stores.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <vector>

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

 private:
  std::vector<std::function<void()>> work_;
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

}  // namespace pipetrain

// The loss of a pipeline: what the last stage computes from its output and the target, and how the
// micro-batches' losses make the mini-batch's.
//
// Two signatures, either passed wherever a pipeline takes its loss (PipelineRank, LocalPipeline):
//   - a tensor loss  (const torch::Tensor& output, const torch::Tensor& target) -> torch::Tensor
//     (LossFn): the last stage's "x" and the target bundle's "x" (a target tensor is the bundle {x});
//   - a bundle loss  (const Bundle& output, const Bundle& target) -> LossTerm (or a torch::Tensor):
//     the last stage's whole output bundle (a padding mask that travelled with the activations, a second
//     output) and the micro-batch's rows of every entry of the target bundle (several targets).
//
// Two normalisations over the micro-batches of a mini-batch of N samples:
//   - Sample (the default): the loss returns the mean over its micro-batch of b_k samples and is
//     weighted by b_k / N, so the step's loss and gradient are the full batch's for any split when the
//     loss is a mean over samples.
//   - Token (Loss::per_token): the loss returns LossTerm{sum, count}: the sum of its per-unit losses
//     (tokens, say) and how many units it summed (the tokens that are not padding). The step's loss is
//     the sum of the sums over the sum of the counts, and its gradient that of the same quotient: the
//     full batch's mean per token, exact for any split and any lengths, where the b_k / N weighting of
//     per-micro-batch token means is not (micro-batches of one size hold different numbers of tokens).
//     The counts are summed over the pipeline (and data-parallel copies) at the flush, and the
//     gradients divided by the total before the global norm, clipping and the step. A mini-batch
//     without any unit counts 1 (loss and gradients then stay the zero sums). Synchronous schedules,
//     and pipedream/spectrain (one micro-batch per step, divided at once); not 2bw or UMPIPE.
//
//   auto loss = pipetrain::Loss::per_token([](const pipetrain::Bundle& out, const pipetrain::Bundle& target) {
//     const torch::Tensor mask = out.at("mask");                      // [B, T], travelled with x
//     torch::Tensor nll = torch::nn::functional::cross_entropy(out.at("x").flatten(0, 1),
//         target.at("y").flatten(), torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
//     return pipetrain::LossTerm(nll.masked_select(mask.flatten()).sum(), mask.sum());
//   });
//
// Evaluation (evaluate) combines the micro-batches the same way: a bundle or per-token loss is computed
// per micro-batch; a tensor loss with Sample normalisation on the whole batch's "x" at once, as before.
#pragma once

#include <torch/types.h>

#include <functional>
#include <type_traits>
#include <utility>

#include "pipetrain/runtime/bundle.h"

namespace pipetrain {

// Loss of one micro-batch from the last stage's "x" and the target: the mean over its samples
// (pipetrain scales it by b_k / N).
using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

enum class LossNormalization {
  Sample,  // means per micro-batch, weighted by b_k / N
  Token,   // (sum, count) per micro-batch; the step's loss is sum of sums / sum of counts
};

// What a loss returns for one micro-batch: a one-element tensor (with its graph) and, for per-token
// normalisation, the number of units it sums over. A torch::Tensor converts to a LossTerm without a
// count (a mean).
struct LossTerm {
  torch::Tensor value;
  double count = -1;  // < 0: none given

  LossTerm() = default;
  LossTerm(torch::Tensor mean) : value(std::move(mean)) {}  // NOLINT(google-explicit-constructor)
  // A sum and its count: a number, or a one-element tensor such as mask.sum().
  LossTerm(torch::Tensor sum, const torch::Tensor& count);
  template <class N, std::enable_if_t<std::is_arithmetic<N>::value, int> = 0>
  LossTerm(torch::Tensor sum, N n) : value(std::move(sum)), count(static_cast<double>(n)) {}
  bool has_count() const { return count >= 0; }
};

class Loss {
 public:
  using BundleFn = std::function<LossTerm(const Bundle& output, const Bundle& target)>;

  Loss() = default;
  // A tensor loss (LossFn and anything callable so) or a bundle loss, Sample normalisation. A callable
  // that takes Bundles is a bundle loss (a Bundle converts from a tensor, so it is asked first); one
  // that takes only tensors is a tensor loss. Generic lambdas (auto parameters) must name their types.
  template <class F, std::enable_if_t<!std::is_same<std::decay_t<F>, Loss>::value, int> = 0>
  Loss(F f) {  // NOLINT(google-explicit-constructor)
    if constexpr (std::is_invocable<F&, const Bundle&, const Bundle&>::value) {
      fn_ = BundleFn(std::move(f));
    } else {
      static_assert(std::is_invocable<F&, const torch::Tensor&, const torch::Tensor&>::value,
                    "a loss takes (const torch::Tensor&, const torch::Tensor&) or (const Bundle&, const Bundle&)");
      using R = std::invoke_result_t<F&, const torch::Tensor&, const torch::Tensor&>;
      if constexpr (std::is_convertible<R, torch::Tensor>::value) tensor_ = LossFn(f);
      fn_ = [f = std::move(f)](const Bundle& out, const Bundle& target) mutable -> LossTerm {
        return f(out.at(kMainTensor), target.at(kMainTensor));
      };
    }
  }
  // Per-token normalisation (file comment): `f`, of either signature, returns LossTerm{sum, count}.
  template <class F>
  static Loss per_token(F f) {
    Loss l(std::move(f));
    l.normalization_ = LossNormalization::Token;
    return l;
  }

  // The term of one micro-batch, checked: one value, and a count exactly when normalised per token.
  // Throws UsageError naming the micro-batch and the fix.
  LossTerm operator()(const Bundle& output, const Bundle& target, int micro) const;
  LossNormalization normalization() const { return normalization_; }
  bool defined() const { return static_cast<bool>(fn_); }
  // The tensor loss this was made from (Sample normalisation), or an empty function for a bundle loss.
  const LossFn& tensor_loss() const { return tensor_; }

 private:
  BundleFn fn_;
  LossFn tensor_;
  LossNormalization normalization_ = LossNormalization::Sample;
};

// The message for an exception `e` thrown by a loss function on `output` and `target` (micro-batch
// `micro`, or -1: the whole batch): what it got, and LibTorch's message without its backtrace.
std::string loss_failure(const std::exception& e, const Bundle& output, const Bundle& target, int micro);

}  // namespace pipetrain

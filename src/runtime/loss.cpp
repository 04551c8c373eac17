#include "pipetrain/runtime/loss.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "pipetrain/core/error.h"

namespace pipetrain {

LossTerm::LossTerm(torch::Tensor sum, const torch::Tensor& n) : value(std::move(sum)) {
  if (!n.defined() || n.numel() != 1)
    throw UsageError("a loss term's count must be one number (e.g. mask.sum()), got " +
                     (n.defined() ? std::to_string(n.numel()) + " values" : std::string("an undefined tensor")));
  count = n.item<double>();
}

std::string loss_failure(const std::exception& e, const Bundle& output, const Bundle& target, int micro) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
  return "the loss function failed on " + (micro >= 0 ? "micro-batch " + std::to_string(micro) : std::string("the batch")) +
         ", output " + describe(output) + ", target " + describe(target) + ": " +
         (torch_error ? torch_error->what_without_backtrace() : e.what());
}

LossTerm Loss::operator()(const Bundle& output, const Bundle& target, int micro) const {
  if (!fn_) throw UsageError("the pipeline has no loss function: pass one to its constructor");
  LossTerm t;
  try {
    t = fn_(output, target);
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {  // what it got, without LibTorch's backtrace
    throw std::runtime_error(loss_failure(e, output, target, micro));
  }
  const std::string where = "the loss function returned ";
  const std::string mb = " for micro-batch " + std::to_string(micro);
  if (!t.value.defined()) throw UsageError(where + "an undefined tensor" + mb + ": return a one-element tensor");
  if (t.value.numel() != 1)
    throw UsageError(where + std::to_string(t.value.numel()) + " values" + mb + ": it must return one (" +
                     (normalization_ == LossNormalization::Token ? "the sum over the micro-batch's tokens" : "the mean over the micro-batch") + ")");
  if (normalization_ == LossNormalization::Token) {
    if (!t.has_count())
      throw UsageError(where + "no count" + mb + ", but it normalises per token (Loss::per_token): return " +
                       "LossTerm(sum, count), the sum of the per-token losses and how many tokens it sums");
    if (!std::isfinite(t.count))
      throw UsageError(where + "the count " + std::to_string(t.count) + mb + ": a count is a finite number >= 0");
  } else if (t.has_count()) {
    throw UsageError(where + "a count (" + std::to_string(t.count) + ")" + mb + " but the loss is normalised per " +
                     "sample: wrap it in Loss::per_token to divide by the mini-batch's total count, or return the mean");
  }
  return t;
}

}  // namespace pipetrain

#include "pipetrain/runtime/verify.h"

#include <torch/torch.h>

#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pipetrain/core/error.h"
#include "torch_compat.h"

namespace pipetrain {

VerifyResult verify_transparency(const std::function<torch::nn::Sequential()>& factory, const Loss& loss,
                                 const std::shared_ptr<Transport>& transport, PipelineOptions options,
                                 const torch::Tensor& input, const torch::Tensor& target) {
  return verify_transparency(factory, loss, transport, std::move(options), Bundle(input), Bundle(target), input.size(0));
}

VerifyResult verify_transparency(const std::function<torch::nn::Sequential()>& factory, const Loss& loss,
                                 const std::shared_ptr<Transport>& transport, PipelineOptions options,
                                 const Bundle& input, const torch::Tensor& target, int64_t batch_size) {
  return verify_transparency(factory, loss, transport, std::move(options), input, Bundle(target), batch_size);
}

VerifyResult verify_transparency(const std::function<torch::nn::Sequential()>& factory, const Loss& loss,
                                 const std::shared_ptr<Transport>& transport, PipelineOptions options,
                                 const Bundle& input, const Bundle& target, int64_t batch_size) {
  const int64_t n = batch_size;
  // Data parallelism across pipelines (options.data_parallel): copy k of the pipeline trains on the k-th
  // of R equal shares of the batch, as `pipetrain train --replicas R` does, and the reference is plain
  // accumulation over the whole batch (each share's micro-batches in turn), which the averaged gradients
  // must equal.
  const int copies = options.data_parallel ? options.data_parallel->world_size() : 1;
  const int copy = copies > 1 ? options.data_parallel->rank() : 0;
  if (n % copies != 0)
    throw UsageError("a batch of " + std::to_string(n) + " samples does not split into " + std::to_string(copies) +
                     " equal shares, one per copy of the pipeline: give a batch size that is a multiple of " +
                     std::to_string(copies));
  const int64_t share = n / copies;
  // Pipelined step: capture this rank's gradients, by parameter name, before the optimizer touches them.
  torch::nn::Sequential model = factory();
  std::map<const void*, std::string> names;
  for (const auto& item : model->named_parameters()) names[item.value().unsafeGetTensorImpl()] = item.key();
  std::map<std::string, torch::Tensor> grads;
  options.on_gradients = [&](int, const std::vector<torch::Tensor>& params) {
    for (const auto& p : params)
      if (p.grad().defined()) grads[names.at(p.unsafeGetTensorImpl())] = p.grad().clone();
  };
  options.optimizer.clip_grad_norm = 0;
  PipelineRank rank(model, loss, transport, options);
  const StepStats stats = copies > 1 ? rank.train_step(input.slice(copy * share, (copy + 1) * share),
                                                       target.slice(copy * share, (copy + 1) * share), share)
                                     : rank.train_step(input, target, n);

  // Plain accumulation over the same micro-batches, with the forward RNG left alone (use models without
  // dropout for an exact comparison).
  // The reference runs on the pipeline's device, so that both sides use the same kernels (a GPU's
  // convolutions and reductions round differently from the CPU's).
  torch::nn::Sequential ref = factory();
  ref->to(options.device);
  const Bundle ref_input = input.to(options.device);
  const Bundle ref_target = target.to(options.device);
  Stage whole(ref, 0, layer_count(ref));  // plain layers on "x", BundleModules on the bundle
  double ref_loss = 0;
  const bool bf16 = options.precision == "bf16";  // the reference under the same autocast, its loss in float32
  const bool per_token = loss.normalization() == LossNormalization::Token;
  std::vector<LossTerm> terms;  // per token: every micro-batch's sum, divided by the total count at the end
  int micro = 0;
  std::vector<std::pair<int64_t, int64_t>> micro_batches;  // the pipeline's, of every copy in turn
  for (int k = 0; k < copies; ++k)
    for (const auto& [b, e] : split_equal(share, options.microbatches))
      micro_batches.emplace_back(k * share + b, k * share + e);
  for (const auto& [b, e] : micro_batches) {
    Bundle out;
    {
      const compat::AutocastGuard autocast(options.device.type(),
                                           bf16 ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt);
      out = whole.forward(ref_input.slice(b, e));
    }
    if (bf16)
      for (auto& [name, t] : out.items())
        if (t.defined() && t.is_floating_point() && t.scalar_type() != torch::kDouble) t = t.to(torch::kFloat);
    LossTerm term = loss(out, ref_target.slice(b, e), micro++);
    if (per_token) {
      terms.push_back(std::move(term));
      continue;
    }
    torch::Tensor l = term.value.reshape({}) * (static_cast<double>(e - b) / static_cast<double>(n));
    l.backward();
    ref_loss += l.item<double>();
  }
  if (per_token) {
    double count = 0;
    for (const LossTerm& t : terms) count += t.count;
    for (const LossTerm& t : terms) {
      torch::Tensor l = t.value.reshape({}) / std::max(count, 1.0);
      l.backward();
      ref_loss += l.item<double>();
    }
  }
  double err = 0;
  std::size_t compared = 0;
  for (const auto& item : ref->named_parameters()) {
    auto it = grads.find(item.key());
    if (it == grads.end()) continue;
    const torch::Tensor want = item.value().grad().to(torch::kCPU, torch::kDouble);
    const double scale = want.abs().max().item<double>() + 1e-12;
    err = std::max(err, (it->second.to(torch::kCPU, torch::kDouble) - want).abs().max().item<double>() / scale);
    ++compared;
  }
  // Every trainable parameter this rank holds must have been compared: a missing gradient is a failure.
  std::size_t held = 0;
  for (const auto& p : rank.parameters()) held += p.requires_grad();
  if (compared != grads.size() || grads.size() != held) err = std::numeric_limits<double>::infinity();
  // Every rank learns the worst error of all.
  const int p = transport->world_size();
  torch::Tensor all = torch::zeros({p}, torch::kDouble);
  all[transport->rank()] = err;
  transport->all_reduce_sum(all);
  double worst = all.max().item<double>();
  if (copies > 1) {  // and the worst of every copy
    torch::Tensor each = torch::zeros({copies}, torch::kDouble);
    each[copy] = worst;
    options.data_parallel->all_reduce_sum(each);
    worst = each.max().item<double>();
  }
  VerifyResult r;
  r.pipeline_loss = stats.loss;
  r.reference_loss = ref_loss;
  r.max_grad_error = worst;
  r.loss_error = std::abs(stats.loss - ref_loss) / std::max(std::abs(ref_loss), 1e-12);
  return r;
}

}  // namespace pipetrain

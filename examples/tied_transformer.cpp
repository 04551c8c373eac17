// A small transformer of your own with tied input and output embeddings, a padding mask and a loss
// normalised per token, pipelined over 2 stages. Sequences have different lengths: each batch is padded, the mask travels with the
// activations (a bundle of named tensors, pipetrain/runtime/bundle.h), and the first layer trims every
// micro-batch to its longest sequence, so shapes change between micro-batches (variable_shapes).
#include <torch/torch.h>

#include <iostream>

#include "pipetrain/runtime/executor.h"

constexpr int64_t kVocab = 16, kWidth = 32, kMaxLen = 12;

// ids [n, T] + mask [n, T] -> x [n, L, C], mask [n, L]: L is this micro-batch's longest sequence.
struct Embed : pipetrain::BundleModule {
  torch::Tensor tokens = register_parameter("tokens", torch::randn({kVocab, kWidth}) * 0.1);
  torch::Tensor positions = register_parameter("positions", torch::randn({kMaxLen, kWidth}) * 0.1);
  pipetrain::Bundle forward(pipetrain::Bundle in) override {
    const int64_t len = in.at("mask").sum(1).max().item<int64_t>();
    const torch::Tensor ids = in.at("x").slice(1, 0, len);
    in.set("mask", in.at("mask").slice(1, 0, len));
    in.set("x", tokens.index_select(0, ids.reshape(-1)).view({ids.size(0), len, kWidth}) + positions.slice(0, 0, len));
    return in;
  }
};

// Pre-norm self-attention + MLP; a position attends to earlier, non-padding positions.
struct Block : pipetrain::BundleModule {
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::MultiheadAttention attn{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  Block() {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    attn = register_module("attn", torch::nn::MultiheadAttention(kWidth, 4));
    fc1 = register_module("fc1", torch::nn::Linear(kWidth, 4 * kWidth));
    fc2 = register_module("fc2", torch::nn::Linear(4 * kWidth, kWidth));
  }
  pipetrain::Bundle forward(pipetrain::Bundle in) override {
    const torch::Tensor x = in.at("x"), mask = in.at("mask");
    const int64_t len = x.size(1);
    const torch::Tensor causal = torch::ones({len, len}, torch::kBool).triu(1);
    const torch::Tensor h = ln1(x).transpose(0, 1);  // [L, n, C], MultiheadAttention's layout
    const torch::Tensor a = std::get<0>(attn(h, h, h, /*key_padding_mask=*/~mask, /*need_weights=*/false, causal));
    const torch::Tensor y = x + a.transpose(0, 1);
    in.set("x", y + fc2(torch::gelu(fc1(ln2(y)))));
    return in;
  }
};

// logits = x W^T with W [vocab, C]: its own copy, tied to the embedding by PipelineOptions::tied.
struct Head : torch::nn::Module {
  torch::Tensor weight = register_parameter("weight", torch::zeros({kVocab, kWidth}));
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(weight.t()); }
};

int main() {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  model->push_back(std::make_shared<Embed>());
  model->push_back(std::make_shared<Block>());
  model->push_back(std::make_shared<Block>());
  model->push_back(std::make_shared<Head>());

  pipetrain::PipelineOptions options;
  options.schedule = "1f1b";
  options.microbatches = 4;
  options.optimizer.name = "adam";
  options.optimizer.lr = 3e-3;
  options.tied = {{{0, "tokens"}, {3, "weight"}}};  // the head starts as (and stays) the embedding
  options.variable_shapes = true;                   // sequence lengths differ between micro-batches
  // Next-token loss per token: each micro-batch returns the sum of its tokens' losses and how many tokens
  // it has, and the step's loss is the sum over the mini-batch divided by its token count. (A mean per
  // micro-batch, weighted by micro-batch size, would weigh a token in a micro-batch of short sequences
  // more than one among long sequences.) The target is a bundle: the next token, and whether there is one.
  auto loss = pipetrain::Loss::per_token([](const pipetrain::Bundle& out, const pipetrain::Bundle& target) {
    const torch::Tensor logits = out.at("x");  // [n, L, vocab], L = this micro-batch's longest sequence
    const int64_t len = logits.size(1);
    const torch::Tensor next = target.at("next").slice(1, 0, len).reshape(-1);
    const torch::Tensor real = target.at("has_next").slice(1, 0, len).reshape(-1);
    const torch::Tensor nll = torch::nn::functional::cross_entropy(
        logits.reshape({-1, kVocab}), next, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    return pipetrain::LossTerm(nll.masked_select(real).sum(), real.sum());
  });
  pipetrain::LocalPipeline pipeline(model, loss, /*stages=*/2, options);

  // Task: count up modulo the vocabulary from a random start, in sequences of 4 to 12 tokens.
  double first = 0, last = 0;
  for (int step = 0; step < 150; ++step) {
    const torch::Tensor start = torch::randint(kVocab, {32, 1});
    const torch::Tensor len = torch::randint(4, kMaxLen + 1, {32, 1});
    const torch::Tensor pos = torch::arange(kMaxLen + 1).unsqueeze(0);
    const torch::Tensor seq = (start + pos) % kVocab;
    const torch::Tensor mask = pos.slice(1, 0, kMaxLen) < len;
    const pipetrain::Bundle target{{"next", seq.slice(1, 1)}, {"has_next", pos.slice(1, 1) < len}};
    last = pipeline.train_steps(pipetrain::Bundle{{"x", seq.slice(1, 0, kMaxLen)}, {"mask", mask}}, target, 32, 1).loss;
    if (step == 0) first = last;
    if (step % 50 == 0) std::cout << "step " << step << " loss " << last << "\n";
  }
  const bool tied = torch::equal(model->ptr(0)->named_parameters()["tokens"], model->ptr(3)->named_parameters()["weight"]);
  std::cout << "loss " << first << " -> " << last << "; tied copies equal: " << (tied ? "yes" : "no") << "\n";
  return last < first / 4 && tied ? 0 : 1;
}

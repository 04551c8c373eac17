// Models as torch::nn::Sequential of blocks, so a balance can cut them anywhere between blocks.
// Linear layers inside use pipetrain::nn::Linear, so zero-bubble schedules split their backward.
//
//   mlp  Flatten, then `layers` blocks of Linear(+ReLU), the last one to `classes` outputs.
//   gpt  character/token language model: [Embedding(tokens + positions)] [Block]*N [LayerNorm + Head].
//        Each block is pre-norm: x + Attention(LN(x)), x + MLP(LN(x)), causal self-attention with
//        `heads` heads. The first and last layers carry the vocabulary (vocab x d_model parameters each)
//        and the head's logits, so they are heavier than a middle block, as in real language models.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <string>

namespace pipetrain::zoo {

struct MlpConfig {
  int64_t inputs = 784;   // input features (images are flattened)
  int64_t hidden = 256;   // width of the hidden layers
  int64_t classes = 10;   // outputs
  int layers = 4;         // Linear layers (>= 1); each is one pipeline layer
};
torch::nn::Sequential make_mlp(const MlpConfig& c);

struct GptConfig {
  int64_t vocab = 96;       // tokens
  int64_t seq_len = 64;     // context length T
  int64_t d_model = 128;    // width C
  int64_t heads = 4;        // attention heads (d_model % heads == 0)
  int layers = 4;           // transformer blocks; the model has layers + 2 pipeline layers
  double dropout = 0.0;     // attention and residual dropout
};
torch::nn::Sequential make_gpt(const GptConfig& c);

// Mean cross entropy of logits [B, T, V] against targets [B, T] (or [B, V] against [B]).
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target);

// Throws UsageError naming the bad value and the fix.
void check(const MlpConfig& c);
void check(const GptConfig& c);

}  // namespace pipetrain::zoo

#include "pipetrain/zoo/models.h"

#include <torch/torch.h>

#include <cmath>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/split_linear.h"

namespace pipetrain::zoo {
namespace {

class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(const GptConfig& c)
      : tokens(register_module("tokens", torch::nn::Embedding(c.vocab, c.d_model))),
        positions(register_module("positions", torch::nn::Embedding(c.seq_len, c.d_model))),
        drop(register_module("drop", torch::nn::Dropout(c.dropout))),
        seq_len(c.seq_len) {}
  torch::Tensor forward(const torch::Tensor& idx) {
    const int64_t t = idx.size(1);
    if (t > seq_len)
      throw UsageError("sequence of " + std::to_string(t) + " tokens is longer than the model's context of " +
                       std::to_string(seq_len) + ": use --seq-len >= " + std::to_string(t));
    torch::Tensor pos = torch::arange(t, torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
    return drop(tokens(idx) + positions(pos).unsqueeze(0));
  }
  torch::nn::Embedding tokens, positions;
  torch::nn::Dropout drop;
  int64_t seq_len;
};
TORCH_MODULE(Embedding);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GptConfig& c)
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})))),
        qkv(register_module("qkv", nn::Linear(c.d_model, 3 * c.d_model))),
        proj(register_module("proj", nn::Linear(c.d_model, c.d_model))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})))),
        fc1(register_module("fc1", nn::Linear(c.d_model, 4 * c.d_model))),
        fc2(register_module("fc2", nn::Linear(4 * c.d_model, c.d_model))),
        attn_drop(register_module("attn_drop", torch::nn::Dropout(c.dropout))),
        resid_drop(register_module("resid_drop", torch::nn::Dropout(c.dropout))),
        heads(c.heads) {}

  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2), hd = c / heads;
    auto parts = qkv(ln1(x)).split(c, 2);
    auto shape = [&](const torch::Tensor& y) { return y.view({b, t, heads, hd}).transpose(1, 2); };
    torch::Tensor q = shape(parts[0]), k = shape(parts[1]), v = shape(parts[2]);
    torch::Tensor att = q.matmul(k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
    torch::Tensor mask = torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
    att = attn_drop(torch::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1));
    torch::Tensor y = att.matmul(v).transpose(1, 2).contiguous().view({b, t, c});
    torch::Tensor h = x + resid_drop(proj(y));
    return h + resid_drop(fc2(torch::gelu(fc1(ln2(h)))));
  }
  torch::nn::LayerNorm ln1;
  nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  nn::Linear fc1, fc2;
  torch::nn::Dropout attn_drop, resid_drop;
  int64_t heads;
};
TORCH_MODULE(Block);

class HeadImpl : public torch::nn::Module {
 public:
  explicit HeadImpl(const GptConfig& c)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})))),
        out(register_module("out", nn::Linear(c.d_model, c.vocab, /*bias=*/false))) {}
  torch::Tensor forward(const torch::Tensor& x) { return out(ln(x)); }
  torch::nn::LayerNorm ln;
  nn::Linear out;
};
TORCH_MODULE(Head);

class LinearReluImpl : public torch::nn::Module {
 public:
  LinearReluImpl(int64_t in, int64_t out, bool relu, bool flatten)
      : fc(register_module("fc", nn::Linear(in, out))), relu(relu), flatten(flatten) {}
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = fc(flatten ? x.flatten(1) : x);
    return relu ? torch::relu(y) : y;
  }
  nn::Linear fc;
  bool relu, flatten;
};
TORCH_MODULE(LinearRelu);

void positive(int64_t v, const char* flag) {
  if (v < 1) throw UsageError(std::string(flag) + " must be >= 1, got " + std::to_string(v));
}

}  // namespace

void check(const MlpConfig& c) {
  positive(c.inputs, "mlp inputs");
  positive(c.hidden, "--hidden");
  positive(c.classes, "mlp classes");
  positive(c.layers, "--layers");
}

void check(const GptConfig& c) {
  positive(c.vocab, "--vocab");
  positive(c.seq_len, "--seq-len");
  positive(c.d_model, "--d-model");
  positive(c.heads, "--heads");
  positive(c.layers, "--layers");
  if (c.d_model % c.heads != 0)
    throw UsageError("--d-model " + std::to_string(c.d_model) + " is not divisible by --heads " +
                     std::to_string(c.heads) + ": choose heads that divide the width");
  if (!(c.dropout >= 0 && c.dropout < 1))
    throw UsageError("--dropout " + std::to_string(c.dropout) + " must lie in [0, 1)");
}

torch::nn::Sequential make_mlp(const MlpConfig& c) {
  check(c);
  torch::nn::Sequential m;
  for (int l = 0; l < c.layers; ++l) {
    const int64_t in = l == 0 ? c.inputs : c.hidden;
    const int64_t out = l == c.layers - 1 ? c.classes : c.hidden;
    m->push_back("fc" + std::to_string(l), LinearRelu(in, out, l != c.layers - 1, l == 0));
  }
  return m;
}

torch::nn::Sequential make_gpt(const GptConfig& c) {
  check(c);
  torch::nn::Sequential m;
  m->push_back("embed", Embedding(c));
  for (int l = 0; l < c.layers; ++l) m->push_back("block" + std::to_string(l), Block(c));
  m->push_back("head", Head(c));
  return m;
}

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
}

}  // namespace pipetrain::zoo

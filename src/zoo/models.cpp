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

  torch::Tensor forward(const torch::Tensor& x) { return attend(x, torch::Tensor()); }
  // `real` (bool [B, T], optional): keys that are padding are masked too, besides the causal mask.
  torch::Tensor attend(const torch::Tensor& x, const torch::Tensor& real) {
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2), hd = c / heads;
    auto parts = qkv(ln1(x)).split(c, 2);
    auto shape = [&](const torch::Tensor& y) { return y.view({b, t, heads, hd}).transpose(1, 2); };
    torch::Tensor q = shape(parts[0]), k = shape(parts[1]), v = shape(parts[2]);
    torch::Tensor att = q.matmul(k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
    torch::Tensor mask = torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
    if (real.defined()) mask = (mask.unsqueeze(0) | ~real.unsqueeze(1)).unsqueeze(1);  // [B, 1, T, T]
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

// The variable-length GPT's layers (GptConfig::variable_length): bundles of the activation "x" and the
// padding mask "mask" (true on real tokens). The embedding trims a micro-batch to its longest sample.
class MaskedEmbeddingImpl : public BundleModule {
 public:
  explicit MaskedEmbeddingImpl(const GptConfig& c) : embed(register_module("embed", Embedding(c))) {}
  Bundle forward(Bundle b) override {
    torch::Tensor ids = b.at(kMainTensor);
    if (b.has("mask")) {
      const int64_t len = std::max<int64_t>(1, b.at("mask").sum(1).max().item<int64_t>());
      ids = ids.slice(1, 0, len);
      b.set("mask", b.at("mask").slice(1, 0, len));
    }
    b.set(kMainTensor, embed(ids));
    return b;
  }
  Embedding embed;
};

class MaskedBlockImpl : public BundleModule {
 public:
  explicit MaskedBlockImpl(const GptConfig& c) : block(register_module("block", Block(c))) {}
  Bundle forward(Bundle b) override {
    b.set(kMainTensor, block->attend(b.at(kMainTensor), b.has("mask") ? b.at("mask") : torch::Tensor()));
    return b;
  }
  Block block;
};

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

// One VGG conv layer: Conv 3x3 (padding 1) + ReLU, then nothing, a 2x2 max pool, or a global max pool.
enum class Pool { kNone, kMax2, kGlobalMax };

class ConvReluImpl : public torch::nn::Module {
 public:
  ConvReluImpl(int64_t in, int64_t out, Pool pool)
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)))), pool(pool) {
    torch::nn::init::kaiming_normal_(conv->weight, 0.0, torch::kFanOut, torch::kReLU);
    torch::nn::init::zeros_(conv->bias);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = torch::relu(conv(x));
    if (pool == Pool::kMax2) return torch::max_pool2d(y, 2);
    if (pool == Pool::kGlobalMax) return y.amax({2, 3}, /*keepdim=*/true);
    return y;
  }
  torch::nn::Conv2d conv;
  Pool pool;
};
TORCH_MODULE(ConvRelu);

torch::nn::Conv2d resnet_conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
  torch::nn::init::kaiming_normal_(conv->weight, 0.0, torch::kFanOut, torch::kReLU);
  return conv;
}

class StemImpl : public torch::nn::Module {
 public:
  StemImpl(int64_t in, int64_t out)
      : conv(register_module("conv", resnet_conv(in, out, 3, 1))),
        bn(register_module("bn", torch::nn::BatchNorm2d(out))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(bn(conv(x))); }
  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
};
TORCH_MODULE(Stem);

// relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)); the shortcut projects (1x1 conv + BatchNorm) only
// when the block changes the channels or the resolution.
class ResidualBlockImpl : public torch::nn::Module {
 public:
  ResidualBlockImpl(int64_t in, int64_t out, int64_t stride)
      : conv1(register_module("conv1", resnet_conv(in, out, 3, stride))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(out))),
        conv2(register_module("conv2", resnet_conv(out, out, 3, 1))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(out))) {
    if (in != out || stride != 1) {
      shortcut_conv = register_module("shortcut_conv", resnet_conv(in, out, 1, stride));
      shortcut_bn = register_module("shortcut_bn", torch::nn::BatchNorm2d(out));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = bn2(conv2(torch::relu(bn1(conv1(x)))));
    return torch::relu(y + (shortcut_conv ? shortcut_bn(shortcut_conv(x)) : x));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Conv2d shortcut_conv{nullptr};
  torch::nn::BatchNorm2d shortcut_bn{nullptr};
};
TORCH_MODULE(ResidualBlock);

class PoolHeadImpl : public torch::nn::Module {
 public:
  PoolHeadImpl(int64_t in, int64_t classes) : fc(register_module("fc", nn::Linear(in, classes))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc(x.mean({2, 3})); }
  nn::Linear fc;
};
TORCH_MODULE(PoolHead);

// U-Net levels (make_unet): a down layer stashes its features as skip k before pooling; the up layer of
// the same level pops it.
std::string skip_name(int k) { return "unet_skip" + std::to_string(k); }

torch::nn::Conv2d unet_conv(int64_t in, int64_t out) {
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(in, out, 3).padding(1));
  torch::nn::init::kaiming_normal_(conv->weight, 0.0, torch::kFanOut, torch::kReLU);
  torch::nn::init::zeros_(conv->bias);
  return conv;
}

class UNetDownImpl : public BundleModule {
 public:
  UNetDownImpl(int64_t in, int64_t out, int level) : conv(register_module("conv", unet_conv(in, out))), level(level) {}
  Bundle forward(Bundle b) override {
    torch::Tensor y = torch::relu(conv(b.at(kMainTensor)));
    b.set(skip_name(level), y);
    b.set(kMainTensor, torch::max_pool2d(y, 2));
    return b;
  }
  std::vector<std::string> stashes() const override { return {skip_name(level)}; }
  torch::nn::Conv2d conv;
  int level;
};

class UNetUpImpl : public BundleModule {
 public:
  UNetUpImpl(int64_t in, int64_t out, int level) : conv(register_module("conv", unet_conv(in, out))), level(level) {}
  Bundle forward(Bundle b) override {
    const torch::Tensor skip = b.take(skip_name(level));
    torch::Tensor up = torch::upsample_nearest2d(b.at(kMainTensor), {skip.size(2), skip.size(3)});
    b.set(kMainTensor, torch::relu(conv(torch::cat({up, skip}, 1))));
    return b;
  }
  std::vector<std::string> pops() const override { return {skip_name(level)}; }
  torch::nn::Conv2d conv;
  int level;
};

class ConvBlockImpl : public torch::nn::Module {
 public:
  ConvBlockImpl(int64_t in, int64_t out) : conv(register_module("conv", unet_conv(in, out))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(conv(x)); }
  torch::nn::Conv2d conv;
};
TORCH_MODULE(ConvBlock);

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

void check(const CnnConfig& c) {
  positive(c.channels, "cnn input channels");
  positive(c.width, "--width");
  positive(c.hidden, "--hidden");
  positive(c.classes, "cnn classes");
  if (c.image_size < 8)
    throw UsageError("cnn image size " + std::to_string(c.image_size) +
                     " is too small: three 2x2 max pools need images of at least 8x8 pixels");
}

void check(const ResNetConfig& c) {
  positive(c.channels, "resnet input channels");
  positive(c.width, "--width");
  positive(c.blocks, "--blocks");
  positive(c.classes, "resnet classes");
  if (c.stages < 1 || c.stages > 8)
    throw UsageError("--stages " + std::to_string(c.stages) +
                     " must lie in 1..8 (each stage doubles the channels): use a value in that range");
}

void check(const UNetConfig& c) {
  positive(c.channels, "unet input channels");
  positive(c.width, "--width");
  positive(c.classes, "unet classes");
  if (c.depth < 1 || c.depth > 4)
    throw UsageError("--depth " + std::to_string(c.depth) + " must lie in 1..4 (each level halves the image): use a "
                     "value in that range");
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
  if (c.variable_length) {
    m->push_back("embed", std::make_shared<MaskedEmbeddingImpl>(c));
    for (int l = 0; l < c.layers; ++l) m->push_back("block" + std::to_string(l), std::make_shared<MaskedBlockImpl>(c));
  } else {
    m->push_back("embed", Embedding(c));
    for (int l = 0; l < c.layers; ++l) m->push_back("block" + std::to_string(l), Block(c));
  }
  m->push_back("head", Head(c));
  if (c.tie_embeddings) {
    torch::NoGradGuard no_grad;
    const std::string prefix = c.variable_length ? "embed." : "";
    for (const std::string name : {"tokens.weight", "positions.weight"})
      m->ptr(0)->named_parameters()[prefix + name].normal_(0.0, 0.02);
    m->ptr(static_cast<std::size_t>(c.layers) + 1)->named_parameters()["out.weight"].copy_(
        m->ptr(0)->named_parameters()[prefix + "tokens.weight"]);
  }
  return m;
}

LayerwiseModel gpt_layers(const GptConfig& c, uint64_t seed) {
  check(c);
  LayerwiseModel m;
  m.layers = c.layers + 2;
  m.seed = seed;
  m.build = [c](int i) -> torch::nn::AnyModule {
    if (i == 0) {
      torch::nn::AnyModule embed = c.variable_length ? torch::nn::AnyModule(std::make_shared<MaskedEmbeddingImpl>(c))
                                                     : torch::nn::AnyModule(Embedding(c));
      if (c.tie_embeddings) {  // GPT-2's initialisation of both embeddings (make_gpt)
        torch::NoGradGuard no_grad;
        const std::string prefix = c.variable_length ? "embed." : "";
        for (const std::string name : {"tokens.weight", "positions.weight"})
          embed.ptr()->named_parameters()[prefix + name].normal_(0.0, 0.02);
      }
      return embed;
    }
    if (i <= c.layers)
      return c.variable_length ? torch::nn::AnyModule(std::make_shared<MaskedBlockImpl>(c)) : torch::nn::AnyModule(Block(c));
    return torch::nn::AnyModule(Head(c));
  };
  m.info = [c](int i) {
    const double d = static_cast<double>(c.d_model), v = static_cast<double>(c.vocab), t = static_cast<double>(c.seq_len);
    LayerInfo info;
    if (i == 0) {
      info.type = c.variable_length ? "MaskedEmbedding" : "Embedding";
      info.parameters = v * d + t * d;
    } else if (i <= c.layers) {
      info.type = c.variable_length ? "MaskedBlock" : "Block";
      info.parameters = 12 * d * d + 13 * d;  // LayerNorms 2 x 2d, qkv 3d(d+1), proj d(d+1), fc1 4d(d+1), fc2 d(4d+1)
    } else {
      info.type = "Head";
      info.parameters = 2 * d + d * v;
    }
    return info;
  };
  return m;
}

std::vector<std::vector<ParameterRef>> gpt_ties(const GptConfig& c) {
  if (!c.tie_embeddings) return {};
  return {{{0, c.variable_length ? "embed.tokens.weight" : "tokens.weight"}, {c.layers + 1, "out.weight"}}};
}

torch::nn::Sequential make_unet(const UNetConfig& c) {
  check(c);
  torch::nn::Sequential m;
  int64_t in = c.channels;
  for (int k = 0; k < c.depth; ++k) {
    m->push_back("down" + std::to_string(k), std::make_shared<UNetDownImpl>(in, c.width << k, k));
    in = c.width << k;
  }
  m->push_back("bottom", ConvBlock(in, c.width << c.depth));
  in = c.width << c.depth;
  for (int k = c.depth - 1; k >= 0; --k) {
    m->push_back("up" + std::to_string(k), std::make_shared<UNetUpImpl>(in + (c.width << k), c.width << k, k));
    in = c.width << k;
  }
  m->push_back("head", PoolHead(in, c.classes));
  return m;
}

torch::nn::Sequential make_cnn(const CnnConfig& c) {
  check(c);
  // VGG-16's groups: (convs, channels as a multiple of width, pooling after the last conv).
  struct Group {
    int convs;
    int64_t mult;
    Pool pool;
  };
  const Group groups[] = {
      {2, 1, Pool::kMax2}, {2, 2, Pool::kMax2}, {3, 4, Pool::kMax2}, {3, 8, Pool::kNone}, {3, 8, Pool::kGlobalMax}};
  torch::nn::Sequential m;
  int64_t in = c.channels;
  for (int g = 0; g < 5; ++g) {
    const int64_t out = groups[g].mult * c.width;
    for (int k = 0; k < groups[g].convs; ++k) {
      const Pool pool = k == groups[g].convs - 1 ? groups[g].pool : Pool::kNone;
      m->push_back("conv" + std::to_string(g + 1) + "_" + std::to_string(k + 1), ConvRelu(in, out, pool));
      in = out;
    }
  }
  m->push_back("fc6", LinearRelu(in, c.hidden, /*relu=*/true, /*flatten=*/true));
  m->push_back("fc7", LinearRelu(c.hidden, c.hidden, /*relu=*/true, /*flatten=*/false));
  m->push_back("fc8", LinearRelu(c.hidden, c.classes, /*relu=*/false, /*flatten=*/false));
  return m;
}

torch::nn::Sequential make_resnet(const ResNetConfig& c) {
  check(c);
  torch::nn::Sequential m;
  m->push_back("stem", Stem(c.channels, c.width));
  int64_t in = c.width;
  for (int s = 0; s < c.stages; ++s) {
    const int64_t out = c.width << s;
    for (int b = 0; b < c.blocks; ++b) {
      const int64_t stride = s > 0 && b == 0 ? 2 : 1;
      m->push_back("block" + std::to_string(s + 1) + "_" + std::to_string(b + 1), ResidualBlock(in, out, stride));
      in = out;
    }
  }
  m->push_back("head", PoolHead(in, c.classes));
  return m;
}

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target) {
  torch::Tensor t = target;
  if (logits.dim() == 3 && t.dim() == 2 && logits.size(1) < t.size(1)) t = t.slice(1, 0, logits.size(1));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), t.reshape({-1}),
                                              torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
}

}  // namespace pipetrain::zoo

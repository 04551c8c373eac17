// Models as torch::nn::Sequential of blocks, so a balance can cut them anywhere between blocks.
// Linear layers inside use pipetrain::nn::Linear, so zero-bubble schedules split their backward.
//
//   mlp  Flatten, then `layers` blocks of Linear(+ReLU), the last one to `classes` outputs.
//   gpt  character/token language model: [Embedding(tokens + positions)] [Block]*N [LayerNorm + Head].
//        Each block is pre-norm: x + Attention(LN(x)), x + MLP(LN(x)), causal self-attention with
//        `heads` heads. The first and last layers carry the vocabulary (vocab x d_model parameters each)
//        and the head's logits, so they are heavier than a middle block, as in real language models.
//   cnn  VGG-16 for small images: 13 conv layers in 5 groups (2, 2, 3, 3, 3), then 3 fully connected
//        layers; 16 pipeline layers. See CnnConfig for the pooling on 28x28 inputs.
//   resnet  [stem conv] [residual block]*(stages x blocks) [global average pool + Linear]; each residual
//        block is one pipeline layer, so a cut never separates a block from its shortcut.
//
// Construction draws the initial weights from LibTorch's default generator: seed it (torch::manual_seed)
// first, and every rank builds the same model. make_* check their configuration (check(...) below).
// The generator is one per process: ranks running as threads must not build models while another thread
// seeds or draws from it (a pipeline forward reseeds it), or their weights differ; build under one lock
// before any rank starts, or copy the weights of one model built up front.
//
// BatchNorm (resnet only): in a pipeline it normalises each micro-batch by that micro-batch's statistics,
// as in GPipe, and its running statistics are updated by every training-mode forward, re-materialised
// ones included. Pipelined and plain runs over the same micro-batches agree; a run with different
// micro-batch sizes does not match a full-batch run exactly.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <string>
#include <vector>

#include "pipetrain/runtime/layers.h"
#include "pipetrain/runtime/stage.h"

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
  // The output head's weight is the token embedding (vocab x d_model), as in GPT-2: the model keeps a
  // copy in each layer and gpt_ties names the pair for PipelineOptions::tied. Both embeddings are then
  // drawn from N(0, 0.02^2), GPT-2's initialisation, so the tied head starts with small logits.
  bool tie_embeddings = false;
  // Samples of differing length (zoo make_text_lines): the input is a bundle {x: ids, mask} padded to
  // seq_len; the embedding trims each micro-batch to its longest sample and the blocks mask padding
  // keys, so the mask travels through every stage (PipelineOptions::variable_shapes must be set).
  bool variable_length = false;
};
torch::nn::Sequential make_gpt(const GptConfig& c);
// The gpt layer by layer (runtime/layers.h), for ranks that build only their own layers: layer i drawn
// from (seed, i), its info given without building. Its layers are make_gpt's modules; their weights are
// build_all's, not those of make_gpt after torch::manual_seed (one stream for the whole model). With
// tie_embeddings the head's copy of the token embedding is its own draw until a pipeline built with
// gpt_ties copies the embedding's value into it.
LayerwiseModel gpt_layers(const GptConfig& c, uint64_t seed);
// The tie groups of a gpt built with `c` (for PipelineOptions::tied): the token embedding (layer 0,
// "tokens.weight") with the head's weight (the last layer, "out.weight"); none without tie_embeddings.
std::vector<std::vector<ParameterRef>> gpt_ties(const GptConfig& c);

// VGG-16 (Simonyan & Zisserman, configuration D) scaled for 1x28x28 images (Fashion-MNIST).
// Pipeline layers, in order (w = width, S = image_size):
//   conv1_1 conv1_2+pool          w channels      S      -> S/2   (28 -> 14)
//   conv2_1 conv2_2+pool          2w              S/2    -> S/4   (14 -> 7)
//   conv3_1 conv3_2 conv3_3+pool  4w              S/4    -> S/8   (7 -> 3, floor)
//   conv4_1 conv4_2 conv4_3       8w              S/8             (3, no pool)
//   conv5_1 conv5_2 conv5_3+gmax  8w              S/8    -> 1     (global max pool)
//   fc6 (Flatten, 8w -> hidden, ReLU)  fc7 (hidden -> hidden, ReLU)  fc8 (hidden -> classes, logits)
// Each conv layer is Conv2d 3x3 padding 1 + ReLU (no BatchNorm, as in the original), pools are 2x2 max.
// VGG pools after all five groups; a 28x28 image would shrink to 1x1 after four pools and leave group 5
// convolving single pixels (only the kernel's centre would ever see data), so group 4 keeps its 3x3 map
// and group 5 ends in a global max pool instead. width 64 and hidden 4096 give VGG-16's channel counts.
// Initialisation follows torchvision's VGG: conv weights Kaiming-normal (fan out, ReLU), biases zero;
// without it the 13 plain conv layers shrink the signal so much that training stalls.
struct CnnConfig {
  int64_t channels = 1;     // input channels (1: grey images)
  int64_t image_size = 28;  // input height and width (>= 8, so that three 2x2 pools leave >= 1 pixel)
  int64_t width = 8;        // channels of group 1 (VGG-16: 64); small so it trains on a few CPU cores
  int64_t hidden = 128;     // width of fc6 and fc7 (VGG-16: 4096)
  int64_t classes = 10;     // outputs (logits)
};
torch::nn::Sequential make_cnn(const CnnConfig& c);

// A ResNet for small images, in the style of He et al.'s CIFAR ResNets (6n + 2 layers).
// Pipeline layers: stem (Conv 3x3 -> width, BatchNorm, ReLU), then `stages` stages of `blocks` residual
// blocks each (stage s has width * 2^s channels; its first block has stride 2 for s > 0, halving the image:
// 28 -> 14 -> 7), then the head (global average pool, Linear to classes). stages * blocks + 2 layers.
// A block is relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), convs 3x3 without bias; the shortcut is
// the identity where shape is kept, else a 1x1 conv with the block's stride and a BatchNorm.
// Convs are initialised Kaiming-normal (fan out, ReLU), BatchNorm to scale 1 and shift 0, as torchvision.
struct ResNetConfig {
  int64_t channels = 1;  // input channels (1: grey images)
  int64_t width = 16;    // channels of the stem and the first stage; each later stage doubles them
  int stages = 3;        // stages (1..8); each after the first halves the image
  int blocks = 2;        // residual blocks per stage, each one pipeline layer
  int64_t classes = 10;  // outputs (logits)
};
torch::nn::Sequential make_resnet(const ResNetConfig& c);

// A U-Net (Ronneberger et al.) classifier for small images, whose skips cross stage cuts. Pipeline layers:
// `depth` down layers (Conv 3x3 + ReLU, the result stashed as skip k, then a 2x2 max pool; level k has
// width * 2^k channels), the bottom (Conv 3x3 + ReLU to width * 2^depth), `depth` up layers (nearest
// upsampling to skip k's size, concatenated with skip k, which the layer pops, Conv 3x3 + ReLU to
// width * 2^k), and the head (global average pool, Linear to classes): 2 depth + 2 layers. The down and
// up layers are BundleModules (runtime/bundle.h), so a skip whose ends are more than one stage apart
// goes straight between them. Convs initialised Kaiming-normal (fan out, ReLU), no BatchNorm.
struct UNetConfig {
  int64_t channels = 1;  // input channels (1: grey images)
  int64_t width = 8;     // channels of the first level; each deeper level doubles them
  int depth = 2;         // levels (1..4); the image must halve that many times (28 -> 14 -> 7)
  int64_t classes = 10;  // outputs (logits)
};
torch::nn::Sequential make_unet(const UNetConfig& c);

// Mean cross entropy of logits [B, T, V] against targets [B, T] (or [B, V] against [B]). Targets -1 are
// padding and ignored (the mean is over the others); logits of L < T positions (a micro-batch trimmed to
// its longest sample) are scored against the first L target positions.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target);

// Throws UsageError naming the bad value and the fix.
void check(const MlpConfig& c);
void check(const GptConfig& c);
void check(const CnnConfig& c);
void check(const ResNetConfig& c);
void check(const UNetConfig& c);

}  // namespace pipetrain::zoo

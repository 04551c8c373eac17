// Data sets for training runs. A Dataset hands out mini-batches by step number, deterministically
// from its seed, so every rank (and a resumed run) sees the same batch for the same step; only the
// ranks holding the first and last stages use it.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>

namespace pipetrain::zoo {

struct Batch {
  torch::Tensor input;   // stage 0's input
  torch::Tensor target;  // the loss function's target
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::string name() const = 0;
  // The training mini-batch of `step` (batch_size samples).
  virtual Batch batch(int64_t step, int64_t batch_size) = 0;
};

// Token sequences from a fixed random "grammar": each next token follows the previous one by a random
// but fixed transition table 90% of the time, else is uniform. Targets are the inputs shifted by one.
// Learnable, so the loss falls from ln(vocab) towards the table's entropy.
std::unique_ptr<Dataset> make_synthetic_tokens(int64_t vocab, int64_t seq_len, uint64_t seed);

// Gaussian feature vectors labelled by a fixed random linear teacher (argmax of x W).
std::unique_ptr<Dataset> make_synthetic_classes(int64_t features, int64_t classes, uint64_t seed);

}  // namespace pipetrain::zoo

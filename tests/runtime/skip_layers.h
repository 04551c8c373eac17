// Test layers for skip connections (runtime/bundle.h): a layer that stashes a tensor for a later one and
// the layer that pops it, shared by the bundle and skip-runtime tests.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "pipetrain/runtime/bundle.h"
#include "pipetrain/runtime/split_linear.h"

namespace pipetrain::testing {

// x -> Linear(x); stashes "skip" = tanh of the result for a later layer.
struct StashLayer : BundleModule {
  nn::Linear lin{nullptr};
  StashLayer(int64_t in, int64_t out) { lin = register_module("lin", nn::Linear(in, out)); }
  Bundle forward(Bundle b) override {
    const torch::Tensor h = lin(b.at(kMainTensor));
    b.set(kMainTensor, h);
    b.set("skip", torch::tanh(h));
    return b;
  }
  std::vector<std::string> stashes() const override { return {"skip"}; }
};

// Pops "skip": x -> Linear(x + skip).
struct PopLayer : BundleModule {
  nn::Linear lin{nullptr};
  PopLayer(int64_t in, int64_t out) { lin = register_module("lin", nn::Linear(in, out)); }
  Bundle forward(Bundle b) override {
    const torch::Tensor skip = b.take("skip");
    b.set(kMainTensor, lin(b.at(kMainTensor) + skip));
    return b;
  }
  std::vector<std::string> pops() const override { return {"skip"}; }
};

}  // namespace pipetrain::testing

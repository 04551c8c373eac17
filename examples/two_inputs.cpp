// A model of your own with two inputs and two outputs, and a loss over bundles: an 8x8 image and a side
// vector go in together (a bundle of named tensors), the model predicts a class and a value, and the loss
// reads both outputs and both targets. The image passes through a convolution on stage 0 while the side
// vector rides along in the bundle; stage 1 joins them. Checked against the same model trained without a
// pipeline: the losses agree.
#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <memory>

#include "pipetrain/runtime/executor.h"

constexpr int64_t kClasses = 3, kSide = 4;

// image [n, 1, 8, 8] -> features [n, 64]; the side vector is left as it is.
struct Features : pipetrain::BundleModule {
  torch::nn::Conv2d conv{register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)))};
  pipetrain::Bundle forward(pipetrain::Bundle b) override {
    b.set("x", torch::max_pool2d(torch::relu(conv(b.at("x"))), 2).flatten(1));
    return b;
  }
};

// [features, side] -> hidden [n, 32]; the side vector is used up here.
struct Join : pipetrain::BundleModule {
  torch::nn::Linear fc{register_module("fc", torch::nn::Linear(64 + kSide, 32))};
  pipetrain::Bundle forward(pipetrain::Bundle b) override {
    b.set("x", torch::relu(fc(torch::cat({b.at("x"), b.take("side")}, 1))));
    return b;
  }
};

// hidden -> class logits ("x") and a value ("value"): two outputs in one bundle.
struct Heads : pipetrain::BundleModule {
  torch::nn::Linear cls{register_module("cls", torch::nn::Linear(32, kClasses))};
  torch::nn::Linear val{register_module("val", torch::nn::Linear(32, 1))};
  pipetrain::Bundle forward(pipetrain::Bundle b) override {
    const torch::Tensor h = b.at("x");
    b.set("value", val(h).squeeze(1));
    b.set("x", cls(h));
    return b;
  }
};

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  torch::nn::Sequential m;
  m->push_back(std::make_shared<Features>());
  m->push_back(std::make_shared<Join>());
  m->push_back(std::make_shared<Heads>());
  return m;
}

// Cross-entropy on the class plus half the squared error on the value: both outputs, both targets.
torch::Tensor two_part_loss(const pipetrain::Bundle& out, const pipetrain::Bundle& target) {
  return torch::nn::functional::cross_entropy(out.at("x"), target.at("label")) +
         0.5 * torch::mse_loss(out.at("value"), target.at("value"));
}

int main() {
  pipetrain::PipelineOptions options;
  options.schedule = "1f1b";
  options.microbatches = 4;
  options.optimizer.name = "adam";
  options.optimizer.lr = 3e-3;
  options.layers_per_stage = {1, 2};  // the convolution alone on stage 0
  pipetrain::LocalPipeline pipeline(make_model(), two_part_loss, /*stages=*/2, options);

  torch::nn::Sequential plain = make_model();
  torch::optim::Adam adam(plain->parameters(), torch::optim::AdamOptions(3e-3));

  // Data: the class is which third of the image is brightest; the value is the side vector's sum.
  torch::manual_seed(1);
  const int64_t n = 32;
  double first = 0, last = 0, worst = 0;
  for (int step = 0; step < 150; ++step) {
    const torch::Tensor label = torch::randint(kClasses, {n}, torch::kLong);
    torch::Tensor image = torch::randn({n, 1, 8, 8}) * 0.3;
    for (int64_t i = 0; i < n; ++i) image[i].slice(2, label[i].item<int64_t>() * 3, label[i].item<int64_t>() * 3 + 2) += 1.0;
    const torch::Tensor side = torch::randn({n, kSide});
    const pipetrain::Bundle input{{"x", image}, {"side", side}};
    const pipetrain::Bundle target{{"label", label}, {"value", side.sum(1)}};

    last = pipeline.train_step(input, target, n).loss;
    adam.zero_grad();
    pipetrain::Bundle out = input;
    for (const auto& layer : plain->children()) out = std::dynamic_pointer_cast<pipetrain::BundleModule>(layer)->forward(out);
    const torch::Tensor plain_loss = two_part_loss(out, target);
    plain_loss.backward();
    adam.step();
    worst = std::max(worst, std::abs(last - plain_loss.item<double>()));
    if (step == 0) first = last;
    if (step % 50 == 0) std::cout << "step " << step << " loss " << last << " (plain " << plain_loss.item<double>() << ")\n";
  }
  std::cout << "two inputs, two outputs: loss " << first << " -> " << last
            << "; largest difference from plain LibTorch " << worst << "\n";
  return last < first / 3 && worst < 1e-4 ? 0 : 1;
}

// A U-Net-like MLP of your own, made of plain torch::nn::Linear layers, with skip connections that cross
// stages, on the zero-bubble V schedule (zb-v) over 3 ranks: 6 virtual stages, placed in a V. The skips
// are declared with stashes()/pops() (pipetrain/runtime/bundle.h) and travel straight from the stashing
// stage to the popping one. The program trains the same model without a pipeline next to it and checks
// that both give the same losses: a pipeline changes where the work runs, not what is computed.
//
// zb-v splits each backward into an input-gradient part (B) and a weight-gradient part (W). For plain
// LibTorch layers such as torch::nn::Linear the split goes through autograd (PipelineOptions::
// backward_split, "auto" by default): B asks for the stage input's gradient only and W computes the
// weights' gradients later from the kept graph; pipetrain::nn::Linear has the split built in.
#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <memory>
#include <string>

#include "pipetrain/runtime/executor.h"

constexpr int64_t kIn = 16, kWidth = 32;

// x -> relu(fc(x)), and the result kept as skip `name` for the matching Up layer.
struct Down : pipetrain::BundleModule {
  Down(int64_t in, std::string skip) : fc(register_module("fc", torch::nn::Linear(in, kWidth))), skip(std::move(skip)) {}
  pipetrain::Bundle forward(pipetrain::Bundle b) override {
    const torch::Tensor y = torch::relu(fc(b.at("x")));
    b.set(skip, y);
    b.set("x", y);
    return b;
  }
  std::vector<std::string> stashes() const override { return {skip}; }
  torch::nn::Linear fc;
  std::string skip;
};

// [x, skip] -> relu(fc([x, skip])): takes the skip out of the bundle.
struct Up : pipetrain::BundleModule {
  explicit Up(std::string skip) : fc(register_module("fc", torch::nn::Linear(2 * kWidth, kWidth))), skip(std::move(skip)) {}
  pipetrain::Bundle forward(pipetrain::Bundle b) override {
    b.set("x", torch::relu(fc(torch::cat({b.at("x"), b.take(skip)}, 1))));
    return b;
  }
  std::vector<std::string> pops() const override { return {skip}; }
  torch::nn::Linear fc;
  std::string skip;
};

torch::nn::Sequential make_model() {
  torch::manual_seed(0);  // both copies start from the same weights
  torch::nn::Sequential m;
  m->push_back(std::make_shared<Down>(kIn, "skip1"));
  m->push_back(std::make_shared<Down>(kWidth, "skip2"));
  m->push_back(torch::nn::Linear(kWidth, kWidth));  // plain tensor layers act on the bundle's "x"
  m->push_back(torch::nn::ReLU());
  m->push_back(std::make_shared<Up>("skip2"));
  m->push_back(std::make_shared<Up>("skip1"));
  m->push_back(torch::nn::Linear(kWidth, 1));
  return m;
}

// The same layers, one after the other, without a pipeline.
torch::Tensor run_plain(const torch::nn::Sequential& m, const torch::Tensor& x) {
  pipetrain::Bundle b{{"x", x}};
  for (const auto& layer : m->children()) {
    if (auto bundle_layer = std::dynamic_pointer_cast<pipetrain::BundleModule>(layer)) {
      b = bundle_layer->forward(std::move(b));
    } else if (auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(layer)) {
      b.set("x", linear->forward(b.at("x")));
    } else {
      b.set("x", std::dynamic_pointer_cast<torch::nn::ReLUImpl>(layer)->forward(b.at("x")));
    }
  }
  return b.at("x");
}

int main() {
  pipetrain::PipelineOptions options;
  options.schedule = "zb-v";
  options.virtual_stages = 2;  // two stages per rank, in a V
  options.microbatches = 6;
  options.optimizer.name = "sgd";
  options.optimizer.lr = 0.05;
  auto mse = [](const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); };
  pipetrain::LocalPipeline pipeline(make_model(), mse, /*stages=*/3, options);

  torch::nn::Sequential plain = make_model();
  torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.05));

  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({240, kIn});
  const torch::Tensor y = x.slice(1, 0, 4).sum(1, /*keepdim=*/true).sin();  // a smooth target
  double first = 0, last = 0, worst = 0;
  for (int step = 0; step < 60; ++step) {
    const torch::Tensor rows = torch::arange(step % 10 * 24, step % 10 * 24 + 24);
    const torch::Tensor xb = x.index_select(0, rows), yb = y.index_select(0, rows);
    last = pipeline.train_step(xb, yb).loss;
    sgd.zero_grad();
    const torch::Tensor plain_loss = torch::mse_loss(run_plain(plain, xb), yb);
    plain_loss.backward();
    sgd.step();
    worst = std::max(worst, std::abs(last - plain_loss.item<double>()));
    if (step == 0) first = last;
    if (step % 20 == 0) std::cout << "step " << step << " loss " << last << " (plain " << plain_loss.item<double>() << ")\n";
  }
  std::cout << "zb-v over 3 ranks, stages of";
  for (int n : pipeline.balance()) std::cout << " " << n;
  std::cout << " layers: loss " << first << " -> " << last << "; largest difference from plain LibTorch " << worst << "\n";
  return last < 0.75 * first && worst < 1e-5 ? 0 : 1;  // it learned, and as plain LibTorch does
}

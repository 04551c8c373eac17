// Your own LibTorch model on your own tensors, trained with a 1F1B pipeline of 2 stages in one process
// (each stage on its own thread). For one process per stage, build a PipelineRank per process over
// make_process_transport("auto") instead, and start it with `pipetrain launch -n 2 -- ./my_mlp`.
#include <torch/torch.h>

#include <iostream>

#include "pipetrain/runtime/executor.h"

int main() {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(16, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                              torch::nn::ReLU(), torch::nn::Linear(64, 1));
  // A regression task: y = sum of the inputs' squares.
  const torch::Tensor x = torch::randn({256, 16});
  const torch::Tensor y = x.pow(2).sum(1, /*keepdim=*/true);

  pipetrain::PipelineOptions options;
  options.schedule = "1f1b";  // or gpipe, interleaved, zb-h1, ...
  options.microbatches = 4;
  options.optimizer.name = "adam";
  options.optimizer.lr = 1e-2;
  auto mse = [](const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); };
  pipetrain::LocalPipeline pipeline(model, mse, /*stages=*/2, options);

  double first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    const torch::Tensor idx = torch::randint(256, {32}, torch::kLong);  // a mini-batch of 32
    last = pipeline.train_step(x.index_select(0, idx), y.index_select(0, idx)).loss;
    if (step == 0) first = last;
    if (step % 50 == 0) std::cout << "step " << step << " loss " << last << "\n";
  }
  std::cout << "loss " << first << " -> " << last << " on stages of " << pipeline.balance()[0] << " and "
            << pipeline.balance()[1] << " layers\n";
  return last < first / 4 ? 0 : 1;  // it learned
}

// The library's training loop on your own model and data: a Trainer per rank runs a 2-stage 1F1B
// pipeline with a warm-up + cosine learning-rate schedule, evaluates on held-out samples every 50
// steps and saves a checkpoint at the end. Here each rank is a thread of one process; for one process
// per rank, use make_process_transport("auto") as the transport (world and pipeline alike) and start
// the program with `pipetrain launch -n 2 -- ./my_trainer`.
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>
#include <iostream>

#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/trainer.h"

int main() {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(16, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                              torch::nn::ReLU(), torch::nn::Linear(64, 1));
  // A regression task: y = sum of the inputs' squares; 512 training and 128 held-out samples.
  const torch::Tensor x = torch::randn({640, 16});
  const torch::Tensor y = x.pow(2).sum(1, /*keepdim=*/true);
  pipetrain::TrainData data;
  data.train_size = 512;
  data.eval_size = 128;
  data.batch = [&](int step, int64_t n) {  // a pure function of the step: resumed runs see the same data
    const int64_t begin = (step * n) % (512 - n);
    return std::make_pair(x.slice(0, begin, begin + n), y.slice(0, begin, begin + n));
  };
  data.eval_batch = [&](int64_t begin, int64_t n) {
    return std::make_pair(x.slice(0, 512 + begin, 512 + begin + n), y.slice(0, 512 + begin, 512 + begin + n));
  };

  pipetrain::PipelineOptions options;
  options.schedule = "1f1b";
  options.microbatches = 4;
  options.optimizer.name = "adam";
  options.optimizer.lr = 1e-2;  // the trainer's schedule sets it per step
  auto mse = [](const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); };

  pipetrain::TrainerOptions run;
  run.steps = 300;
  run.batch_size = 32;
  run.lr = {1e-2, "cosine", /*warmup=*/20};
  run.eval_every = 50;
  // A folder of this run's own (two runs, or two users, must not share one); removed at the end.
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("my_trainer_checkpoint_" + std::to_string(::getpid()))).string();
  run.save_dir = dir;
  run.run_description = [](int steps) { return nlohmann::json{{"example", "my_trainer"}, {"steps", steps}}; };

  auto transports = pipetrain::make_local_transports(2);
  double first_eval = 0, last_eval = 0;
  try {
    pipetrain::run_on_threads(2, [&](int r) {
      pipetrain::PipelineRank rank(model, mse, transports[r], options);
      pipetrain::TrainerCallbacks cb;
      if (r == 0)
        cb.on_eval = [](int step, const pipetrain::EvalResult& e) {
          std::cout << "step " << step << ": held-out loss " << e.loss << "\n";
        };
      pipetrain::Trainer trainer(rank, transports[r], transports[r], &data, run, cb);
      const pipetrain::TrainResult result = trainer.run();
      if (r == 0) {
        first_eval = result.first_eval->loss;
        last_eval = result.last_eval->loss;
        std::cout << "median step " << result.median_step_ms() << " ms; checkpoint of step " << result.last_saved
                  << " written to " << dir << " (removed now that the example ends)\n";
      }
    });
  } catch (const std::exception& e) {  // a rank's error (a save that failed, say): said, not an abort
    std::cerr << "my_trainer: " << e.what() << "\n";
    std::filesystem::remove_all(dir);
    return 1;
  }
  std::filesystem::remove_all(dir);
  return last_eval < first_eval / 4 ? 0 : 1;  // it learned
}

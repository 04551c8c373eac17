// `pipetrain profile`: measures a model layer by layer (runtime/profiler.h) on a real batch of its data
// and writes the JSON profile the planners read (docs/PROFILE.md), printing a table.
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <memory>

#include "cli_common.h"
#include "pipetrain/core/error.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/runtime/profiler.h"
#include "pipetrain/runtime/info.h"
#include "run_common.h"

namespace pipetrain::cli {

void add_profile_command(CLI::App& app, int& exit_code) {
  struct Flags {
    ModelFlags model;
    int micro_batch = 8;
    int repeats = 10;
    int warmup = 2;
    int threads = 0;
    std::string optimizer = "adam";
    std::vector<int> sizes;
    std::string out;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand("profile", "measure a model layer by layer and write a JSON profile for planning");
  f->model.add_to(*cmd);
  cmd->add_option("--microbatch-size", f->micro_batch, "samples per micro-batch to measure at, default 8");
  cmd->add_option("--repeats", f->repeats, "timed runs per measurement (median), default 10");
  cmd->add_option("--warmup", f->warmup, "untimed runs first, default 2");
  cmd->add_option("--threads", f->threads, "intra-op threads while measuring; default: as LibTorch starts");
  cmd->add_option("--optimizer", f->optimizer, "adam, adamw, sgd or sgd-momentum (optimizer state bytes); default adam");
  cmd->add_option("--sizes", f->sizes, "also measure at these micro-batch sizes (for UMPIPE), e.g. --sizes 1 2 4 16");
  cmd->add_option("--out", f->out, "write the profile JSON here");
  cmd->footer(
      "Examples:\n"
      "  pipetrain profile --model gpt --microbatch-size 8 --out gpt.json\n"
      "  pipetrain profile --model cnn --microbatch-size 32 --threads 1 --sizes 8 16 64 --out cnn.json\n"
      "The JSON format is documented in docs/PROFILE.md.");
  cmd->callback([f, &exit_code] {
    exit_code = guarded("profile", [&] {
      if (f->micro_batch < 1) throw UsageError("--microbatch-size must be >= 1, got " + std::to_string(f->micro_batch));
      if (f->threads < 0) throw UsageError("--threads must be >= 0, got " + std::to_string(f->threads));
      if (f->threads > 0) at::set_num_threads(f->threads);
      f->model.prepare();
      auto model = f->model.factory()();
      auto data = f->model.dataset();
      const zoo::Batch b = data->batch(0, f->micro_batch);
      ProfilerOptions o;
      o.repeats = f->repeats;
      o.warmup = f->warmup;
      o.optimizer = f->optimizer;
      o.model_name = f->model.describe();
      o.loss = f->model.loss();  // the last layer's times include the loss, as the last stage runs it
      o.target = b.target;
      std::vector<int> sizes = f->sizes;
      std::sort(sizes.begin(), sizes.end());
      sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
      o.extra_sizes = sizes;
      const Profile p = profile_model(model, b.input, o);
      std::cout << fmt::format("profile of {}\n  micro-batch {}, {} threads, median of {} runs\n", p.model,
                               p.micro_batch_size, p.threads, f->repeats);
      std::cout << fmt::format("{:>3} {:<22} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12}\n", "#", "layer", "F ms", "B ms",
                               "W ms", "BW ms", "output KiB", "params KiB");
      double tf = 0, tb = 0;
      for (std::size_t i = 0; i < p.layers.size(); ++i) {
        const LayerProfile& l = p.layers[i];
        tf += l.forward_ms;
        tb += l.backward_ms;
        std::cout << fmt::format("{:>3} {:<22} {:>9.3f} {:>9} {:>9} {:>9.3f} {:>12.1f} {:>12.1f}\n", i, l.type,
                                 l.forward_ms, l.bw_split ? fmt::format("{:.3f}", l.input_grad_ms) : "-",
                                 l.bw_split ? fmt::format("{:.3f}", l.weight_grad_ms) : "-", l.backward_ms,
                                 l.activation_bytes / 1024.0, l.parameter_bytes / 1024.0);
      }
      std::cout << fmt::format("    total forward {:.3f} ms, backward {:.3f} ms\n", tf, tb);
      if (!f->out.empty()) {
        save_profile(f->out, p);
        std::cout << "profile written to " << f->out << "\n";
      }
      return 0;
    });
  });
}

}  // namespace pipetrain::cli

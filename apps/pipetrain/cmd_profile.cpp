// `pipetrain profile`: measures a model layer by layer (runtime/profiler.h) on a real batch of its data
// and writes the JSON profile the planners read (docs/PROFILE.md), printing a table. With --transport it
// also measures, over two ranks of that transport, the transfer latency and bandwidth and the executor's
// per-action overhead (profile_runtime), and writes them as the profile's "runtime".
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>

#include "cli_common.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/runtime/profiler.h"
#include "pipetrain/runtime/info.h"
#include "run_common.h"

namespace pipetrain::cli {

namespace {

struct ProfileFlags {
  ModelFlags model;
  int micro_batch = 8;
  int repeats = 10;
  bool warm_caches = false;
  int warmup = 2;
  int threads = 0;
  std::string optimizer = "adam";
  std::vector<int> sizes;
  std::string out;
  std::string transport;  // empty: compute only
  std::string device = "cpu";
  int concurrent = 1;     // processes measuring the layers at once (rank 0's are written)
  std::string backward_split = "auto";
};

// Profiles the layers, adds `runtime` when given, prints the table and writes --out (only the measuring
// when `report` is false: the other processes of --concurrent).
void profile_layers(ProfileFlags& f, const RuntimeCosts* runtime, bool report = true) {
  auto data = f.model.dataset();
  const zoo::Batch b = data->batch(0, f.micro_batch);
  ProfilerOptions o;
  o.repeats = f.repeats;
  o.cold_caches = !f.warm_caches;
  o.warmup = f.warmup;
  o.optimizer = f.optimizer;
  o.model_name = f.model.describe();
  o.loss = f.model.mean_loss();  // the last layer's times include the loss, as the last stage runs it
  o.target = b.target;
  o.device = device_of_flag(f.device);
  o.backward_split = f.backward_split;
  std::vector<int> sizes = f.sizes;
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  o.extra_sizes = sizes;
  // A model given layer by layer (the gpt) is built, measured and dropped one layer at a time.
  const auto layers = f.model.layerwise();
  Profile p = layers ? profile_model(*layers, b.input, o) : profile_model(f.model.factory()(), b.input, o);
  if (!report) return;
  if (runtime) p.runtime = *runtime;
  std::cout << fmt::format("profile of {}\n  micro-batch {}, {} threads, median of {} runs\n", p.model,
                           p.micro_batch_size, p.threads, f.repeats);
  std::cout << fmt::format("{:>3} {:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12}\n", "#", "layer", "F ms", "B ms",
                           "W ms", "BW ms", "step ms", "output KiB", "params KiB");
  double tf = 0, tb = 0, ts = 0;
  for (std::size_t i = 0; i < p.layers.size(); ++i) {
    const LayerProfile& l = p.layers[i];
    tf += l.forward_ms;
    tb += l.backward_ms;
    ts += l.optimizer_ms;
    std::cout << fmt::format("{:>3} {:<22} {:>9.3f} {:>9} {:>9} {:>9.3f} {:>9.3f} {:>12.1f} {:>12.1f}\n", i, l.type,
                             l.forward_ms, l.bw_split ? fmt::format("{:.3f}", l.input_grad_ms) : "-",
                             l.bw_split ? fmt::format("{:.3f}", l.weight_grad_ms) : "-", l.backward_ms, l.optimizer_ms,
                             l.activation_bytes / 1024.0, l.parameter_bytes / 1024.0);
  }
  std::cout << fmt::format("    total forward {:.3f} ms, backward {:.3f} ms, optimizer step {:.3f} ms ({})\n", tf, tb,
                           ts, f.optimizer);
  if (runtime) {
    std::cout << fmt::format("runtime over {} (2 ranks): one transfer = {:.2f} us + bytes at {}; overhead {:.2f} us per "
                             "compute action\n",
                             runtime->transport, runtime->latency_ms * 1e3,
                             runtime->bandwidth_bytes_per_ms > 0
                                 ? fmt::format("{:.2f} GB/s", runtime->bandwidth_bytes_per_ms / 1e6)
                                 : std::string("no measurable cost per byte"),
                             runtime->overhead_ms * 1e3);
    for (const TransferSample& t : runtime->transfers)
      std::cout << fmt::format("  {:>10.0f} bytes one way {:>9.2f} us (fit {:.2f} us)\n", t.bytes, t.one_way_ms * 1e3,
                               runtime->transfer_ms(t.bytes) * 1e3);
    if (!runtime->allreduce.empty()) {
      std::cout << fmt::format("data-parallel all-reduce of float32 gradients over {} ranks (copy in, sum, copy back):\n",
                               runtime->allreduce_ranks);
      for (const TransferSample& t : runtime->allreduce)
        std::cout << fmt::format("  {:>10.0f} bytes {:>9.2f} us\n", t.bytes, t.one_way_ms * 1e3);
    }
  }
  if (!f.out.empty()) {
    save_profile(f.out, p);
    std::cout << "profile written to " << f.out << "\n";
  }
}

}  // namespace

void add_profile_command(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<ProfileFlags>();
  CLI::App* cmd = app.add_subcommand("profile", "measure a model layer by layer and write a JSON profile for planning");
  f->model.add_to(*cmd);
  cmd->add_option("--microbatch-size", f->micro_batch, "samples per micro-batch to measure at, default 8");
  cmd->add_option("--repeats", f->repeats, "timed runs per measurement (median), default 10");
  cmd->add_flag("--warm-caches", f->warm_caches,
                "time each repeat with what the last one left in the CPU caches (default: write a buffer the size of the "
                "last-level cache before each timed run, so weights and activations come from memory as in training)");
  cmd->add_option("--warmup", f->warmup, "untimed runs first, default 2");
  cmd->add_option("--threads", f->threads, "intra-op threads while measuring; default: as LibTorch starts");
  cmd->add_option("--optimizer", f->optimizer, "adam, adamw, sgd or sgd-momentum (the optimizer state's bytes and step time); default adam");
  cmd->add_option("--sizes", f->sizes, "also measure at these micro-batch sizes (for UMPIPE), e.g. --sizes 1 2 4 16");
  cmd->add_option("--out", f->out, "write the profile JSON here");
  cmd->add_option("--backward-split", f->backward_split,
                  "how B and W are measured, as train --backward-split runs them: auto (autograd splits any layer, "
                  "pipetrain::nn::Linear by its own split), autograd, or explicit (only pipetrain::nn::Linear splits; "
                  "other layers' backward is all B); default auto")
      ->check(CLI::IsMember({"auto", "autograd", "explicit"}));
  cmd->add_option("--device", f->device,
                  "cpu (default), cuda or cuda:N: measure there (on a GPU each time waits for the device, so it is "
                  "the kernels' time; plan and simulate then predict GPU steps)");
  cmd->add_option("--transport", f->transport,
                  "also measure transfers (latency, bandwidth) and the executor's per-action overhead over two ranks "
                  "of this transport: local (threads), shm or gloo (two processes started here), mpi (under mpirun "
                  "-n 2); default: compute only")
      ->check(CLI::IsMember({"local", "shm", "gloo", "mpi"}));
  cmd->add_option("--concurrent", f->concurrent,
                  "measure the layers in N processes at once (rank 0's times are written), as the N ranks of a run on "
                  "this host compute at once and share its cores, caches and memory bandwidth; default 1 (alone)")
      ->check(CLI::Range(1, 64));
  cmd->footer(
      "Examples:\n"
      "  pipetrain profile --model gpt --microbatch-size 8 --out gpt.json\n"
      "  pipetrain profile --model cnn --microbatch-size 32 --threads 1 --sizes 8 16 64 --out cnn.json\n"
      "  pipetrain profile --model mlp --microbatch-size 8 --threads 1 --transport shm --out mlp.json\n"
      "  pipetrain profile --model gpt --threads 1 --concurrent 2 --out gpt.json  # as 2 ranks of a run see it\n"
      "The JSON format is documented in docs/PROFILE.md.");
  cmd->callback([f, cmd, &exit_code] {
    exit_code = guarded("profile", [&] {
      // As train's outputs: not an empty name (an unset variable measured the whole model and wrote
      // nothing), not the --text it reads, not inside the --data-dir (each replaced by the JSON profile).
      refuse_empty_names(cmd, {"--out", "--text", "--data-dir"});
      check_outputs_apart({{"--out", f->out}}, {{"--text", f->model.text_file}});
      if (!f->out.empty() && cmd->get_option("--data-dir")->count() > 0 && inside(f->out, f->model.data_dir))
        throw UsageError("--out " + f->out + " lies in the --data-dir folder " + f->model.data_dir +
                         ", which holds the data: write --out elsewhere");
      check_output_path(f->out, "--out");
      if (f->micro_batch < 1) throw UsageError("--microbatch-size must be >= 1, got " + std::to_string(f->micro_batch));
      if (f->threads < 0) throw UsageError("--threads must be >= 0, got " + std::to_string(f->threads));
      if (f->threads > 0) at::set_num_threads(f->threads);
      f->model.prepare();
      // The default data folder too, when it is read (root may write there).
      if (!f->out.empty() && f->model.data == "fashion-mnist" && inside(f->out, f->model.data_dir))
        throw UsageError("--out " + f->out + " lies in the Fashion-MNIST folder " + f->model.data_dir +
                         ", which holds the data this profile reads: write --out elsewhere");
      // As train: a model or micro-batch past this host's memory is refused before anything is built (it
      // ended in LibTorch's allocator error, with a stack trace). The gpt is built one layer at a time here.
      {
        int64_t largest = f->micro_batch;
        for (int size : f->sizes) largest = std::max<int64_t>(largest, size);
        f->model.check_fits(largest, 1, std::max(1, f->concurrent),
                            f->model.layerwise() ? f->model.layer_count() : 1, 0,
                            f->sizes.empty() ? "--microbatch-size" : "--microbatch-size or --sizes");
      }
      if (const std::string b = f->model.bundle_layers(); !b.empty())
        throw UsageError("pipetrain profile times layers that take and return one tensor, and " + b +
                         " (bundles): it cannot measure this model. Train it balanced by layer counts or parameters "
                         "(train --balance uniform, the default, or parameters), and plan from a profile of a model "
                         "of one-tensor layers");
      const int threads = at::get_num_threads();  // the pipeline below runs one thread per rank
      // Under a launcher, its processes must be the ranks profile runs: without --transport or --concurrent
      // every process profiled and wrote the same --out; a mismatch was told to "pass --stages", a flag
      // profile does not have.
      {
        const int wanted = !f->transport.empty() || f->concurrent > 1 ? std::max(f->transport.empty() ? 1 : 2, f->concurrent) : 1;
        const char* ws = std::getenv("WORLD_SIZE") ? std::getenv("WORLD_SIZE") : std::getenv("OMPI_COMM_WORLD_SIZE");
        const int started = ws ? std::atoi(ws) : 0;
        if (started > 0 && started != wanted)
          throw UsageError(
              "a launcher started " + std::to_string(started) + " processes, but pipetrain profile runs " +
              std::to_string(wanted) + " rank(s) here" +
              (wanted == 1 ? std::string(" (it measures in one process): run it without the launcher, or give "
                                         "--concurrent ") + std::to_string(started) +
                                 " to measure as that many ranks of a run do (rank 0's times are written)"
                           : std::string(" (") + (f->transport.empty() ? "" : "--transport measures transfers between 2; ") +
                                 "--concurrent " + std::to_string(f->concurrent) + "): launch " + std::to_string(wanted) +
                                 " (pipetrain launch -n " + std::to_string(wanted) + " -- ...)" +
                                 (started >= (f->transport.empty() ? 1 : 2)
                                      ? ", or set --concurrent " + std::to_string(started)
                                      : std::string())));
      }
      if (!f->transport.empty() || f->concurrent > 1) {
        // Ranks of the transport (shm for --concurrent alone): the runtime's costs over two of them, then
        // rank 0 profiles the layers, with --concurrent N ranks 0..N-1 at once.
        PipelineFlags ranks;
        ranks.stages = std::max(f->transport.empty() ? 1 : 2, f->concurrent);
        ranks.transport = f->transport.empty() ? "shm" : f->transport;
        return run_ranks(ranks, cli_argc(), cli_argv(), [&](std::shared_ptr<Transport> t) {
          std::optional<RuntimeCosts> rc;
          if (!f->transport.empty()) rc = profile_runtime(t, f->transport);
          at::set_num_threads(threads);
          t->barrier();  // the measuring ranks start together
          if (t->rank() < f->concurrent) profile_layers(*f, rc ? &*rc : nullptr, t->rank() == 0);
          t->barrier();  // every rank stays until rank 0 is done, so no transport sees its peer leave early
          return 0;
        });
      }
      profile_layers(*f, nullptr);
      return 0;
    });
  });
}

}  // namespace pipetrain::cli

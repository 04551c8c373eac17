#include "run_common.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <thread>

#include <torch/cuda.h>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/launch.h"

namespace pipetrain::cli {

void ModelFlags::add_to(CLI::App& app) {
  app.add_option("--model", model, "gpt (token language model) or mlp; default gpt")
      ->check(CLI::IsMember({"gpt", "mlp"}));
  app.add_option("--layers", gpt.layers, "gpt: transformer blocks (the model has layers+2 pipeline layers), mlp: Linear layers; default 4");
  app.add_option("--d-model", gpt.d_model, "gpt width, default 128");
  app.add_option("--heads", gpt.heads, "gpt attention heads, default 4");
  app.add_option("--vocab", gpt.vocab, "gpt vocabulary, default 96");
  app.add_option("--seq-len", gpt.seq_len, "gpt context length, default 64");
  app.add_option("--dropout", gpt.dropout, "gpt dropout, default 0");
  app.add_option("--hidden", mlp.hidden, "mlp width, default 256");
  app.add_option("--seed", seed, "seed for the model, the data and dropout; default 0");
}

std::function<torch::nn::Sequential()> ModelFlags::factory() const {
  if (model == "mlp") {
    zoo::MlpConfig c = mlp;
    c.layers = gpt.layers;
    c.inputs = 64;
    const uint64_t s = seed;
    zoo::check(c);
    return [c, s] {
      torch::manual_seed(s);
      return zoo::make_mlp(c);
    };
  }
  const zoo::GptConfig c = gpt;
  zoo::check(c);
  const uint64_t s = seed;
  return [c, s] {
    torch::manual_seed(s);
    return zoo::make_gpt(c);
  };
}

LossFn ModelFlags::loss() const { return zoo::cross_entropy; }

std::unique_ptr<zoo::Dataset> ModelFlags::dataset() const {
  if (model == "mlp") return zoo::make_synthetic_classes(64, mlp.classes, seed + 1);
  return zoo::make_synthetic_tokens(gpt.vocab, gpt.seq_len, seed + 1);
}

std::string ModelFlags::describe() const {
  if (model == "mlp")
    return fmt::format("mlp: {} Linear layers, width {}, 64 inputs, {} classes (synthetic teacher data)", gpt.layers,
                       mlp.hidden, mlp.classes);
  return fmt::format("gpt: {} blocks, d_model {}, {} heads, vocab {}, context {} (synthetic token data)", gpt.layers,
                     gpt.d_model, gpt.heads, gpt.vocab, gpt.seq_len);
}

void PipelineFlags::add_to(CLI::App& app) {
  stages_option = app.add_option("--stages,-p", stages, "pipeline stages = ranks, default 2");
  app.add_option("--schedule,-s", schedule, "gpipe, 1f1b, interleaved, zb-h1, zb-h2 or zb-auto; default 1f1b");
  app.add_option("--microbatches,-m", microbatches, "micro-batches per step, default 4");
  app.add_option("--virtual,-v", virtual_stages, "virtual stages per rank (interleaved), default 1");
  app.add_option("--balance", balance, "uniform, parameters, or layer counts per stage such as 3,2,2; default uniform");
  app.add_option("--checkpoint", checkpoint, "re-materialisation: always, except_last or never; default never");
  app.add_option("--transport", transport,
                 "local (threads in this process), gloo, mpi (under mpirun), or auto: mpi under mpirun, gloo "
                 "otherwise; default auto");
  app.add_option("--threads", threads, "intra-op threads per rank; default: cores / ranks");
  app.add_flag("--reference", reference, "use the blocking reference executor instead of the fast path");
  app.add_option("--device", device,
                 "cpu (default), cuda (rank r on GPU r mod the GPU count) or cuda:N; cuda needs a CUDA LibTorch");
}

PipelineOptions PipelineFlags::options(uint64_t seed, int local_rank) const {
  PipelineOptions o;
  if (device == "cpu") {
    o.device = torch::kCPU;
  } else if (device.rfind("cuda", 0) == 0) {
    if (!torch::cuda::is_available())
      throw UsageError("--device " + device + ": this LibTorch has no CUDA device; build against a CUDA LibTorch "
                       "(make build TORCH_DIR=...) on a machine with a GPU, or use --device cpu");
    const int gpus = static_cast<int>(torch::cuda::device_count());
    try {
      o.device = device == "cuda" ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % gpus))
                                  : torch::Device(device);
    } catch (const std::exception&) {
      throw UsageError("--device " + device + " is not a device: use cpu, cuda or cuda:N");
    }
    if (o.device.index() >= gpus)
      throw UsageError("--device " + device + ": there are only " + std::to_string(gpus) + " GPUs (0.." +
                       std::to_string(gpus - 1) + ")");
  } else {
    throw UsageError("--device " + device + " is not a device: use cpu, cuda or cuda:N");
  }
  o.schedule = schedule;
  o.microbatches = microbatches;
  o.virtual_stages = virtual_stages;
  o.balance = balance;
  o.checkpoint = parse_checkpoint(checkpoint);
  o.seed = seed;
  o.reference = reference;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (threads < 0) throw UsageError("--threads must be >= 0, got " + std::to_string(threads));
  o.threads = threads > 0 ? threads : std::max(1, cores / std::max(1, stages));
  return o;
}

namespace {
bool launched() { return std::getenv("RANK") || std::getenv("OMPI_COMM_WORLD_RANK"); }
}  // namespace

int run_ranks(const PipelineFlags& flags, int argc, char** argv,
              const std::function<int(std::shared_ptr<Transport>)>& body) {
  if (flags.stages < 1) throw UsageError("--stages must be >= 1, got " + std::to_string(flags.stages));
  const std::string& t = flags.transport;
  if (t != "local" && t != "gloo" && t != "mpi" && t != "auto")
    throw UsageError("unknown transport '" + t + "': use local, gloo, mpi or auto");
  if (t == "local") {
    auto transports = make_local_transports(flags.stages);
    std::vector<int> codes(static_cast<std::size_t>(flags.stages), 0);
    run_on_threads(
        flags.stages, [&](int r) { codes[static_cast<std::size_t>(r)] = body(transports[static_cast<std::size_t>(r)]); },
        [&](int r) { transports[static_cast<std::size_t>(r)]->abort("rank " + std::to_string(r) + " failed"); });
    for (int c : codes)
      if (c != 0) return c;
    return 0;
  }
  if (!launched()) {
    if (t == "mpi")
      throw UsageError("--transport mpi needs ranks started by mpirun, e.g. mpirun -n " + std::to_string(flags.stages) +
                       " pipetrain ...; or use --transport gloo");
    std::vector<std::string> args{"/proc/self/exe"};
    for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
    return launch_local(flags.stages, args);  // the ranks see no mpirun variables, so "auto" means gloo
  }
  auto transport = make_process_transport(t);
  if (transport->world_size() != flags.stages) {
    const std::string msg = "the launcher started " + std::to_string(transport->world_size()) + " ranks but --stages is " +
                            std::to_string(flags.stages) + ": launch " + std::to_string(flags.stages) +
                            " ranks or pass --stages " + std::to_string(transport->world_size());
    transport->abort(msg);
    throw UsageError(msg);
  }
  try {
    return body(transport);
  } catch (const RemoteFailure&) {
    throw;
  } catch (const std::exception& e) {
    transport->abort(e.what());
    throw;
  }
}

}  // namespace pipetrain::cli

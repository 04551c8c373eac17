#include "run_common.h"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string_view>
#include <thread>
#include <vector>

#include <torch/cuda.h>

#include "pipetrain/core/read_file.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/planner.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/plan/search.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/runtime/launch.h"
#include "pipetrain/runtime/profiler.h"

namespace pipetrain::cli {

void PipelineFlags::add_to(CLI::App& app) {
  stages_option = app.add_option("--stages,-p", stages, "pipeline stages = ranks, default 2");
  app.add_option("--schedule,-s", schedule, "gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-auto, zb-v, v-half, v-min, dualpipev, interleaved-zb, looped-bfs, or "
                 "the asynchronous pipedream, 2bw, spectrain; "
                 "default 1f1b");
  app.add_option("--microbatches,-m", microbatches, "micro-batches per step, default 4");
  app.add_option("--virtual,-v", virtual_stages, "virtual stages per rank (interleaved, interleaved-zb, looped-bfs), default 1");
  app.add_option("--balance", balance,
                 "uniform, parameters, time, memory (measured), type:REGEX (layers whose type matches), or layer "
                 "counts per stage such as 3,2,2; default uniform");
  app.add_option("--balance-solver", balance_solver,
                 "min-max (optimal contiguous partition, default) or block-partition (torchgpipe's heuristic)");
  app.add_option_function<std::string>(
         "--replication",
         [this](const std::string& text) {
           replication = text;
           try {
             const auto counts = replication_counts();
             if (stages_option->count() > 0 && static_cast<int>(counts.size()) != stages)
               throw UsageError("--replication " + text + " names " + std::to_string(counts.size()) +
                                " stages but --stages is " + std::to_string(stages) + ": give one count per stage");
             stages = static_cast<int>(counts.size());
           } catch (const UsageError& e) {
             throw CLI::ValidationError("--replication", e.what());
           }
         },
         "replicas per stage, e.g. 3,1 (PipeDream's 1F1B-RR: micro-batches round robin over a stage's replicas, "
                 "gradients summed before the step; the ranks are their sum); gpipe or 1f1b");
  app.add_option("--plan-use", plan_use,
                 "which plan of a --plan file to run: pipeline (the chosen straight pipeline, default) or pipedream "
                 "(the PipeDream planner's, with its stage replication)")
      ->check(CLI::IsMember({"pipeline", "pipedream"}));
  app.add_option_function<std::string>(
      "--plan", [this, &app](const std::string& path) { apply_plan(path, app); },
      "a plan from pipetrain plan: its balance, schedule, micro-batch count, replication (copies of the pipeline, "
      "or PipeDream's per stage), placement, mini-batch and threads per rank (--schedule, --microbatches, --balance, "
      "--batch-size and --threads given here win; --stages and replication flags must agree with the file)");
  app.add_option("--profile", profile_file,
                 "a profile from pipetrain profile (JSON) to balance by time or memory; default: measure the model");
  app.add_option("--checkpoint", checkpoint, "re-materialisation: always, except_last or never; default never (the last stage, whose forward ends in the loss, is never re-materialised)");
  app.add_option("--backward-split", backward_split,
                 "schedules with W (zb-*, v-*, dualpipev, interleaved-zb): auto (autograd splits B and W for any layer, "
                 "pipetrain::nn::Linear by its own split), autograd (every layer through autograd) or explicit (only "
                 "pipetrain::nn::Linear defers its weight gradients); default auto")
      ->check(CLI::IsMember({"auto", "autograd", "explicit"}));
  app.add_option("--transport", transport,
                 "local (threads in this process), shm (processes on this host, over shared memory), gloo, mpi "
                 "(under mpirun), nccl (CUDA ranks on distinct GPUs; builds against a CUDA LibTorch), or auto: mpi "
                 "under mpirun, nccl for --device cuda ranks with a GPU each (when built with it), shm for ranks "
                 "pipetrain starts on this host, gloo otherwise; default auto");
  app.add_option("--threads", threads, "intra-op threads per rank; default: a --plan's (its profile's), else cores / ranks");
  app.add_option("--placement", placement,
                 "with --replicas: pipeline-inner (a copy's ranks side by side, default) or replicas-inner (a stage's "
                 "copies side by side, world rank = stage x replicas + copy); default: a --plan's")
      ->check(CLI::IsMember({"pipeline-inner", "replicas-inner"}));
  app.add_option("--replicas", replicas,
                 "data parallelism across pipelines: R copies of the pipeline (R x stages ranks), each on 1/R of the "
                 "mini-batch, gradients averaged per stage before the step; default 1");
  app.add_flag("--reference", reference, "use the blocking reference executor instead of the fast path");
  app.add_option("--device", device,
                 "cpu (default), cuda (local rank r on GPU r mod the GPU count) or cuda:N; cuda needs a CUDA LibTorch");
  app.add_option("--precision", precision,
                 "fp32 (default) or bf16: forwards under autocast to bfloat16 (activations, their gradients and the "
                 "transfers in bf16; weights, gradients, optimizer state and loss in float32)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
}

std::vector<int> PipelineFlags::replication_counts() const {
  if (replication.empty()) return {};
  std::vector<int> out;
  std::stringstream in(replication);
  std::string item;
  while (std::getline(in, item, ',')) {
    std::size_t used = 0;
    int r = 0;
    try {
      r = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || r < 1)
      throw UsageError("--replication " + replication + ": '" + item +
                       "' is not a replica count >= 1; give one count per stage, e.g. 3,1");
    out.push_back(r);
  }
  return out;
}

int PipelineFlags::world_size() const {
  // In 64 bits, saturated: --stages 100000 --replicas 100000 must not wrap to a small or negative count.
  long long total = 0;
  if (replication.empty()) {
    total = static_cast<long long>(stages) * replicas;
  } else {
    for (int r : replication_counts()) total = std::min<long long>(total + r, std::numeric_limits<int>::max());
  }
  return static_cast<int>(std::min<long long>(total, std::numeric_limits<int>::max()));
}


torch::Device device_of_flag(const std::string& device, int local_rank) {
  if (device == "cpu") return torch::kCPU;
  if (device.rfind("cuda", 0) != 0) throw UsageError("--device " + device + " is not a device: use cpu, cuda or cuda:N");
  if (!torch::cuda::is_available())
    throw UsageError("--device " + device + ": this LibTorch has no CUDA device; build against a CUDA LibTorch "
                     "(make build TORCH_DIR=...) on a machine with a GPU, or use --device cpu");
  const int gpus = static_cast<int>(torch::cuda::device_count());
  torch::Device d = torch::kCPU;
  try {
    d = device == "cuda" ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % gpus))
                         : torch::Device(device);
  } catch (const std::exception&) {
    throw UsageError("--device " + device + " is not a device: use cpu, cuda or cuda:N");
  }
  if (d.index() >= gpus)
    throw UsageError("--device " + device + ": there are only " + std::to_string(gpus) + " GPUs (0.." +
                     std::to_string(gpus - 1) + ")");
  return d;
}

int device_rank(const std::string& transport, int world_rank) {
  if (transport != "local")
    if (const char* v = std::getenv("LOCAL_RANK"); v && *v) {
      char* end = nullptr;
      const long r = std::strtol(v, &end, 10);
      if (*end == '\0' && r >= 0) return static_cast<int>(r);
    }
  return world_rank;
}

PipelineOptions PipelineFlags::options(uint64_t seed, int local_rank) const {
  PipelineOptions o;
  o.device = device_of_flag(device, local_rank);
  o.precision = precision;
  o.schedule = schedule;
  o.microbatches = microbatches;
  o.virtual_stages = virtual_stages;
  o.replication = replication_counts();
  o.balance = balance;
  o.checkpoint = parse_checkpoint(checkpoint);
  o.backward_split = backward_split;
  o.seed = seed;
  o.reference = reference;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (threads < 0) throw UsageError("--threads must be >= 0, got " + std::to_string(threads));
  // Past a few threads per core LibTorch only adds contention (and --threads 1000000 created threads until
  // the machine ran out).
  if (threads > 4 * cores && !threads_from.empty())  // the user gave no --threads: say where it came from
    throw UsageError(threads_from + " runs " + std::to_string(threads) + " threads per rank (its profile was measured "
                     "with them), more than 4 per core of this host's " + std::to_string(cores) + ": give --threads N "
                     "(at most " + std::to_string(4 * cores) + "; 0: cores / ranks) to run it here, or profile and plan "
                     "on this host");
  if (threads > 4 * cores)
    throw UsageError("--threads " + std::to_string(threads) + " is more than 4 per core of this host's " +
                     std::to_string(cores) + ": use at most " + std::to_string(4 * cores) + " (or 0: cores / ranks)");
  o.threads = threads > 0 ? threads : std::max(1, cores / std::max(1, world_size()));
  return o;
}

namespace {
bool measured_kind(const std::string& kind) { return kind == "time" || kind == "memory"; }
}  // namespace

void check_balance_flags(const PipelineFlags& pipe, const ModelFlags& model) {
  parse_balance_solver(pipe.balance_solver);
  const int stages = pipe.stages * stages_per_rank(pipe.schedule, pipe.virtual_stages);
  {  // each (virtual) stage needs a layer: the fix is more layers or fewer stages, said in the model's terms
    const int layers = model.layer_count();
    if (stages > layers) {
      const std::string asked = stages > pipe.stages
                                    ? fmt::format("--stages {} x {} stages per rank = {} stages", pipe.stages,
                                                  stages / pipe.stages, stages)
                                    : fmt::format("--stages {}", stages);
      std::string more;
      if (model.model == "gpt")
        more = fmt::format("give the gpt --layers {} or more (it has --layers + 2 pipeline layers)", stages - 2);
      else if (model.model == "mlp")
        more = fmt::format("give the mlp --layers {} or more", stages);
      else
        more = "use a model with more layers";
      throw UsageError(fmt::format("{} but the {} has {} pipeline layers, and every stage needs at least one: {}, or "
                                   "use fewer stages",
                                   asked, model.model, layers, more));
    }
  }
  if (!pipe.profile_file.empty()) {
    const Profile p = load_profile(pipe.profile_file);
    const int layers = model.layer_count();
    if (static_cast<int>(p.layers.size()) != layers)
      throw UsageError("--profile " + pipe.profile_file + " has " + std::to_string(p.layers.size()) +
                       " layers but the model has " + std::to_string(layers) +
                       ": profile this model (pipetrain profile with the same model flags)");
    plan_balance(p, stages, pipe.balance, parse_balance_solver(pipe.balance_solver));
  } else if (!measured_kind(pipe.balance)) {
    model.choose_balance(stages, pipe.balance, pipe.balance_solver);
  }
}

namespace {

// Rank 0's measurement of the model on a micro-batch of its data (one layer at a time for a model given
// layer by layer: rank 0 never holds the gpt whole). `repeats` timed runs per measurement.
Profile measure_model(const ModelFlags& model, const PipelineFlags& pipe, int64_t micro_batch, int repeats) {
  const zoo::Batch b = model.dataset()->batch(0, std::max<int64_t>(1, micro_batch));
  ProfilerOptions o;
  o.repeats = repeats;
  o.warmup = 1;
  o.loss = model.mean_loss();
  o.target = b.target;
  o.backward_split = pipe.backward_split;  // B and W (and what W keeps) as the run splits them
  const auto layers = model.layerwise();
  return layers ? profile_model(*layers, b.input, o) : profile_model(model.factory()(), b.input, o);
}

}  // namespace

std::vector<int> resolve_balance(const PipelineFlags& pipe, const ModelFlags& model, int64_t micro_batch,
                                 Transport& transport, std::optional<Profile>* profile) {
  const int stages = pipe.stages * stages_per_rank(pipe.schedule, pipe.virtual_stages);
  const BalanceSolver solver = parse_balance_solver(pipe.balance_solver);
  const bool keep = profile && transport.rank() == 0;
  std::vector<int> balance;
  if (!pipe.profile_file.empty()) {
    const Profile p = load_profile(pipe.profile_file);
    balance = plan_balance(p, stages, pipe.balance, solver);
    if (keep) *profile = p;
  } else if (!measured_kind(pipe.balance)) {
    if (profile) {
      // Only the memory columns are wanted, so one timed run; the others wait, so that no rank sharing
      // this process allocates while the heap is measured.
      if (keep) *profile = measure_model(model, pipe, micro_batch, 1);
      torch::Tensor done = torch::zeros({1}, torch::kDouble);
      transport.all_reduce_sum(done);
    }
    if (solver == BalanceSolver::min_max) return {};  // PipelineOptions::balance (the kind) does it
    balance = model.choose_balance(stages, pipe.balance, pipe.balance_solver);
  } else {
    // Measured on rank 0 only, so every rank cuts the model the same way.
    torch::Tensor counts = torch::zeros({stages}, torch::kDouble);
    if (transport.rank() == 0) {
      const Profile p = measure_model(model, pipe, micro_batch, 5);
      const auto mine = plan_balance(p, stages, pipe.balance, solver);
      for (int s = 0; s < stages; ++s) counts[s] = mine[static_cast<std::size_t>(s)];
      if (keep) *profile = p;
    }
    transport.all_reduce_sum(counts);
    for (int s = 0; s < stages; ++s) balance.push_back(static_cast<int>(counts[s].item<double>()));
  }
  return balance;
}

std::shared_ptr<Transport> PipelineFlags::placed_world(const std::shared_ptr<Transport>& world) const {
  if (placement != "replicas-inner" || replicas == 1 || stages == 1) return world;
  std::vector<int> members;  // members[k * stages + s]: the world rank of stage s of copy k
  for (int k = 0; k < replicas; ++k)
    for (int s = 0; s < stages; ++s) members.push_back(s * replicas + k);
  return make_group_transport(world, members);
}

std::shared_ptr<Transport> PipelineFlags::pipeline_group(const std::shared_ptr<Transport>& world) const {
  if (replicas == 1) return world;
  const int k = world->rank() / stages;
  std::vector<int> members;
  for (int s = 0; s < stages; ++s) members.push_back(k * stages + s);
  return make_group_transport(world, members);
}

std::shared_ptr<Transport> PipelineFlags::replica_group(const std::shared_ptr<Transport>& world) const {
  if (replicas == 1) return nullptr;
  const int s = world->rank() % stages;
  std::vector<int> members;
  for (int k = 0; k < replicas; ++k) members.push_back(k * stages + s);
  return make_group_transport(world, members);
}

uint64_t fnv1a(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

void check_same_on_every_rank(const nlohmann::json& settings, Transport& world) {
  std::vector<std::string> names;
  for (const auto& [k, v] : settings.items()) names.push_back(k);  // sorted: the same order on every rank
  const int n = world.world_size(), fields = static_cast<int>(names.size());
  // Two collectives of fixed shape: first the whole settings' hash and the number of settings (another
  // build may compare other ones), then, only where they differ and the count agrees, each setting's
  // hash, to name what differs. Hashes travel as two 32-bit halves, exact in a double.
  const auto put = [](torch::Tensor row, int at, uint64_t h) {
    row[at] = static_cast<double>(h >> 32);
    row[at + 1] = static_cast<double>(h & 0xffffffffULL);
  };
  torch::Tensor whole = torch::zeros({n, 3}, torch::kDouble);
  whole[world.rank()][0] = fields;
  put(whole[world.rank()], 1, fnv1a(settings.dump()));
  world.all_reduce_sum(whole);
  bool same = true, same_count = true;
  for (int r = 1; r < n; ++r) {
    same = same && torch::equal(whole[r], whole[0]);
    same_count = same_count && whole[r][0].item<double>() == fields;
  }
  if (same) return;
  std::vector<std::string> differ;
  int first = 1;
  if (same_count) {
    torch::Tensor t = torch::zeros({n, 2 * fields}, torch::kDouble);
    for (int i = 0; i < fields; ++i) put(t[world.rank()], 2 * i, fnv1a(settings[names[static_cast<std::size_t>(i)]].dump()));
    world.all_reduce_sum(t);
    while (first < n && torch::equal(t[first], t[0])) ++first;
    for (int i = 0; i < fields && first < n; ++i)
      if (!torch::equal(t[first].slice(0, 2 * i, 2 * i + 2), t[0].slice(0, 2 * i, 2 * i + 2)))
        differ.push_back(names[static_cast<std::size_t>(i)]);
  } else {
    while (first < n && torch::equal(whole[first], whole[0])) ++first;
  }
  throw UsageError(fmt::format(
      "rank {} was started with other settings than rank 0: {}: start every rank with the same flags and files "
      "(only output file names may differ)",
      first,
      differ.empty() ? std::string("it compares another list of settings (another pipetrain build?)")
                     : fmt::format("{} differ{}", fmt::join(differ, ", "), differ.size() == 1 ? "s" : "")));
}


namespace {
bool launched() { return std::getenv("RANK") || std::getenv("OMPI_COMM_WORLD_RANK"); }
}  // namespace

int run_ranks(const PipelineFlags& flags, int argc, char** argv,
              const std::function<int(std::shared_ptr<Transport>)>& body) {
  if (flags.stages < 1) throw UsageError("--stages must be >= 1, got " + std::to_string(flags.stages));
  if (flags.replicas < 1) throw UsageError("--replicas must be >= 1, got " + std::to_string(flags.replicas));
  const int world = flags.world_size();
  const std::string& t = flags.transport;
  if (t != "local" && t != "shm" && t != "gloo" && t != "mpi" && t != "nccl" && t != "auto")
    throw UsageError("unknown transport '" + t + "': use local, shm, gloo, mpi, nccl or auto");
  if (t == "gloo" && !gloo_transport_available()) throw UsageError("--transport gloo: " + gloo_transport_absent_reason());
  if (t == "nccl" && !nccl_transport_available()) throw UsageError("--transport nccl: " + nccl_transport_absent_reason());
  if (t == "nccl" && flags.device.rfind("cuda", 0) != 0)
    throw UsageError("--transport nccl moves CUDA tensors, but --device is " + flags.device +
                     ": use --device cuda (each rank on its own GPU), or --transport shm, gloo or mpi for CPU ranks");
  // A device this build or host lacks: one message before any rank starts (selftest said it from rank 1
  // only, after starting the ranks).
  if (flags.device != "cpu") (void)device_of_flag(flags.device, 0);
  // Ranks this process starts itself (threads, or processes through the launcher) are bounded by what
  // one host serves; the message names the user's flags, not the launcher's -n.
  if ((t == "local" || (!launched() && t != "mpi")) && world > kMaxLocalRanks) {
    const std::string given =
        !flags.replication.empty()
            ? "--replication " + excerpt(flags.replication) + " adds up to " + std::to_string(world) + " ranks"
            : "--stages " + std::to_string(flags.stages) +
                  (flags.replicas > 1 ? " x --replicas " + std::to_string(flags.replicas) : "") + " is " +
                  std::to_string(world) + " ranks";
    throw UsageError(given + ", more than the " + std::to_string(kMaxLocalRanks) +
                     " one host runs (one rank per stage replica): give at most " + std::to_string(kMaxLocalRanks) +
                     " in all" + (flags.replication.empty() && flags.replicas == 1
                                      ? " (--stages <= " + std::to_string(kMaxLocalRanks) + ")"
                                      : "") +
                     ", or start the ranks on several hosts with torchrun or mpirun");
  }
  // Under a launcher that started several processes, each would run the whole pipeline on its own
  // threads: WORLD_SIZE complete runs writing the same --save and --log (pipetrain launch -n 2 -- ...
  // --transport local did).
  if (t == "local" && launched()) {
    const char* ws = std::getenv("WORLD_SIZE");
    if (!ws) ws = std::getenv("OMPI_COMM_WORLD_SIZE");
    if (ws && std::atoi(ws) > 1)
      throw UsageError(std::string("--transport local runs every rank as a thread of one process, but a launcher "
                                   "started this one as one of WORLD_SIZE=") + ws + " processes: use --transport shm, "
                       "gloo or mpi (or auto) under a launcher, or run pipetrain train --transport local without one");
  }
  if (t == "local") {
    auto transports = make_local_transports(world);
    std::vector<int> codes(static_cast<std::size_t>(world), 0);
    run_on_threads(
        world, [&](int r) { codes[static_cast<std::size_t>(r)] = body(transports[static_cast<std::size_t>(r)]); },
        [&](int r) { transports[static_cast<std::size_t>(r)]->abort("rank " + std::to_string(r) + " failed"); });
    for (int c : codes)
      if (c != 0) return c;
    return 0;
  }
  if (!launched()) {
    if (t == "mpi")
      throw UsageError("--transport mpi needs ranks started by mpirun, e.g. mpirun -n " + std::to_string(world) +
                       " pipetrain ...; or use --transport gloo");
    std::vector<std::string> args{"/proc/self/exe"};
    for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
    // Ranks on this host: "auto" means shm. Gloo ranks are pinned to cores, shm ranks are not: each was
    // the faster placement for its transport (LaunchOptions::bind_cores).
    LaunchOptions options;
    options.bind_cores = t == "gloo";
    return launch_local(world, args, options);
  }
  auto mismatch = [&](int started) {
    return "the launcher started " + std::to_string(started) + " ranks (its world size in the environment; if no "
           "launcher started this process, unset RANK and WORLD_SIZE, leftovers of another tool, and pipetrain starts "
           "its own ranks) but --stages is " +
           std::to_string(flags.stages) + (flags.replicas > 1 ? " x --replicas " + std::to_string(flags.replicas) : "") +
           (flags.replication.empty() ? "" : " replicated " + flags.replication + " (their sum)") + ": launch " +
           std::to_string(world) + " ranks" +
           // --stages S x --replicas R needs S x R ranks: the stages that fit, where R divides the count.
           (!flags.replication.empty() || started % std::max(1, flags.replicas) != 0 ||
                    started / std::max(1, flags.replicas) == flags.stages
                ? std::string()
                : " or pass --stages " + std::to_string(started / std::max(1, flags.replicas)));
  };
  // The launcher's world size, checked before the rendezvous: every rank refuses it on its own (exit 2),
  // rather than the first to check aborting the others (exit 1 there).
  for (const char* var : {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"})
    if (const char* v = std::getenv(var)) {
      const int started = std::atoi(v);
      if (started > 0 && started != world) throw UsageError(mismatch(started));
      break;
    }
  // The device decides whether auto means nccl (CUDA ranks on distinct GPUs), and nccl needs it.
  torch::Device device = torch::kCPU;
  if (flags.device != "cpu" && (t == "nccl" || t == "auto")) {
    const char* rank = std::getenv("RANK") ? std::getenv("RANK") : std::getenv("OMPI_COMM_WORLD_RANK");
    device = device_of_flag(flags.device, device_rank(t, rank ? std::atoi(rank) : 0));
  }
  auto transport = make_process_transport(t, device, flags.device == "cuda");
  if (transport->world_size() != world) {
    const std::string msg = mismatch(transport->world_size());
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

// Reads what the linked LibTorch reports about itself. Only light ATen/c10 headers are included
// here; this file needs none of torch/torch.h.
#include "pipetrain/runtime/info.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <dlfcn.h>
#include <fmt/format.h>

#include "pipetrain/runtime/transport.h"

#include <climits>
#include <cstdlib>

namespace pipetrain {
namespace {

// The value of `KEY=value` in show_config()'s "Build settings" line (comma-separated), or "".
std::string config_value(const std::string& config, const std::string& key) {
  const std::string needle = key + "=";
  for (size_t pos = config.find(needle); pos != std::string::npos;
       pos = config.find(needle, pos + 1)) {
    const bool at_token_start = pos == 0 || config[pos - 1] == ' ' || config[pos - 1] == ',';
    if (!at_token_start) continue;
    const size_t begin = pos + needle.size();
    const size_t end = config.find_first_of(",\n", begin);
    return config.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
  }
  return "";
}

std::string blas_from_config(const std::string& config) {
  const std::string info = config_value(config, "BLAS_INFO");
  if (info == "mkl") return "MKL";
  if (info == "open") return "OpenBLAS";
  if (info == "eigen") return "Eigen";
  if (info == "accelerate" || info == "veclib") return "Accelerate";
  if (!info.empty()) return info;  // "generic" (the system libblas.so.3), "blis", "atlas", ...
  if (config.find("Math Kernel Library") != std::string::npos) return "MKL";
  if (config.find("Eigen") != std::string::npos) return "Eigen";
  return "unknown";
}

// Which library the process resolves sgemm_ to, and OpenBLAS's own description when it is
// OpenBLAS. Empty when sgemm_ is not visible (e.g. MKL linked statically into libtorch_cpu).
std::string loaded_blas() {
  void* sgemm = dlsym(RTLD_DEFAULT, "sgemm_");
  if (sgemm == nullptr) return "";
  std::string path;
  Dl_info where{};
  if (dladdr(sgemm, &where) != 0 && where.dli_fname != nullptr) {
    char resolved[PATH_MAX];
    path = realpath(where.dli_fname, resolved) != nullptr ? resolved : where.dli_fname;
  }
  using ConfigFn = const char* (*)();
  if (auto config = reinterpret_cast<ConfigFn>(dlsym(RTLD_DEFAULT, "openblas_get_config"))) {
    std::string name = config();
    while (!name.empty() && name.back() == ' ') name.pop_back();
    return path.empty() ? name : fmt::format("{} ({})", name, path);
  }
  return path;
}

}  // namespace

RuntimeInfo runtime_info() {
  RuntimeInfo info;
  info.build_config = at::show_config();
  info.torch_version = config_value(info.build_config, "TORCH_VERSION");
  if (info.torch_version.empty()) info.torch_version = TORCH_VERSION;
  info.intra_op_threads = at::get_num_threads();
  info.inter_op_threads = at::get_num_interop_threads();
  info.cuda_available = torch::cuda::is_available();
  info.cuda_devices = static_cast<int>(torch::cuda::device_count());
  info.blas = blas_from_config(info.build_config);
  info.blas_library = loaded_blas();
  info.gloo = gloo_transport_available();
  info.nccl = nccl_transport_available();
  return info;
}

std::string describe(const RuntimeInfo& info) {
  std::string blas = info.blas;
  if (!info.blas_library.empty()) blas += fmt::format(" -> {}", info.blas_library);
  const std::string cuda =
      info.cuda_available ? fmt::format("{} device(s)", info.cuda_devices) : std::string("none");
  return fmt::format(
      "LibTorch {}, {} intra-op thread(s), {} inter-op thread(s)\n"
      "BLAS: {}\n"
      "CUDA: {}\n"
      "Transports: local, shm, mpi{}{}{}\n",
      info.torch_version, info.intra_op_threads, info.inter_op_threads, blas, cuda, info.gloo ? ", gloo" : "",
      info.nccl ? ", nccl" : "",
      !info.gloo && !info.nccl ? " (no gloo, no nccl in this build)"
      : !info.gloo             ? " (no gloo in this build)"
      : !info.nccl             ? " (no nccl in this build)"
                               : "");
}

}  // namespace pipetrain

// What the LibTorch build this binary links against can do: version, threads, BLAS, CUDA.
// Printed by `pipetrain info` and recorded in every benchmark's output. Any thread may call it.
#pragma once

#include <string>

namespace pipetrain {

struct RuntimeInfo {
  std::string torch_version;   // e.g. "1.13.0" (what Debian's 1.13.1 package calls itself)
  int intra_op_threads = 0;    // at::get_num_threads()
  int inter_op_threads = 0;    // at::get_num_interop_threads()
  bool cuda_available = false; // torch::cuda::is_available()
  int cuda_devices = 0;        // torch::cuda::device_count()
  std::string blas;            // BLAS named in LibTorch's build configuration, or "unknown"
  std::string blas_library;    // the BLAS actually loaded, when it can tell (e.g. "OpenBLAS 0.3.21
                               // ... (/usr/lib/.../openblas-openmp/libblas.so.3)"), else empty.
                               // Matters where blas is "generic": Debian's libblas.so.3 alternative.
  std::string build_config;    // at::show_config(), verbatim
  bool gloo = false;           // this build has the gloo transport (gloo_transport_available())
  bool nccl = false;           // this build has the nccl transport (nccl_transport_available())
};

RuntimeInfo runtime_info();

// A few human-readable lines: "LibTorch 1.13.1, 2 intra-op threads, BLAS ..., CUDA: none", and the
// process transports of this build ("Transports: local, shm, mpi, gloo (no nccl in this build)").
std::string describe(const RuntimeInfo& info);

}  // namespace pipetrain

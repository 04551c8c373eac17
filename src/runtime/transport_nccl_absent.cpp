// Built in place of transport_nccl.cpp when the build has no nccl transport (cmake/PipetrainNccl.cmake:
// a LibTorch without CUDA or without c10d's NCCL headers, LibTorch 1.x, or PIPETRAIN_NCCL=OFF). CMake
// passes the reason as PIPETRAIN_NCCL_ABSENT_WHY.
#include "pipetrain/core/error.h"
#include "pipetrain/runtime/transport.h"

#ifndef PIPETRAIN_NCCL_ABSENT_WHY
#define PIPETRAIN_NCCL_ABSENT_WHY "its LibTorch has no c10d NCCL"
#endif

namespace pipetrain {

bool nccl_transport_available() { return false; }

std::string nccl_transport_absent_reason() {
  return std::string("this pipetrain was built against a LibTorch without NCCL (") + PIPETRAIN_NCCL_ABSENT_WHY +
         "); use --transport gloo|shm|mpi, or rebuild against a CUDA LibTorch (make build TORCH_DIR=...; see "
         "PIPETRAIN_NCCL in the README)";
}

std::shared_ptr<Transport> make_nccl_transport(const Rendezvous&, const torch::Device&) {
  throw UsageError(nccl_transport_absent_reason());
}

}  // namespace pipetrain

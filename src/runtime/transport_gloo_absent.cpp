// Built in place of transport_gloo.cpp when the build has no gloo transport (cmake/PipetrainGloo.cmake:
// no Gloo headers known to match this LibTorch's Gloo, e.g. pip's PyTorch, or PIPETRAIN_GLOO=OFF).
#include "pipetrain/core/error.h"
#include "pipetrain/runtime/transport.h"

namespace pipetrain {

bool gloo_transport_available() { return false; }

std::string gloo_transport_absent_reason() {
  return "this pipetrain was built without the gloo transport (its LibTorch ships no Gloo headers known to "
         "match the Gloo inside it, e.g. pip's PyTorch; see PIPETRAIN_GLOO in the README): use shm (ranks on "
         "one host started by `pipetrain train`/`selftest` or `pipetrain launch -n P -- ...`), mpi (under "
         "mpirun: --transport mpi) or local (threads of one process: --transport local)";
}

std::shared_ptr<Transport> make_gloo_transport(const Rendezvous&) { throw UsageError(gloo_transport_absent_reason()); }

}  // namespace pipetrain

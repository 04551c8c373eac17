// Rendezvous::from_environment (transport.h): where a multi-process rank finds its peers. Shared by the
// shm, gloo and mpi transports; needs no Gloo.
#include <string>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/transport.h"
#include "transport_util.h"

namespace pipetrain {

using detail::getenv_string;
using detail::parse_integer;

Rendezvous Rendezvous::from_environment() {
  Rendezvous rv;
  // Open MPI's variables come first: mpirun sets them for each process, whereas RANK may be inherited
  // from an outer launcher and then be the same in every process.
  const bool mpi = getenv_string("OMPI_COMM_WORLD_SIZE").has_value();
  const char* rank_var = mpi ? "OMPI_COMM_WORLD_RANK" : "RANK";
  const char* size_var = mpi ? "OMPI_COMM_WORLD_SIZE" : "WORLD_SIZE";
  const std::string how =
      "start the ranks with `pipetrain launch -n P -- ...`, torchrun or mpirun, or set RANK and WORLD_SIZE";

  const auto size_text = getenv_string(size_var);
  if (!size_text) {
    // RANK alone is most often a leftover of another tool in the environment: it made this process one
    // rank of a launch that does not exist, and "set WORLD_SIZE" then waited for ranks that never came.
    const auto rank_text = getenv_string(rank_var);
    if (rank_text)
      throw UsageError(std::string(rank_var) + "=" + *rank_text + " is set in the environment, so this process was "
                       "taken for one rank started by a launcher, but " + size_var + " is not set: if no launcher "
                       "started it, `unset " + rank_var + "` and pipetrain starts its own ranks; otherwise " + how);
    throw UsageError(std::string(size_var) + " is not set: " + how);
  }
  const auto size = parse_integer(*size_text);
  if (!size || *size < 1 || *size > 1000000)
    throw UsageError(std::string(size_var) + "=" + *size_text + " is not a process count: set " + size_var +
                     " to the number of ranks (>= 1)");
  rv.world_size = static_cast<int>(*size);

  const auto rank_text = getenv_string(rank_var);
  if (!rank_text) throw UsageError(std::string(rank_var) + " is not set: " + how);
  const auto rank = parse_integer(*rank_text);
  if (!rank)
    throw UsageError(std::string(rank_var) + "=" + *rank_text + " is not a rank number: set " + rank_var + " to 0.." +
                     std::to_string(rv.world_size - 1));
  if (*rank < 0 || *rank >= rv.world_size)
    throw UsageError(std::string(rank_var) + "=" + *rank_text + " is out of range for " + size_var + "=" +
                     *size_text + ": set " + rank_var + " to 0.." + std::to_string(rv.world_size - 1));
  rv.rank = static_cast<int>(*rank);

  if (const auto addr = getenv_string("MASTER_ADDR")) {
    if (addr->empty()) throw UsageError("MASTER_ADDR is set but empty: set it to rank 0's host, e.g. 127.0.0.1");
    rv.master_addr = *addr;
  }
  if (const auto port_text = getenv_string("MASTER_PORT")) {
    const auto port = parse_integer(*port_text);
    if (!port || *port < 1 || *port > 65535)
      throw UsageError("MASTER_PORT=" + *port_text +
                       " is not a port number: set MASTER_PORT to 1..65535 (default 29500)");
    rv.master_port = static_cast<int>(*port);
  }
  return rv;
}

}  // namespace pipetrain

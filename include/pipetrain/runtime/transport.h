// Transports move tensors between the ranks of a pipeline. One small interface, four implementations:
//   local  (transport_local.cpp): ranks are threads of one process; for tests and single-process use.
//   shm    (transport_shm.cpp):   ranks are processes on one host; rings in one shared-memory segment,
//                                  introduced through the rendezvous store (runtime/store.h).
//   gloo   (transport_gloo.cpp):  ranks are processes; c10d's ProcessGroupGloo over pipetrain's own
//                                  rendezvous store (runtime/store.h), or torchrun's TCPStore under torchrun.
//   mpi    (transport_mpi.cpp):   ranks are processes started by mpirun; Open MPI point-to-point (CPU).
//   nccl   (transport_nccl.cpp):  ranks are processes with one CUDA device each (distinct GPUs);
//                                  c10d's ProcessGroupNCCL over the same rendezvous store as gloo's.
//                                  Only in builds against a CUDA LibTorch with c10d NCCL.
//
// Contract shared by all of them (tested once for each in tests/runtime/test_transport.cpp and
// test_transport_conformance.cpp):
// - isend/irecv return at once; the tensors must stay alive (and, for isend, unchanged) until wait()
//   returns. A receive's tensor is preallocated with the agreed shape and dtype; a message whose size
//   differs is an error, never a hang or a silent truncation.
// - Messages between one pair of ranks with the same tag arrive in the order they were sent.
// - A transport keeps nothing per tag once that tag's messages are received, so a program may use new
//   tags all the time (a step counter in the tag, say) without the transport growing.
// - Collectives (all_reduce_sum, barrier) must be called by every rank in the same order.
// - Failure: abort(message) tells every other rank that this rank failed. From then on, a blocked or new
//   operation on any rank fails with RemoteFailure naming the failed rank and its message (the process
//   transports may instead print that message and exit the process with code 1). A rank that dies
//   without calling abort (killed) is detected too. Either way every rank stops within 30 s; the gloo
//   transport's ranks within a second or two of a death (at any phase, the rendezvous included) and
//   within its heartbeat timeout + 5 s of a hang or a silent network.
// - Finishing: a rank whose transport is destroyed (local: also whose thread of run_on_threads returned)
//   has finished. A rank that waits for a message from it that it never sent, or in a collective it
//   never called, fails within seconds with std::runtime_error "rank K finished while rank R waits for
//   ..." (the ranks made different calls: different numbers of steps, say) and is expected to abort()
//   with it (gloo stops the process of a rank blocked in such a collective itself). A message sent to a
//   rank that finished without receiving it fails the send (shm, mpi: once it cannot be buffered) or
//   stops every rank (gloo, whose large sends would wait for good); local buffers every send. A
//   destructor that waits for the other ranks to finish (shm, gloo, mpi) gives up after
//   PIPETRAIN_FINAL_BARRIER_TIMEOUT seconds (default 30 min), naming the ranks it waited for (mpi then
//   leaves without MPI_Finalize, so mpirun stops the job).
// - A transport object belongs to its rank; only that rank's thread calls it (abort may be called from
//   any thread).
// - nccl (tests/runtime/test_transport_nccl.cpp: one rank only, on a GPU) keeps this contract with two
//   differences NCCL imposes: the first isend from one rank to another returns only once that peer
//   waits for a message from it (NCCL connects the pair then), and a send is done (its wait() orders
//   the caller's stream after it; the CPU goes on) only once the receiver has read it, which a rank
//   does while it waits for a message from that sender. See transport_nccl.cpp.
#pragma once

#include <torch/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace pipetrain {

// Another rank failed; `what()` names it and carries its message.
class RemoteFailure : public std::runtime_error {
 public:
  RemoteFailure(int failed_rank, const std::string& message)
      : std::runtime_error("rank " + std::to_string(failed_rank) + " failed: " + message), rank_(failed_rank) {}
  int failed_rank() const { return rank_; }

 private:
  int rank_;
};

// A pending send or receive.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation completed; throws RemoteFailure if a rank failed meanwhile, or
  // std::runtime_error on a transport error (message size mismatch, closed connection, timeout).
  virtual void wait() = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string name() const = 0;  // "local", "shm", "gloo", "mpi" or "nccl"
  // True when all ranks share one process (and so the global RNG): the executor then serialises
  // forwards that consume random numbers, to keep dropout masks deterministic.
  virtual bool shares_process() const { return false; }
  // True when isend and irecv take tensors on a device (a GPU) as they are, ordered by events on the
  // sender's and the receiver's current streams and never through host memory (the local transport);
  // false when a rank must hand them host tensors.
  virtual bool carries_device_tensors() const { return false; }

  virtual std::unique_ptr<Work> isend(const torch::Tensor& tensor, int dst, int tag) = 0;
  virtual std::unique_ptr<Work> irecv(torch::Tensor& tensor, int src, int tag) = 0;

  // Element-wise sum over all ranks, in place (CPU or the transport's device).
  virtual void all_reduce_sum(torch::Tensor& tensor) = 0;
  virtual void barrier() = 0;

  // Marks this rank as failed and tells the others. Never throws; safe from any thread.
  virtual void abort(const std::string& message) noexcept = 0;

  // Blocking conveniences.
  void send(const torch::Tensor& tensor, int dst, int tag) { isend(tensor, dst, tag)->wait(); }
  void recv(torch::Tensor& tensor, int src, int tag) { irecv(tensor, src, tag)->wait(); }
};

// Runs body(r) for r = 0..n-1, each on its own thread, and joins them. If any threw, rethrows the
// failing rank's own error: the first that is not a RemoteFailure (another rank's report of it), else
// the first RemoteFailure. `on_error(r)` runs on rank r's thread right after it threw (optional).
// With local transports (make_local_transports) no thread waits for a failed or finished one: when a
// thread throws, every local transport the call's threads have used is aborted with its error (the
// others stop at once with RemoteFailure carrying it); once a thread has returned, a receive from its
// rank that has no message, or a collective it did not join, fails at once naming both ranks (the
// ranks made different calls, such as different numbers of steps).
void run_on_threads(int n, const std::function<void(int)>& body,
                    const std::function<void(int)>& on_error = {});

// In-process group: `world_size` transports sharing mailboxes; transport r is rank r's (thread's).
// `timeout` bounds any single wait, so a bug can never hang a test forever.
std::vector<std::shared_ptr<Transport>> make_local_transports(
    int world_size, std::chrono::milliseconds timeout = std::chrono::minutes(5));

// Where a multi-process rank finds its peers: the usual rendezvous variables. The gloo transport also
// reads these (transport_gloo.cpp has the details):
//   PIPETRAIN_RUN_TOKEN       the run's secret; the store refuses clients without it. pipetrain launch sets a
//                             fresh one; ranks started by hand without it use none (rank 0 warns when its
//                             store listens on a non-loopback address). Set the same value on every rank.
//   PIPETRAIN_STORE_BIND      the address rank 0's store listens on; default MASTER_ADDR's (0.0.0.0: every
//                             interface, for hosts that reach rank 0 through NAT).
//   PIPETRAIN_LAUNCHER_STORE  HOST:PORT of the store pipetrain launch hosts (set by it; rank 0 then hosts none).
//   TORCHELASTIC_USE_AGENT_STORE=True (torchrun): join the agent's TCPStore at MASTER_ADDR:MASTER_PORT.
struct Rendezvous {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";  // MASTER_ADDR; loopback unless told otherwise
  int master_port = 29500;                // MASTER_PORT
  // Reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, or Open MPI's OMPI_COMM_WORLD_RANK/SIZE.
  // Throws UsageError naming the variable and the value it expected when one is missing or bad.
  static Rendezvous from_environment();
};

// Gloo over TCP (c10d::ProcessGroupGloo with the rendezvous store of runtime/store.h, hosted by the
// launcher or rank 0). Starts a watchdog thread that turns another rank's failure or death into
// RemoteFailure / a clean exit. Throws std::runtime_error when the store refuses this rank (another run's
// token or world size: "ADDR:PORT (MASTER_ADDR:MASTER_PORT) hosts another pipetrain run ...") or the
// rendezvous fails, and RemoteFailure when another rank failed during the rendezvous.
// Without the gloo transport in this build (gloo_transport_available() false) it throws UsageError with
// gloo_transport_absent_reason().
std::shared_ptr<Transport> make_gloo_transport(const Rendezvous& rv);
// Whether this build has the gloo transport: it is left out where no Gloo headers are known to match the
// Gloo inside the LibTorch (pip's PyTorch ships none), or with PIPETRAIN_GLOO=OFF.
bool gloo_transport_available();
// Why it is missing and which transports to use instead ("" when it is there).
std::string gloo_transport_absent_reason();

// Shared memory between processes of one host (transport_shm.cpp has the details): the ranks meet in the
// same rendezvous store as gloo's (the launcher's, or one rank 0 hosts at MASTER_ADDR:MASTER_PORT), map one
// segment that rank 0 creates, and remove its name once all have mapped it. Throws std::runtime_error when
// a rank cannot map it (another host: use gloo) or /dev/shm has no room, RemoteFailure when another rank
// failed during the rendezvous.
std::shared_ptr<Transport> make_shm_transport(const Rendezvous& rv);

// Open MPI point-to-point (CPU tensors). Requires a process started by mpirun; initialises MPI.
std::shared_ptr<Transport> make_mpi_transport();

// A group of some of `base`'s ranks, renumbered 0..n-1 in the order of `members` (which must hold
// base's own rank), for data parallelism across pipelines: one group per pipeline replica for its
// stages' transfers, one per stage for the all-reduce of the replicas' gradients. Point-to-point goes
// straight through `base` (groups whose members never share a pair of ranks cannot mix up messages);
// collectives run as messages with tag `collective_tag`: all_reduce_sum as a reduce-scatter and an
// all-gather between the members (each sends and receives 2 (n - 1) / n of the tensor), every element
// summed in member order by one member, so every member gets bitwise the same result, the same as a sum
// in member order (transport_group.cpp). abort() aborts `base`: every rank stops.
// Collectives of one group must not overlap another group's that shares a pair of ranks.
std::shared_ptr<Transport> make_group_transport(std::shared_ptr<Transport> base, const std::vector<int>& members,
                                                int collective_tag = 32767);

// NCCL (c10d::ProcessGroupNCCL) between processes that each drive one CUDA device, `device` (this
// rank's; cuda:N). Rendezvous, failure board, watchdog and final barrier are the gloo transport's
// (transport_board.h); transport_nccl.cpp has the details (message order, headers, costs). Throws
// UsageError when `device` is not a CUDA device, when two ranks name the same GPU (NCCL refuses that:
// the message names both ranks and the GPU), or, in a build without it (nccl_transport_available()
// false), with nccl_transport_absent_reason().
std::shared_ptr<Transport> make_nccl_transport(const Rendezvous& rv, const torch::Device& device);
// Whether this build has the nccl transport: only a build against a CUDA LibTorch whose headers have c10d's
// ProcessGroupNCCL (CMake option PIPETRAIN_NCCL).
bool nccl_transport_available();
// Why it is missing and which transports to use instead ("" when it is there).
std::string nccl_transport_absent_reason();

// Whether "auto" may choose nccl. Not yet: the nccl transport has been compiled against CUDA headers but has
// not run between ranks on GPUs (issue 26); until it has, a user names it (--transport nccl) and auto keeps
// CUDA ranks in separate processes on shm or gloo. The rule it will follow is below.
inline constexpr bool kAutoPicksNccl = false;

// The transport `name` stands for in a process whose rank computes on `device`: "shm", "gloo", "mpi" and
// "nccl" as they are; "auto": mpi when launched by mpirun; else (once kAutoPicksNccl) nccl when this build has it, `device` is
// a CUDA device, and the ranks on this host (LOCAL_WORLD_SIZE, 1 when unset) have distinct GPUs (`device`
// was picked as cuda:LOCAL_RANK mod the GPU count, i.e. `cuda_device_given_by_rank`, and there are at
// least LOCAL_WORLD_SIZE GPUs); else shm for ranks that pipetrain launch started on this host
// (PIPETRAIN_SHM_PREFIX set); else gloo (torchrun, ranks started by hand, several hosts; a build without
// gloo refuses with the alternatives instead). Every rank decides from its own host's facts, so hosts of
// one run must agree (same GPU count) or name the transport. Throws UsageError listing the valid names
// for an unknown one ("local" is not valid here: it needs make_local_transports).
std::string resolve_process_transport(const std::string& name, const torch::Device& device = torch::kCPU,
                                      bool cuda_device_given_by_rank = true);

// Makes the transport resolve_process_transport names (see there; `device` is the rank's device, which
// nccl needs).
std::shared_ptr<Transport> make_process_transport(const std::string& name, const torch::Device& device = torch::kCPU,
                                                  bool cuda_device_given_by_rank = true);

}  // namespace pipetrain

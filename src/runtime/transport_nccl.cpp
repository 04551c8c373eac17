// The nccl transport: ranks are processes, each driving one CUDA device; c10d::ProcessGroupNCCL moves
// the tensors device to device, and the rendezvous store is the rendezvous and the failure board, as
// for gloo (detail::RunBoard, transport_board.h; transport_gloo.cpp tells that protocol). Built only
// against a CUDA LibTorch 2.x whose headers have c10d's NCCL (cmake/PipetrainNccl.cmake), compiled with
// USE_C10D_NCCL, which ProcessGroupNCCL.hpp needs.
//
// What NCCL does not do, and what this file does about it:
// - Tags. NCCL's point-to-point has none: between two ranks, on one communicator, the k-th receive
//   gets the k-th send, whatever either side meant. So every message is a 72-byte header (tag, dtype,
//   shape, byte count) followed by its payload, and the receiver reads headers in arrival order and
//   matches each with the receive posted for its (source, tag), FIFO, as the gloo transport does. A
//   message that comes before its receive is posted is received into a buffer of its own on the device
//   (stashed), and copied when the receive is posted. So receives may be posted in any order, as the
//   Transport contract allows, and a message is never delivered to the wrong receive.
// - Sizes. NCCL cannot tell a receiver how big an incoming message is, and a receive whose size differs
//   from the send's hangs the GPU or misreads the next message. The header comes first, so the payload
//   is received with the size the header gives: a dtype or size that differs from the posted receive's
//   fails that receive's wait() with both descriptions (the payload is drained into scratch memory and
//   later messages arrive), never a hang. This check costs one device-to-host copy of a header per
//   message, which blocks the receiving CPU until the header has arrived (on a stream of its own, so not
//   behind the rank's queued compute). The consumer of a message waits for it anyway; what is lost is
//   the CPU's run-ahead of kernel launches at that point. The alternative, trusting the executor's own
//   layout agreement (fixed shapes after first use, checked by the sender), would leave a message of an
//   unexpected size to NCCL, i.e. to a hang; so the header stays.
// - Directions. ProcessGroupNCCL gives a pair of ranks one communicator and one stream for both
//   directions, and operations on it run in the order they were issued; a rank that sends a large
//   tensor and then receives, while its peer does the same, deadlocks there. Two process groups keep the
//   directions apart: `up_` carries messages from a lower rank to a higher one, `down_` the others, and
//   `up_` also runs the collectives. Each pair then has one communicator per direction (two in all; NCCL
//   makes them when the pair first talks in that direction, which blocks the sender's isend until the
//   receiver waits for that first message).
// - When receives happen. A receive is issued to NCCL when its wait() needs it (or when a wait for
//   another message from the same source reads past it), not at irecv(): an issued receive blocks its
//   stream until the message comes, and receives posted early (the executor's prefetch) would otherwise
//   queue ahead of sends the peer needs first. Sends are issued at once; their wait() orders the
//   caller's current stream after them and returns without blocking the CPU (NCCL's stream semantics).
// - Progress. NCCL buffers nothing: a send is done only once its receiver has read it, and a rank reads
//   from a source only while it waits for a message from that source (there is no thread per peer as in
//   gloo: ProcessGroupNCCL is not made to be called from several threads at once). The executor waits
//   for its sends at the end of a step and keeps at most `prefetch` sends unfinished (reap_sends), so a
//   sender's stream can stall until its receiver reaches a wait for it. For the pipelines' usual order
//   (a stage reads its input before it needs anything the input's sender makes later) that wait comes;
//   whether every schedule's order avoids a cycle of such stalls has not been checked on hardware.
// - Failure. NCCL operations do not return when a peer dies. The failure board does it: a rank that
//   fails (abort()), dies (its store connection closes without a goodbye), hangs (no heartbeat for
//   PIPETRAIN_HEARTBEAT_TIMEOUT s) or loses the store makes every other rank print
//     pipetrain rank R: stopping: rank K failed: <message>
//   and end its process (std::_Exit(1)) within about a second, whatever its GPU is blocked in. A rank
//   waiting for a message from a rank that finished without sending it fails with "rank K finished while
//   rank R waits for ...": at once when it is about to read the header, or from the watchdog (which then
//   ends the process, as the read cannot be interrupted) when it is reading it already. A rank that
//   finishes with messages received but never matched, or with messages sent to it that it never read,
//   reports them and exits with code 1. NCCL's own operation timeout is 30 min (its watchdog then ends
//   the process); the board's checks come first.
// - Devices. Each rank names its device (cuda:N, `--device cuda` gives cuda:LOCAL_RANK mod the GPU
//   count). NCCL refuses two ranks on one GPU; the ranks publish (host, PCI address) at the rendezvous
//   and two ranks on the same GPU stop with a message naming both. Tensors given on the CPU are copied
//   to the device (through pinned memory) and back; tensors on another device are refused.
//
// Unverified: everything with two or more ranks (messages, stashing, the per-direction groups, the
// failure paths with NCCL blocked, the shared-GPU refusal) has never run on hardware: the machines this
// was written with have one GPU at most. World size 1 (all_reduce_sum, barrier, a one-stage run) is what
// the tests run where a GPU is present; it passed on an H200 with pip's PyTorch 2.11 (BENCHMARKS, run 3).
//
// Environment: that of the gloo transport's store (transport_gloo.cpp), plus NCCL's own (NCCL_DEBUG,
// NCCL_SOCKET_IFNAME, ...) and ProcessGroupNCCL's (TORCH_NCCL_*), passed through untouched.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/store.h"
#include "pipetrain/runtime/transport.h"
#include "torch_compat.h"
#include "transport_board.h"
#include "transport_util.h"

namespace pipetrain {
namespace {

using detail::byte_size;
using detail::RunBoard;
using detail::short_what;
using std::chrono::milliseconds;

constexpr milliseconds kOpTimeout = std::chrono::minutes(30);
constexpr int kMaxTag = (1 << 30) - 1;  // the same range as gloo's

// --- messages ----------------------------------------------------------------------------------

constexpr int kMaxDims = 6;
struct Header {
  uint32_t magic;
  int32_t tag;
  int32_t dtype;  // c10::ScalarType
  int32_t ndim;
  int64_t nbytes;
  int64_t sizes[kMaxDims];  // the first kMaxDims sizes, for error messages
};
static_assert(sizeof(Header) == 72, "the header is part of the wire format");
constexpr uint32_t kMagic = 0x50504e43;  // "PPNC"

std::string describe(const at::Tensor& t) {
  return detail::describe(t.scalar_type(), t.sizes().data(), static_cast<int>(t.dim()), byte_size(t), kMaxDims);
}

std::string describe(const Header& h) {
  const int ndim = std::max(0, std::min<int>(h.ndim, kMaxDims + 1));
  return detail::describe(static_cast<c10::ScalarType>(h.dtype), h.sizes, ndim, h.nbytes, kMaxDims);
}

Header header_for(const at::Tensor& t, int tag) {
  Header h{};
  h.magic = kMagic;
  h.tag = tag;
  h.dtype = static_cast<int32_t>(t.scalar_type());
  h.ndim = static_cast<int32_t>(t.dim());
  h.nbytes = byte_size(t);
  for (int i = 0; i < std::min<int>(h.ndim, kMaxDims); ++i) h.sizes[i] = t.size(i);
  return h;
}

// A contiguous tensor's bytes as a 1-D uint8 tensor (NCCL moves them as ncclUint8, whatever the dtype).
at::Tensor as_bytes(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

// One receive: posted by irecv, matched with its header by the owner thread while it reads headers.
struct PendingRecv {
  enum State { Waiting, Matched, Failed };
  int src = 0;
  int tag = 0;
  at::Tensor buffer;  // on the device, contiguous; the caller's tensor when it is one
  State state = Waiting;
  c10::intrusive_ptr<c10d::Work> work;  // the payload's receive (or the copy's source stash's), once issued
  std::string error;                    // for Failed
};

// A message read before its receive was posted.
struct Stashed {
  Header header;
  at::Tensor bytes;  // on the device
  c10::intrusive_ptr<c10d::Work> work;
};

class NcclTransport;

class NcclSendWork final : public Work {
 public:
  NcclSendWork(NcclTransport& t, int dst, c10::intrusive_ptr<c10d::Work> header, c10::intrusive_ptr<c10d::Work> payload,
               at::Tensor keep_header, at::Tensor keep_payload, std::string what)
      : t_(t),
        dst_(dst),
        header_(std::move(header)),
        payload_(std::move(payload)),
        keep_header_(std::move(keep_header)),
        keep_payload_(std::move(keep_payload)),
        what_(std::move(what)) {}
  void wait() override;

 private:
  NcclTransport& t_;
  int dst_;
  c10::intrusive_ptr<c10d::Work> header_, payload_;
  at::Tensor keep_header_, keep_payload_;
  std::string what_;
};

class NcclRecvWork final : public Work {
 public:
  NcclRecvWork(NcclTransport& t, std::shared_ptr<PendingRecv> rec, at::Tensor target)
      : t_(t), rec_(std::move(rec)), target_(std::move(target)) {}
  void wait() override;

 private:
  NcclTransport& t_;
  std::shared_ptr<PendingRecv> rec_;
  at::Tensor target_;  // the caller's tensor; differs from rec_->buffer when it is not device-contiguous
  bool done_ = false;
};

class NcclTransport final : public Transport {
 public:
  NcclTransport(const Rendezvous& rv, const at::Device& device);
  ~NcclTransport() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string name() const override { return "nccl"; }
  bool carries_device_tensors() const override { return true; }

  std::unique_ptr<Work> isend(const torch::Tensor& tensor, int dst, int tag) override;
  std::unique_ptr<Work> irecv(torch::Tensor& tensor, int src, int tag) override;
  void all_reduce_sum(torch::Tensor& tensor) override;
  void barrier() override;
  void abort(const std::string& message) noexcept override { board_.abort(message); }

 private:
  friend class NcclSendWork;
  friend class NcclRecvWork;

  // Another rank's reported failure stops this rank with it; else throws runtime_error "nccl: OPERATION
  // failed: ERROR".
  [[noreturn]] void fail(const std::string& operation, const std::string& error);
  void check_peer(int peer, int tag, const char* what) const;
  // The group that carries messages from `from` to `to`.
  c10d::ProcessGroupNCCL& group(int from, int to) const { return from < to ? *up_ : *down_; }
  // `t` on this rank's device and contiguous: itself, or a copy (CPU tensors through pinned memory).
  at::Tensor on_device(const at::Tensor& t, const char* what) const;
  // Reads the next header from `src` and receives its payload: into the oldest receive posted for its
  // tag, else into a stash. Blocks until the header has arrived.
  void read_one(int src, const std::string& waiting_for);
  // Matches the receive `rec` with a message: sizes equal? issue its payload receive : fail it.
  void match(PendingRecv& rec, const Header& h);
  // The error of a receive whose message `h` differs in size or dtype, naming both sides.
  std::string mismatch(const PendingRecv& rec, const Header& h) const;
  // The message for "rank K finished while rank R waits for WHAT from rank K".
  std::string finished_while_waiting(int peer, const std::string& what) const;
  // Called by the watchdog when `peer` finished, having sent `sent_here` messages to this rank.
  void peer_finished(int peer, int64_t sent_here);
  // Before the final barrier: messages received that no receive took.
  void check_unreceived();

  RunBoard board_;  // the store, the watchdog, the failure board (transport_board.h)
  int rank_;
  int world_size_;
  at::Device device_;
  std::optional<c10::cuda::CUDAStream> header_stream_;  // where headers are read (not behind compute)
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> up_, down_;

  // Owner thread only.
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<PendingRecv>>> posted_;  // (src, tag), FIFO
  std::map<std::pair<int, int>, std::deque<Stashed>> stashed_;                      // (src, tag), FIFO
  std::vector<int64_t> sent_;  // messages sent per peer
  // Owner thread writes, the watchdog reads.
  std::unique_ptr<std::atomic<int64_t>[]> received_;   // headers read per peer
  std::unique_ptr<std::atomic<int64_t>[]> peer_sent_;  // per peer: -1 until it finished, then what it sent here
  std::atomic<int> reading_from_{-1};                  // the peer whose header the owner is blocked on
  std::mutex reading_mu_;
  std::string reading_what_;  // reading_mu_: what the owner waits for, for the watchdog's message
};

NcclTransport::NcclTransport(const Rendezvous& rv, const at::Device& device)
    : board_(rv, "nccl"), rank_(rv.rank), world_size_(rv.world_size), device_(device) {
  if (!device_.is_cuda())
    throw UsageError("the nccl transport moves CUDA tensors, but rank " + std::to_string(rank_) + "'s device is " +
                     device_.str() + ": use --device cuda (rank r on GPU r mod the GPU count), or a CPU transport "
                     "(--transport shm, gloo or mpi)");
  const int gpus = static_cast<int>(c10::cuda::device_count());
  if (!device_.has_index()) device_ = at::Device(at::kCUDA, c10::cuda::current_device());
  if (device_.index() >= gpus)
    throw UsageError("rank " + std::to_string(rank_) + ": " + device_.str() + " does not exist: this host has " +
                     std::to_string(gpus) + " GPU(s) (cuda:0..cuda:" + std::to_string(gpus - 1) + ")");
  c10::cuda::set_device(device_.index());  // NCCL's communicators are made on the current device
  header_stream_ = c10::cuda::getStreamFromPool(false, device_.index());
  sent_.assign(world_size_, 0);
  received_.reset(new std::atomic<int64_t>[world_size_]);
  peer_sent_.reset(new std::atomic<int64_t>[world_size_]);
  for (int k = 0; k < world_size_; ++k) {
    received_[k] = 0;
    peer_sent_[k] = -1;
  }

  board_.connect(rv);
  board_.set_phase("the rendezvous");
  detail::rendezvous_fault(rank_, "after-join");
  board_.start([this](int peer, int64_t sent_here) { peer_finished(peer, sent_here); });

  // Which GPU this rank drives, by host and PCI address: NCCL refuses two ranks on one GPU, and says so
  // less clearly (or, with some versions, only once the two first talk).
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device_.index());
  char pci[64];
  std::snprintf(pci, sizeof pci, "%04x:%02x:%02x", prop->pciDomainID, prop->pciBusID, prop->pciDeviceID);
  const std::string mine = std::string(host) + " " + pci;
  const auto gpu_key = [](int r) { return "pipetrain/nccl/gpu/" + std::to_string(r); };
  std::string own_error;
  try {
    board_.with_store([&](c10d::Store& store) {
      store.set(gpu_key(rank_), std::vector<uint8_t>(mine.begin(), mine.end()));
    });
    for (int k = 0; k < world_size_ && own_error.empty(); ++k) {
      if (k == rank_) continue;
      // get() waits for the key, and throws RemoteFailure when a rank reports a failure meanwhile.
      const std::vector<uint8_t> raw = board_.store()->get(gpu_key(k));
      if (std::string(raw.begin(), raw.end()) != mine) continue;
      const int a = std::min(k, rank_), b = std::max(k, rank_);
      own_error = "ranks " + std::to_string(a) + " and " + std::to_string(b) + " would share one GPU (" + mine +
                  ", host and PCI address; rank " + std::to_string(rank_) + " has it as " + device_.str() +
                  "), which NCCL refuses: give each rank its own GPU (--device cuda gives rank r GPU r mod the GPU "
                  "count; start at most as many ranks per host as it has GPUs), or use --transport shm or gloo";
    }
  } catch (const RemoteFailure&) {
    board_.stop_threads();
    throw;
  } catch (const std::exception& e) {
    own_error = "rank " + std::to_string(rank_) + " could not exchange its GPU's address through the store: " +
                short_what(e);
  }
  if (!own_error.empty()) {
    board_.abort(own_error);
    board_.stop_threads();
    throw UsageError(own_error);
  }

  // Both groups, and their first collective: it connects each group's communicator of all ranks now,
  // in the rendezvous, rather than in the first step.
  try {
    auto make = [&](const std::string& prefix) {
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = kOpTimeout;
      auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, board_.store());
      return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank_, world_size_, options);
    };
    up_ = make("pipetrain/nccl/up");
    down_ = make("pipetrain/nccl/down");
    c10::cuda::CUDAStreamGuard guard(*header_stream_);
    for (auto* pg : {up_.get(), down_.get()}) {
      std::vector<at::Tensor> one{at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(device_))};
      pg->allreduce(one)->wait();
      if (one[0].item<float>() != static_cast<float>(world_size_))
        throw std::runtime_error("the first all-reduce gave " + std::to_string(one[0].item<float>()) + ", not " +
                                 std::to_string(world_size_));
    }
  } catch (const RemoteFailure&) {
    board_.stop_threads();
    throw;
  } catch (const std::exception& e) {
    std::optional<std::pair<int, std::string>> reported;
    try {
      reported = board_.reported_failure("connecting over NCCL failed: " + short_what(e));
    } catch (...) {
    }
    const std::string own = "rank " + std::to_string(rank_) + " could not connect to the other ranks over NCCL on " +
                            device_.str() + ": " + short_what(e) +
                            ". NCCL_DEBUG=INFO shows why; NCCL_SOCKET_IFNAME picks the network interface";
    if (reported && reported->first != rank_) {
      board_.stop_threads();
      throw RemoteFailure(reported->first, reported->second);
    }
    board_.abort(own);
    board_.stop_threads();
    throw std::runtime_error(own);
  }
  board_.set_connected();
  board_.set_phase("the run");
}

NcclTransport::~NcclTransport() {
  if (std::uncaught_exceptions() > 0 && !board_.aborted())
    board_.abort("its transport was destroyed while an error was propagating (see rank " + std::to_string(rank_) +
                 "'s own output for it)");
  const bool failed = board_.aborted();
  if (!failed) {
    check_unreceived();
    board_.finish(sent_);
    // Every rank has finished: what each sent here is known (the watchdog reads it; wait for it briefly).
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    for (int k = 0; k < world_size_; ++k)
      while (k != rank_ && peer_sent_[k] < 0 && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(milliseconds(20));
    for (int k = 0; k < world_size_; ++k)
      if (k != rank_ && peer_sent_[k] > received_[k])
        board_.stop_process(rank_,
                            "rank " + std::to_string(k) + " sent " + std::to_string(peer_sent_[k].load()) +
                                " message(s) to rank " + std::to_string(rank_) + ", which finished after receiving " +
                                std::to_string(received_[k].load()) +
                                ": do all ranks make the same calls (the same number of train_step calls, say)?",
                            RunBoard::Report::kPublish);
  }
  if (!failed) {
    // With the watchdog still running: should a rank report a failure now (messages sent here never
    // read, above), a shutdown that waits for an unfinished send does not hang this process.
    try {
      compat::shutdown_process_group(*up_);
      compat::shutdown_process_group(*down_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pipetrain rank %d: nccl: shutting the process groups down failed: %s\n", rank_,
                   short_what(e).c_str());
    }
    up_.reset();
    down_.reset();
  } else {
    // After a failure NCCL may be blocked in an operation that never completes; tearing its groups
    // down could wait for it. The process is about to end: leave them.
    (void)up_.release();
    (void)down_.release();
  }
  board_.stop_threads();
  board_.leave(failed, 0);
}

void NcclTransport::fail(const std::string& operation, const std::string& error) {
  if (!board_.aborted())
    if (const auto reported = board_.reported_failure(operation + " failed: " + error))
      if (reported->first >= 0 && reported->first != rank_)
        board_.stop_process(reported->first, reported->second, RunBoard::Report::kAcknowledge);
  throw std::runtime_error("nccl: " + operation + " failed: " + error);
}

void NcclTransport::check_peer(int peer, int tag, const char* what) const {
  if (peer < 0 || peer >= world_size_ || peer == rank_)
    throw std::invalid_argument(std::string("nccl ") + what + ": rank " + std::to_string(peer) +
                                " is not a peer of rank " + std::to_string(rank_) + ": use 0.." +
                                std::to_string(world_size_ - 1) + " except " + std::to_string(rank_));
  if (tag < 0 || tag > kMaxTag)
    throw std::invalid_argument(std::string("nccl ") + what + ": tag " + std::to_string(tag) +
                                " is out of range: use 0.." + std::to_string(kMaxTag));
}

at::Tensor NcclTransport::on_device(const at::Tensor& t, const char* what) const {
  if (t.is_cuda() && t.device() != device_)
    throw std::invalid_argument(std::string("nccl ") + what + ": rank " + std::to_string(rank_) + " drives " +
                                device_.str() + " but was given " + describe(t) + " on " + t.device().str() +
                                ": move it to " + device_.str() + " first");
  if (t.is_cuda()) return t.is_contiguous() ? t : t.contiguous();
  if (!t.device().is_cpu())
    throw std::invalid_argument(std::string("nccl ") + what + ": rank " + std::to_string(rank_) + " was given " +
                                describe(t) + " on " + t.device().str() + ": give CUDA (" + device_.str() +
                                ") or CPU tensors");
  at::Tensor host = t.is_contiguous() ? t : t.contiguous();
  // Through pinned memory, asynchronously on the current stream: no wait for the GPU's queued work.
  return host.pin_memory().to(device_, /*non_blocking=*/true);
}

std::string NcclTransport::finished_while_waiting(int peer, const std::string& what) const {
  return "nccl: rank " + std::to_string(peer) + " finished while rank " + std::to_string(rank_) + " waits for " +
         what + " from it: do all ranks make the same calls (the same number of train_step calls, say)?";
}

void NcclTransport::peer_finished(int peer, int64_t sent_here) {
  peer_sent_[peer] = sent_here;
  // The owner may be blocked reading a header that will never come; that read cannot be interrupted.
  if (reading_from_.load() == peer && received_[peer].load() >= sent_here) {
    std::string what;
    {
      std::lock_guard<std::mutex> lk(reading_mu_);
      what = reading_what_;
    }
    board_.stop_process(rank_, finished_while_waiting(peer, what), RunBoard::Report::kPublish);
  }
}

// --- point-to-point ----------------------------------------------------------------------------

std::unique_ptr<Work> NcclTransport::isend(const torch::Tensor& tensor, int dst, int tag) {
  check_peer(dst, tag, "isend");
  at::Tensor payload = on_device(tensor, "isend");
  const Header h = header_for(payload, tag);
  at::Tensor host = at::empty({static_cast<int64_t>(sizeof(Header))},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), &h, sizeof h);
  at::Tensor header = host.to(device_, /*non_blocking=*/true);
  const std::string what =
      "sending " + describe(payload) + " to rank " + std::to_string(dst) + " (tag " + std::to_string(tag) + ")";
  c10::intrusive_ptr<c10d::Work> hw, pw;
  try {
    std::vector<at::Tensor> hv{header};
    hw = group(rank_, dst).send(hv, dst, 0);
    ++sent_[dst];
    if (h.nbytes > 0) {
      std::vector<at::Tensor> pv{as_bytes(payload)};
      pw = group(rank_, dst).send(pv, dst, 0);
    }
  } catch (const std::exception& e) {
    fail(what, short_what(e));
  }
  return std::make_unique<NcclSendWork>(*this, dst, std::move(hw), std::move(pw), header, payload, what);
}

std::unique_ptr<Work> NcclTransport::irecv(torch::Tensor& tensor, int src, int tag) {
  check_peer(src, tag, "irecv");
  if (!tensor.is_cuda() && !tensor.device().is_cpu())
    throw std::invalid_argument("nccl irecv: rank " + std::to_string(rank_) + " was given " + describe(tensor) +
                                " on " + tensor.device().str() + ": give CUDA (" + device_.str() + ") or CPU tensors");
  if (tensor.is_cuda() && tensor.device() != device_)
    throw std::invalid_argument("nccl irecv: rank " + std::to_string(rank_) + " drives " + device_.str() +
                                " but was given " + describe(tensor) + " on " + tensor.device().str() +
                                ": receive into a tensor on " + device_.str());
  auto rec = std::make_shared<PendingRecv>();
  rec->src = src;
  rec->tag = tag;
  rec->buffer = tensor.device() == device_ && tensor.is_contiguous()
                    ? tensor
                    : at::empty(tensor.sizes(), tensor.options().device(device_));
  if (auto stash = detail::take_oldest(stashed_, {src, tag})) {
    // Read already: its payload went into a stash; copy it on the caller's stream after its receive.
    const Header& h = stash->header;
    if (h.nbytes == byte_size(rec->buffer) && h.dtype == static_cast<int32_t>(rec->buffer.scalar_type())) {
      if (stash->work) stash->work->wait();
      if (h.nbytes > 0) as_bytes(rec->buffer).copy_(stash->bytes);
      rec->state = PendingRecv::Matched;
    } else {
      rec->state = PendingRecv::Failed;  // its payload is in the stash already: nothing to drain
      rec->error = mismatch(*rec, h);
    }
  } else {
    posted_[{src, tag}].push_back(rec);
  }
  return std::make_unique<NcclRecvWork>(*this, rec, tensor);
}

std::string NcclTransport::mismatch(const PendingRecv& rec, const Header& h) const {
  return "nccl: message mismatch from rank " + std::to_string(rec.src) + " (tag " + std::to_string(rec.tag) +
         "): it sent " + describe(h) + " but rank " + std::to_string(rank_) + " expected " + describe(rec.buffer) +
         ": sender and receiver must agree on the tensor's size and dtype";
}

void NcclTransport::match(PendingRecv& rec, const Header& h) {
  const int64_t expected = byte_size(rec.buffer);
  if (h.nbytes == expected && h.dtype == static_cast<int32_t>(rec.buffer.scalar_type())) {
    rec.state = PendingRecv::Matched;
    if (expected > 0) {
      std::vector<at::Tensor> v{as_bytes(rec.buffer)};
      rec.work = group(rec.src, rank_).recv(v, rec.src, 0);
    }
    return;
  }
  rec.state = PendingRecv::Failed;
  rec.error = mismatch(rec, h);
  if (h.nbytes > 0) {  // drain the payload, so later messages stay in step
    std::vector<at::Tensor> v{at::empty({h.nbytes}, at::TensorOptions().dtype(at::kByte).device(device_))};
    rec.work = group(rec.src, rank_).recv(v, rec.src, 0);
  }
}

void NcclTransport::read_one(int src, const std::string& waiting_for) {
  {
    std::lock_guard<std::mutex> lk(reading_mu_);
    reading_what_ = waiting_for;
  }
  reading_from_ = src;
  // All that `src` sent before it finished has been read: nothing more comes (the watchdog covers the
  // case where it finishes while this rank is reading below).
  if (peer_sent_[src] >= 0 && received_[src] >= peer_sent_[src]) {
    reading_from_ = -1;
    throw std::runtime_error(finished_while_waiting(src, waiting_for));
  }
  Header h{};
  try {
    c10::cuda::CUDAStreamGuard guard(*header_stream_);
    std::vector<at::Tensor> v{at::empty({static_cast<int64_t>(sizeof(Header))},
                                        at::TensorOptions().dtype(at::kByte).device(device_))};
    group(src, rank_).recv(v, src, 0)->wait();
    const at::Tensor host = v[0].to(at::kCPU);  // waits for the header stream only
    std::memcpy(&h, host.data_ptr(), sizeof h);
  } catch (const std::exception& e) {
    reading_from_ = -1;
    fail("receiving a header from rank " + std::to_string(src) + " (waiting for " + waiting_for + ")", short_what(e));
  }
  ++received_[src];
  reading_from_ = -1;
  if (h.magic != kMagic)
    throw std::runtime_error("nccl: rank " + std::to_string(src) + " sent rank " + std::to_string(rank_) +
                             " a message that is not a pipetrain header: is it the same pipetrain build?");
  try {
    if (auto rec = detail::take_oldest(posted_, {src, h.tag})) {
      match(**rec, h);
      return;
    }
    Stashed stash;
    stash.header = h;
    stash.bytes = at::empty({h.nbytes}, at::TensorOptions().dtype(at::kByte).device(device_));
    if (h.nbytes > 0) {
      std::vector<at::Tensor> v{stash.bytes};
      stash.work = group(src, rank_).recv(v, src, 0);
    }
    stashed_[{src, h.tag}].push_back(std::move(stash));
  } catch (const std::exception& e) {
    fail("receiving " + describe(h) + " from rank " + std::to_string(src) + " (tag " + std::to_string(h.tag) + ")",
         short_what(e));
  }
}

void NcclTransport::check_unreceived() {
  for (const auto& [key, messages] : stashed_)
    if (!messages.empty())
      board_.stop_process(rank_,
                          "rank " + std::to_string(rank_) + " finished while rank " + std::to_string(key.first) +
                              " sent it " + describe(messages.front().header) + " (tag " +
                              std::to_string(key.second) +
                              "), which it never received: do all ranks make the same calls (the same number of "
                              "train_step calls, say)?",
                          RunBoard::Report::kPublish);
}

void NcclSendWork::wait() {
  try {
    if (header_) header_->wait();  // orders the caller's stream after the send; the CPU goes on
    if (payload_) payload_->wait();
  } catch (const std::exception& e) {
    header_.reset();
    payload_.reset();
    t_.fail(what_, short_what(e));
  }
  header_.reset();
  payload_.reset();
}

void NcclRecvWork::wait() {
  if (done_) return;
  done_ = true;
  PendingRecv& rec = *rec_;
  const std::string what = describe(target_) + " (tag " + std::to_string(rec.tag) + ")";
  while (rec.state == PendingRecv::Waiting) t_.read_one(rec.src, what);
  if (rec.work) {
    try {
      rec.work->wait();
    } catch (const std::exception& e) {
      rec.work.reset();
      t_.fail("receiving " + what + " from rank " + std::to_string(rec.src), short_what(e));
    }
    rec.work.reset();
  }
  if (rec.state == PendingRecv::Failed) throw std::runtime_error(rec.error);
  if (!rec.buffer.is_same(target_)) target_.copy_(rec.buffer);
}

// --- collectives -------------------------------------------------------------------------------

void NcclTransport::all_reduce_sum(torch::Tensor& tensor) {
  at::Tensor buffer = on_device(tensor, "all_reduce_sum");
  try {
    std::vector<at::Tensor> v{buffer};
    board_.enter_collective();
    up_->allreduce(v)->wait();
    board_.leave_collective();
  } catch (const std::exception& e) {
    board_.leave_collective();
    fail("reducing " + describe(tensor) + " (all_reduce_sum) on rank " + std::to_string(rank_), short_what(e));
  }
  if (!buffer.is_same(tensor)) tensor.copy_(buffer);
}

void NcclTransport::barrier() {
  // An all-reduce of one number, waited for on the CPU (on the header stream: not behind this rank's
  // queued compute). ProcessGroupNCCL's own barrier guesses the device.
  try {
    c10::cuda::CUDAStreamGuard guard(*header_stream_);
    std::vector<at::Tensor> v{at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(device_))};
    board_.enter_collective();
    up_->allreduce(v)->wait();
    (void)v[0].to(at::kCPU);
    board_.leave_collective();
  } catch (const std::exception& e) {
    board_.leave_collective();
    fail("in a barrier on rank " + std::to_string(rank_), short_what(e));
  }
}

}  // namespace

std::shared_ptr<Transport> make_nccl_transport(const Rendezvous& rv, const torch::Device& device) {
  return std::make_shared<NcclTransport>(rv, device);
}

bool nccl_transport_available() { return true; }

std::string nccl_transport_absent_reason() { return ""; }

}  // namespace pipetrain

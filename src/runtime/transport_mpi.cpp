// The mpi transport: ranks are processes started by mpirun; Open MPI point-to-point on CPU tensors, sent
// as raw bytes on a duplicate of MPI_COMM_WORLD whose errors come back as return codes.
//
// Size mismatch: a receive is posted for exactly the expected byte count; a larger message fails it
// with MPI_ERR_TRUNCATE, a smaller one is caught by MPI_Get_count. Both are reported by wait(). (The
// dtype is not checked: MPI carries bytes. The gloo transport checks both.)
//
// Failure: abort() prints "pipetrain rank R: failed: <message>" and calls MPI_Abort, which makes mpirun
// kill every rank. A rank that dies or exits non-zero makes mpirun end the job too.
//
// Finished ranks: a transport's destructor sends every peer a note on the top tag (user tags end below
// it): how many collectives it called and how many messages it sent to that peer. Each rank keeps a
// receive for that note posted per peer, and every wait waits for its operation or a note
// (MPI_Waitany). A rank waiting in a collective that a finished peer never called, or for a message
// from (or a send to) a finished peer that is still not done a second after its note (Open MPI delivers
// a peer's messages in order: the note comes after all it sent), fails with "rank K finished while rank
// R waits for ...", as when the ranks run different numbers of steps.
//
// Shutdown: after its notes, the destructor is a barrier (MPI_Ibarrier on a communicator of its own,
// polled): a rank waits for the others to finish for at most PIPETRAIN_FINAL_BARRIER_TIMEOUT seconds
// (default 30 min), as the shm and gloo transports do; a rank that gives up names the ranks that did
// not finish and skips MPI_Finalize (which would wait for them for good), so mpirun stops the job.
//
// Lifetime: MPI is initialised once per process (MPI_THREAD_MULTIPLE when the library offers it,
// else MPI_THREAD_SERIALIZED) by the first make_mpi_transport() and finalised at exit, but only after a
// clean run: a process that leaves with a transport still alive, or that destroyed one while an
// exception was propagating, skips MPI_Finalize (which would wait for the other ranks) and mpirun,
// seeing it leave, stops the job.
#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <mpi.h>

#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/transport.h"
#include "transport_util.h"

// Under AddressSanitizer the leak check runs before MPI_Finalize (see finalize_at_exit).
#if defined(__SANITIZE_ADDRESS__)
#define PIPETRAIN_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PIPETRAIN_LSAN 1
#endif
#endif
#ifdef PIPETRAIN_LSAN
#include <sanitizer/lsan_interface.h>
#endif

namespace pipetrain {
namespace {

std::mutex g_mpi_mu;
bool g_mpi_initialised_here = false;
int g_thread_level = MPI_THREAD_SINGLE;
int g_alive = 0;           // transports not yet destroyed
bool g_unclean = false;    // one was aborted or destroyed during an exception

void finalize_at_exit() {
  std::lock_guard<std::mutex> lk(g_mpi_mu);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || !g_mpi_initialised_here) return;
  if (g_alive > 0 || g_unclean) return;  // see the file comment
#ifdef PIPETRAIN_LSAN
  // LeakSanitizer's own check runs after MPI_Finalize has unloaded Open MPI's plugins (mca_*.so): the
  // blocks they keep until exit are then unreachable and their stacks unsymbolised (<unknown module>),
  // so no suppression can name them. Checking here, with the plugins still mapped, still finds every
  // block pipetrain leaked (nothing reaches it) and sees Open MPI's blocks as reachable. LeakSanitizer
  // does not check a second time at exit.
  __lsan_do_leak_check();
#endif
  MPI_Finalize();
}

std::string mpi_error(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}

void init_mpi() {
  std::lock_guard<std::mutex> lk(g_mpi_mu);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Query_thread(&g_thread_level);
  } else {
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &g_thread_level);
    if (rc != MPI_SUCCESS) throw std::runtime_error("MPI_Init_thread failed: " + mpi_error(rc));
    g_mpi_initialised_here = true;
    std::atexit(finalize_at_exit);
  }
  if (g_thread_level < MPI_THREAD_SERIALIZED)
    throw std::runtime_error("this MPI library offers thread level " + std::to_string(g_thread_level) +
                             " but the mpi transport needs MPI_THREAD_SERIALIZED or better: use --transport gloo");
}

int64_t byte_size(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

std::string describe(const at::Tensor& t) {
  std::string s = std::string(c10::toString(t.scalar_type())) + " [";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "] (" + std::to_string(byte_size(t)) + " bytes)";
}

at::Tensor cpu_contiguous(const at::Tensor& t) {
  at::Tensor c = t.device().is_cpu() ? t : t.to(at::kCPU);
  return c.is_contiguous() ? c : c.contiguous();
}

int checked_count(int64_t n, const std::string& what) {
  if (n > INT_MAX)
    throw std::invalid_argument("mpi: " + what + " has " + std::to_string(n) +
                                " elements or bytes, more than MPI's int count allows (2^31-1): split the tensor "
                                "or use --transport gloo");
  return static_cast<int>(n);
}

// The finished notes of the peers (see the file comment); the owner thread's.
class PeerNotes {
 public:
  PeerNotes(MPI_Comm comm, int rank, int size, int tag) : comm_(comm), rank_(rank), tag_(tag) {
    notes_.assign(static_cast<std::size_t>(size), {0, 0});
    reqs_.assign(static_cast<std::size_t>(size), MPI_REQUEST_NULL);
    done_.assign(static_cast<std::size_t>(size), 0);
    for (int k = 0; k < size; ++k)
      if (k != rank) MPI_Irecv(notes_[k].data(), 2, MPI_INT64_T, k, tag_, comm_, &reqs_[k]);
  }
  // The peers whose note has not come, as "1, 3" (never blocks).
  std::string missing() {
    std::string out;
    for (int k = 0; k < static_cast<int>(reqs_.size()); ++k) {
      if (k == rank_ || done_[k]) continue;
      int flag = 0;
      if (reqs_[k] != MPI_REQUEST_NULL && MPI_Test(&reqs_[k], &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) {
        done_[k] = 1;
        continue;
      }
      out += (out.empty() ? "" : ", ") + std::to_string(k);
    }
    return out;
  }
  // Cancels the receives of notes that did not come (never blocks).
  void cancel() {
    for (auto& r : reqs_)
      if (r != MPI_REQUEST_NULL) {
        MPI_Cancel(&r);
        MPI_Request_free(&r);
      }
  }
  // Sends this rank's note to every peer: `collectives` called, sent[k] messages to rank k.
  void send(int64_t collectives, const std::vector<int64_t>& sent) {
    std::vector<std::array<int64_t, 2>> out(sent.size());
    std::vector<MPI_Request> reqs;
    for (std::size_t k = 0; k < sent.size(); ++k) {
      if (static_cast<int>(k) == rank_) continue;
      out[k] = {collectives, sent[k]};
      reqs.emplace_back();
      MPI_Isend(out[k].data(), 2, MPI_INT64_T, static_cast<int>(k), tag_, comm_, &reqs.back());
    }
    MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
  }
  // Waits for `*req`, an operation with `peer` (-1: collective number `collective`, with every peer);
  // returns MPI_Wait's code, or throws std::runtime_error naming `what()` when a peer finished first.
  template <class What>
  int wait(MPI_Request* req, MPI_Status* status, int peer, int64_t collective, What what) {
    for (;;) {
      reqs_of_wait_.assign(1, *req);
      peers_of_wait_.assign(1, -1);
      for (int k = 0; k < static_cast<int>(done_.size()); ++k) {
        if (k == rank_ || (peer >= 0 && k != peer)) continue;
        if (!done_[k]) {
          reqs_of_wait_.push_back(reqs_[k]);
          peers_of_wait_.push_back(k);
          continue;
        }
        if (peer < 0 && notes_[k][0] >= collective) continue;  // it called this collective
        if (peer >= 0) {  // what it sent before its note may still be arriving
          int rc = MPI_SUCCESS;
          if (settles(req, status, &rc)) return rc;
        }
        throw std::runtime_error("mpi: rank " + std::to_string(k) + " finished" +
                                 (peer < 0 ? " after " + std::to_string(notes_[k][0]) + " collectives" : std::string()) +
                                 " while rank " + std::to_string(rank_) + " waits for " + what() +
                                 ": do all ranks make the same calls (the same number of train_step calls, say)?");
      }
      if (reqs_of_wait_.size() == 1) return MPI_Wait(req, status);
      int index = MPI_UNDEFINED;
      const int rc = MPI_Waitany(static_cast<int>(reqs_of_wait_.size()), reqs_of_wait_.data(), &index, status);
      if (rc != MPI_SUCCESS || index == 0 || index == MPI_UNDEFINED) {
        *req = reqs_of_wait_[0];
        return rc;
      }
      const int k = peers_of_wait_[static_cast<std::size_t>(index)];
      reqs_[k] = MPI_REQUEST_NULL;
      done_[k] = 1;
    }
  }

 private:
  // Whether the operation completes within a second (what the peer sent before its note may still be
  // arriving); its code in *rc.
  static bool settles(MPI_Request* req, MPI_Status* status, int* rc) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    do {
      int flag = 0;
      *rc = MPI_Test(req, &flag, status);
      if (*rc != MPI_SUCCESS || flag) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } while (std::chrono::steady_clock::now() < until);
    return false;
  }
  MPI_Comm comm_;
  int rank_, tag_;
  std::vector<std::array<int64_t, 2>> notes_;
  std::vector<MPI_Request> reqs_;
  std::vector<char> done_;
  std::vector<MPI_Request> reqs_of_wait_;  // one wait's: its operation, then the notes it also waits for
  std::vector<int> peers_of_wait_;
};

class MpiSendWork final : public Work {
 public:
  MpiSendWork(MPI_Request req, at::Tensor keep, std::string what, PeerNotes* notes, int dst)
      : req_(req), keep_(std::move(keep)), what_(std::move(what)), notes_(notes), dst_(dst) {}
  ~MpiSendWork() override {
    if (req_ != MPI_REQUEST_NULL) {  // never waited (an error path): let MPI finish it, never block here;
      MPI_Request_free(&req_);       // the bytes it may still read are kept alive on purpose
      (void)new at::Tensor(keep_);
    }
  }
  void wait() override {
    if (req_ == MPI_REQUEST_NULL) return;
    MPI_Status status;
    const int rc = notes_->wait(&req_, &status, dst_, -1, [&] { return "its " + what_ + " to be received"; });
    req_ = MPI_REQUEST_NULL;
    if (rc != MPI_SUCCESS) throw std::runtime_error("mpi: " + what_ + " failed: " + mpi_error(rc));
  }

 private:
  MPI_Request req_;
  at::Tensor keep_;
  std::string what_;
  PeerNotes* notes_;
  int dst_;
};

class MpiRecvWork final : public Work {
 public:
  MpiRecvWork(MPI_Request req, at::Tensor buffer, at::Tensor target, int self, int src, int tag, PeerNotes* notes)
      : req_(req), buffer_(std::move(buffer)), target_(std::move(target)), self_(self), src_(src), tag_(tag),
        notes_(notes) {}
  ~MpiRecvWork() override {
    if (req_ != MPI_REQUEST_NULL) {  // never waited (an error path): cancel without blocking, and keep
      MPI_Cancel(&req_);             // the buffer alive in case MPI still writes into it
      MPI_Request_free(&req_);
      (void)new at::Tensor(buffer_);
    }
  }
  void wait() override {
    if (req_ == MPI_REQUEST_NULL) return;
    MPI_Status status;
    const int rc = notes_->wait(&req_, &status, src_, -1, [&] {
      return describe(target_) + " from rank " + std::to_string(src_) + " (tag " + std::to_string(tag_) + ")";
    });
    req_ = MPI_REQUEST_NULL;
    const std::string from = "rank " + std::to_string(src_) + " (tag " + std::to_string(tag_) + ")";
    const std::string agree = ": sender and receiver must agree on the tensor's size and dtype";
    const int expected = static_cast<int>(byte_size(buffer_));
    int error_class = MPI_SUCCESS;
    if (rc != MPI_SUCCESS) MPI_Error_class(rc, &error_class);
    if (error_class == MPI_ERR_TRUNCATE)
      throw std::runtime_error("mpi: message mismatch from " + from + ": it sent more than the " +
                               std::to_string(expected) + " bytes rank " + std::to_string(self_) + " expected (" +
                               describe(target_) + ")" + agree);
    if (rc != MPI_SUCCESS)
      throw std::runtime_error("mpi: receiving " + describe(target_) + " from " + from + " failed: " + mpi_error(rc));
    int got = 0;
    MPI_Get_count(&status, MPI_BYTE, &got);
    if (got != expected)
      throw std::runtime_error("mpi: message mismatch from " + from + ": it sent " + std::to_string(got) +
                               " bytes but rank " + std::to_string(self_) + " expected " + describe(target_) + agree);
    if (!buffer_.is_same(target_)) target_.copy_(buffer_);
  }

 private:
  MPI_Request req_;
  at::Tensor buffer_, target_;
  int self_, src_, tag_;
  PeerNotes* notes_;
};

class MpiTransport final : public Transport {
 public:
  MpiTransport() {
    init_mpi();
    final_limit_ = detail::final_barrier_limit();
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    // The final barrier's own communicator: a peer still calling collectives on comm_ must not have them
    // matched with it.
    MPI_Comm_dup(MPI_COMM_WORLD, &final_comm_);
    MPI_Comm_set_errhandler(final_comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    int* tag_ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &flag);
    tag_ub_ = flag && tag_ub ? *tag_ub : 32767;
    sent_.assign(static_cast<std::size_t>(size_), 0);
    notes_ = std::make_unique<PeerNotes>(comm_, rank_, size_, tag_ub_);  // tag_ub_ is the notes' tag
    std::lock_guard<std::mutex> lk(g_mpi_mu);
    ++g_alive;
  }
  ~MpiTransport() override {
    bool unclean = std::uncaught_exceptions() > 0 || aborted_;
    if (!unclean) {
      notes_->send(collectives_, sent_);
      // A rank that gave up the barrier skips MPI_Finalize, which would wait for the missing ranks for
      // good; mpirun, seeing it leave without it, stops the job.
      if (!final_barrier()) unclean = true;
    }
    notes_->cancel();
    std::lock_guard<std::mutex> lk(g_mpi_mu);
    --g_alive;
    if (unclean) g_unclean = true;
    // comm_ is left to MPI_Finalize: freeing it is collective, and this may be a failing rank.
  }

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  // Waits until every rank reached its destructor, for at most final_limit_ (then names the ranks that
  // did not and returns false). A peer that fails meanwhile ends this process through mpirun.
  bool final_barrier() {
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Ibarrier(final_comm_, &req) != MPI_SUCCESS) return false;
    const auto until = std::chrono::steady_clock::now() + final_limit_;
    auto pause = std::chrono::microseconds(50);
    for (;;) {
      int flag = 0;
      if (MPI_Test(&req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
      if (flag) return true;
      if (std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(20000));
    }
    std::fprintf(stderr,
                 "pipetrain rank %d: mpi: gave up the final barrier after %s: rank(s) %s neither finished nor failed "
                 "(still working, or waiting where nothing comes?); leaving without MPI_Finalize, so mpirun stops "
                 "the job\n",
                 rank_, detail::describe_limit(final_limit_).c_str(), notes_->missing().c_str());
    std::fflush(nullptr);
    return false;
  }

  std::unique_ptr<Work> isend(const torch::Tensor& tensor, int dst, int tag) override {
    check_peer(dst, tag, "isend");
    at::Tensor payload = cpu_contiguous(tensor);
    const std::string what =
        "sending " + describe(payload) + " to rank " + std::to_string(dst) + " (tag " + std::to_string(tag) + ")";
    const int count = checked_count(byte_size(payload), what);
    MPI_Request req = MPI_REQUEST_NULL;
    const int rc = MPI_Isend(payload.data_ptr(), count, MPI_BYTE, dst, tag, comm_, &req);
    if (rc != MPI_SUCCESS) throw std::runtime_error("mpi: " + what + " failed: " + mpi_error(rc));
    ++sent_[static_cast<std::size_t>(dst)];
    return std::make_unique<MpiSendWork>(req, payload, what, notes_.get(), dst);
  }

  std::unique_ptr<Work> irecv(torch::Tensor& tensor, int src, int tag) override {
    check_peer(src, tag, "irecv");
    at::Tensor buffer = tensor.device().is_cpu() && tensor.is_contiguous()
                            ? tensor
                            : at::empty(tensor.sizes(), tensor.options().device(at::kCPU));
    const int count = checked_count(byte_size(buffer), "receiving " + describe(tensor));
    MPI_Request req = MPI_REQUEST_NULL;
    const int rc = MPI_Irecv(buffer.data_ptr(), count, MPI_BYTE, src, tag, comm_, &req);
    if (rc != MPI_SUCCESS)
      throw std::runtime_error("mpi: receiving " + describe(tensor) + " from rank " + std::to_string(src) +
                               " failed: " + mpi_error(rc));
    return std::make_unique<MpiRecvWork>(req, buffer, tensor, rank_, src, tag, notes_.get());
  }

  void all_reduce_sum(torch::Tensor& tensor) override {
    MPI_Datatype type;
    switch (tensor.scalar_type()) {
      case at::kFloat: type = MPI_FLOAT; break;
      case at::kDouble: type = MPI_DOUBLE; break;
      case at::kLong: type = MPI_INT64_T; break;
      case at::kInt: type = MPI_INT32_T; break;
      default:
        throw std::invalid_argument("mpi: all_reduce_sum of " + describe(tensor) +
                                    ": dtype not supported: use Float, Double, Long or Int");
    }
    at::Tensor buffer = cpu_contiguous(tensor);
    const int count = checked_count(buffer.numel(), "all_reduce_sum of " + describe(tensor));
    MPI_Request req = MPI_REQUEST_NULL;
    const int64_t number = ++collectives_;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, buffer.data_ptr(), count, type, MPI_SUM, comm_, &req);
    if (rc == MPI_SUCCESS)
      rc = notes_->wait(&req, MPI_STATUS_IGNORE, -1, number, [&] { return "the others in all_reduce_sum of " + describe(tensor); });
    if (rc != MPI_SUCCESS)
      throw std::runtime_error("mpi: all_reduce_sum of " + describe(tensor) + " failed: " + mpi_error(rc));
    if (!buffer.is_same(tensor)) tensor.copy_(buffer);
  }

  void barrier() override {
    MPI_Request req = MPI_REQUEST_NULL;
    const int64_t number = ++collectives_;
    int rc = MPI_Ibarrier(comm_, &req);
    if (rc == MPI_SUCCESS)
      rc = notes_->wait(&req, MPI_STATUS_IGNORE, -1, number, [] { return std::string("the others in a barrier"); });
    if (rc != MPI_SUCCESS) throw std::runtime_error("mpi: barrier failed: " + mpi_error(rc));
  }

  void abort(const std::string& message) noexcept override {
    aborted_ = true;
    std::fprintf(stderr, "pipetrain rank %d: failed: %s\n", rank_, message.c_str());
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);  // MPI_Abort does not return; in case it does
  }

 private:
  void check_peer(int peer, int tag, const char* what) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw std::invalid_argument(std::string("mpi ") + what + ": rank " + std::to_string(peer) +
                                  " is not a peer of rank " + std::to_string(rank_) + ": use 0.." +
                                  std::to_string(size_ - 1) + " except " + std::to_string(rank_));
    if (tag < 0 || tag >= tag_ub_)
      throw std::invalid_argument(std::string("mpi ") + what + ": tag " + std::to_string(tag) +
                                  " is out of range: use 0.." + std::to_string(tag_ub_ - 1) +
                                  " (this MPI's largest tag carries the finished notes)");
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm final_comm_ = MPI_COMM_NULL;  // the final barrier's
  std::chrono::milliseconds final_limit_{std::chrono::minutes(30)};  // PIPETRAIN_FINAL_BARRIER_TIMEOUT
  int rank_ = 0;
  int size_ = 1;
  int tag_ub_ = 32767;
  std::atomic<bool> aborted_{false};
  std::unique_ptr<PeerNotes> notes_;
  std::vector<int64_t> sent_;  // messages sent per peer
  int64_t collectives_ = 0;   // collectives called
};

}  // namespace

std::shared_ptr<Transport> make_mpi_transport() {
  if (!std::getenv("OMPI_COMM_WORLD_SIZE"))
    throw UsageError(
        "the mpi transport needs processes started by Open MPI's mpirun (OMPI_COMM_WORLD_SIZE is not set): run "
        "`mpirun -n P pipetrain ...` (on this machine add --allow-run-as-root --oversubscribe --mca btl self,vader), "
        "or use --transport gloo with `pipetrain launch -n P -- pipetrain ...`");
  return std::make_shared<MpiTransport>();
}

namespace {

// LOCAL_WORLD_SIZE (pipetrain launch and torchrun set it): the ranks on this host; 1 when unset or bad.
int local_world_size() {
  const auto v = detail::getenv_string("LOCAL_WORLD_SIZE");
  const auto n = v ? detail::parse_integer(*v) : std::nullopt;
  return n && *n > 0 ? static_cast<int>(*n) : 1;
}

}  // namespace

std::string resolve_process_transport(const std::string& name, const torch::Device& device,
                                      bool cuda_device_given_by_rank) {
  if (name == "gloo" || name == "mpi" || name == "shm" || name == "nccl") return name;
  if (name == "auto") {
    if (std::getenv("OMPI_COMM_WORLD_SIZE")) return "mpi";
    // CUDA ranks on distinct GPUs: NCCL moves their tensors device to device. Ranks that would share a
    // GPU (more ranks on this host than GPUs, or one cuda:N named for all) must not get it: NCCL
    // refuses two ranks on one GPU.
    if (kAutoPicksNccl && nccl_transport_available() && device.is_cuda()) {
      const int here = local_world_size();
      const int gpus = static_cast<int>(torch::cuda::device_count());
      if (cuda_device_given_by_rank ? here <= gpus : here == 1) return "nccl";
    }
    // Ranks of `pipetrain launch` on one host get PIPETRAIN_SHM_PREFIX from it: they share this host's
    // memory, so shm (per-transfer cost a fraction of gloo's loopback TCP; docs/BENCHMARKS.md, issue 15).
    // Ranks started otherwise (torchrun, by hand, across hosts) meet over gloo.
    const char* prefix = std::getenv("PIPETRAIN_SHM_PREFIX");
    if (prefix && *prefix) return "shm";
    if (!gloo_transport_available())
      throw UsageError("--transport auto needs gloo for ranks that neither mpirun nor pipetrain started, but " +
                       gloo_transport_absent_reason());
    return "gloo";
  }
  if (name == "local")
    throw UsageError("transport 'local' runs every rank as a thread of one process and is made with "
                     "make_local_transports; for processes use shm, gloo, mpi, nccl or auto");
  throw UsageError("unknown transport '" + name +
                   "': use shm, gloo, mpi, nccl or auto ('local' is only for in-process runs)");
}

std::shared_ptr<Transport> make_process_transport(const std::string& name, const torch::Device& device,
                                                  bool cuda_device_given_by_rank) {
  const std::string chosen = resolve_process_transport(name, device, cuda_device_given_by_rank);
  if (chosen == "gloo") {
    // A build without gloo says so first, not that the rendezvous variables are missing.
    if (!gloo_transport_available()) throw UsageError(gloo_transport_absent_reason());
    return make_gloo_transport(Rendezvous::from_environment());
  }
  if (chosen == "nccl") {
    if (!nccl_transport_available()) throw UsageError(nccl_transport_absent_reason());
    return make_nccl_transport(Rendezvous::from_environment(), device);
  }
  if (chosen == "mpi") return make_mpi_transport();
  return make_shm_transport(Rendezvous::from_environment());
}

}  // namespace pipetrain

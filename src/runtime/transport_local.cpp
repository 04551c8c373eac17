// In-process transport: ranks are threads of one process sharing mailboxes. Sends copy the tensor into
// the receiver's mailbox and complete at once (buffered); receives wait for the matching message. A GPU
// tensor stays on its GPU: the copy is ordered by an event on the sender's stream, which the receiver's
// stream waits for (issue 26).
//
// Threads of run_on_threads: a thread of one call that uses a local transport enlists it (with the rank
// it plays) in the call's group. When such a thread throws, every transport the group's threads used is
// aborted with its error, so the others stop at once even when the caller gave no on_error; when it
// returns, its rank counts as finished until the call ends: as sends are buffered, a receive from it
// that has no message yet (or a collective it has not joined) can never complete and fails at once,
// naming both ranks. A destroyed transport's rank counts as finished for good.
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include "pipetrain/runtime/transport.h"
#include "transport_util.h"

namespace pipetrain {
namespace {

// A message: the sender's copy, and for a device tensor the event recorded after that copy on the
// sender's stream (the receiver's stream waits for it; no thread waits for the device).
struct Message {
  at::Tensor tensor;
  std::shared_ptr<c10::Event> ready;
};

struct Shared {
  explicit Shared(int world, std::chrono::milliseconds t) : world_size(world), timeout(t) {}
  const int world_size;
  const std::chrono::milliseconds timeout;
  std::mutex mu;
  std::condition_variable cv;
  // (src, dst, tag) -> messages, FIFO; a key is there only while it has messages (take_oldest).
  std::map<std::tuple<int, int, int>, std::deque<Message>> mailbox;
  int failed_rank = -1;
  std::string failure;
  // Per rank: 0 running, 1 its thread of run_on_threads returned, 2 its transport was destroyed.
  std::vector<char> finished = std::vector<char>(static_cast<std::size_t>(world_size), 0);
  // all_reduce / barrier state: contributions of the current generation.
  long generation = 0;
  int arrived = 0;
  at::Tensor sum;
  at::Tensor result;

  void throw_if_failed() const {
    if (failed_rank >= 0) throw RemoteFailure(failed_rank, failure);
  }
  // The rank among `from` (-1: any other than `rank`) that has finished, or -1.
  int finished_peer(int from, int rank) const {
    for (int r = 0; r < world_size; ++r)
      if (r != rank && (from < 0 || r == from) && finished[static_cast<std::size_t>(r)]) return r;
    return -1;
  }
  void fail(int rank, const std::string& message) {
    if (failed_rank < 0) {
      failed_rank = rank;
      failure = message;
    }
    cv.notify_all();
  }
  // Waits for `ready` under `lock`, which needs rank `from` (-1: every other rank); throws on failure,
  // on `from` finishing first, or on timeout.
  template <class Pred>
  void wait(std::unique_lock<std::mutex>& lock, Pred ready, int rank, int from, const std::string& what) {
    int gone = -1;
    if (!cv.wait_for(lock, timeout, [&] {
          if (failed_rank >= 0 || ready()) return true;
          gone = finished_peer(from, rank);
          return gone >= 0;
        }))
      throw std::runtime_error("rank " + std::to_string(rank) + " waited " + std::to_string(timeout.count()) +
                               " ms for " + what + ": the schedule or a peer is stuck");
    throw_if_failed();
    if (!ready())
      throw std::runtime_error("rank " + std::to_string(gone) + " finished while rank " + std::to_string(rank) +
                               " waits for " + what + ": do all ranks make the same calls (the same number of "
                               "train_step calls, say)?");
  }
};

// The threads of one run_on_threads call (see the file comment).
struct ThreadGroup {
  std::mutex mu;
  std::vector<std::pair<std::shared_ptr<Shared>, int>> used;  // (transport group, rank) the threads used
  int failed_rank = -1;
  std::string failure;
};
thread_local ThreadGroup* t_group = nullptr;
thread_local std::vector<std::pair<Shared*, int>> t_enlisted;  // this thread's entries of t_group->used

// Records that this thread plays `rank` of `s` (once per pair; a vector search on later calls).
void enlist(const std::shared_ptr<Shared>& s, int rank) {
  if (t_group == nullptr) return;
  for (const auto& e : t_enlisted)
    if (e.first == s.get() && e.second == rank) return;
  t_enlisted.emplace_back(s.get(), rank);
  int failed = -1;
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(t_group->mu);
    t_group->used.emplace_back(s, rank);
    failed = t_group->failed_rank;
    failure = t_group->failure;
  }
  if (failed >= 0) {  // another thread of the call failed before this one first used the transport
    std::lock_guard<std::mutex> lock(s->mu);
    s->fail(failed, failure);
  }
}

// Thread `r` of the group failed with `message`: every transport the group used is aborted in its name
// (the rank it played in that transport, when it used one).
void fail_group(ThreadGroup& group, int r, const std::string& message) {
  std::vector<std::pair<std::shared_ptr<Shared>, int>> used;
  int rank = r;
  for (const auto& e : t_enlisted) rank = e.second;
  {
    std::lock_guard<std::mutex> lock(group.mu);
    if (group.failed_rank < 0) {
      group.failed_rank = rank;
      group.failure = message;
    }
    used = group.used;
  }
  for (const auto& [s, ignored] : used) {
    std::lock_guard<std::mutex> lock(s->mu);
    s->fail(rank, message);
  }
}

// This thread returned: its ranks count as finished in the transports it used.
void mark_finished(ThreadGroup& group) {
  std::lock_guard<std::mutex> lock(group.mu);
  for (const auto& [s, rank] : group.used) {
    bool mine = false;
    for (const auto& e : t_enlisted) mine |= e.first == s.get() && e.second == rank;
    if (!mine) continue;
    std::lock_guard<std::mutex> lk(s->mu);
    char& f = s->finished[static_cast<std::size_t>(rank)];
    f = std::max<char>(f, 1);
    s->cv.notify_all();
  }
}

class DoneWork : public Work {
 public:
  void wait() override {}
};

class LocalRecv : public Work {
 public:
  LocalRecv(std::shared_ptr<Shared> s, at::Tensor& dst, int src, int rank, int tag)
      : s_(std::move(s)), dst_(dst), src_(src), rank_(rank), tag_(tag) {}
  void wait() override {
    enlist(s_, rank_);
    std::unique_lock<std::mutex> lock(s_->mu);
    auto key = std::make_tuple(src_, rank_, tag_);
    s_->wait(lock, [&] { return s_->mailbox.count(key) > 0; }, rank_, src_,
             "a message from rank " + std::to_string(src_) + " with tag " + std::to_string(tag_));
    Message message = std::move(*detail::take_oldest(s_->mailbox, key));
    lock.unlock();
    const at::Tensor& msg = message.tensor;
    if (msg.numel() != dst_.numel() || msg.scalar_type() != dst_.scalar_type())
      throw std::runtime_error("rank " + std::to_string(rank_) + " expected " + std::to_string(dst_.numel()) + " " +
                               std::string(c10::toString(dst_.scalar_type())) + " elements from rank " +
                               std::to_string(src_) + " (tag " + std::to_string(tag_) + ") but got " +
                               std::to_string(msg.numel()) + " " + c10::toString(msg.scalar_type()));
    at::NoGradGuard no_grad;
    if (!message.ready) {
      dst_.copy_(msg.sizes() == dst_.sizes() ? msg : msg.view(dst_.sizes()));
      return;
    }
    // A device tensor: this thread's stream (on the destination's GPU, or the message's for a host
    // destination) waits for the sender's copy, copies, and tells the caching allocator it used the
    // message, so the sender's stream does not reuse that memory before the copy is done.
    const at::Device where = dst_.is_cuda() ? dst_.device() : msg.device();
    const c10::impl::VirtualGuardImpl impl(where.type());
    const c10::Stream stream = impl.getStream(where);
    message.ready->block(stream);
    dst_.copy_(msg.sizes() == dst_.sizes() ? msg : msg.view(dst_.sizes()));
    if (where == msg.device())
      impl.recordDataPtrOnStream(msg.storage().data_ptr(), stream);
    else  // another GPU of this process: wait here rather than record a stream of another device
      stream.synchronize();
  }

 private:
  std::shared_ptr<Shared> s_;
  at::Tensor& dst_;
  int src_, rank_, tag_;
};

class LocalTransport : public Transport {
 public:
  LocalTransport(std::shared_ptr<Shared> s, int rank) : s_(std::move(s)), rank_(rank) {}
  ~LocalTransport() override {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->finished[static_cast<std::size_t>(rank_)] = 2;
    s_->cv.notify_all();
  }
  int rank() const override { return rank_; }
  int world_size() const override { return s_->world_size; }
  std::string name() const override { return "local"; }
  bool shares_process() const override { return true; }
  bool carries_device_tensors() const override { return true; }

  std::unique_ptr<Work> isend(const at::Tensor& t, int dst, int tag) override {
    check_peer(dst);
    enlist(s_, rank_);
    Message copy;
    {
      at::NoGradGuard no_grad;  // the copy has no graph: no detach needed (one operator call less)
      copy.tensor = t.clone(at::MemoryFormat::Contiguous);
    }
    if (!copy.tensor.device().is_cpu()) {  // ordered by an event on this rank's current stream
      const c10::impl::VirtualGuardImpl impl(copy.tensor.device().type());
      copy.ready = std::make_shared<c10::Event>(copy.tensor.device().type());
      copy.ready->record(impl.getStream(copy.tensor.device()));
    }
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->throw_if_failed();
    s_->mailbox[std::make_tuple(rank_, dst, tag)].push_back(std::move(copy));
    s_->cv.notify_all();
    return std::make_unique<DoneWork>();
  }

  std::unique_ptr<Work> irecv(at::Tensor& t, int src, int tag) override {
    check_peer(src);
    enlist(s_, rank_);
    return std::make_unique<LocalRecv>(s_, t, src, rank_, tag);
  }

  void all_reduce_sum(at::Tensor& t) override {
    enlist(s_, rank_);
    std::unique_lock<std::mutex> lock(s_->mu);
    s_->throw_if_failed();
    const long gen = s_->generation;
    {
      at::NoGradGuard no_grad;
      if (s_->arrived == 0) s_->sum = t.detach().clone();
      else s_->sum.add_(t);
    }
    if (++s_->arrived == s_->world_size) {
      s_->result = s_->sum;
      s_->sum = at::Tensor();
      s_->arrived = 0;
      ++s_->generation;
      s_->cv.notify_all();
    } else {
      s_->wait(lock, [&] { return s_->generation != gen; }, rank_, -1, "the other ranks in all_reduce");
    }
    at::NoGradGuard no_grad;
    t.copy_(s_->result);
  }

  void barrier() override {
    at::Tensor one = at::ones({1});
    all_reduce_sum(one);
  }

  void abort(const std::string& message) noexcept override {
    try {
      std::lock_guard<std::mutex> lock(s_->mu);
      s_->fail(rank_, message);
    } catch (...) {
    }
  }

  std::optional<std::pair<int, std::string>> failure() const {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->failed_rank < 0) return std::nullopt;
    return std::make_pair(s_->failed_rank, s_->failure);
  }

 private:
  void check_peer(int peer) const {
    if (peer < 0 || peer >= s_->world_size || peer == rank_)
      throw std::invalid_argument("rank " + std::to_string(rank_) + " cannot exchange with rank " +
                                  std::to_string(peer) + " (world size " + std::to_string(s_->world_size) + ")");
  }
  std::shared_ptr<Shared> s_;
  int rank_;
};

}  // namespace

void run_on_threads(int n, const std::function<void(int)>& body, const std::function<void(int)>& on_error) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  ThreadGroup group;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      t_group = &group;
      t_enlisted.clear();
      try {
        body(r);
        mark_finished(group);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        if (on_error) on_error(r);
        std::string message = "unknown exception";
        try {
          throw;
        } catch (const std::exception& e) {
          message = e.what();
        } catch (...) {
        }
        fail_group(group, r, message);
      }
      t_group = nullptr;
      t_enlisted.clear();
    });
  for (auto& t : threads) t.join();
  // The ranks may run again in a later call: they are finished no more.
  for (const auto& [s, rank] : group.used) {
    std::lock_guard<std::mutex> lock(s->mu);
    char& f = s->finished[static_cast<std::size_t>(rank)];
    if (f == 1) f = 0;
  }
  std::exception_ptr remote;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const RemoteFailure&) {
      if (!remote) remote = e;
    }
  }
  if (remote) std::rethrow_exception(remote);
}

namespace detail {
std::optional<std::pair<int, std::string>> local_transport_failure(const Transport& t) {
  const auto* local = dynamic_cast<const LocalTransport*>(&t);
  return local ? local->failure() : std::nullopt;
}
}  // namespace detail

std::vector<std::shared_ptr<Transport>> make_local_transports(int world_size, std::chrono::milliseconds timeout) {
  if (world_size < 1) throw std::invalid_argument("world size must be >= 1, got " + std::to_string(world_size));
  auto shared = std::make_shared<Shared>(world_size, timeout);
  std::vector<std::shared_ptr<Transport>> out;
  for (int r = 0; r < world_size; ++r) out.push_back(std::make_shared<LocalTransport>(shared, r));
  return out;
}

}  // namespace pipetrain

// In-process transport: ranks are threads of one process sharing mailboxes. Sends copy the tensor into
// the receiver's mailbox and complete at once (buffered); receives wait for the matching message.
#include <ATen/ATen.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "pipetrain/runtime/transport.h"
#include "transport_util.h"

namespace pipetrain {
namespace {

struct Shared {
  explicit Shared(int world, std::chrono::milliseconds t) : world_size(world), timeout(t) {}
  const int world_size;
  const std::chrono::milliseconds timeout;
  std::mutex mu;
  std::condition_variable cv;
  // (src, dst, tag) -> messages, FIFO; a key is there only while it has messages (take_oldest).
  std::map<std::tuple<int, int, int>, std::deque<at::Tensor>> mailbox;
  int failed_rank = -1;
  std::string failure;
  // all_reduce / barrier state: contributions of the current generation.
  long generation = 0;
  int arrived = 0;
  at::Tensor sum;
  at::Tensor result;

  void throw_if_failed() const {
    if (failed_rank >= 0) throw RemoteFailure(failed_rank, failure);
  }
  // Waits for `ready` under `lock`; throws on failure or timeout.
  template <class Pred>
  void wait(std::unique_lock<std::mutex>& lock, Pred ready, int rank, const std::string& what) {
    if (!cv.wait_for(lock, timeout, [&] { return failed_rank >= 0 || ready(); }))
      throw std::runtime_error("rank " + std::to_string(rank) + " waited " + std::to_string(timeout.count()) +
                               " ms for " + what + ": the schedule or a peer is stuck");
    throw_if_failed();
  }
};

class DoneWork : public Work {
 public:
  void wait() override {}
};

class LocalRecv : public Work {
 public:
  LocalRecv(std::shared_ptr<Shared> s, at::Tensor& dst, int src, int rank, int tag)
      : s_(std::move(s)), dst_(dst), src_(src), rank_(rank), tag_(tag) {}
  void wait() override {
    std::unique_lock<std::mutex> lock(s_->mu);
    auto key = std::make_tuple(src_, rank_, tag_);
    s_->wait(lock, [&] { return s_->mailbox.count(key) > 0; }, rank_,
             "a message from rank " + std::to_string(src_) + " with tag " + std::to_string(tag_));
    at::Tensor msg = std::move(*detail::take_oldest(s_->mailbox, key));
    lock.unlock();
    if (msg.numel() != dst_.numel() || msg.scalar_type() != dst_.scalar_type())
      throw std::runtime_error("rank " + std::to_string(rank_) + " expected " + std::to_string(dst_.numel()) + " " +
                               std::string(c10::toString(dst_.scalar_type())) + " elements from rank " +
                               std::to_string(src_) + " (tag " + std::to_string(tag_) + ") but got " +
                               std::to_string(msg.numel()) + " " + c10::toString(msg.scalar_type()));
    at::NoGradGuard no_grad;
    dst_.copy_(msg.sizes() == dst_.sizes() ? msg : msg.view(dst_.sizes()));
  }

 private:
  std::shared_ptr<Shared> s_;
  at::Tensor& dst_;
  int src_, rank_, tag_;
};

class LocalTransport : public Transport {
 public:
  LocalTransport(std::shared_ptr<Shared> s, int rank) : s_(std::move(s)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return s_->world_size; }
  std::string name() const override { return "local"; }
  bool shares_process() const override { return true; }

  std::unique_ptr<Work> isend(const at::Tensor& t, int dst, int tag) override {
    check_peer(dst);
    at::Tensor copy;
    {
      at::NoGradGuard no_grad;  // the copy has no graph: no detach needed (one operator call less)
      copy = t.clone(at::MemoryFormat::Contiguous);
    }
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->throw_if_failed();
    s_->mailbox[std::make_tuple(rank_, dst, tag)].push_back(std::move(copy));
    s_->cv.notify_all();
    return std::make_unique<DoneWork>();
  }

  std::unique_ptr<Work> irecv(at::Tensor& t, int src, int tag) override {
    check_peer(src);
    return std::make_unique<LocalRecv>(s_, t, src, rank_, tag);
  }

  void all_reduce_sum(at::Tensor& t) override {
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
      s_->wait(lock, [&] { return s_->generation != gen; }, rank_, "the other ranks in all_reduce");
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
      if (s_->failed_rank < 0) {
        s_->failed_rank = rank_;
        s_->failure = message;
      }
      s_->cv.notify_all();
    } catch (...) {
    }
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
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        if (on_error) on_error(r);
      }
    });
  for (auto& t : threads) t.join();
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

std::vector<std::shared_ptr<Transport>> make_local_transports(int world_size, std::chrono::milliseconds timeout) {
  if (world_size < 1) throw std::invalid_argument("world size must be >= 1, got " + std::to_string(world_size));
  auto shared = std::make_shared<Shared>(world_size, timeout);
  std::vector<std::shared_ptr<Transport>> out;
  for (int r = 0; r < world_size; ++r) out.push_back(std::make_shared<LocalTransport>(shared, r));
  return out;
}

}  // namespace pipetrain

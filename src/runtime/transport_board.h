// Internal to pipetrain_runtime: a process rank's seat on the rendezvous store, shared by the transports
// that meet through it and cannot interrupt their own blocked calls (gloo, nccl). It holds what those
// transports do the same way; each transport keeps its messages. transport_gloo.cpp's file comment
// tells the whole protocol (phases, abort key, heartbeats, the store's "went away" reports, finished
// counts, the final barrier, who keeps the store up for how long); this class is that protocol's code:
//   connect()        joins the launcher's store, torchrun's agent store, or the one rank 0 hosts;
//   start()          the watchdog (abort key every 150 ms, heartbeats every 1 s once connected, other
//                    ranks' finished counts) and its monitor (a watchdog stuck in a store call);
//   stop_process()   ends the process with "pipetrain rank R: stopping: rank K failed: ..." after
//                    publishing or acknowledging the report (blocked calls in other threads are never
//                    interrupted: a process that must stop, ends);
//   finish()/leave() the final barrier and the goodbye (ranks 1.. detach, rank 0 keeps the store up).
// Threads: the owner's thread calls everything but abort(), stop_process(), lost_store() and
// reported_failure(), which any thread may call; with_store() serialises the main client. The watchdog
// calls the transport's on_peer_finished hook (under no lock of the board's).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pipetrain/runtime/store.h"
#include "pipetrain/runtime/transport.h"

namespace pipetrain::detail {

class RunBoard {
 public:
  // What stop_process does with the store first: kPublish writes the diagnosis as the abort key (or
  // reports the one already there), kAcknowledge only counts this rank in abort_seen (rank 0 instead
  // keeps the store up for the others for up to 2 s), kLeave does not touch it (it is gone or hung).
  enum class Report { kPublish, kAcknowledge, kLeave };

  // Checks `rv` (UsageError naming the variable and the fix) and reads PIPETRAIN_HEARTBEAT_TIMEOUT,
  // PIPETRAIN_FINAL_BARRIER_TIMEOUT and PIPETRAIN_RENDEZVOUS_TIMEOUT. `transport` names the transport in
  // messages ("gloo", "nccl"). Ignores SIGPIPE (a peer that dies mid-write must give an error).
  RunBoard(const Rendezvous& rv, std::string transport);
  ~RunBoard();  // stops the threads; the clients and the server go with it (server last)
  RunBoard(const RunBoard&) = delete;
  RunBoard& operator=(const RunBoard&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::string& store_address() const { return store_address_; }  // "addr:port", for messages
  std::chrono::milliseconds final_limit() const { return final_limit_; }

  // Joins (or, on rank 0 without a launcher, hosts and joins) the store: two clients, the main one and
  // the watchdog's. Under torchrun, the agent's TCPStore. Throws std::runtime_error naming the store.
  void connect(const Rendezvous& rv);
  // The main client: for a process group's rendezvous (its waits end with RemoteFailure once a failure
  // is reported, until stop_watching_abort()).
  c10::intrusive_ptr<c10d::Store> store() const { return store_; }
  // From here on the main client's waits no longer throw on the abort key (the watchdog reports it).
  void stop_watching_abort();
  // Runs f(main client) under the main client's mutex.
  template <class F>
  auto with_store(F&& f) {
    std::lock_guard<std::mutex> lk(store_mu_);
    return f(*store_);
  }
  // Tells the store what this rank is doing, for its report should the rank vanish. Never throws.
  void set_phase(const std::string& phase);

  // Starts the watchdog and its monitor. `on_peer_finished(peer, messages peer sent to this rank)` runs
  // on the watchdog thread once per peer, when it has finished.
  void start(std::function<void(int, int64_t)> on_peer_finished);
  // The transport is connected: from now on heartbeats are judged and finished counts read.
  void set_connected() { connected_ = true; }
  // Stops the watchdog and the monitor (idempotent).
  void stop_threads();

  // Collectives: counted for the finished ranks' check ("rank K finished after N collectives while rank
  // R waits in its collective number M").
  void enter_collective() {
    ++collectives_;
    in_collective_ = true;
  }
  void leave_collective() { in_collective_ = false; }

  // Marks this rank as failed and posts `message` as the run's failure report unless one is there.
  void abort(const std::string& message) noexcept;
  bool aborted() const { return aborted_; }
  // The failure reported on the store, read through the main client; lost_store() when the store is gone.
  std::optional<std::pair<int, std::string>> reported_failure(const std::string& then_failed);
  [[noreturn]] void stop_process(int failed_rank, std::string message, Report report);
  [[noreturn]] void lost_store(const std::string& why);

  // The final barrier: writes this rank's counts (collectives; messages sent to each peer), counts itself
  // finished and waits for all (at most final_limit(), then names the missing ranks on stderr).
  void finish(const std::vector<int64_t>& sent_per_peer);
  // After the threads stopped: ranks 1.. say they detached and rank 0 waits for them (at most 10 s);
  // after a failure, rank 0 keeps the store up until the `world_size - 1 - gone` ranks still connected
  // have seen it (at most 5 s). Never throws.
  void leave(bool failed, int gone);
  // Polls `key` (an add() counter) on the main client until it reaches `target` or `limit` passes.
  bool wait_for_count(const std::string& key, int64_t target, std::chrono::milliseconds limit);
  // Reads the finished count on the main client (lost_store() when the store is gone).
  int64_t finished_count(const std::string& then_failed);

 private:
  void watchdog_loop();
  void monitor_loop();
  void watchdog_poll(std::vector<int64_t>& beats, std::vector<std::chrono::steady_clock::time_point>& changed,
                     std::chrono::steady_clock::time_point& next_beat,
                     std::chrono::steady_clock::time_point& next_check);
  void poll_finished();

  int rank_;
  int world_size_;
  std::string transport_;
  std::string store_address_;
  std::chrono::milliseconds dead_after_;
  std::chrono::milliseconds final_limit_;
  std::chrono::milliseconds join_timeout_;

  std::unique_ptr<StoreServer> server_;          // rank 0's, when it hosts the store (destroyed last)
  c10::intrusive_ptr<c10d::Store> store_;        // main client
  c10::intrusive_ptr<c10d::Store> watch_store_;  // the watchdog's own connection
  std::mutex store_mu_;                          // guards store_ (abort may come from any thread)

  std::function<void(int, int64_t)> on_peer_finished_;
  std::vector<int64_t> peer_collectives_;   // watchdog: per peer, -1 until it finished; then its collectives
  int64_t finished_seen_ = 0;               // watchdog: the finished count last read
  std::atomic<int64_t> collectives_{0};     // owner thread: collectives entered
  std::atomic<bool> in_collective_{false};  // owner thread: in one now

  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  bool wd_stop_ = false;
  std::atomic<int64_t> wd_progress_ns_{0};
  std::atomic<bool> aborted_{false};    // this rank called abort()
  std::atomic<bool> connected_{false};  // the transport is connected: heartbeats are judged
  std::thread watchdog_, monitor_;
};

// The text of an exception without c10's backtrace or Gloo's "[file.cc:line] " prefix.
std::string short_what(const std::exception& e);

}  // namespace pipetrain::detail

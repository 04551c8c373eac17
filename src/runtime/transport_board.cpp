// A rank's seat on the rendezvous store (transport_board.h); the protocol is told in transport_gloo.cpp's
// file comment.
#include "transport_board.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "pipetrain/core/error.h"
#include "torch_compat.h"
#include "transport_util.h"

namespace pipetrain::detail {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr milliseconds kAbortPollPeriod{150};
constexpr milliseconds kHeartbeatPeriod{1000};
constexpr milliseconds kDetachWait{10000};
constexpr milliseconds kAbortLinger{5000};

const std::string kAbortSeenKey = "pipetrain/abort_seen";
const std::string kFinishedKey = "pipetrain/finished";
const std::string kDetachedKey = "pipetrain/detached";
std::string heartbeat_key(int rank) { return "pipetrain/heartbeat/" + std::to_string(rank); }
std::string finished_key(int rank) { return "pipetrain/finished/" + std::to_string(rank); }

std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::atomic<bool> g_exiting{false};  // one thread ends the process; the others wait for it

[[noreturn]] void wait_for_exit() {
  for (;;) ::pause();
}

}  // namespace

std::string short_what(const std::exception& e) {
  std::string text = e.what();
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) text = c10e->what_without_backtrace();
  if (text.rfind("[", 0) == 0) {
    const auto end = text.find("] ");
    if (end != std::string::npos && text.find(".cc:") < end) text.erase(0, end + 2);
  }
  return text;
}

RunBoard::RunBoard(const Rendezvous& rv, std::string transport)
    : rank_(rv.rank), world_size_(rv.world_size), transport_(std::move(transport)) {
  if (rv.world_size < 1)
    throw UsageError("WORLD_SIZE=" + std::to_string(rv.world_size) + " is not a process count: use >= 1");
  if (rv.rank < 0 || rv.rank >= rv.world_size)
    throw UsageError("RANK=" + std::to_string(rv.rank) + " is out of range for WORLD_SIZE=" +
                     std::to_string(rv.world_size) + ": use 0.." + std::to_string(rv.world_size - 1));
  if (rv.master_port < 1 || rv.master_port > 65535)
    throw UsageError("MASTER_PORT=" + std::to_string(rv.master_port) + " is not a port number: use 1..65535");
  if (rv.master_addr.empty()) throw UsageError("MASTER_ADDR is empty: set it to rank 0's host, e.g. 127.0.0.1");
  store_address_ = rv.master_addr + ":" + std::to_string(rv.master_port);
  dead_after_ = env_seconds("PIPETRAIN_HEARTBEAT_TIMEOUT", seconds(10));
  final_limit_ = final_barrier_limit();
  join_timeout_ = env_seconds("PIPETRAIN_RENDEZVOUS_TIMEOUT", seconds(300));
  peer_collectives_.assign(world_size_, -1);

  // A peer that dies mid-write must give an error, not SIGPIPE.
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

RunBoard::~RunBoard() {
  stop_threads();
  watch_store_.reset();
  store_.reset();
}

void RunBoard::connect(const Rendezvous& rv) {
  const std::string join_hint = "start all WORLD_SIZE=" + std::to_string(world_size_) +
                                " ranks with the same MASTER_ADDR and MASTER_PORT (pipetrain launch does), or "
                                "raise PIPETRAIN_RENDEZVOUS_TIMEOUT (now " +
                                std::to_string(join_timeout_.count() / 1000) + " s)";
  const std::string master = store_address_ + " (MASTER_ADDR:MASTER_PORT)";

  // torchrun: its agent hosts a c10d::TCPStore on MASTER_ADDR:MASTER_PORT for the workers; join it.
  if (getenv_string("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True") {
    const std::string attempt = getenv_string("TORCHELASTIC_RESTART_COUNT").value_or("0");
    try {
      c10d::TCPStoreOptions o;
      o.port = static_cast<std::uint16_t>(rv.master_port);
      o.isServer = false;
      o.waitWorkers = false;
      o.timeout = join_timeout_;
      auto prefix = "pipetrain/attempt-" + attempt;  // a restarted group must not read the last one's keys
      store_ = c10::make_intrusive<c10d::PrefixStore>(prefix, compat::make_tcp_store<c10d::TCPStore>(rv.master_addr, o));
      watch_store_ =
          c10::make_intrusive<c10d::PrefixStore>(prefix, compat::make_tcp_store<c10d::TCPStore>(rv.master_addr, o));
    } catch (const std::exception& e) {
      throw std::runtime_error("rank " + std::to_string(rank_) + " could not join torchrun's store at " + master +
                               " (TORCHELASTIC_USE_AGENT_STORE=True): " + short_what(e));
    }
    return;
  }

  StoreSite site = find_or_host_store(rv, rank_, world_size_);
  server_ = std::move(site.server);
  if (site.launcher) store_address_ = site.host + ":" + std::to_string(site.port) + " (the launcher's)";
  rendezvous_fault(rank_, "before-join");
  try {
    auto main = c10::make_intrusive<StoreClient>(site.host, site.port, site.token, rank_, world_size_, join_timeout_,
                                                 site.what);
    watch_store_ = c10::make_intrusive<StoreClient>(site.host, site.port, site.token, rank_, world_size_,
                                                    join_timeout_, site.what);
    main->stop_waiting_on_abort(rank_);  // the process group's rendezvous waits end at once when a rank failed
    store_ = main;
  } catch (const std::exception& e) {
    const std::string text = e.what();
    if (text.find("hosts another pipetrain run") != std::string::npos)
      throw std::runtime_error("rank " + std::to_string(rank_) + ": " + text);
    throw std::runtime_error("rank " + std::to_string(rank_) + " could not join the rendezvous store: " + text +
                             ". Is rank 0 running? " + join_hint);
  }
}

void RunBoard::stop_watching_abort() {
  if (auto* client = dynamic_cast<StoreClient*>(store_.get())) client->stop_waiting_on_abort(StoreClient::kNotWatching);
}

void RunBoard::set_phase(const std::string& phase) {
  try {
    std::lock_guard<std::mutex> lk(store_mu_);
    store_->set(phase_key(rank_), bytes_of(phase));
  } catch (const std::exception&) {
    // Only for the store's report; a lost store shows elsewhere.
  }
}

void RunBoard::start(std::function<void(int, int64_t)> on_peer_finished) {
  on_peer_finished_ = std::move(on_peer_finished);
  wd_progress_ns_ = Clock::now().time_since_epoch().count();
  watchdog_ = std::thread([this] { watchdog_loop(); });
  monitor_ = std::thread([this] { monitor_loop(); });
}

void RunBoard::stop_threads() {
  {
    std::lock_guard<std::mutex> lk(wd_mu_);
    wd_stop_ = true;
  }
  wd_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (monitor_.joinable()) monitor_.join();
}

bool RunBoard::wait_for_count(const std::string& key, int64_t target, milliseconds limit) {
  const auto until = Clock::now() + limit;
  milliseconds pause{5};
  for (;;) {
    int64_t v;
    {
      std::lock_guard<std::mutex> lk(store_mu_);
      v = store_->add(key, 0);
    }
    if (v >= target) return true;
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, milliseconds(50));
  }
}

int64_t RunBoard::finished_count(const std::string& then_failed) {
  try {
    std::lock_guard<std::mutex> lk(store_mu_);
    return store_->add(kFinishedKey, 0);
  } catch (const std::exception& e) {
    // The store lives in rank 0's process (or the launcher's): its host is the one that died.
    lost_store(short_what(e) + "; " + then_failed);
  }
}

void RunBoard::finish(const std::vector<int64_t>& sent_per_peer) {
  try {
    set_phase("shutdown (the final barrier)");
    {
      std::string counts = std::to_string(collectives_.load()) + ";";
      for (int k = 0; k < world_size_; ++k)
        counts += (k ? "," : "") + std::to_string(k < static_cast<int>(sent_per_peer.size()) ? sent_per_peer[k] : 0);
      std::lock_guard<std::mutex> lk(store_mu_);
      store_->set(finished_key(rank_), bytes_of(counts));
      store_->add(kFinishedKey, 1);
    }
    // A slower rank is still working; one that fails meanwhile is caught by the watchdog, which ends this
    // process, and one that waits for this rank fails as soon as its watchdog reads the counts above.
    if (!wait_for_count(kFinishedKey, world_size_, final_limit_)) {
      std::string missing;
      for (int k = 0; k < world_size_; ++k) {
        std::lock_guard<std::mutex> lk(store_mu_);
        if (!store_->check({finished_key(k)})) missing += (missing.empty() ? "" : ", ") + std::to_string(k);
      }
      std::fprintf(stderr,
                   "pipetrain rank %d: %s: gave up the final barrier after %s: rank(s) %s neither finished "
                   "nor failed (still working, or waiting where nothing comes?)\n",
                   rank_, transport_.c_str(), describe_limit(final_limit_).c_str(), missing.c_str());
    }
  } catch (const std::exception& e) {
    lost_store(short_what(e));
  }
}

void RunBoard::leave(bool failed, int gone) {
  try {
    if (!failed) {
      if (rank_ != 0) {
        std::lock_guard<std::mutex> lk(store_mu_);
        store_->add(kDetachedKey, 1);
      } else {
        wait_for_count(kDetachedKey, world_size_ - 1, kDetachWait);
      }
    } else if (rank_ == 0) {  // keep the store up until the ranks still connected have seen the failure
      wait_for_count(kAbortSeenKey, world_size_ - 1 - gone, kAbortLinger);
    }
  } catch (const std::exception&) {
    // The store is gone: nothing left to coordinate.
  }
}

void RunBoard::lost_store(const std::string& why) {
  stop_process(0, "lost the rendezvous store at " + store_address_ + " (its host died?): " + why, Report::kLeave);
}

void RunBoard::stop_process(int failed_rank, std::string message, Report report) {
  if (g_exiting.exchange(true)) wait_for_exit();
  if (report != Report::kLeave) {
    try {
      // The watchdog thread owns watch_store_; any other thread uses the main client.
      const bool on_watchdog = std::this_thread::get_id() == watchdog_.get_id();
      std::unique_lock<std::mutex> lk(store_mu_, std::defer_lock);
      if (!on_watchdog) lk.lock();
      c10d::Store& st = on_watchdog ? *watch_store_ : *store_;
      if (report == Report::kPublish) {
        const std::string value = std::to_string(failed_rank) + "\n" + message;
        const std::vector<uint8_t> raw = st.compareSet(kAbortKey, {}, bytes_of(value));
        const std::string stored(raw.begin(), raw.end());
        if (stored != value) {  // someone reported a failure first: that is the root cause
          const auto nl = stored.find('\n');
          failed_rank = static_cast<int>(parse_integer(stored.substr(0, nl)).value_or(failed_rank));
          message = nl == std::string::npos ? stored : stored.substr(nl + 1);
        }
      }
      if (rank_ != 0) {
        st.add(kAbortSeenKey, 1);
      } else {  // the store dies with this process: give the others time to read the report
        const auto until = Clock::now() + milliseconds(2000);
        while (Clock::now() < until && st.add(kAbortSeenKey, 0) < world_size_ - 2)
          std::this_thread::sleep_for(milliseconds(20));
      }
    } catch (...) {
    }
  }
  std::fprintf(stderr, "pipetrain rank %d: stopping: rank %d failed: %s\n", rank_, failed_rank, message.c_str());
  std::fflush(nullptr);
  std::_Exit(1);
}

void RunBoard::abort(const std::string& message) noexcept {
  aborted_ = true;
  try {
    const std::string value = std::to_string(rank_) + "\n" + message;
    std::lock_guard<std::mutex> lk(store_mu_);
    store_->compareSet(kAbortKey, {}, bytes_of(value));  // the first failure is the one reported
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "pipetrain rank %d: could not tell the other ranks that it failed (%s); they will notice "
                 "when it exits\n",
                 rank_, short_what(e).c_str());
  } catch (...) {
  }
}

std::optional<std::pair<int, std::string>> RunBoard::reported_failure(const std::string& then_failed) {
  std::optional<std::string> reported;
  try {
    std::lock_guard<std::mutex> lk(store_mu_);
    if (store_->check({kAbortKey})) {
      const std::vector<uint8_t> raw = store_->get(kAbortKey);
      reported = std::string(raw.begin(), raw.end());
    }
  } catch (const RemoteFailure& remote) {  // a client still watching the abort key reports it so
    std::string message = remote.what();
    const std::string prefix = "rank " + std::to_string(remote.failed_rank()) + " failed: ";
    if (message.rfind(prefix, 0) == 0) message.erase(0, prefix.size());
    return std::make_pair(remote.failed_rank(), message);
  } catch (const std::exception& e) {
    // The store lives in rank 0's process: rank 0 died, and is the likely cause of this error too.
    lost_store(short_what(e) + "; then " + then_failed);
  }
  if (!reported) return std::nullopt;
  const auto nl = reported->find('\n');
  const int failed = static_cast<int>(parse_integer(reported->substr(0, nl)).value_or(-1));
  return std::make_pair(failed, nl == std::string::npos ? *reported : reported->substr(nl + 1));
}

// --- watchdog ----------------------------------------------------------------------------------

void RunBoard::watchdog_loop() {
  const auto start = Clock::now();
  std::vector<int64_t> beats(world_size_, -1);
  std::vector<Clock::time_point> changed(world_size_, start);
  Clock::time_point next_beat = start, next_check = start + kHeartbeatPeriod;
  std::unique_lock<std::mutex> lk(wd_mu_);
  while (!wd_stop_) {
    lk.unlock();
    watchdog_poll(beats, changed, next_beat, next_check);
    wd_progress_ns_ = Clock::now().time_since_epoch().count();
    lk.lock();
    wd_cv_.wait_for(lk, kAbortPollPeriod, [&] { return wd_stop_; });
  }
}

void RunBoard::watchdog_poll(std::vector<int64_t>& beats, std::vector<Clock::time_point>& changed,
                             Clock::time_point& next_beat, Clock::time_point& next_check) {
  try {
    const auto now = Clock::now();
    if (now >= next_beat) {
      watch_store_->add(heartbeat_key(rank_), 1);
      next_beat = now + kHeartbeatPeriod;
    }
    if (aborted_) return;  // this rank is already failing: nothing to add
    if (watch_store_->check({kAbortKey})) {
      const std::vector<uint8_t> raw = watch_store_->get(kAbortKey);
      const std::string value(raw.begin(), raw.end());
      const auto nl = value.find('\n');
      const int failed = static_cast<int>(parse_integer(value.substr(0, nl)).value_or(-1));
      const std::string message = nl == std::string::npos ? value : value.substr(nl + 1);
      if (failed != rank_ && !aborted_) stop_process(failed, message, Report::kAcknowledge);
    }
    if (connected_) poll_finished();
    if (!connected_) {  // ranks may join late: heartbeats count from the moment the transport is connected
      next_check = now + kHeartbeatPeriod;
      std::fill(changed.begin(), changed.end(), now);
    } else if (now >= next_check) {
      next_check = now + kHeartbeatPeriod;
      for (int k = 0; k < world_size_; ++k) {
        if (k == rank_) continue;
        const int64_t v = watch_store_->add(heartbeat_key(k), 0);
        if (v != beats[k]) {
          beats[k] = v;
          changed[k] = now;
        } else if (now - changed[k] > dead_after_) {
          stop_process(k,
                       "it stopped responding: no heartbeat for " + std::to_string(dead_after_.count() / 1000) +
                           " s (killed, crashed or hung)",
                       Report::kPublish);
        }
      }
    }
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lk(wd_mu_);
      if (wd_stop_) return;
    }
    if (aborted_) return;
    lost_store(short_what(e));
  }
}

void RunBoard::poll_finished() {
  const int64_t finished = watch_store_->add(kFinishedKey, 0);
  if (finished > finished_seen_) {
    finished_seen_ = finished;  // each rank writes its counts before it counts itself finished
    for (int k = 0; k < world_size_; ++k) {
      if (k == rank_ || peer_collectives_[k] >= 0 || !watch_store_->check({finished_key(k)})) continue;
      const std::vector<uint8_t> raw = watch_store_->get(finished_key(k));
      const std::string value(raw.begin(), raw.end());
      const auto semi = value.find(';');
      std::vector<int64_t> counts;
      for (std::size_t at = semi + 1; semi != std::string::npos && at <= value.size();) {
        const auto comma = std::min(value.find(',', at), value.size());
        counts.push_back(parse_integer(value.substr(at, comma - at)).value_or(0));
        at = comma + 1;
      }
      peer_collectives_[k] = parse_integer(value.substr(0, semi)).value_or(0);
      if (on_peer_finished_) on_peer_finished_(k, rank_ < static_cast<int>(counts.size()) ? counts[rank_] : 0);
    }
  }
  if (!in_collective_) return;
  const int64_t entered = collectives_.load();
  for (int k = 0; k < world_size_; ++k)
    if (k != rank_ && peer_collectives_[k] >= 0 && peer_collectives_[k] < entered && in_collective_)
      stop_process(rank_,
                   "rank " + std::to_string(k) + " finished after " + std::to_string(peer_collectives_[k]) +
                       " collectives while rank " + std::to_string(rank_) + " waits in its collective number " +
                       std::to_string(entered) +
                       " (all_reduce_sum or barrier): do all ranks make the same calls (the same number of "
                       "train_step calls, say)?",
                   Report::kPublish);
}

void RunBoard::monitor_loop() {
  // The watchdog's store calls have no timeout of their own: one that hangs (rank 0 stopped, network
  // gone) shows here as a watchdog that stopped making progress.
  const auto limit = dead_after_ + seconds(5);
  std::unique_lock<std::mutex> lk(wd_mu_);
  while (!wd_stop_) {
    wd_cv_.wait_for(lk, seconds(1), [&] { return wd_stop_; });
    if (wd_stop_ || aborted_) break;
    const auto last = Clock::time_point(Clock::duration(wd_progress_ns_.load()));
    if (Clock::now() - last > limit)
      stop_process(0,
                   "the rendezvous store at " + store_address_ + " has not answered for " +
                       std::to_string(std::chrono::duration_cast<seconds>(limit).count()) +
                       " s (rank 0 hung, or its host is unreachable)",
                   Report::kLeave);
  }
}

}  // namespace pipetrain::detail

// The gloo transport: ranks are processes; c10d::ProcessGroupGloo moves the tensors, a rendezvous store
// (runtime/store.h) is the rendezvous and the failure board. Whose store:
//   - PIPETRAIN_LAUNCHER_STORE=HOST:PORT (pipetrain launch / launch_local set it): the launcher's; every
//     rank joins it with PIPETRAIN_RUN_TOKEN.
//   - TORCHELASTIC_USE_AGENT_STORE=True (torchrun): the agent's c10d::TCPStore at MASTER_ADDR:MASTER_PORT,
//     joined as a client (no token: torchrun owns it), keys under pipetrain/attempt-N for restart N. That
//     store cannot tell a lost connection, so a rank that dies during the rendezvous is noticed there by
//     torchrun's agent (it stops the group), later by the Gloo connections and heartbeats as usual.
//   - else (ranks started by hand): rank 0 hosts a StoreServer on MASTER_ADDR's address only (or
//     PIPETRAIN_STORE_BIND's), port MASTER_PORT, and requires PIPETRAIN_RUN_TOKEN (empty when unset).
// Joining: each rank connects twice (its main client and the watchdog's), writes its phase ("the
// rendezvous", then "the run", then "shutdown ...") to the store, starts its watchdog, then connects Gloo
// through the store. Gloo's waits for the other ranks' addresses poll the store and end with
// RemoteFailure as soon as a failure is reported; the watchdog ends the process too, so a rank that dies
// during the rendezvous (its store connection closes without a goodbye, or, before it ever connected,
// the launcher reports its exit) stops the others within a second. A rank that fails here itself reports
// why before it throws.
//
// Messages. Gloo cannot be trusted with a size mismatch: a message larger than the posted receive
// throws inside Gloo's network thread (the process dies in std::terminate), a smaller one completes the
// receive silently with stale bytes at the end. So every isend first sends a 72-byte header (tag,
// dtype, shape, byte count) on one control slot, and the payload on the user's tag. Each rank runs one
// *header thread per peer* that keeps a receive posted on the control slot from that peer; when a header
// arrives it is matched (FIFO per source and tag) with the receive the rank posted, and only then is the
// payload receive posted, with the right size. A mismatch fails that receive's wait() with both
// descriptions, and the payload is drained into scratch memory so later messages stay in step. The
// threads keep sends non-blocking in effect (a peer's send completes while this rank is busy elsewhere),
// and since a receive posted on a peer's connection fails as soon as Gloo sees that connection close,
// they also notice at once when a peer dies (see Failure).
//
//   sender  isend: [header -> control slot][payload -> slot tag]        (both posted at once)
//   receiver header thread for src: header arrives -> match irecv(src, tag) -> sizes equal? post payload
//                                                       recv : record the error, drain the payload
//   receiver wait(): waits for the match, then for the payload
//
// Failure. A *watchdog thread* per rank polls the store: every 150 ms for the abort key
// ("pipetrain/abort" = "<rank>\n<message>"; the first writer wins), every 1 s it bumps this rank's
// heartbeat counter and, once Gloo is connected, reads the others'. A rank whose counter has not moved for
// PIPETRAIN_HEARTBEAT_TIMEOUT seconds (default 10) was killed or is hung (a stopped process; the
// heartbeat runs on its own thread, so a rank busy computing still beats). The store itself posts the
// abort key when a rank's connection closes without a goodbye ("it went away ... during PHASE"), and the
// launcher when a rank exits non-zero. A store call that fails means the store's host (rank 0, or the
// launcher) is gone; a store call that blocks is caught by a second thread that checks the watchdog's
// progress. On any of these the watchdog prints
//   pipetrain rank R: stopping: rank K failed: <message>
// and ends the process with std::_Exit(1): Gloo calls blocked in other threads cannot be interrupted.
// The header threads and the rank's own thread do the same when a connection to a peer fails: if a
// failure was reported already the rank stops with that one; else the peer is gone (a rank closes its
// connections only after the final barrier, which the store's finished count tells apart), so it
// reports "rank K failed: it went away (killed or crashed?) while rank R was ..." and stops. As every
// rank keeps a header receive posted to every peer, a killed rank is noticed by all within milliseconds;
// the heartbeat is for ranks that hang (SIGSTOP, a frozen host) or a network that drops silently.
// Other errors (a collective's, a size mismatch) are std::runtime_error from wait(): the caller is
// expected to abort() with them. Whoever finds a failure first writes it as the abort key, so every
// rank reports the same root cause (rank 0, which keeps the store, waits up to 2 s for the others to
// read it before it exits). Worst case, every rank stops within the heartbeat timeout + 1 s.
//
// Shutdown. The destructor is a store barrier: each rank counts itself finished and waits until all
// are (its watchdog still running, so a peer failing meanwhile still stops it; at most the operations'
// time limit, then it names the ranks that never finished and goes), then stops its threads;
// ranks 1.. then say they have detached and rank 0 keeps the store up until all have (at most 10 s).
// So a rank must destroy its transport (or let it go out of scope) before exiting, and after the last
// operation every rank has waited for; exiting with a live transport looks like a failure to the others.
// If the transport is destroyed while an exception propagates, or after abort(), there is no barrier: it
// calls abort() (when not done yet, with a message pointing at the rank's own output), and rank 0 keeps
// the store up for up to 5 s until every other rank still connected has seen the failure.
//
// A finished rank first writes how many messages it sent to each peer and how many collectives it
// called ("pipetrain/finished/K"). The watchdogs read that as soon as the finished count moves; a rank
// that waits for a message from it that was never sent (all it sent has arrived), or in a collective it
// never called, fails at once: "rank K finished while rank R waits for ...", as when the ranks run
// different numbers of steps (a receive throws; a collective, which cannot be interrupted, stops the
// process after reporting it). The other way round, a message sent to a rank that finished without
// receiving it: Gloo's send of a large payload waits for the receive and would wait for good, so the
// finished rank, which holds the message's header (or gets it later on its header thread), publishes
// "rank K finished while rank R sends it ..." and every rank stops.
//
// Environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (or OMPI_COMM_WORLD_RANK/SIZE), GLOO_SOCKET_IFNAME
// (the network interface for Gloo; default: the one that routes to MASTER_ADDR, loopback for 127.0.0.1),
// PIPETRAIN_HEARTBEAT_TIMEOUT (seconds, default 10), PIPETRAIN_FINAL_BARRIER_TIMEOUT (transport.h),
// PIPETRAIN_RENDEZVOUS_TIMEOUT (seconds all ranks get to join, default 300), PIPETRAIN_RUN_TOKEN,
// PIPETRAIN_STORE_BIND, PIPETRAIN_LAUNCHER_STORE and TORCHELASTIC_USE_AGENT_STORE (above),
// PIPETRAIN_RENDEZVOUS_FAULT (a test hook, rendezvous_fault()).
// Gloo operations time out after 30 min.
//
// Listening addresses: the store only on MASTER_ADDR's address (127.0.0.1 under pipetrain launch), never
// the wildcard unless PIPETRAIN_STORE_BIND asks; Gloo only on the address chosen above.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/store.h"
#include "pipetrain/runtime/transport.h"
#include "torch_compat.h"
#include "transport_util.h"

namespace pipetrain {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using detail::byte_size;
using detail::cpu_contiguous;
using detail::env_seconds;
using detail::getenv_string;
using detail::parse_integer;
using detail::rendezvous_fault;
using detail::find_or_host_store;
using detail::StoreSite;
using std::chrono::seconds;

constexpr milliseconds kAbortPollPeriod{150};
constexpr milliseconds kHeartbeatPeriod{1000};
constexpr milliseconds kOpTimeout = std::chrono::minutes(30);
constexpr milliseconds kForever = std::chrono::hours(24 * 365);  // a year: no overflow inside wait_for
constexpr milliseconds kDetachWait{10000};
constexpr milliseconds kAbortLinger{5000};
constexpr int kControlTag = 1 << 30;  // Gloo slot of the headers; user tags are 0 .. kControlTag-1

const std::string kAbortSeenKey = "pipetrain/abort_seen";
const std::string kFinishedKey = "pipetrain/finished";
const std::string kDetachedKey = "pipetrain/detached";
std::string heartbeat_key(int rank) { return "pipetrain/heartbeat/" + std::to_string(rank); }
std::string finished_key(int rank) { return "pipetrain/finished/" + std::to_string(rank); }

// --- environment -------------------------------------------------------------------------------

// The text of an exception without c10's backtrace or Gloo's "[file.cc:line] " prefix.
std::string short_what(const std::exception& e) {
  std::string text = e.what();
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) text = c10e->what_without_backtrace();
  if (text.rfind("[", 0) == 0) {
    const auto end = text.find("] ");
    if (end != std::string::npos && text.find(".cc:") < end) text.erase(0, end + 2);
  }
  return text;
}

std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// The local address of the route towards `host`: the interface this rank should give Gloo ("" if
// unknown). A UDP connect sends nothing; it only makes the kernel pick the route.
std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return "";
  std::string found;
  for (addrinfo* ai = res; ai && found.empty(); ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char text[INET6_ADDRSTRLEN] = {};
      const void* a = local.ss_family == AF_INET
                          ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
                          : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
      if (::inet_ntop(local.ss_family, a, text, sizeof text)) found = text;
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return found;
}

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
constexpr uint32_t kMagic = 0x50504c54;  // "PPLT"

std::string describe(const at::Tensor& t) {
  return detail::describe(t.scalar_type(), t.sizes().data(), static_cast<int>(t.dim()), byte_size(t), kMaxDims);
}

std::string describe(const Header& h) {
  return detail::describe(static_cast<c10::ScalarType>(h.dtype), h.sizes, h.ndim, h.nbytes, kMaxDims);
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

std::atomic<bool> g_exiting{false};  // one thread ends the process; the others wait for it

[[noreturn]] void wait_for_exit() {
  for (;;) ::pause();
}

// One receive: posted by the owner thread, matched with its header by the header thread of its source
// (or by irecv itself when the header came first).
struct PendingRecv {
  enum State { Waiting, Matched, Failed };
  int src = 0;
  int tag = 0;
  at::Tensor buffer;  // CPU contiguous; after a mismatch, the scratch bytes the payload drains into
  State state = Waiting;
  c10::intrusive_ptr<c10d::Work> work;  // the payload receive, once posted
  std::string error;                    // for Failed
};

class GlooTransport;

class GlooSendWork final : public Work {
 public:
  GlooSendWork(GlooTransport& t, int dst, c10::intrusive_ptr<c10d::Work> header,
               c10::intrusive_ptr<c10d::Work> payload, at::Tensor keep, std::string what)
      : t_(t),
        dst_(dst),
        header_(std::move(header)),
        payload_(std::move(payload)),
        keep_(std::move(keep)),
        what_(std::move(what)) {}
  void wait() override;

 private:
  GlooTransport& t_;
  int dst_;
  c10::intrusive_ptr<c10d::Work> header_, payload_;
  at::Tensor keep_;
  std::string what_;
};

class GlooRecvWork final : public Work {
 public:
  GlooRecvWork(GlooTransport& t, std::shared_ptr<PendingRecv> rec, at::Tensor target)
      : t_(t), rec_(std::move(rec)), target_(std::move(target)) {}
  void wait() override;

 private:
  GlooTransport& t_;
  std::shared_ptr<PendingRecv> rec_;
  at::Tensor target_;  // the caller's tensor; differs from rec_->buffer when it is not CPU-contiguous
  bool done_ = false;
};

class GlooTransport final : public Transport {
 public:
  explicit GlooTransport(const Rendezvous& rv);
  ~GlooTransport() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string name() const override { return "gloo"; }

  std::unique_ptr<Work> isend(const torch::Tensor& tensor, int dst, int tag) override;
  std::unique_ptr<Work> irecv(torch::Tensor& tensor, int src, int tag) override;
  void all_reduce_sum(torch::Tensor& tensor) override;
  void barrier() override;
  void abort(const std::string& message) noexcept override;

 private:
  friend class GlooRecvWork;
  friend class GlooSendWork;

  // Handles an error of a Gloo operation (`operation` like "receiving Float [4] from rank 1 (tag 2)",
  // `error` Gloo's text). Another rank's failure is the likely cause: if one was reported, this rank
  // stops with it, like the watchdog does. Else, if the operation was with `peer` (>= 0), that peer
  // died: this rank reports it and stops. Else throws std::runtime_error.
  [[noreturn]] void fail(const std::string& operation, const std::string& error, int peer);

  void check_peer(int peer, int tag, const char* what) const;
  void match(PendingRecv& rec, const Header& h);  // mu_ held
  void header_loop(int peer);
  // The connection to `peer` failed (on its header thread): unless that is the end of a normal run,
  // `peer` died; stop this rank now rather than when it next needs that peer.
  void peer_lost(int peer, const std::string& error);
  void watchdog_loop();
  void monitor_loop();
  void watchdog_poll(std::vector<int64_t>& beats, std::vector<Clock::time_point>& changed,
                     Clock::time_point& next_beat, Clock::time_point& next_check);
  [[noreturn]] void lost_store(const std::string& why);
  // Watchdog: reads what newly finished ranks sent; stops this rank if it waits in a collective one of
  // them never called.
  void poll_finished();
  // What stop_process does with the store first: kPublish writes the diagnosis as the abort key (or
  // reports the one already there), kAcknowledge only counts this rank in abort_seen (rank 0 instead
  // keeps the store up for the others for up to 2 s), kLeave does not touch it (it is gone or hung).
  enum class Store { kPublish, kAcknowledge, kLeave };
  // Ends the process after rank `failed_rank`'s failure (see the file comment).
  [[noreturn]] void stop_process(int failed_rank, std::string message, Store store);
  // Joins (or, on rank 0, hosts and joins) the rendezvous store: store_ and watch_store_.
  void connect_store(const Rendezvous& rv, milliseconds join_timeout);
  // Tells the store what this rank is doing, for its report should the rank vanish.
  void set_phase(const std::string& phase);
  void finish_barrier();
  // mu_ held: the message naming a message from `peer` (its header `h`) that arrived at this finished rank
  // and will never be received.
  std::string unreceived(int peer, const Header& h) const;
  void stop_threads();
  // Polls `key` (an add() counter) on the main store client until it reaches `target` or `limit` passes.
  bool wait_for_count(const std::string& key, int64_t target, milliseconds limit);

  int rank_;
  int world_size_;
  std::string store_address_;  // "addr:port", for messages
  milliseconds dead_after_;
  milliseconds final_limit_{std::chrono::minutes(30)};  // the final barrier's (PIPETRAIN_FINAL_BARRIER_TIMEOUT)

  std::unique_ptr<StoreServer> server_;          // rank 0's, when it hosts the store (destroyed last)
  c10::intrusive_ptr<c10d::Store> store_;        // main client
  c10::intrusive_ptr<c10d::Store> watch_store_;  // the watchdog's own connection
  std::mutex store_mu_;                             // guards store_ (abort may come from any thread)
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;

  // Matching of headers and receives (owner thread and header threads).
  std::mutex mu_;
  std::condition_variable cv_;
  // Per (src, tag), FIFO, taken with take_oldest (which erases emptied keys).
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<PendingRecv>>> posted_;  // (src, tag)
  std::map<std::pair<int, int>, std::deque<Header>> arrived_;
  std::vector<c10::intrusive_ptr<c10d::Work>> header_work_;  // per peer: the posted header receive
  std::vector<std::string> peer_error_;  // per peer: why its receives fail from now on
  std::vector<bool> peer_gone_;          // per peer: ... because its connection failed
  bool stopping_ = false;
  bool finishing_ = false;  // in the final barrier: no receive is posted any more (a header now is an error)

  // Finished peers (see the file comment).
  std::vector<int64_t> sent_;               // owner thread: headers sent per peer
  std::vector<int64_t> received_;           // mu_: headers received per peer
  std::vector<int64_t> peer_sent_;          // mu_: per peer, -1 until it finished; then what it sent here
  std::vector<int64_t> peer_collectives_;   // watchdog: per peer, -1 until it finished; then its collectives
  int64_t finished_seen_ = 0;               // watchdog: the finished count last read
  std::atomic<int64_t> collectives_{0};     // owner thread: collectives entered
  std::atomic<bool> in_collective_{false};  // owner thread: in one now

  // Watchdog.
  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  bool wd_stop_ = false;
  std::atomic<int64_t> wd_progress_ns_{0};
  std::atomic<bool> aborted_{false};  // this rank called abort()
  std::atomic<bool> connected_{false};  // Gloo is connected: from now on heartbeats are judged

  std::vector<std::thread> header_threads_;
  std::thread watchdog_, monitor_;
};

GlooTransport::GlooTransport(const Rendezvous& rv) : rank_(rv.rank), world_size_(rv.world_size) {
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
  final_limit_ = detail::final_barrier_limit();
  const milliseconds join_timeout = env_seconds("PIPETRAIN_RENDEZVOUS_TIMEOUT", seconds(300));

  // A peer that dies mid-write must give an error, not SIGPIPE.
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);

  connect_store(rv, join_timeout);
  set_phase("the rendezvous");
  rendezvous_fault(rank_, "after-join");
  // The watchdog runs from here on: a failure reported while Gloo connects (a rank that died during the
  // rendezvous) stops this rank too. Heartbeats are judged only once Gloo is connected.
  wd_progress_ns_ = Clock::now().time_since_epoch().count();
  watchdog_ = std::thread([this] { watchdog_loop(); });
  monitor_ = std::thread([this] { monitor_loop(); });

  auto options = c10d::ProcessGroupGloo::Options::create(kOpTimeout);
  std::string device_address;
  try {
    if (const auto ifname = getenv_string("GLOO_SOCKET_IFNAME"); ifname && !ifname->empty()) {
      device_address = "interface " + *ifname + " (GLOO_SOCKET_IFNAME)";
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(*ifname));
    } else {
      const std::string local = local_address_towards(rv.master_addr, rv.master_port);
      if (local.empty()) {
        device_address = "this host's default address";
        options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      } else {
        device_address = local;
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(local));
      }
    }
    options->threads = 1;  // collectives only; point-to-point runs on Gloo's network thread
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("pipetrain/gloo", store_);
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank_, world_size_, options);
  } catch (const std::exception& e) {
    // Another rank's failure (seen while waiting for its address) is the root cause; else this rank's
    // own error, which the others must hear of, or they wait for it until the rendezvous times out.
    std::optional<RemoteFailure> reported;
    if (const auto* remote = dynamic_cast<const RemoteFailure*>(&e)) {
      reported = *remote;
    } else {
      try {
        std::lock_guard<std::mutex> lk(store_mu_);
        if (store_->check({kAbortKey})) {
          const auto raw = store_->get(kAbortKey);
          const auto [failed, message] = parse_abort(std::string(raw.begin(), raw.end()));
          reported = RemoteFailure(failed, message);
        }
      } catch (const RemoteFailure& remote) {  // the client's get() reports it so while it watches
        reported = remote;
      } catch (const std::exception&) {
      }
    }
    if (reported && reported->failed_rank() == rank_) reported.reset();
    const std::string own = "rank " + std::to_string(rank_) + " could not connect to the other ranks over Gloo on " +
                            device_address + ": " + short_what(e) +
                            ". Set GLOO_SOCKET_IFNAME to the network interface that reaches the other ranks";
    if (!reported) abort(own);
    stop_threads();
    if (reported) throw *reported;
    throw std::runtime_error(own);
  }
  // From here on a failure report reaches this rank through the watchdog; the main client's get() must
  // read the report itself (fail() does), not throw it.
  if (auto* client = dynamic_cast<StoreClient*>(store_.get())) client->stop_waiting_on_abort(StoreClient::kNotWatching);
  header_work_.resize(world_size_);
  peer_error_.resize(world_size_);
  peer_gone_.resize(world_size_);
  sent_.assign(world_size_, 0);
  received_.assign(world_size_, 0);
  peer_sent_.assign(world_size_, -1);
  peer_collectives_.assign(world_size_, -1);
  connected_ = true;
  set_phase("the run");
  for (int peer = 0; peer < world_size_; ++peer)
    if (peer != rank_) header_threads_.emplace_back([this, peer] { header_loop(peer); });
}

void GlooTransport::set_phase(const std::string& phase) {
  try {
    std::lock_guard<std::mutex> lk(store_mu_);
    store_->set(phase_key(rank_), bytes_of(phase));
  } catch (const std::exception&) {
    // Only for the store's report; a lost store shows elsewhere.
  }
}

void GlooTransport::connect_store(const Rendezvous& rv, milliseconds join_timeout) {
  const std::string join_hint = "start all WORLD_SIZE=" + std::to_string(world_size_) +
                                " ranks with the same MASTER_ADDR and MASTER_PORT (pipetrain launch does), or "
                                "raise PIPETRAIN_RENDEZVOUS_TIMEOUT (now " +
                                std::to_string(join_timeout.count() / 1000) + " s)";
  const std::string master = store_address_ + " (MASTER_ADDR:MASTER_PORT)";

  // torchrun: its agent hosts a c10d::TCPStore on MASTER_ADDR:MASTER_PORT for the workers; join it.
  if (getenv_string("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True") {
    const std::string attempt = getenv_string("TORCHELASTIC_RESTART_COUNT").value_or("0");
    try {
      c10d::TCPStoreOptions o;
      o.port = static_cast<std::uint16_t>(rv.master_port);
      o.isServer = false;
      o.waitWorkers = false;
      o.timeout = join_timeout;
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
  const std::string& token = site.token;
  const std::string& host = site.host;
  const int port = site.port;
  const std::string& what = site.what;
  rendezvous_fault(rank_, "before-join");
  try {
    auto main = c10::make_intrusive<StoreClient>(host, port, token, rank_, world_size_, join_timeout, what);
    watch_store_ = c10::make_intrusive<StoreClient>(host, port, token, rank_, world_size_, join_timeout, what);
    main->stop_waiting_on_abort(rank_);  // Gloo's rendezvous waits end at once when a rank failed
    store_ = main;
  } catch (const std::exception& e) {
    const std::string text = e.what();
    if (text.find("hosts another pipetrain run") != std::string::npos)
      throw std::runtime_error("rank " + std::to_string(rank_) + ": " + text);
    throw std::runtime_error("rank " + std::to_string(rank_) + " could not join the rendezvous store: " + text +
                             ". Is rank 0 running? " + join_hint);
  }
}

GlooTransport::~GlooTransport() {
  if (std::uncaught_exceptions() > 0 && !aborted_)
    abort("its transport was destroyed while an error was propagating (see rank " + std::to_string(rank_) +
          "'s own output for it)");
  const bool failed = aborted_;
  if (!failed) finish_barrier();
  stop_threads();
  try {
    if (!failed) {
      if (rank_ != 0) {
        std::lock_guard<std::mutex> lk(store_mu_);
        store_->add(kDetachedKey, 1);
      } else {
        wait_for_count(kDetachedKey, world_size_ - 1, kDetachWait);
      }
    } else {
      if (rank_ == 0) {  // keep the store up until the ranks still connected have seen the failure
        int gone = 0;
        {
          std::lock_guard<std::mutex> lk(mu_);
          for (int k = 0; k < world_size_; ++k) gone += k != rank_ && peer_gone_[k];
        }
        wait_for_count(kAbortSeenKey, world_size_ - 1 - gone, kAbortLinger);
      }
    }
  } catch (const std::exception&) {
    // The store is gone: nothing left to coordinate.
  }
  pg_.reset();
  watch_store_.reset();
  store_.reset();
}

bool GlooTransport::wait_for_count(const std::string& key, int64_t target, milliseconds limit) {
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

std::string GlooTransport::unreceived(int peer, const Header& h) const {
  const int ndim = std::max(0, std::min<int>(h.ndim, kMaxDims + 1));
  return "rank " + std::to_string(rank_) + " finished while rank " + std::to_string(peer) + " sends it " +
         detail::describe(static_cast<c10::ScalarType>(h.dtype), h.sizes, ndim, h.nbytes, kMaxDims) + " (tag " +
         std::to_string(h.tag) + "), which it will never receive: do all ranks make the same calls (the same number of "
         "train_step calls, say)?";
}

void GlooTransport::finish_barrier() {
  // From now on this rank posts no receive: a message a peer sent that has not been matched never will
  // be. Its sender may be blocked in Gloo's send (a large payload waits for the receive) and cannot be
  // interrupted, so the failure is published and every rank stops (the header threads do the same for
  // headers that arrive later).
  {
    std::unique_lock<std::mutex> lk(mu_);
    finishing_ = true;
    for (const auto& [key, headers] : arrived_)
      if (!headers.empty()) {
        const std::string message = unreceived(key.first, headers.front());
        lk.unlock();
        stop_process(rank_, message, Store::kPublish);
      }
  }
  try {
    set_phase("shutdown (the final barrier)");
    {
      std::string counts = std::to_string(collectives_.load()) + ";";
      for (int k = 0; k < world_size_; ++k) counts += (k ? "," : "") + std::to_string(sent_[k]);
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
                   "pipetrain rank %d: gloo: gave up the final barrier after %s: rank(s) %s neither finished "
                   "nor failed (still working, or waiting where nothing comes?)\n",
                   rank_, detail::describe_limit(final_limit_).c_str(), missing.c_str());
    }
  } catch (const std::exception& e) {
    lost_store(short_what(e));
  }
}

void GlooTransport::stop_threads() {
  {
    std::lock_guard<std::mutex> lk(wd_mu_);
    wd_stop_ = true;
  }
  wd_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (monitor_.joinable()) monitor_.join();
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
    for (auto& w : header_work_)
      if (w) w->abort();
  }
  cv_.notify_all();
  for (auto& t : header_threads_) t.join();
}

void GlooTransport::lost_store(const std::string& why) {
  stop_process(0, "lost the rendezvous store at " + store_address_ + " (its host died?): " + why,
               Store::kLeave);
}

void GlooTransport::stop_process(int failed_rank, std::string message, Store store) {
  if (g_exiting.exchange(true)) wait_for_exit();
  if (store != Store::kLeave) {
    try {
      // The watchdog thread owns watch_store_; any other thread uses the main client.
      const bool on_watchdog = std::this_thread::get_id() == watchdog_.get_id();
      std::unique_lock<std::mutex> lk(store_mu_, std::defer_lock);
      if (!on_watchdog) lk.lock();
      c10d::Store& st = on_watchdog ? *watch_store_ : *store_;
      if (store == Store::kPublish) {
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

void GlooTransport::abort(const std::string& message) noexcept {
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

// --- watchdog ----------------------------------------------------------------------------------

void GlooTransport::watchdog_loop() {
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

void GlooTransport::watchdog_poll(std::vector<int64_t>& beats, std::vector<Clock::time_point>& changed,
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
      if (failed != rank_ && !aborted_) stop_process(failed, message, Store::kAcknowledge);
    }
    if (connected_) poll_finished();
    if (!connected_) {  // ranks may join late: heartbeats count from the moment Gloo is connected
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
                       Store::kPublish);
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

void GlooTransport::poll_finished() {
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
      std::lock_guard<std::mutex> lk(mu_);
      peer_sent_[k] = rank_ < static_cast<int>(counts.size()) ? counts[rank_] : 0;
      cv_.notify_all();
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
                   Store::kPublish);
}

void GlooTransport::monitor_loop() {
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
                   Store::kLeave);
  }
}

// --- messages ----------------------------------------------------------------------------------

void GlooTransport::check_peer(int peer, int tag, const char* what) const {
  if (peer < 0 || peer >= world_size_ || peer == rank_)
    throw std::invalid_argument(std::string("gloo ") + what + ": rank " + std::to_string(peer) +
                                " is not a peer of rank " + std::to_string(rank_) + ": use 0.." +
                                std::to_string(world_size_ - 1) + " except " + std::to_string(rank_));
  if (tag < 0 || tag >= kControlTag)
    throw std::invalid_argument(std::string("gloo ") + what + ": tag " + std::to_string(tag) +
                                " is out of range: use 0.." + std::to_string(kControlTag - 1));
}

std::unique_ptr<Work> GlooTransport::isend(const torch::Tensor& tensor, int dst, int tag) {
  check_peer(dst, tag, "isend");
  at::Tensor payload = cpu_contiguous(tensor);
  const Header h = header_for(payload, tag);
  at::Tensor header = at::empty({static_cast<int64_t>(sizeof(Header))}, at::kByte);
  std::memcpy(header.data_ptr(), &h, sizeof h);
  const std::string what =
      "sending " + describe(payload) + " to rank " + std::to_string(dst) + " (tag " + std::to_string(tag) + ")";
  c10::intrusive_ptr<c10d::Work> hw, pw;
  try {
    std::vector<at::Tensor> hv{header};
    hw = pg_->send(hv, dst, kControlTag);
    ++sent_[dst];
    if (h.nbytes > 0) {
      std::vector<at::Tensor> pv{payload};
      pw = pg_->send(pv, dst, tag);
    }
  } catch (const std::exception& e) {
    fail(what, short_what(e), dst);
  }
  return std::make_unique<GlooSendWork>(*this, dst, std::move(hw), std::move(pw), payload, what);
}

std::unique_ptr<Work> GlooTransport::irecv(torch::Tensor& tensor, int src, int tag) {
  check_peer(src, tag, "irecv");
  auto rec = std::make_shared<PendingRecv>();
  rec->src = src;
  rec->tag = tag;
  rec->buffer = tensor.device().is_cpu() && tensor.is_contiguous()
                    ? tensor
                    : at::empty(tensor.sizes(), tensor.options().device(at::kCPU));
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (const auto h = detail::take_oldest(arrived_, {src, tag})) {
      match(*rec, *h);
    } else {
      posted_[{src, tag}].push_back(rec);
    }
  }
  return std::make_unique<GlooRecvWork>(*this, rec, tensor);
}

void GlooTransport::match(PendingRecv& rec, const Header& h) {
  const int64_t expected = byte_size(rec.buffer);
  const bool same = h.nbytes == expected && h.dtype == static_cast<int32_t>(rec.buffer.scalar_type());
  try {
    if (same) {
      rec.state = PendingRecv::Matched;
      if (expected > 0) {
        std::vector<at::Tensor> v{rec.buffer};
        rec.work = pg_->recv(v, rec.src, rec.tag);
      }
    } else {
      rec.state = PendingRecv::Failed;
      rec.error = "gloo: message mismatch from rank " + std::to_string(rec.src) + " (tag " + std::to_string(rec.tag) +
                  "): it sent " + describe(h) + " but rank " + std::to_string(rank_) + " expected " +
                  describe(rec.buffer) + ": sender and receiver must agree on the tensor's size and dtype";
      rec.buffer = at::empty({h.nbytes}, at::kByte);  // drain the payload, so later messages stay in step
      if (h.nbytes > 0) {
        std::vector<at::Tensor> v{rec.buffer};
        rec.work = pg_->recv(v, rec.src, rec.tag);
      }
    }
  } catch (const std::exception& e) {
    rec.state = PendingRecv::Failed;
    rec.error = "gloo: receiving from rank " + std::to_string(rec.src) + " (tag " + std::to_string(rec.tag) +
                ") failed: " + short_what(e);
  }
  cv_.notify_all();
}

void GlooTransport::fail(const std::string& operation, const std::string& error, int peer) {
  if (!aborted_) {
    std::optional<std::string> reported;
    try {
      std::lock_guard<std::mutex> lk(store_mu_);
      if (store_->check({kAbortKey})) {
        const std::vector<uint8_t> raw = store_->get(kAbortKey);
        reported = std::string(raw.begin(), raw.end());
      }
    } catch (const std::exception& e) {
      // The store lives in rank 0's process: rank 0 died, and is the likely cause of this error too.
      lost_store(short_what(e) + "; then " + operation + " failed: " + error);
    }
    if (reported) {
      const auto nl = reported->find('\n');
      const int failed = static_cast<int>(parse_integer(reported->substr(0, nl)).value_or(-1));
      if (failed >= 0 && failed != rank_)
        stop_process(failed, nl == std::string::npos ? *reported : reported->substr(nl + 1), Store::kAcknowledge);
    }
    if (peer >= 0)
      stop_process(peer,
                   "it went away (killed or crashed?) while rank " + std::to_string(rank_) + " was " + operation +
                       ": " + error,
                   Store::kPublish);
  }
  throw std::runtime_error("gloo: " + operation + " failed: " + error +
                           (peer >= 0 ? "" : " (a peer has probably stopped; see its output)"));
}

void GlooSendWork::wait() {
  try {
    if (header_) header_->wait();
    if (payload_) payload_->wait();
  } catch (const std::exception& e) {
    header_.reset();
    payload_.reset();
    t_.fail(what_, short_what(e), dst_);
  }
  header_.reset();
  payload_.reset();
}

void GlooRecvWork::wait() {
  if (done_) return;
  done_ = true;
  PendingRecv& rec = *rec_;
  const std::string from = "rank " + std::to_string(rec.src) + " (tag " + std::to_string(rec.tag) + ")";
  c10::intrusive_ptr<c10d::Work> work;
  {
    std::unique_lock<std::mutex> lk(t_.mu_);
    const std::string& peer_error = t_.peer_error_[rec.src];
    // All that the source sent before it finished has arrived, and none of it matched.
    auto never = [&] { return t_.peer_sent_[rec.src] >= 0 && t_.received_[rec.src] >= t_.peer_sent_[rec.src]; };
    const bool matched = t_.cv_.wait_for(lk, kOpTimeout, [&] {
      return rec.state != PendingRecv::Waiting || !peer_error.empty() || t_.stopping_ || never();
    });
    if (rec.state == PendingRecv::Waiting) {
      if (peer_error.empty() && never())
        throw std::runtime_error("gloo: rank " + std::to_string(rec.src) + " finished while rank " +
                                 std::to_string(t_.rank_) + " waits for " + describe(target_) + " from " + from +
                                 ": do all ranks make the same calls (the same number of train_step calls, say)?");
      if (!peer_error.empty()) {
        const std::string error = peer_error;
        const bool gone = t_.peer_gone_[rec.src];
        lk.unlock();
        t_.fail("receiving " + describe(target_) + " from " + from, error, gone ? rec.src : -1);
      }
      if (!matched)
        throw std::runtime_error("gloo: timed out after " + std::to_string(kOpTimeout.count() / 60000) +
                                 " min waiting for " + describe(target_) + " from " + from +
                                 ": does that rank send it (same tag, same order)?");
      throw std::runtime_error("gloo: the transport was shut down while receiving from " + from);
    }
    work = rec.work;
  }
  if (work) {
    try {
      work->wait();
    } catch (const std::exception& e) {
      t_.fail("receiving " + describe(target_) + " from " + from, short_what(e), rec.src);
    }
  }
  rec.work.reset();
  if (rec.state == PendingRecv::Failed) throw std::runtime_error(rec.error);
  if (!rec.buffer.is_same(target_)) target_.copy_(rec.buffer);
}

void GlooTransport::peer_lost(int peer, const std::string& error) {
  if (aborted_) return;  // this rank is failing already
  int64_t finished = 0;
  try {
    std::lock_guard<std::mutex> lk(store_mu_);
    finished = store_->add(kFinishedKey, 0);
  } catch (const std::exception& e) {
    // The store lives in rank 0's process: rank 0 is the one that died (the peer may just have
    // stopped because of it).
    lost_store(short_what(e) + "; the connection to rank " + std::to_string(peer) + " closed too (" + error + ")");
  }
  // A rank closes its connections only after the final barrier, i.e. once every rank has finished.
  if (finished >= world_size_) return;
  try {
    fail("waiting for its messages", error, peer);
  } catch (const std::exception&) {
    // This rank aborted meanwhile: its own error is the one to report.
  }
}

void GlooTransport::header_loop(int peer) {
  const std::string who = "rank " + std::to_string(peer);
  for (;;) {
    at::Tensor header = at::empty({static_cast<int64_t>(sizeof(Header))}, at::kByte);
    c10::intrusive_ptr<c10d::Work> work;
    std::string error;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) return;
      try {
        std::vector<at::Tensor> v{header};
        work = pg_->recv(v, peer, kControlTag);
        header_work_[peer] = work;
      } catch (const std::exception& e) {
        error = short_what(e);
      }
    }
    bool got = false;
    if (work) {
      try {
        got = work->wait(kForever);
      } catch (const std::exception& e) {
        error = short_what(e);
      }
    }
    std::unique_lock<std::mutex> lk(mu_);
    header_work_[peer].reset();
    if (stopping_) return;
    if (!error.empty() || !got) {
      if (error.empty()) error = "receive aborted";
      peer_error_[peer] = "the connection to " + who + " failed: " + error;
      peer_gone_[peer] = true;
      cv_.notify_all();
      lk.unlock();
      peer_lost(peer, error);
      return;
    }
    Header h;
    std::memcpy(&h, header.data_ptr(), sizeof h);
    if (h.magic != kMagic) {
      peer_error_[peer] = who + " sent a message that is not a pipetrain header: is it the same pipetrain build?";
      cv_.notify_all();
      return;
    }
    ++received_[peer];
    if (peer_sent_[peer] >= 0) cv_.notify_all();  // a wait may learn that nothing more comes
    if (const auto rec = detail::take_oldest(posted_, {peer, h.tag})) {
      match(**rec, h);
    } else {
      arrived_[{peer, h.tag}].push_back(h);
      if (finishing_) {
        const std::string message = unreceived(peer, h);
        lk.unlock();
        stop_process(rank_, message, Store::kPublish);
      }
    }
  }
}

// --- collectives -------------------------------------------------------------------------------

void GlooTransport::all_reduce_sum(torch::Tensor& tensor) {
  at::Tensor buffer = cpu_contiguous(tensor);
  try {
    std::vector<at::Tensor> v{buffer};
    ++collectives_;
    in_collective_ = true;
    pg_->allreduce(v)->wait();
    in_collective_ = false;
  } catch (const std::exception& e) {
    in_collective_ = false;
    fail("reducing " + describe(tensor) + " (all_reduce_sum) on rank " + std::to_string(rank_), short_what(e), -1);
  }
  if (!buffer.is_same(tensor)) tensor.copy_(buffer);
}

void GlooTransport::barrier() {
  try {
    ++collectives_;
    in_collective_ = true;
    pg_->barrier()->wait();
    in_collective_ = false;
  } catch (const std::exception& e) {
    in_collective_ = false;
    fail("in a barrier on rank " + std::to_string(rank_), short_what(e), -1);
  }
}

}  // namespace

std::shared_ptr<Transport> make_gloo_transport(const Rendezvous& rv) { return std::make_shared<GlooTransport>(rv); }

bool gloo_transport_available() { return true; }

std::string gloo_transport_absent_reason() { return ""; }

}  // namespace pipetrain

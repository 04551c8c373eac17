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
//
// Code: the store, phases, watchdog, heartbeats, failure reports, finished counts and the final barrier
// are detail::RunBoard's (transport_board.h), which the nccl transport shares; this file keeps Gloo's
// connection, the headers and their threads, and what a lost connection means.
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
#include "transport_board.h"
#include "transport_util.h"

namespace pipetrain {
namespace {

using std::chrono::milliseconds;
using detail::byte_size;
using detail::cpu_contiguous;
using detail::getenv_string;
using detail::rendezvous_fault;
using detail::RunBoard;
using detail::short_what;

constexpr milliseconds kOpTimeout = std::chrono::minutes(30);
constexpr milliseconds kForever = std::chrono::hours(24 * 365);  // a year: no overflow inside wait_for
constexpr int kControlTag = 1 << 30;  // Gloo slot of the headers; user tags are 0 .. kControlTag-1

// --- environment -------------------------------------------------------------------------------

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
  using Store = RunBoard::Report;
  // Ends the process after rank `failed_rank`'s failure (see the file comment).
  [[noreturn]] void stop_process(int failed_rank, std::string message, Store store) {
    board_.stop_process(failed_rank, std::move(message), store);
  }
  void finish_barrier();
  // mu_ held: the message naming a message from `peer` (its header `h`) that arrived at this finished rank
  // and will never be received.
  std::string unreceived(int peer, const Header& h) const;
  void stop_threads();

  RunBoard board_;  // the store, the watchdog, the failure board (transport_board.h)
  int rank_;
  int world_size_;
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

  std::vector<std::thread> header_threads_;
};

GlooTransport::GlooTransport(const Rendezvous& rv)
    : board_(rv, "gloo"), rank_(rv.rank), world_size_(rv.world_size) {
  board_.connect(rv);
  board_.set_phase("the rendezvous");
  rendezvous_fault(rank_, "after-join");
  // The watchdog runs from here on: a failure reported while Gloo connects (a rank that died during the
  // rendezvous) stops this rank too. Heartbeats are judged only once Gloo is connected.
  board_.start([this](int peer, int64_t sent_here) {
    std::lock_guard<std::mutex> lk(mu_);
    peer_sent_[peer] = sent_here;
    cv_.notify_all();
  });

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
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("pipetrain/gloo", board_.store());
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank_, world_size_, options);
  } catch (const std::exception& e) {
    // Another rank's failure (seen while waiting for its address) is the root cause; else this rank's
    // own error, which the others must hear of, or they wait for it until the rendezvous times out.
    std::optional<RemoteFailure> reported;
    if (const auto* remote = dynamic_cast<const RemoteFailure*>(&e)) {
      reported = *remote;
    } else {
      try {
        board_.with_store([&](c10d::Store& store) {
          if (store.check({kAbortKey})) {
            const auto raw = store.get(kAbortKey);
            const auto [failed, message] = parse_abort(std::string(raw.begin(), raw.end()));
            reported = RemoteFailure(failed, message);
          }
        });
      } catch (const RemoteFailure& remote) {  // the client's get() reports it so while it watches
        reported = remote;
      } catch (const std::exception&) {
      }
    }
    if (reported && reported->failed_rank() == rank_) reported.reset();
    // The store's host (rank 0, or the launcher) gone is no network problem: no interface advice then, and
    // no report to a store that is not there.
    const bool store_lost = std::string(e.what()).find("lost the rendezvous store") != std::string::npos;
    const std::string own =
        "rank " + std::to_string(rank_) + " could not connect to the other ranks over Gloo on " + device_address +
        ": " + short_what(e) +
        (store_lost ? ": the store's host (rank 0, or the launcher that started the ranks) stopped or died; see its "
                      "output for why"
                    : ". Set GLOO_SOCKET_IFNAME to the network interface that reaches the other ranks");
    if (!reported && !store_lost) abort(own);
    stop_threads();
    if (reported) throw *reported;
    throw std::runtime_error(own);
  }
  // From here on a failure report reaches this rank through the watchdog; the main client's get() must
  // read the report itself (fail() does), not throw it.
  board_.stop_watching_abort();
  header_work_.resize(world_size_);
  peer_error_.resize(world_size_);
  peer_gone_.resize(world_size_);
  sent_.assign(world_size_, 0);
  received_.assign(world_size_, 0);
  peer_sent_.assign(world_size_, -1);
  board_.set_connected();
  board_.set_phase("the run");
  for (int peer = 0; peer < world_size_; ++peer)
    if (peer != rank_) header_threads_.emplace_back([this, peer] { header_loop(peer); });
}

GlooTransport::~GlooTransport() {
  if (std::uncaught_exceptions() > 0 && !board_.aborted())
    abort("its transport was destroyed while an error was propagating (see rank " + std::to_string(rank_) +
          "'s own output for it)");
  const bool failed = board_.aborted();
  if (!failed) finish_barrier();
  stop_threads();
  int gone = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (int k = 0; k < world_size_; ++k) gone += k != rank_ && peer_gone_[k];
  }
  board_.leave(failed, gone);
  pg_.reset();
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
  board_.finish(sent_);
}

void GlooTransport::stop_threads() {
  board_.stop_threads();
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
    for (auto& w : header_work_)
      if (w) w->abort();
  }
  cv_.notify_all();
  for (auto& t : header_threads_) t.join();
}

void GlooTransport::abort(const std::string& message) noexcept { board_.abort(message); }

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
  if (!board_.aborted()) {
    // A store that is gone means rank 0 died, the likely cause of this error too (lost_store).
    if (const auto reported = board_.reported_failure(operation + " failed: " + error))
      if (reported->first >= 0 && reported->first != rank_)
        stop_process(reported->first, reported->second, Store::kAcknowledge);
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
  if (board_.aborted()) return;  // this rank is failing already
  // A store that is gone means rank 0 died (the peer may just have stopped because of it): lost_store.
  const int64_t finished =
      board_.finished_count("the connection to rank " + std::to_string(peer) + " closed too (" + error + ")");
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
    board_.enter_collective();
    pg_->allreduce(v)->wait();
    board_.leave_collective();
  } catch (const std::exception& e) {
    board_.leave_collective();
    fail("reducing " + describe(tensor) + " (all_reduce_sum) on rank " + std::to_string(rank_), short_what(e), -1);
  }
  if (!buffer.is_same(tensor)) tensor.copy_(buffer);
}

void GlooTransport::barrier() {
  try {
    board_.enter_collective();
    pg_->barrier()->wait();
    board_.leave_collective();
  } catch (const std::exception& e) {
    board_.leave_collective();
    fail("in a barrier on rank " + std::to_string(rank_), short_what(e), -1);
  }
}

}  // namespace

std::shared_ptr<Transport> make_gloo_transport(const Rendezvous& rv) { return std::make_shared<GlooTransport>(rv); }

bool gloo_transport_available() { return true; }

std::string gloo_transport_absent_reason() { return ""; }

}  // namespace pipetrain

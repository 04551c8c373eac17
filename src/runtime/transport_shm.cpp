// The shm transport: ranks are processes on one host; messages travel through rings in one POSIX
// shared-memory segment, and the rendezvous store (runtime/store.h) only introduces the ranks.
//
// Segment. Rank 0 creates it (shm_open, O_EXCL, mode 0600; every byte reserved with posix_fallocate, so a
// full /dev/shm is an error at start and never a SIGBUS later) and publishes its name in the store. Every
// rank maps it, writes its pid into its control block and counts itself in; once all have, every rank
// calls shm_unlink on the name: from then on the segment has no name and disappears with the last
// mapping, whatever way the processes end (SIGKILL included). A rank killed between the creation and the
// unlink leaves the name behind; pipetrain launch removes every segment under the prefix it gave its
// ranks (PIPETRAIN_SHM_PREFIX) when they are gone.
//
//   [segment header: geometry, failure report, finished count][rank control blocks][rings (s -> d)]
//
// Rings. One single-producer single-consumer byte ring per ordered pair of ranks (s -> d); `head` counts
// the bytes s wrote, `tail` the bytes d consumed. A message is a 64-byte header (tag, dtype, shape,
// byte count) and its payload, padded to 64 bytes so every header and payload starts cache-line aligned.
// A payload larger than the free space streams through in chunks: the sender copies as the receiver
// frees space. The receiver copies straight into the posted receive's tensor when it is CPU and
// contiguous (else into a buffer, then copy_); a message whose receive is not posted yet is copied into
// a buffer of its own (FIFO per source and tag), so receives may be posted in any order. A size or dtype
// mismatch fails that receive with both descriptions; the payload is skipped and later messages arrive.
//
// Progress. There is no progress thread: every operation and every wait() moves whatever can move, in
// both directions (sends queued behind a full ring, messages waiting in incoming rings). Two ranks that
// send each other large messages and then wait therefore never deadlock. A send completes once its last
// byte is in the ring (isend of a message that fits returns with the work done).
//
// Waiting. A waiting rank spins for PIPETRAIN_SHM_SPIN_US (default 20 us) and then sleeps on a futex in
// its control block ("bell"). A rank that writes into one of its rings rings the reader's bell with
// FUTEX_WAKE only when the reader says it sleeps; one that frees space in a ring rings the writer's only
// when the writer also says a send of its waits for that space (the ring's want_room), so a rank asleep
// waiting for a gradient is not woken because the peer read its activation. A busy pair makes no system
// calls. Each wake-up that is made costs both sides CPU time in the kernel; across cores of a virtual
// machine much more than on one core (docs/BENCHMARKS.md, issue 15).
//
// Collectives. all_reduce_sum: every rank sends its tensor to every other and sums the n contributions in
// rank order, so every rank gets bitwise the same result (and for two ranks the same as gloo's a + b).
// barrier: the same exchange with empty messages. Both on a reserved tag (user tags: 0 .. 2^30-1).
//
// Failure. A watchdog thread per rank polls (every 50 ms) the failure report in the segment, the peers'
// pids (a pidfd per peer, readable once that process has exited; kill(pid, 0) where pidfd_open is
// missing) and their heartbeats (a counter their watchdog bumps; none for PIPETRAIN_HEARTBEAT_TIMEOUT
// seconds, default 10: stopped or hung). abort(message) writes the report ("the first writer wins");
// a peer that died without a report gets one naming it ("it went away (killed or crashed?)"). Every
// other rank then prints
//   pipetrain rank R: stopping: rank K failed: <message>
// and ends with std::_Exit(1), as the gloo transport's ranks do; a rank blocked in a wait() stops at once.
// A rank that fails during the rendezvous reports through the store (its waits end with RemoteFailure).
//
// Shutdown. The destructor is a barrier in the segment: a rank marks itself finished and waits for all
// (its watchdog still watching), for at most the operations' time limit (then it names the ranks that
// never finished and goes); a finished rank's exit is not a failure. A rank that waits for a message
// from a finished rank (or sends to one, or waits in a collective) fails as soon as it would sleep:
// "rank K finished while rank R waits for ...", as when the ranks run different numbers of steps; the
// finished rank has written every message it sent, so one last pass over the rings decides. If the
// transport is destroyed while an exception propagates, or after abort(), there is no barrier: it
// aborts (when not done yet).
//
// Threads: one rank's operations come from one thread (transport.h); abort() may come from any.
// Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the store variables of the gloo transport
// (PIPETRAIN_LAUNCHER_STORE, PIPETRAIN_RUN_TOKEN, PIPETRAIN_STORE_BIND, PIPETRAIN_RENDEZVOUS_TIMEOUT),
// PIPETRAIN_SHM_PREFIX (set by pipetrain launch), PIPETRAIN_SHM_RING_BYTES (ring size, a power of two
// from 64 KiB; default 4 MiB, less when /dev/shm is small), PIPETRAIN_SHM_SPIN_US,
// PIPETRAIN_HEARTBEAT_TIMEOUT, PIPETRAIN_FINAL_BARRIER_TIMEOUT (transport.h), PIPETRAIN_SHM_FAULT and
// PIPETRAIN_RENDEZVOUS_FAULT (test hooks, shm_fault() and rendezvous_fault()).
#include <ATen/ATen.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
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
#include "futex.h"
#include "transport_util.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace pipetrain {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using detail::byte_size;
using detail::cpu_contiguous;
using detail::cpu_relax;
using detail::env_seconds;
using detail::futex_wait;
using detail::futex_wake;
using detail::getenv_string;
using detail::parse_integer;
using detail::rendezvous_fault;

constexpr uint64_t kSegmentMagic = 0x3230484d53505050ull;  // "PPPSMH02"
constexpr uint32_t kMsgMagic = 0x4d485350;                // "PSHM"
constexpr int kCollectiveTag = 1 << 30;                   // user tags are 0 .. kCollectiveTag-1
constexpr int64_t kAlign = 64;
constexpr int64_t kChunk = 64 << 10;                      // bytes published at a time
constexpr int64_t kMinRing = 64 << 10;
constexpr int64_t kDefaultRing = 4 << 20;
constexpr std::size_t kMessageBytes = 4096;               // failure report text
constexpr milliseconds kWatchPeriod{50};
constexpr milliseconds kOpTimeout = std::chrono::minutes(30);

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "the rings need address-free atomics");

// --- the segment's layout ----------------------------------------------------------------------

struct SegmentHeader {
  uint64_t magic;
  int32_t world_size;
  int32_t pad0;
  int64_t ring_bytes;
  int64_t total_bytes;
  alignas(64) std::atomic<uint32_t> report_state;  // 0 none, 1 being written, 2 written
  int32_t failed_rank;
  char message[kMessageBytes];
  alignas(64) std::atomic<uint32_t> finished;  // ranks past their final barrier's start
};

struct RankControl {
  alignas(64) std::atomic<uint32_t> bell;      // futex word: bumped when there is news for this rank
  std::atomic<uint32_t> sleeping;              // 1 while this rank sleeps on `bell`
  alignas(64) std::atomic<int32_t> pid;
  std::atomic<uint32_t> attached;
  std::atomic<uint32_t> finished;
  std::atomic<uint64_t> heartbeat;
  uint64_t pid_namespace;                      // inode of /proc/self/ns/pid
};

struct RingControl {
  alignas(64) std::atomic<uint64_t> head;  // written by the sender
  std::atomic<uint32_t> want_room;         // written by the sender: 1 while a send waits for free space
  alignas(64) std::atomic<uint64_t> tail;  // written by the receiver
};

constexpr int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

struct Layout {
  int world = 1;
  int64_t ring = 0;
  int64_t controls = 0, rings = 0, total = 0;
  static int64_t ring_stride(int64_t ring) { return round_up(static_cast<int64_t>(sizeof(RingControl)), 4096) + ring; }
  Layout(int w, int64_t r) : world(w), ring(r) {
    controls = round_up(static_cast<int64_t>(sizeof(SegmentHeader)), 4096);
    rings = controls + round_up(static_cast<int64_t>(sizeof(RankControl)) * w, 4096);
    total = rings + ring_stride(r) * w * (w - 1);
  }
};

// --- messages ----------------------------------------------------------------------------------

constexpr int kMaxDims = 5;
struct MsgHeader {
  uint32_t magic;
  int32_t tag;
  int32_t dtype;
  int32_t ndim;
  int64_t nbytes;
  int64_t sizes[kMaxDims];  // for error messages
};
static_assert(sizeof(MsgHeader) == kAlign, "a header is one aligned slot of the ring");

std::string describe(const at::Tensor& t) {
  return detail::describe(t.scalar_type(), t.sizes().data(), static_cast<int>(t.dim()), byte_size(t), kMaxDims);
}
std::string describe(const MsgHeader& h) {
  return detail::describe(static_cast<c10::ScalarType>(h.dtype), h.sizes, h.ndim, h.nbytes, kMaxDims);
}

// --- environment -------------------------------------------------------------------------------

// The ring size: PIPETRAIN_SHM_RING_BYTES, else 4 MiB, or less so that all rings take at most a quarter
// of /dev/shm's free space (Docker's default /dev/shm is 64 MiB).
int64_t choose_ring_bytes(int world) {
  if (const auto text = getenv_string("PIPETRAIN_SHM_RING_BYTES")) {
    const auto v = parse_integer(*text);
    if (!v || *v < kMinRing || *v > (int64_t{1} << 32) || (*v & (*v - 1)) != 0)
      throw UsageError("PIPETRAIN_SHM_RING_BYTES=" + *text +
                       " is not a ring size: use a power of two from 65536 to 4294967296 (default 4194304)");
    return *v;
  }
  int64_t ring = kDefaultRing;
  struct statvfs fs {};
  if (::statvfs("/dev/shm", &fs) == 0) {
    const int64_t free_bytes = static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize);
    const int64_t pairs = std::max<int64_t>(1, int64_t{world} * (world - 1));
    while (ring > kMinRing && ring * pairs > free_bytes / 4) ring /= 2;
  }
  return ring;
}

// Test hook: PIPETRAIN_SHM_FAULT="RANK:POINT" makes rank RANK SIGKILL itself at POINT of its rendezvous:
// "created" (rank 0: the segment exists under its name, not yet published) or "attached" (mapped and
// counted in, the name not yet removed). For the tests of what a rank killed there leaves in /dev/shm.
void shm_fault(int rank, const char* point) {
  const auto spec = getenv_string("PIPETRAIN_SHM_FAULT");
  if (!spec) return;
  const auto colon = spec->find(':');
  const auto r = parse_integer(spec->substr(0, colon));
  const std::string where = colon == std::string::npos ? "" : spec->substr(colon + 1);
  if (!r || (where != "created" && where != "attached"))
    throw UsageError("PIPETRAIN_SHM_FAULT='" + *spec + "' must read RANK:POINT with POINT created or attached");
  if (*r == rank && where == point) ::kill(::getpid(), SIGKILL);
}

uint64_t pid_namespace_id() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

std::atomic<bool> g_exiting{false};

[[noreturn]] void wait_for_exit() {
  for (;;) ::pause();
}

// --- operations --------------------------------------------------------------------------------

struct SendOp {
  at::Tensor keep;  // CPU contiguous payload
  MsgHeader header{};
  int64_t sent = -1;  // payload bytes in the ring (padding included); -1: header not yet
  bool done = false;
};

struct RecvOp {
  enum State { Posted, Done, Failed };
  int src = 0, tag = 0;
  at::Tensor buffer;  // CPU contiguous; the target itself when it can be
  State state = Posted;
  std::string error;
};

// A message that arrived before its receive was posted.
struct Early {
  MsgHeader header{};
  at::Tensor bytes;
  bool complete = false;
  std::shared_ptr<RecvOp> claimed;  // a receive posted while it still streamed in
};

// The message a rank is reading from one incoming ring.
struct Incoming {
  bool active = false;
  MsgHeader header{};
  int64_t got = 0;        // payload bytes consumed (padding included)
  char* dest = nullptr;   // nullptr: skip the payload (a mismatch)
  std::shared_ptr<RecvOp> rec;
  std::shared_ptr<Early> early;
};

class ShmTransport;

class ShmSendWork final : public Work {
 public:
  ShmSendWork(ShmTransport& t, std::shared_ptr<SendOp> op, int dst) : t_(t), op_(std::move(op)), dst_(dst) {}
  void wait() override;

 private:
  ShmTransport& t_;
  std::shared_ptr<SendOp> op_;
  int dst_;
};

class ShmRecvWork final : public Work {
 public:
  ShmRecvWork(ShmTransport& t, std::shared_ptr<RecvOp> op, at::Tensor target)
      : t_(t), op_(std::move(op)), target_(std::move(target)) {}
  void wait() override;

 private:
  ShmTransport& t_;
  std::shared_ptr<RecvOp> op_;
  at::Tensor target_;
  bool done_ = false;
};

class DoneWork final : public Work {
 public:
  void wait() override {}
};

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(const Rendezvous& rv);
  ~ShmTransport() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string name() const override { return "shm"; }

  std::unique_ptr<Work> isend(const torch::Tensor& tensor, int dst, int tag) override;
  std::unique_ptr<Work> irecv(torch::Tensor& tensor, int src, int tag) override;
  void all_reduce_sum(torch::Tensor& tensor) override;
  void barrier() override;
  void abort(const std::string& message) noexcept override;

  // Waits (progressing every ring) until `done()`, for which `needs(r)` says whether rank r still has to
  // read or write something; `what()` names the wait in a timeout error or when a rank it needs has
  // finished (built only then: a wait that ends in time formats nothing).
  template <class Done, class Needs, class What>
  void wait_until(Done done, Needs needs, What what);

 private:
  // Rendezvous.
  void connect_store(const Rendezvous& rv, milliseconds join_timeout);
  void create_or_open_segment(milliseconds join_timeout);
  void leave_store();
  void report_to_store(const std::string& message) noexcept;

  // Segment access.
  RankControl& control(int r) const {
    return reinterpret_cast<RankControl*>(base_ + layout_.controls)[r];
  }
  RingControl& ring(int src, int dst) const {
    const int64_t index = int64_t{src} * (world_ - 1) + (dst < src ? dst : dst - 1);
    return *reinterpret_cast<RingControl*>(base_ + layout_.rings + index * Layout::ring_stride(layout_.ring));
  }
  char* ring_data(RingControl& r) const { return reinterpret_cast<char*>(&r) + Layout::ring_stride(layout_.ring) - layout_.ring; }
  void ring_bell(int r) {
    RankControl& c = control(r);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (c.sleeping.load(std::memory_order_seq_cst)) {
      c.bell.fetch_add(1, std::memory_order_seq_cst);
      futex_wake(&c.bell);
    }
  }
  // After freeing space in `r` (its tail stored): wakes the sender only when a send of its waits for room,
  // so a sender that sleeps waiting for something else is not woken for nothing.
  void freed_room(RingControl& r, int src) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (r.want_room.load(std::memory_order_seq_cst)) ring_bell(src);
  }
  void map_own_rings();
  void write_ring(RingControl& r, uint64_t pos, const void* src, int64_t n);
  void read_ring(RingControl& r, uint64_t pos, void* dst, int64_t n);

  // Progress.
  bool progress();
  bool push(int dst);
  bool pull(int src);
  void arrived(Incoming& in);
  void start_message(int src, Incoming& in, const MsgHeader& h);
  std::shared_ptr<SendOp> post_send(const at::Tensor& payload, int dst, int tag);
  std::shared_ptr<RecvOp> post_recv(const at::Tensor& buffer, int src, int tag);
  void check_peer(int peer, int tag, const char* what) const;

  // Failure.
  void check_report();  // a report by another rank stops this one
  bool publish_report(int failed_rank, const std::string& message);  // true when this report won
  std::pair<int, std::string> read_report() const;
  [[noreturn]] void stop_process(int failed_rank, std::string message);
  void watchdog_loop();
  void finish_barrier();
  void stop_watchdog();

  int rank_ = 0;
  int world_ = 1;
  milliseconds dead_after_{10000};
  milliseconds final_limit_{std::chrono::minutes(30)};  // the final barrier's (PIPETRAIN_FINAL_BARRIER_TIMEOUT)
  long spin_us_ = 20;  // PIPETRAIN_SHM_SPIN_US
  std::string name_;  // the segment's name until it is unlinked

  // Store (rendezvous only).
  std::unique_ptr<StoreServer> server_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::mutex store_mu_;

  // Segment.
  Layout layout_{1, 0};
  char* base_ = nullptr;
  int64_t mapped_ = 0;  // bytes mapped at base_
  SegmentHeader* header_ = nullptr;

  // The owner thread's state.
  std::vector<std::deque<std::shared_ptr<SendOp>>> out_;  // per destination, in order
  std::vector<uint64_t> head_;                            // per destination: bytes written
  std::vector<char> want_room_;                           // per destination: this rank's want_room flag
  std::vector<uint64_t> tail_;                            // per source: bytes consumed
  std::vector<Incoming> in_;                              // per source
  // Receives waiting for a message, and messages waiting for a receive, per (src, tag): FIFO, taken with
  // take_oldest (which erases emptied keys).
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<RecvOp>>> posted_;  // (src, tag)
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Early>>> early_;    // (src, tag)
  int pending_sends_ = 0;

  // Watchdog.
  std::vector<int> pidfds_;
  std::thread watchdog_;
  std::atomic<bool> watch_stop_{false};
  std::atomic<bool> aborted_{false};
};

// --- rendezvous --------------------------------------------------------------------------------

const std::string kSegmentKey = "pipetrain/shm/segment";
const std::string kAttachedKey = "pipetrain/shm/attached";
const std::string kReadyKey = "pipetrain/shm/ready";
const std::string kDetachedKey = "pipetrain/shm/detached";

std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

ShmTransport::ShmTransport(const Rendezvous& rv) : rank_(rv.rank), world_(rv.world_size) {
  if (world_ < 1) throw UsageError("WORLD_SIZE=" + std::to_string(world_) + " is not a process count: use >= 1");
  if (rank_ < 0 || rank_ >= world_)
    throw UsageError("RANK=" + std::to_string(rank_) + " is out of range for WORLD_SIZE=" + std::to_string(world_) +
                     ": use 0.." + std::to_string(world_ - 1));
  dead_after_ = env_seconds("PIPETRAIN_HEARTBEAT_TIMEOUT", std::chrono::seconds(10));
  final_limit_ = detail::final_barrier_limit();
  const milliseconds join_timeout = env_seconds("PIPETRAIN_RENDEZVOUS_TIMEOUT", std::chrono::seconds(300));
  long spin_us = 20;
  if (const auto text = getenv_string("PIPETRAIN_SHM_SPIN_US")) {
    const auto v = parse_integer(*text);
    if (!v || *v < 0 || *v > 1000000)
      throw UsageError("PIPETRAIN_SHM_SPIN_US=" + *text + " is not a spin time: use 0..1000000 microseconds (default 20)");
    spin_us = static_cast<long>(*v);
  }
  spin_us_ = spin_us;
  out_.resize(world_);
  head_.assign(world_, 0);
  want_room_.assign(world_, 0);
  tail_.assign(world_, 0);
  in_.resize(world_);
  if (world_ == 1) return;  // nothing to share

  rendezvous_fault(rank_, "before-join");
  connect_store(rv, join_timeout);
  rendezvous_fault(rank_, "after-join");
  // On a failure here the segment (if any) loses its name and this rank's mapping: nothing is left.
  auto release = [this] {
    if (!name_.empty()) ::shm_unlink(name_.c_str());
    if (base_) ::munmap(base_, static_cast<std::size_t>(mapped_));
    base_ = nullptr;
    header_ = nullptr;
    for (int fd : pidfds_)
      if (fd >= 0) ::close(fd);
  };
  try {
    create_or_open_segment(join_timeout);
  } catch (const RemoteFailure&) {
    release();
    leave_store();
    throw;
  } catch (const std::exception& e) {
    report_to_store("rank " + std::to_string(rank_) + " could not join the shm transport: " + e.what());
    release();
    leave_store();
    throw;
  }
  leave_store();
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

void ShmTransport::connect_store(const Rendezvous& rv, milliseconds join_timeout) {
  if (getenv_string("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True")
    throw UsageError("the shm transport does not join torchrun's store: under torchrun use --transport gloo, or start "
                     "the ranks with pipetrain launch");
  detail::StoreSite site = detail::find_or_host_store(rv, rank_, world_);
  server_ = std::move(site.server);
  const std::string& token = site.token;
  const std::string& host = site.host;
  const int port = site.port;
  const std::string& what = site.what;
  try {
    auto client = c10::make_intrusive<StoreClient>(host, port, token, rank_, world_, join_timeout, what);
    client->stop_waiting_on_abort(rank_);  // a rank that fails during the rendezvous ends the waits
    store_ = client;
    store_->set(phase_key(rank_), bytes_of("the shm rendezvous"));
  } catch (const std::exception& e) {
    server_.reset();
    throw std::runtime_error("rank " + std::to_string(rank_) + " could not join the rendezvous store: " + e.what() +
                             ". Start all WORLD_SIZE=" + std::to_string(world_) +
                             " ranks with pipetrain launch, or with the same MASTER_ADDR and MASTER_PORT");
  }
}

void ShmTransport::create_or_open_segment(milliseconds join_timeout) {
  int fd = -1;
  if (rank_ == 0) {
    // The segment is made once every rank has joined the store: a rank 0 interrupted while it waits for
    // the others (Ctrl-C on a hand-started rank whose peers never came) then leaves nothing in /dev/shm,
    // where a segment made at once stayed there, its name held by no one.
    std::vector<std::string> joined;
    for (int r = 1; r < world_; ++r) joined.push_back(phase_key(r));
    store_->wait(joined);  // one wait for all, within the rendezvous timeout
    const int64_t ring = choose_ring_bytes(world_);
    layout_ = Layout(world_, ring);
    const std::string prefix = getenv_string("PIPETRAIN_SHM_PREFIX").value_or("pipetrain-shm");
    if (prefix.empty() || prefix.size() > 200 || prefix.find('/') != std::string::npos)
      throw UsageError("PIPETRAIN_SHM_PREFIX=" + prefix + " is not a segment name prefix: use up to 200 characters "
                       "without '/' (pipetrain launch sets it)");
    name_ = "/" + prefix + "-" + make_run_token().substr(0, 16);
    fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0)
      throw std::runtime_error("cannot create the shared-memory segment /dev/shm" + name_ + ": " + std::strerror(errno) +
                               ": make /dev/shm writable, or use --transport gloo");
    int rc = ::ftruncate(fd, layout_.total);
    if (rc == 0) rc = ::posix_fallocate(fd, 0, layout_.total);
    else rc = errno;
    if (rc != 0) {
      ::close(fd);
      ::shm_unlink(name_.c_str());
      throw std::runtime_error("cannot reserve " + std::to_string(layout_.total >> 20) + " MiB in /dev/shm for " +
                               std::to_string(world_) + " ranks (rings of " + std::to_string(ring >> 10) +
                               " KiB): " + std::strerror(rc) +
                               ". Free /dev/shm, set PIPETRAIN_SHM_RING_BYTES lower (>= 65536), or use --transport gloo");
    }
  } else {
    const auto raw = store_->get(kSegmentKey);
    name_.assign(raw.begin(), raw.end());
    fd = ::shm_open(name_.c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0)
      throw std::runtime_error("cannot open rank 0's shared-memory segment /dev/shm" + name_ + ": " +
                               std::strerror(errno) +
                               ": the shm transport needs every rank on one host; across hosts use --transport gloo");
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(SegmentHeader))) {
      ::close(fd);
      throw std::runtime_error("rank 0's shared-memory segment /dev/shm" + name_ + " is too small");
    }
    layout_.total = st.st_size;
  }
  void* p = ::mmap(nullptr, static_cast<std::size_t>(layout_.total), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    if (rank_ == 0) ::shm_unlink(name_.c_str());
    throw std::runtime_error("cannot map the shared-memory segment /dev/shm" + name_ + ": " + std::strerror(map_errno));
  }
  base_ = static_cast<char*>(p);
  mapped_ = layout_.total;
  header_ = reinterpret_cast<SegmentHeader*>(base_);
  if (rank_ == 0) {
    new (header_) SegmentHeader();
    header_->world_size = world_;
    header_->ring_bytes = layout_.ring;
    header_->total_bytes = layout_.total;
    header_->failed_rank = -1;
    for (int r = 0; r < world_; ++r) new (&control(r)) RankControl();
    for (int s = 0; s < world_; ++s)
      for (int d = 0; d < world_; ++d)
        if (s != d) new (&ring(s, d)) RingControl();
    std::atomic_thread_fence(std::memory_order_release);
    header_->magic = kSegmentMagic;
    shm_fault(rank_, "created");
    store_->set(kSegmentKey, bytes_of(name_));
  } else {
    std::atomic_thread_fence(std::memory_order_acquire);
    if (header_->magic != kSegmentMagic || header_->world_size != world_)
      throw std::runtime_error("/dev/shm" + name_ + " is not this run's segment (it was made for " +
                               std::to_string(header_->world_size) + " ranks, this run has " + std::to_string(world_) +
                               "): is every rank the same pipetrain build?");
    layout_ = Layout(world_, header_->ring_bytes);
    if (layout_.total != header_->total_bytes)
      throw std::runtime_error("/dev/shm" + name_ + " has an unexpected size: is every rank the same pipetrain build?");
  }
  map_own_rings();
  RankControl& me = control(rank_);
  me.pid.store(static_cast<int32_t>(::getpid()));
  me.pid_namespace = pid_namespace_id();
  me.attached.store(1);
  {
    std::lock_guard<std::mutex> lk(store_mu_);
    if (store_->add(kAttachedKey, 1) == world_) store_->set(kReadyKey, bytes_of("1"));
  }
  (void)join_timeout;
  shm_fault(rank_, "attached");
  store_->get(kReadyKey);  // every rank mapped the segment (RemoteFailure if one failed meanwhile)
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT)
    std::fprintf(stderr, "pipetrain rank %d: warning: cannot remove /dev/shm%s: %s\n", rank_, name_.c_str(),
                 std::strerror(errno));
  // Watch every peer's process.
  pidfds_.assign(world_, -1);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const RankControl& c = control(r);
    if (c.pid_namespace != me.pid_namespace)
      throw std::runtime_error("rank " + std::to_string(r) + " runs in another PID namespace (a container?): the shm "
                               "transport watches its peers' processes; use --transport gloo");
    pidfds_[r] = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(c.pid.load()), 0));
  }
}

void ShmTransport::leave_store() {
  if (!store_) return;
  try {
    std::lock_guard<std::mutex> lk(store_mu_);
    if (server_) {  // rank 0 hosts it: keep it up until the others have read what they need
      const auto until = Clock::now() + std::chrono::seconds(10);
      while (Clock::now() < until && store_->add(kDetachedKey, 0) < world_ - 1)
        std::this_thread::sleep_for(milliseconds(5));
    } else {
      store_->add(kDetachedKey, 1);
    }
  } catch (const std::exception&) {
  }
  store_.reset();  // says goodbye
  server_.reset();
}

void ShmTransport::report_to_store(const std::string& message) noexcept {
  try {
    std::lock_guard<std::mutex> lk(store_mu_);
    if (store_) store_->compareSet(kAbortKey, {}, bytes_of(encode_abort(rank_, message)));
  } catch (...) {
  }
}

ShmTransport::~ShmTransport() {
  if (world_ > 1 && base_) {
    if (std::uncaught_exceptions() > 0 && !aborted_)
      abort("its transport was destroyed while an error was propagating (see rank " + std::to_string(rank_) +
            "'s own output for it)");
    if (!aborted_) finish_barrier();
    stop_watchdog();
    for (int fd : pidfds_)
      if (fd >= 0) ::close(fd);
    ::munmap(base_, static_cast<std::size_t>(mapped_));
  }
}

void ShmTransport::finish_barrier() {
  control(rank_).finished.store(1);
  header_->finished.fetch_add(1);
  for (int r = 0; r < world_; ++r)
    if (r != rank_) ring_bell(r);
  // A slower rank is still working (a failure meanwhile stops this process), or waits for a message
  // from this one and fails as soon as it sees it finished; one that neither finishes nor fails within
  // the operations' time limit is named, and this rank goes.
  const auto wait_start = Clock::now();
  while (header_->finished.load() < static_cast<uint32_t>(world_)) {
    check_report();
    if (Clock::now() - wait_start > final_limit_) {
      std::string missing;
      for (int r = 0; r < world_; ++r)
        if (!control(r).finished.load()) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      std::fprintf(stderr,
                   "pipetrain rank %d: shm: gave up the final barrier after %s: rank(s) %s neither finished "
                   "nor failed (still working, or waiting where nothing comes?)\n",
                   rank_, detail::describe_limit(final_limit_).c_str(), missing.c_str());
      return;
    }
    RankControl& me = control(rank_);
    const uint32_t seq = me.bell.load();
    me.sleeping.store(1);
    if (header_->finished.load() >= static_cast<uint32_t>(world_)) {
      me.sleeping.store(0);
      break;
    }
    futex_wait(&me.bell, seq, milliseconds(100));
    me.sleeping.store(0);
  }
}

void ShmTransport::stop_watchdog() {
  watch_stop_ = true;
  if (watchdog_.joinable()) watchdog_.join();
}

// --- rings -------------------------------------------------------------------------------------

// Maps the pages of this rank's rings into its page tables now: the rings it writes for writing, those
// it reads for reading. Otherwise each page costs a page fault the first time a message crosses it,
// which made the first 4 MiB through a ring several times slower (a 4 KiB message one way took 4 us
// instead of 0.8). madvise does it in one call per ring (Linux 5.14 and later); older kernels get a
// touch per page. Writing into a ring this rank sends on is harmless before its first message: the
// reader reads only what was published.
void ShmTransport::map_own_rings() {
  const auto page = static_cast<int64_t>(::sysconf(_SC_PAGESIZE) > 0 ? ::sysconf(_SC_PAGESIZE) : 4096);
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    for (const bool out : {true, false}) {
      char* data = ring_data(out ? ring(rank_, peer) : ring(peer, rank_));
      // Whole pages of the data area only (it starts on a 4 KiB boundary; with larger pages its first
      // page may hold the ring's control block, which the touch below must not write).
      const auto up = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(page - 1)) & ~static_cast<uintptr_t>(page - 1);
      char* begin = reinterpret_cast<char*>(up);
      const auto bytes = static_cast<std::size_t>(std::max<int64_t>(0, data + layout_.ring - begin));
#if defined(MADV_POPULATE_WRITE) && defined(MADV_POPULATE_READ)
      if (::madvise(begin, bytes, out ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0) continue;
#endif
      for (std::size_t at = 0; at < bytes; at += static_cast<std::size_t>(page)) {
        volatile char* p = begin + at;
        if (out) *p = 0;
        else (void)*p;
      }
    }
  }
}

void ShmTransport::write_ring(RingControl& r, uint64_t pos, const void* src, int64_t n) {
  char* data = ring_data(r);
  const int64_t size = layout_.ring;
  const int64_t at = static_cast<int64_t>(pos & static_cast<uint64_t>(size - 1));
  const int64_t first = std::min(n, size - at);
  std::memcpy(data + at, src, static_cast<std::size_t>(first));
  if (first < n) std::memcpy(data, static_cast<const char*>(src) + first, static_cast<std::size_t>(n - first));
}

void ShmTransport::read_ring(RingControl& r, uint64_t pos, void* dst, int64_t n) {
  const char* data = ring_data(r);
  const int64_t size = layout_.ring;
  const int64_t at = static_cast<int64_t>(pos & static_cast<uint64_t>(size - 1));
  const int64_t first = std::min(n, size - at);
  std::memcpy(dst, data + at, static_cast<std::size_t>(first));
  if (first < n) std::memcpy(static_cast<char*>(dst) + first, data, static_cast<std::size_t>(n - first));
}

// Writes what fits of the queued sends to `dst`. True when anything moved.
bool ShmTransport::push(int dst) {
  auto& queue = out_[dst];
  if (queue.empty()) return false;
  RingControl& r = ring(rank_, dst);
  uint64_t head = head_[dst];
  bool moved = false;
  while (!queue.empty()) {
    SendOp& op = *queue.front();
    const uint64_t tail = r.tail.load(std::memory_order_acquire);
    int64_t room = layout_.ring - static_cast<int64_t>(head - tail);
    if (op.sent < 0) {
      if (room < kAlign) break;
      write_ring(r, head, &op.header, kAlign);
      head += kAlign;
      room -= kAlign;
      op.sent = 0;
      moved = true;
    }
    const int64_t nbytes = op.header.nbytes;
    const int64_t padded = round_up(nbytes, kAlign);
    while (op.sent < padded && room > 0) {
      const int64_t n = std::min({room, padded - op.sent, kChunk});
      const int64_t real = std::max<int64_t>(0, std::min(n, nbytes - op.sent));
      if (real > 0) write_ring(r, head, static_cast<const char*>(op.keep.data_ptr()) + op.sent, real);
      head += static_cast<uint64_t>(n);
      op.sent += n;
      room -= n;
      moved = true;
      if (op.sent < padded) {  // publish each chunk, so the receiver copies while this rank writes the next
        r.head.store(head, std::memory_order_release);
        ring_bell(dst);
      }
    }
    if (op.sent < padded) break;
    op.done = true;
    op.keep = at::Tensor();
    queue.pop_front();
    --pending_sends_;
  }
  if (moved) {
    head_[dst] = head;
    r.head.store(head, std::memory_order_release);
    ring_bell(dst);
  }
  // Ask for a bell when space frees up while sends wait for it. The flag is stored before the waiter's
  // last look at `tail` (wait_until's check after `sleeping`), so a receiver that freed space either
  // sees the flag or its space is seen.
  const bool blocked = !queue.empty();
  if (blocked != want_room_[dst]) {
    want_room_[dst] = blocked;
    r.want_room.store(blocked ? 1 : 0, std::memory_order_seq_cst);
  }
  return moved;
}

void ShmTransport::start_message(int src, Incoming& in, const MsgHeader& h) {
  if (h.magic != kMsgMagic || h.nbytes < 0)
    stop_process(src, "it wrote a message that is not a pipetrain shm header into its ring to rank " +
                          std::to_string(rank_) + ": is every rank the same pipetrain build?");
  in = Incoming();
  in.active = true;
  in.header = h;
  if (auto posted = detail::take_oldest(posted_, {src, h.tag})) {
    in.rec = std::move(*posted);
    RecvOp& rec = *in.rec;
    if (h.nbytes == byte_size(rec.buffer) && h.dtype == static_cast<int32_t>(rec.buffer.scalar_type())) {
      in.dest = static_cast<char*>(rec.buffer.data_ptr());
    } else {
      rec.state = RecvOp::Failed;
      rec.error = "shm: message mismatch from rank " + std::to_string(src) + " (tag " + std::to_string(h.tag) +
                  "): it sent " + describe(h) + " but rank " + std::to_string(rank_) + " expected " +
                  describe(rec.buffer) + ": sender and receiver must agree on the tensor's size and dtype";
      in.rec.reset();
    }
  } else {
    in.early = std::make_shared<Early>();
    in.early->header = h;
    in.early->bytes = at::empty({h.nbytes}, at::kByte);
    in.dest = static_cast<char*>(in.early->bytes.data_ptr());
    early_[{src, h.tag}].push_back(in.early);
  }
}

// Completes a receive from a message that arrived early.
void finish_from_early(RecvOp& rec, const Early& e, int self) {
  const MsgHeader& h = e.header;
  if (h.nbytes != byte_size(rec.buffer) || h.dtype != static_cast<int32_t>(rec.buffer.scalar_type())) {
    rec.state = RecvOp::Failed;
    rec.error = "shm: message mismatch from rank " + std::to_string(rec.src) + " (tag " + std::to_string(rec.tag) +
                "): it sent " + describe(h) + " but rank " + std::to_string(self) + " expected " +
                describe(rec.buffer) + ": sender and receiver must agree on the tensor's size and dtype";
    return;
  }
  if (h.nbytes > 0) std::memcpy(rec.buffer.data_ptr(), e.bytes.data_ptr(), static_cast<std::size_t>(h.nbytes));
  rec.state = RecvOp::Done;
}

void ShmTransport::arrived(Incoming& in) {
  if (in.rec) {
    in.rec->state = RecvOp::Done;
  } else if (in.early) {
    in.early->complete = true;
    if (in.early->claimed) {
      finish_from_early(*in.early->claimed, *in.early, rank_);
      // It was popped from early_ when claimed.
    }
  }
  in = Incoming();
}

// Reads what has arrived from `src`. True when anything moved.
bool ShmTransport::pull(int src) {
  RingControl& r = ring(src, rank_);
  uint64_t tail = tail_[src];
  const uint64_t start = tail;
  Incoming& in = in_[src];
  for (;;) {
    const uint64_t head = r.head.load(std::memory_order_acquire);
    int64_t avail = static_cast<int64_t>(head - tail);
    if (avail <= 0) break;
    if (!in.active) {
      if (avail < kAlign) break;
      MsgHeader h;
      read_ring(r, tail, &h, kAlign);
      tail += kAlign;
      avail -= kAlign;
      start_message(src, in, h);
    }
    const int64_t nbytes = in.header.nbytes;
    const int64_t padded = round_up(nbytes, kAlign);
    while (in.got < padded && avail > 0) {
      const int64_t n = std::min({avail, padded - in.got, kChunk});
      const int64_t real = std::max<int64_t>(0, std::min(n, nbytes - in.got));
      if (real > 0 && in.dest) read_ring(r, tail, in.dest + in.got, real);
      tail += static_cast<uint64_t>(n);
      in.got += n;
      avail -= n;
      if (in.got < padded) {  // free the space at once: the sender may be waiting for it
        r.tail.store(tail, std::memory_order_release);
        freed_room(r, src);
      }
    }
    if (in.got < padded) break;
    arrived(in);
  }
  if (tail == start) return false;
  tail_[src] = tail;
  r.tail.store(tail, std::memory_order_release);
  freed_room(r, src);
  return true;
}

bool ShmTransport::progress() {
  bool moved = false;
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    if (pending_sends_ > 0) moved |= push(p);
    moved |= pull(p);
  }
  return moved;
}

template <class Done, class Needs, class What>
void ShmTransport::wait_until(Done done, Needs needs, What what) {
  progress();
  if (done()) return;
  RankControl& me = control(rank_);
  const auto start = Clock::now();
  const auto spin_until = start + std::chrono::microseconds(spin_us_);
  for (long i = 0;; ++i) {
    check_report();
    if (progress()) {
      if (done()) return;
      continue;
    }
    if (done()) return;
    if ((i & 63) != 63 || Clock::now() < spin_until) {
      cpu_relax();
      continue;
    }
    int gone = -1;
    for (int r = 0; r < world_ && gone < 0; ++r)
      if (r != rank_ && control(r).finished.load(std::memory_order_acquire) && needs(r)) gone = r;
    if (gone >= 0) {
      // It wrote all it sent before it finished: what is not in the rings now never comes.
      while (progress()) {
      }
      if (done() || !needs(gone)) continue;
      throw std::runtime_error("shm: rank " + std::to_string(gone) + " finished while rank " + std::to_string(rank_) +
                               " waits for " + what() +
                               ": do all ranks make the same calls (the same number of train_step calls, say)?");
    }
    const uint32_t seq = me.bell.load(std::memory_order_seq_cst);
    me.sleeping.store(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (progress() || done()) {
      me.sleeping.store(0, std::memory_order_relaxed);
      if (done()) return;
      continue;
    }
    futex_wait(&me.bell, seq, milliseconds(200));
    me.sleeping.store(0, std::memory_order_relaxed);
    if (Clock::now() - start > kOpTimeout)
      throw std::runtime_error("shm: rank " + std::to_string(rank_) + " timed out after " +
                               std::to_string(kOpTimeout.count() / 60000) + " min waiting for " + what() +
                               ": does that rank send it (same tag, same order)?");
  }
}

// --- operations --------------------------------------------------------------------------------

void ShmTransport::check_peer(int peer, int tag, const char* what) const {
  if (peer < 0 || peer >= world_ || peer == rank_)
    throw std::invalid_argument(std::string("shm ") + what + ": rank " + std::to_string(peer) +
                                " is not a peer of rank " + std::to_string(rank_) + ": use 0.." +
                                std::to_string(world_ - 1) + " except " + std::to_string(rank_));
  if (tag < 0 || tag >= kCollectiveTag)
    throw std::invalid_argument(std::string("shm ") + what + ": tag " + std::to_string(tag) +
                                " is out of range: use 0.." + std::to_string(kCollectiveTag - 1));
}

std::shared_ptr<SendOp> ShmTransport::post_send(const at::Tensor& payload, int dst, int tag) {
  check_report();
  auto op = std::make_shared<SendOp>();
  op->keep = payload;
  MsgHeader& h = op->header;
  h.magic = kMsgMagic;
  h.tag = tag;
  h.dtype = static_cast<int32_t>(payload.scalar_type());
  h.ndim = static_cast<int32_t>(payload.dim());
  h.nbytes = byte_size(payload);
  for (int i = 0; i < std::min<int>(h.ndim, kMaxDims); ++i) h.sizes[i] = payload.size(i);
  out_[dst].push_back(op);
  ++pending_sends_;
  push(dst);
  return op;
}

std::shared_ptr<RecvOp> ShmTransport::post_recv(const at::Tensor& buffer, int src, int tag) {
  check_report();
  auto rec = std::make_shared<RecvOp>();
  rec->src = src;
  rec->tag = tag;
  rec->buffer = buffer;
  if (auto early = detail::take_oldest(early_, {src, tag})) {
    const std::shared_ptr<Early> e = std::move(*early);
    if (e->complete) finish_from_early(*rec, *e, rank_);
    else e->claimed = rec;
  } else {
    posted_[{src, tag}].push_back(rec);
  }
  return rec;
}

std::unique_ptr<Work> ShmTransport::isend(const torch::Tensor& tensor, int dst, int tag) {
  check_peer(dst, tag, "isend");
  auto op = post_send(cpu_contiguous(tensor), dst, tag);
  if (op->done) return std::make_unique<DoneWork>();
  return std::make_unique<ShmSendWork>(*this, std::move(op), dst);
}

std::unique_ptr<Work> ShmTransport::irecv(torch::Tensor& tensor, int src, int tag) {
  check_peer(src, tag, "irecv");
  at::Tensor buffer = tensor.device().is_cpu() && tensor.is_contiguous()
                          ? tensor
                          : at::empty(tensor.sizes(), tensor.options().device(at::kCPU));
  return std::make_unique<ShmRecvWork>(*this, post_recv(buffer, src, tag), tensor);
}

void ShmSendWork::wait() {
  SendOp& op = *op_;
  t_.wait_until([&] { return op.done; }, [&](int r) { return r == dst_; },
                [&] {
                  return "its send of " + std::to_string(op.header.nbytes) + " bytes to rank " + std::to_string(dst_) +
                         " to be read";
                });
}

void ShmRecvWork::wait() {
  if (done_) return;
  done_ = true;
  RecvOp& rec = *op_;
  if (rec.state == RecvOp::Posted)
    t_.wait_until([&] { return rec.state != RecvOp::Posted; }, [&](int r) { return r == rec.src; },
                  [&] {
                    return describe(target_) + " from rank " + std::to_string(rec.src) + " (tag " +
                           std::to_string(rec.tag) + ")";
                  });
  if (rec.state == RecvOp::Failed) throw std::runtime_error(rec.error);
  if (!rec.buffer.is_same(target_)) target_.copy_(rec.buffer);
}

// A collective's exchange with rank r (per rank: the send to it, the receive from it; none for this rank)
// is over; all of them are.
bool exchanged_with(const std::vector<std::shared_ptr<SendOp>>& sends, const std::vector<std::shared_ptr<RecvOp>>& recvs,
                    int r) {
  return (!sends[r] || sends[r]->done) && (!recvs[r] || recvs[r]->state != RecvOp::Posted);
}
bool exchanged(const std::vector<std::shared_ptr<SendOp>>& sends, const std::vector<std::shared_ptr<RecvOp>>& recvs) {
  for (std::size_t r = 0; r < sends.size(); ++r)
    if (!exchanged_with(sends, recvs, static_cast<int>(r))) return false;
  return true;
}

// Every rank sends its contribution to every other and adds the n contributions in rank order.
void ShmTransport::all_reduce_sum(torch::Tensor& tensor) {
  if (world_ == 1) return;
  at::NoGradGuard no_grad;
  const at::Tensor mine = cpu_contiguous(tensor.detach());
  std::vector<std::shared_ptr<SendOp>> sends(world_);
  std::vector<std::shared_ptr<RecvOp>> recvs(world_);
  for (int r = 0; r < world_; ++r)
    if (r != rank_) recvs[r] = post_recv(at::empty_like(mine), r, kCollectiveTag);
  for (int r = 0; r < world_; ++r)
    if (r != rank_) sends[r] = post_send(mine, r, kCollectiveTag);
  wait_until(
      [&] { return exchanged(sends, recvs); }, [&](int r) { return !exchanged_with(sends, recvs, r); },
      [&] { return "the other ranks in all_reduce_sum of " + describe(tensor); });
  for (const auto& rec : recvs)
    if (rec && rec->state == RecvOp::Failed)
      throw std::runtime_error(rec->error + " (in all_reduce_sum: every rank must reduce the same tensors in the same "
                               "order)");
  at::Tensor sum = (rank_ == 0 ? mine : recvs[0]->buffer).clone();
  for (int r = 1; r < world_; ++r) sum.add_(r == rank_ ? mine : recvs[r]->buffer);
  tensor.copy_(sum);
}

void ShmTransport::barrier() {
  if (world_ == 1) return;
  const at::Tensor none = at::empty({0}, at::kByte);
  std::vector<std::shared_ptr<SendOp>> sends(world_);
  std::vector<std::shared_ptr<RecvOp>> recvs(world_);
  for (int r = 0; r < world_; ++r)
    if (r != rank_) recvs[r] = post_recv(at::empty({0}, at::kByte), r, kCollectiveTag);
  for (int r = 0; r < world_; ++r)
    if (r != rank_) sends[r] = post_send(none, r, kCollectiveTag);
  wait_until(
      [&] { return exchanged(sends, recvs); }, [&](int r) { return !exchanged_with(sends, recvs, r); },
      [] { return std::string("the other ranks in a barrier"); });
  for (const auto& rec : recvs)
    if (rec && rec->state == RecvOp::Failed)
      throw std::runtime_error(rec->error + " (in a barrier: every rank must call the collectives in the same order)");
}

// --- failure -----------------------------------------------------------------------------------

bool ShmTransport::publish_report(int failed_rank, const std::string& message) {
  uint32_t expected = 0;
  if (!header_->report_state.compare_exchange_strong(expected, 1)) return false;
  header_->failed_rank = failed_rank;
  const std::size_t n = std::min(message.size(), kMessageBytes - 1);
  std::memcpy(header_->message, message.data(), n);
  header_->message[n] = '\0';
  header_->report_state.store(2, std::memory_order_release);
  for (int r = 0; r < world_; ++r)
    if (r != rank_) ring_bell(r);
  return true;
}

std::pair<int, std::string> ShmTransport::read_report() const {
  // A writer killed mid-report leaves state 1: give it 100 ms, then read what is there.
  const auto until = Clock::now() + milliseconds(100);
  while (header_->report_state.load(std::memory_order_acquire) == 1 && Clock::now() < until)
    std::this_thread::sleep_for(milliseconds(1));
  std::string text(header_->message, strnlen(header_->message, kMessageBytes));
  return {header_->failed_rank, text};
}

void ShmTransport::check_report() {
  if (header_ == nullptr || header_->report_state.load(std::memory_order_acquire) == 0) return;
  const auto [failed, message] = read_report();
  if (failed == rank_) throw std::runtime_error("shm: this rank (" + std::to_string(rank_) + ") aborted: " + message);
  stop_process(failed, message);
}

void ShmTransport::stop_process(int failed_rank, std::string message) {
  if (g_exiting.exchange(true)) wait_for_exit();
  if (header_ && !publish_report(failed_rank, message) && header_->report_state.load() != 0) {
    const auto [f, m] = read_report();  // someone reported first: that is the root cause
    if (f >= 0) {
      failed_rank = f;
      message = m;
    }
  }
  std::fprintf(stderr, "pipetrain rank %d: stopping: rank %d failed: %s\n", rank_, failed_rank, message.c_str());
  std::fflush(nullptr);
  std::_Exit(1);
}

void ShmTransport::abort(const std::string& message) noexcept {
  aborted_ = true;
  try {
    if (header_) publish_report(rank_, message);
    else report_to_store(message);
  } catch (...) {
  }
}

bool process_gone(int pidfd, pid_t pid) {
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  // A zombie (killed, not reaped yet) still answers kill(pid, 0).
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return true;
  char buf[512] = {};
  const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  const char* close = static_cast<const char*>(std::memchr(buf, ')', n));
  return close && close + 2 < buf + n && (close[2] == 'Z' || close[2] == 'X');
}

void ShmTransport::watchdog_loop() {
  std::vector<uint64_t> beats(world_, 0);
  std::vector<Clock::time_point> changed(world_, Clock::now());
  RankControl& me = control(rank_);
  while (!watch_stop_) {
    me.heartbeat.fetch_add(1, std::memory_order_relaxed);
    if (!aborted_ && header_->report_state.load(std::memory_order_acquire) != 0) {
      const auto [failed, message] = read_report();
      if (failed != rank_) stop_process(failed, message);
    }
    const auto now = Clock::now();
    for (int r = 0; r < world_ && !aborted_; ++r) {
      if (r == rank_) continue;
      RankControl& c = control(r);
      if (c.finished.load(std::memory_order_acquire)) continue;
      if (process_gone(pidfds_[r], c.pid.load())) {
        if (c.finished.load(std::memory_order_acquire)) continue;
        if (header_->report_state.load(std::memory_order_acquire) != 0) continue;  // read above next round
        // Said once, by whichever rank notices first, and shown by every rank: no observer's number in it.
        stop_process(r, "it went away (killed or crashed?) during the run");
      }
      const uint64_t b = c.heartbeat.load(std::memory_order_relaxed);
      if (b != beats[r]) {
        beats[r] = b;
        changed[r] = now;
      } else if (now - changed[r] > dead_after_) {
        stop_process(r, "it stopped responding: no heartbeat for " + std::to_string(dead_after_.count() / 1000) +
                            " s (stopped, hung, or its host is overloaded)");
      }
    }
    std::this_thread::sleep_for(kWatchPeriod);
  }
}

}  // namespace

std::shared_ptr<Transport> make_shm_transport(const Rendezvous& rv) { return std::make_shared<ShmTransport>(rv); }

}  // namespace pipetrain

// The rendezvous store (runtime/store.h): a poll-loop key-value server and its c10d::Store client.
//
// Wire format. Every message is a frame: a 4-byte little-endian length, then the body. Strings are a
// 4-byte length and the bytes; integers 8 bytes little-endian.
//   hello   client -> server: "PTSTORE1" token rank(4) world_size(4)
//           server -> client: status(1) message     (0 ok, 1 token differs, 2 world size differs, 3 busy)
//   request client -> server: op(1) fields...       one at a time; the server answers each in order
//           1 SET key value        -> 0                  5 DELETE key      -> 0 deleted(1)
//           2 CSET key old new     -> 0 current          6 CHECK n keys... -> 0 all_present(1)
//           3 GET key              -> 0 found(1) value   7 NUMKEYS         -> 0 count(8)
//           4 ADD key delta(8)     -> 0 sum(8)           8 BYE             (no answer; the client leaves)
//           any                    -> 1 message          (a refused request: limit, not an integer)
// A frame over kMaxFrame (kMaxHelloFrame before the hello) or a malformed one ends the connection.
// add() keeps decimal text, like c10d's TCPStore, so get() of a counter reads "3".
#include "pipetrain/runtime/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "pipetrain/runtime/transport.h"

namespace pipetrain {

const std::string kAbortKey = "pipetrain/abort";
const std::string kRefusedKey = "pipetrain/refused";

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr char kMagic[8] = {'P', 'T', 'S', 'T', 'O', 'R', 'E', '1'};
constexpr std::size_t kMaxHelloFrame = 512;
constexpr std::size_t kMaxFrame = 4 + kMaxKeysPerRequest * (4 + kMaxKeyBytes) + 64;  // > CSET's 2 MiB too
constexpr std::size_t kMaxOutput = 4u << 20;  // answers a client has not read yet
constexpr milliseconds kHelloTime{10000};     // an unauthenticated connection's time to say who it is
static_assert(kMaxFrame > 2 * kMaxValueBytes + kMaxKeyBytes + 64, "a CSET must fit in a frame");

enum Op : uint8_t { kSet = 1, kCompareSet = 2, kGet = 3, kAdd = 4, kDelete = 5, kCheck = 6, kNumKeys = 7, kBye = 8 };
enum HelloStatus : uint8_t { kOk = 0, kTokenDiffers = 1, kWorldDiffers = 2, kBusy = 3, kRankTaken = 4 };

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_i64(std::string& out, int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}
void put_str(std::string& out, const std::string& s) {
  put_u32(out, static_cast<uint32_t>(s.size()));
  out += s;
}
std::string frame(const std::string& body) {
  std::string out;
  put_u32(out, static_cast<uint32_t>(body.size()));
  return out + body;
}

// Reads fields off a received body; any read past its end marks it bad.
class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  bool ok() const { return ok_; }
  bool done() const { return ok_ && at_ == s_.size(); }
  uint32_t u32() {
    if (!need(4)) return 0;
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(s_[at_ + i])) << (8 * i);
    at_ += 4;
    return v;
  }
  uint8_t u8() {
    if (!need(1)) return 0;
    return static_cast<uint8_t>(s_[at_++]);
  }
  int64_t i64() {
    if (!need(8)) return 0;
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(s_[at_ + i])) << (8 * i);
    at_ += 8;
    return static_cast<int64_t>(v);
  }
  std::string str(std::size_t limit) {
    const uint32_t n = u32();
    if (!ok_ || n > limit || !need(n)) {
      ok_ = false;
      return {};
    }
    std::string v = s_.substr(at_, n);
    at_ += n;
    return v;
  }
  std::string raw(std::size_t n) {
    if (!need(n)) return {};
    std::string v = s_.substr(at_, n);
    at_ += n;
    return v;
  }

 private:
  bool need(std::size_t n) {
    if (!ok_ || s_.size() - at_ < n) ok_ = false;
    return ok_;
  }
  const std::string& s_;
  std::size_t at_ = 0;
  bool ok_ = true;
};

std::string errno_text(int e) { return std::strerror(e); }

std::optional<int64_t> parse_i64(const std::string& text) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || ptr != end) return std::nullopt;
  return v;
}

std::string numeric_address(const sockaddr* sa) {
  char text[INET6_ADDRSTRLEN] = {};
  const void* a = sa->sa_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(sa)->sin_addr)
                                           : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
  return ::inet_ntop(sa->sa_family, a, text, sizeof text) ? std::string(text) : std::string("?");
}

void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace

std::string encode_abort(int rank, const std::string& message) { return std::to_string(rank) + "\n" + message; }

std::pair<int, std::string> parse_abort(const std::string& value) {
  const auto nl = value.find('\n');
  if (nl == std::string::npos) return {-1, value};
  const auto rank = parse_i64(value.substr(0, nl));
  if (!rank) return {-1, value};
  return {static_cast<int>(*rank), value.substr(nl + 1)};
}

std::string phase_key(int rank) { return "pipetrain/phase/" + std::to_string(rank); }

std::string make_run_token() {
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  unsigned char bytes[16];
  std::size_t got = 0;
  while (fd >= 0 && got < sizeof bytes) {
    const ssize_t n = ::read(fd, bytes + got, sizeof bytes - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  if (fd >= 0) ::close(fd);
  if (got < sizeof bytes)
    throw std::runtime_error("cannot read a run token from /dev/urandom (" + errno_text(errno) +
                             "): the launcher needs it to keep other clients out of the ranks' store");
  static const char* hex = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token.push_back(hex[b >> 4]);
    token.push_back(hex[b & 15]);
  }
  return token;
}

bool equal_constant_time(const std::string& a, const std::string& b) {
  const std::size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned>(x ^ y);
  }
  return diff == 0;
}

// --- server ------------------------------------------------------------------------------------

struct StoreServer::Connection {
  int fd = -1;
  bool authenticated = false;
  bool goodbye = false;
  int rank = -1;
  Clock::time_point accepted;
  std::string in, out;
};

StoreServer::StoreServer(const std::string& bind_address, int port, std::string token, int world_size)
    : token_(std::move(token)), world_size_(world_size), joined_(static_cast<std::size_t>(std::max(world_size, 0))) {
  if (token_.size() > kMaxTokenBytes)
    throw std::invalid_argument("the run token has " + std::to_string(token_.size()) + " bytes; at most " +
                                std::to_string(kMaxTokenBytes) + " are allowed");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(bind_address.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0)
    throw std::runtime_error("cannot listen on " + bind_address + ":" + std::to_string(port) + ": the address does not resolve (" +
                             ::gai_strerror(rc) + ")");
  std::string why;
  for (addrinfo* ai = res; ai && listen_fd_ < 0; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      why = errno_text(errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // a finished run's TIME_WAIT is no obstacle
    if (ai->ai_family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      why = numeric_address(ai->ai_addr) + ": " + errno_text(errno);
      ::close(fd);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
    address_ = numeric_address(reinterpret_cast<sockaddr*>(&bound));
    port_ = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                             : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
    listen_fd_ = fd;
  }
  ::freeaddrinfo(res);
  if (listen_fd_ < 0)
    throw std::runtime_error("cannot listen on " + bind_address + ":" + std::to_string(port) + " (" + why + ")");
  if (::pipe2(wake_fd_, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(listen_fd_);
    throw std::runtime_error("cannot start the rendezvous store: pipe: " + errno_text(errno));
  }
  thread_ = std::thread([this] { serve(); });
}

StoreServer::~StoreServer() {
  stop_ = true;
  (void)!::write(wake_fd_[1], "x", 1);
  if (thread_.joinable()) thread_.join();
  for (auto& c : connections_) ::close(c->fd);
  ::close(listen_fd_);
  ::close(wake_fd_[0]);
  ::close(wake_fd_[1]);
}

bool StoreServer::post_abort(int rank, const std::string& message) {
  std::lock_guard<std::mutex> lk(mu_);
  return post_abort_locked(rank, message);
}

bool StoreServer::post_abort_locked(int rank, const std::string& message) {
  if (data_.count(kAbortKey)) return false;
  std::string error;
  return store_value(kAbortKey, encode_abort(rank, message.substr(0, kMaxValueBytes / 2)), error);
}

std::optional<std::string> StoreServer::value(const std::string& key) const {
  std::lock_guard<std::mutex> lk(mu_);
  const auto it = data_.find(key);
  if (it == data_.end()) return std::nullopt;
  return it->second;
}

bool StoreServer::joined(int rank) const {
  std::lock_guard<std::mutex> lk(mu_);
  return rank >= 0 && static_cast<std::size_t>(rank) < joined_.size() && !joined_[static_cast<std::size_t>(rank)].empty();
}

bool StoreServer::store_value(const std::string& key, std::string value, std::string& error) {
  if (key.size() > kMaxKeyBytes) {
    error = "key of " + std::to_string(key.size()) + " bytes; the store takes at most " + std::to_string(kMaxKeyBytes);
    return false;
  }
  if (value.size() > kMaxValueBytes) {
    error = "value of " + std::to_string(value.size()) + " bytes for key '" + key + "'; the store takes at most " +
            std::to_string(kMaxValueBytes);
    return false;
  }
  const auto it = data_.find(key);
  const std::size_t old = it == data_.end() ? 0 : key.size() + it->second.size();
  if (it == data_.end() && data_.size() >= kMaxKeys) {
    error = "the store holds " + std::to_string(kMaxKeys) + " keys, its limit";
    return false;
  }
  if (stored_bytes_ - old + key.size() + value.size() > kMaxStoredBytes) {
    error = "the store would hold more than " + std::to_string(kMaxStoredBytes) + " bytes, its limit";
    return false;
  }
  stored_bytes_ = stored_bytes_ - old + key.size() + value.size();
  data_[key] = std::move(value);
  return true;
}

void StoreServer::serve() {
  for (;;) {
    std::vector<pollfd> fds;
    fds.push_back({wake_fd_[0], POLLIN, 0});
    // When full, new clients wait in the listen backlog (their connect retries), not refused: a burst of
    // ranks joining at once, or a flood of strangers, only delays the rest.
    fds.push_back({listen_fd_, static_cast<short>(room_for_client() ? POLLIN : 0), 0});
    for (auto& c : connections_) {
      // While answers wait to be read, the connection's requests wait too: a client cannot pile them up.
      const short events = c->out.empty() ? POLLIN : POLLOUT;
      fds.push_back({c->fd, events, 0});
    }
    const int n = ::poll(fds.data(), fds.size(), 1000);
    if (stop_) return;
    if (n < 0 && errno != EINTR) return;
    const auto now = Clock::now();
    std::vector<bool> drop(connections_.size(), false);
    for (std::size_t i = 0; i < connections_.size(); ++i) {
      Connection& c = *connections_[i];
      const short re = fds[i + 2].revents;
      if (re & POLLOUT) drop[i] = !flush(c) || !process(c);
      else if (re & (POLLIN | POLLHUP | POLLERR)) drop[i] = !read_from(c);
      if (!c.authenticated && now - c.accepted > kHelloTime) drop[i] = true;
    }
    for (std::size_t i = connections_.size(); i-- > 0;)
      if (drop[i]) {
        connection_closed(*connections_[i]);
        ::close(connections_[i]->fd);
        connections_.erase(connections_.begin() + static_cast<std::ptrdiff_t>(i));
      }
    if (fds[1].revents & POLLIN) accept_clients();
  }
}

bool StoreServer::room_for_client() const {
  const auto pending =
      std::count_if(connections_.begin(), connections_.end(), [](const auto& c) { return !c->authenticated; });
  return static_cast<int>(connections_.size()) < kMaxConnections && pending < kMaxPendingConnections;
}

void StoreServer::accept_clients() {
  while (room_for_client()) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;  // EAGAIN: all taken; other errors: try at the next poll
    set_nodelay(fd);
    auto c = std::make_unique<Connection>();
    c->fd = fd;
    c->accepted = Clock::now();
    connections_.push_back(std::move(c));
  }
}

bool StoreServer::flush(Connection& c) {
  while (!c.out.empty()) {
    const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    c.out.erase(0, static_cast<std::size_t>(n));
  }
  return true;
}

std::size_t StoreServer::buffered_bytes() const {
  std::size_t total = 0;
  for (const auto& c : connections_) total += c->in.size() + c->out.size();
  return total;
}

void StoreServer::reply(Connection& c, const std::string& body) {
  c.out += frame(body);
}

bool StoreServer::read_from(Connection& c) {
  char buf[65536];
  const std::size_t limit = (c.authenticated ? kMaxFrame : kMaxHelloFrame) + 4;
  for (;;) {
    const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n == 0) return false;
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      return false;
    }
    if (buffered_bytes() + static_cast<std::size_t>(n) > kMaxBufferedBytes) return false;  // many clients at once
    c.in.append(buf, static_cast<std::size_t>(n));
    if (c.in.size() > limit) break;  // enough to judge: process() drops a frame that is too big
    if (static_cast<std::size_t>(n) < sizeof buf) break;
  }
  return process(c);
}

bool StoreServer::process(Connection& c) {
  // Whole frames, one at a time; an answer must be read before the next request is served.
  while (c.out.empty() && c.in.size() >= 4) {
    const uint32_t len = Reader(c.in).u32();
    if (len > (c.authenticated ? kMaxFrame : kMaxHelloFrame)) return false;
    if (c.in.size() < 4 + static_cast<std::size_t>(len)) break;
    const std::string body = c.in.substr(4, len);
    c.in.erase(0, 4 + static_cast<std::size_t>(len));
    if (!(c.authenticated ? handle_request(c, body) : handle_hello(c, body))) return false;
    if (c.goodbye) return false;
  }
  if (c.in.size() > (c.authenticated ? kMaxFrame : kMaxHelloFrame) + 4) return false;
  return flush(c);
}

bool StoreServer::handle_hello(Connection& c, const std::string& body) {
  Reader r(body);
  const std::string magic = r.raw(sizeof kMagic);
  const std::string token = r.str(kMaxTokenBytes);
  const auto rank = static_cast<int32_t>(r.u32());
  const auto world = static_cast<int32_t>(r.u32());
  // The joining process's nonce (one per process: a rank's several clients share it), so that a second
  // process claiming a rank that has joined (another run's rank on this port, or RANK given twice) is
  // refused instead of joining as a duplicate and breaking the run.
  const std::string nonce = r.str(kMaxTokenBytes);
  if (!r.done() || magic != std::string(kMagic, sizeof kMagic)) return false;  // not one of ours
  const bool counted = rank >= 0 && static_cast<std::size_t>(rank) < joined_.size();
  const bool taken = [&] {
    std::lock_guard<std::mutex> lk(mu_);
    return counted && !joined_[static_cast<std::size_t>(rank)].empty() && joined_[static_cast<std::size_t>(rank)] != nonce;
  }();
  std::string answer;
  if (!equal_constant_time(token, token_)) {
    answer.push_back(static_cast<char>(kTokenDiffers));
    put_str(answer, "its token differs");
  } else if (world_size_ > 0 && rank >= 0 && world != world_size_) {
    answer.push_back(static_cast<char>(kWorldDiffers));
    put_str(answer, std::to_string(world_size_));
  } else if (world_size_ > 0 && rank >= world_size_) {
    answer.push_back(static_cast<char>(kWorldDiffers));
    put_str(answer, std::to_string(world_size_));
  } else if (taken) {
    answer.push_back(static_cast<char>(kRankTaken));
    put_str(answer, "");
  } else {
    answer.push_back(static_cast<char>(kOk));
    put_str(answer, "");
    c.authenticated = true;
    c.rank = rank;
    std::lock_guard<std::mutex> lk(mu_);
    if (counted) joined_[static_cast<std::size_t>(rank)] = nonce.empty() ? std::string("-") : nonce;
  }
  if (!c.authenticated && answer[0] != static_cast<char>(kTokenDiffers)) {
    // One of this run's token that was refused: most likely a rank of this run started with other
    // settings, which the waiting ranks should hear of (another run on this port has its own token).
    std::string note = "the store refused a process asking to join as RANK=" + std::to_string(rank) +
                       " of WORLD_SIZE=" + std::to_string(world);
    if (answer[0] == static_cast<char>(kRankTaken))
      note += ": rank " + std::to_string(rank) + " has joined already from another process";
    else if (world == world_size_)
      note += ": this run's ranks are 0.." + std::to_string(world_size_ - 1);
    else
      note += ": this run has WORLD_SIZE=" + std::to_string(world_size_) + " (start every rank with it)";
    std::lock_guard<std::mutex> lk(mu_);
    refused_ = note;
  }
  reply(c, answer);
  if (!c.authenticated) {  // say why, then hang up (the answer is tiny: one send)
    flush(c);
    return false;
  }
  return true;
}

bool StoreServer::handle_request(Connection& c, const std::string& body) {
  Reader r(body);
  const uint8_t op = r.u8();
  std::string answer;
  auto refuse = [&](const std::string& why) {
    answer.clear();
    answer.push_back(1);
    put_str(answer, why);
  };
  std::lock_guard<std::mutex> lk(mu_);
  switch (op) {
    case kSet: {  // over-long keys and values are read (the frame is bounded) and refused with the limit
      std::string key = r.str(kMaxFrame);
      std::string value = r.str(kMaxFrame);
      if (!r.done()) return false;
      std::string error;
      if (store_value(key, std::move(value), error)) answer.push_back(0);
      else refuse(error);
      break;
    }
    case kCompareSet: {
      std::string key = r.str(kMaxFrame);
      std::string expected = r.str(kMaxFrame);
      std::string desired = r.str(kMaxFrame);
      if (!r.done()) return false;
      const auto it = data_.find(key);
      std::string current;
      std::string error;
      bool ok = true;
      if (it == data_.end()) {
        // As c10d's stores do: an absent key is set only when the caller expected it absent (empty).
        if (expected.empty()) {
          current = desired;
          ok = store_value(key, std::move(desired), error);
        } else {
          current = expected;
        }
      } else if (it->second == expected) {
        current = desired;
        ok = store_value(key, std::move(desired), error);
      } else {
        current = it->second;
      }
      if (ok) {
        answer.push_back(0);
        put_str(answer, current);
      } else {
        refuse(error);
      }
      break;
    }
    case kGet: {
      const std::string key = r.str(kMaxKeyBytes);
      if (!r.done()) return false;
      if (key == kRefusedKey) {  // the server's note, not a stored key
        answer.push_back(0);
        answer.push_back(refused_.empty() ? 0 : 1);
        put_str(answer, refused_);
        break;
      }
      const auto it = data_.find(key);
      answer.push_back(0);
      answer.push_back(it == data_.end() ? 0 : 1);
      put_str(answer, it == data_.end() ? std::string() : it->second);
      break;
    }
    case kAdd: {
      const std::string key = r.str(kMaxKeyBytes);
      const int64_t delta = r.i64();
      if (!r.done()) return false;
      const auto it = data_.find(key);
      int64_t sum = delta;
      std::optional<int64_t> old = it == data_.end() ? std::optional<int64_t>(0) : parse_i64(it->second);
      std::string error;
      if (!old) {
        refuse("add on key '" + key + "', whose value is not an integer");
      } else if (__builtin_add_overflow(*old, delta, &sum)) {
        refuse("add on key '" + key + "' overflows");
      } else if (store_value(key, std::to_string(sum), error)) {
        answer.push_back(0);
        put_i64(answer, sum);
      } else {
        refuse(error);
      }
      break;
    }
    case kDelete: {
      const std::string key = r.str(kMaxKeyBytes);
      if (!r.done()) return false;
      const auto it = data_.find(key);
      const bool found = it != data_.end();
      if (found) {
        stored_bytes_ -= key.size() + it->second.size();
        data_.erase(it);
      }
      answer.push_back(0);
      answer.push_back(found ? 1 : 0);
      break;
    }
    case kCheck: {
      const uint32_t n = r.u32();
      if (n > kMaxKeysPerRequest) return false;
      bool all = true;
      for (uint32_t i = 0; i < n && r.ok(); ++i) all = data_.count(r.str(kMaxKeyBytes)) > 0 && all;
      if (!r.done()) return false;
      answer.push_back(0);
      answer.push_back(all ? 1 : 0);
      break;
    }
    case kNumKeys:
      if (!r.done()) return false;
      answer.push_back(0);
      put_i64(answer, static_cast<int64_t>(data_.size()));
      break;
    case kBye:
      c.goodbye = true;
      return true;
    default:
      return false;
  }
  if (answer.size() + c.out.size() > kMaxOutput || buffered_bytes() + answer.size() > kMaxBufferedBytes) return false;
  reply(c, answer);
  return true;
}

void StoreServer::connection_closed(Connection& c) {
  if (!c.authenticated || c.rank < 0 || c.goodbye) return;
  std::lock_guard<std::mutex> lk(mu_);
  const auto phase = data_.find(phase_key(c.rank));
  post_abort_locked(c.rank, "it went away (killed or crashed?) during " +
                                (phase == data_.end() ? std::string("the rendezvous") : phase->second) +
                                ": its connection to the rendezvous store closed without a goodbye");
}

// --- client ------------------------------------------------------------------------------------

namespace {

// A line on stderr every kWaitNoteEvery of a long wait, saying what is awaited (a rank whose peer died
// before joining, or a silent listener on the port, was otherwise silent for minutes).
constexpr auto kWaitNoteEvery = std::chrono::seconds(10);
class WaitNotes {
 public:
  WaitNotes() : start_(Clock::now()), next_(start_ + kWaitNoteEvery) {}
  // Prints `what` (with the seconds waited) when the next note is due.
  bool due() const { return Clock::now() >= next_; }
  void tick(const std::string& what, milliseconds limit) {
    const auto now = Clock::now();
    if (now < next_) return;
    next_ = now + kWaitNoteEvery;
    const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - start_).count();
    std::fprintf(stderr, "pipetrain: still waiting after %lld s (at most %lld s) %s\n", static_cast<long long>(waited),
                 static_cast<long long>(limit.count() / 1000), what.c_str());
    std::fflush(stderr);
  }

 private:
  Clock::time_point start_, next_;
};

// Connects to host:port within `deadline`, retrying while nobody listens yet. Returns the fd or throws.
int connect_with_retry(const std::string& host, int port, Clock::time_point deadline, const std::string& what) {
  std::string why = "no attempt";
  WaitNotes notes;
  const auto limit = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
  for (;;) {
    notes.tick("to connect to the rendezvous store at " + what + " (" + why + "): is its first rank (or the "
               "launcher) running?", limit);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (rc != 0) {
      why = std::string("the address does not resolve: ") + ::gai_strerror(rc);
    } else {
      for (addrinfo* ai = res; ai; ai = ai->ai_next) {
        const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) continue;
        int err = 0;
        if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
          err = errno;
          if (err == EINPROGRESS) {
            const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
            pollfd p{fd, POLLOUT, 0};
            const int n = ::poll(&p, 1, static_cast<int>(std::clamp<long long>(left, 1, 5000)));
            socklen_t len = sizeof err;
            if (n == 1) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
            else err = ETIMEDOUT;
          }
        }
        if (err == 0) {
          ::freeaddrinfo(res);
          const int flags = ::fcntl(fd, F_GETFL);
          ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
          set_nodelay(fd);
          return fd;
        }
        why = errno_text(err);
        ::close(fd);
      }
      ::freeaddrinfo(res);
    }
    if (Clock::now() >= deadline)
      throw std::runtime_error("cannot connect to the rendezvous store at " + what + ": " + why);
    std::this_thread::sleep_for(milliseconds(100));
  }
}

void send_all(int fd, const std::string& bytes) {
  std::size_t at = 0;
  while (at < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + at, bytes.size() - at, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(errno_text(errno));
    }
    at += static_cast<std::size_t>(n);
  }
}

void recv_all(int fd, char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got == 0) throw std::runtime_error("the store closed the connection");
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) throw std::runtime_error("no answer in time");
      throw std::runtime_error(errno_text(errno));
    }
    p += got;
    n -= static_cast<std::size_t>(got);
  }
}

std::string recv_frame(int fd) {
  char head[4];
  recv_all(fd, head, 4);
  std::string h(head, 4);
  const uint32_t len = Reader(h).u32();
  if (len > kMaxFrame) throw std::runtime_error("the store sent a frame of " + std::to_string(len) + " bytes");
  std::string body(len, '\0');
  recv_all(fd, body.data(), len);
  return body;
}

std::string key_list(const std::vector<std::string>& keys) {
  std::string s;
  for (std::size_t i = 0; i < keys.size() && i < 4; ++i) s += (i ? ", " : "") + keys[i];
  if (keys.size() > 4) s += ", ... (" + std::to_string(keys.size()) + " keys)";
  return s;
}

}  // namespace

StoreClient::StoreClient(const std::string& host, int port, const std::string& token, int rank, int world_size,
                         milliseconds timeout, std::string what)
    : c10d::Store(timeout), what_(what.empty() ? host + ":" + std::to_string(port) : std::move(what)), host_(host),
      port_(port), token_(token), rank_(rank), world_size_(world_size), wait_limit_(timeout) {
  if (token.size() > kMaxTokenBytes)
    throw std::runtime_error("PIPETRAIN_RUN_TOKEN has " + std::to_string(token.size()) + " bytes: use at most " +
                             std::to_string(kMaxTokenBytes));
  fd_ = connect_with_retry(host, port, Clock::now() + timeout, what_);
  std::string hello(kMagic, sizeof kMagic);
  put_str(hello, token);
  put_u32(hello, static_cast<uint32_t>(rank));
  put_u32(hello, static_cast<uint32_t>(world_size));
  static const std::string nonce = make_run_token();  // this process's
  put_str(hello, nonce);
  // A listener that is not a pipetrain store may never answer, so the answer has a time limit. A store busy
  // with silent strangers keeps this rank in its listen backlog until it hangs up on them (kHelloTime), so the
  // limit covers two such rounds, or the caller's timeout where that is longer (at most a minute).
  const milliseconds answer_limit = std::clamp(timeout, milliseconds(3 * kHelloTime), milliseconds(6 * kHelloTime));
  timeval tv{static_cast<time_t>(answer_limit.count() / 1000), static_cast<suseconds_t>(answer_limit.count() % 1000 * 1000)};
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string answer;
  try {
    send_all(fd_, frame(hello));
    // Until the first byte of the answer arrives, a note every 10 s (a silent listener was 60 s silent).
    WaitNotes notes;
    const auto answer_by = Clock::now() + answer_limit;
    bool readable = false;
    for (pollfd p{fd_, POLLIN, 0}; !readable && Clock::now() < answer_by;) {
      readable = ::poll(&p, 1, 1000) != 0;
      if (!readable)
        notes.tick("for " + what_ + " to answer as a pipetrain rendezvous store: another program may listen there",
                   answer_limit);
    }
    // Not a second wait of answer_limit in recv (a silent listener took twice the limit that the message gave).
    if (!readable) throw std::runtime_error("no answer in time");
    answer = recv_frame(fd_);
  } catch (const std::exception& e) {
    ::close(fd_);
    fd_ = -1;
    throw std::runtime_error(what_ + " does not answer as a pipetrain rendezvous store (" + e.what() + ", " +
                             std::to_string(answer_limit.count() / 1000) + " s" +
                             "): another program may listen there; pick a free MASTER_PORT");
  }
  tv = timeval{0, 0};
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  Reader r(answer);
  const uint8_t status = r.u8();
  const std::string detail = r.str(kMaxValueBytes);
  if (!r.ok() || status != kOk) {
    ::close(fd_);
    fd_ = -1;
    if (status == kTokenDiffers)
      throw std::runtime_error(what_ + " hosts another pipetrain run (its token differs): give this rank that run's "
                               "PIPETRAIN_RUN_TOKEN, or start this run on a free MASTER_PORT");
    if (status == kWorldDiffers)
      throw std::runtime_error(what_ + " hosts another pipetrain run (WORLD_SIZE=" + detail + ", this rank has RANK=" +
                               std::to_string(rank) + " of WORLD_SIZE=" + std::to_string(world_size) +
                               "): start every rank with the same WORLD_SIZE, or start this run on a free MASTER_PORT");
    if (status == kRankTaken && what_.find("PIPETRAIN_LAUNCHER_STORE") != std::string::npos)
      throw std::runtime_error(what_ + " has seen rank " + std::to_string(rank) + " join from another process: the "
                               "store pipetrain launch hosts serves one pipetrain program per rank (one rendezvous), "
                               "and an earlier pipetrain program of this rank (a command run before this one in the "
                               "same launched shell) joined it: run each pipetrain program under its own pipetrain "
                               "launch (pipetrain launch -n P -- CMD1; pipetrain launch -n P -- CMD2)");
    if (status == kRankTaken)
      throw std::runtime_error(what_ + " hosts a run whose rank " + std::to_string(rank) + " has already joined from "
                               "another process: another run may use this MASTER_PORT (start this run on a free "
                               "MASTER_PORT, or give each run its own PIPETRAIN_RUN_TOKEN), or RANK=" +
                               std::to_string(rank) + " was given to two processes");
    throw std::runtime_error(what_ + " refused this rank (" + (r.ok() ? "busy" : "a malformed answer") +
                             "): is it a pipetrain rendezvous store?");
  }
}

StoreClient::~StoreClient() {
  if (fd_ < 0) return;
  try {
    std::string bye;
    bye.push_back(static_cast<char>(kBye));
    send_all(fd_, frame(bye));
  } catch (...) {
  }
  ::close(fd_);
}

// LibTorch 2.7+ makes c10d::Store::clone() pure virtual: this fails to compile if StoreClient's clone() does
// not override it there.
static_assert(!std::is_abstract_v<StoreClient>, "StoreClient must implement every pure virtual of c10d::Store");

c10::intrusive_ptr<c10d::Store> StoreClient::clone() {
  auto copy = c10::make_intrusive<StoreClient>(host_, port_, token_, rank_, world_size_, wait_limit_, what_);
  copy->setTimeout(timeout_);
  copy->abort_watch_rank_ = abort_watch_rank_.load();
  return copy;
}

void StoreClient::drop_without_goodbye() {
  std::lock_guard<std::mutex> lk(mu_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string StoreClient::call(const std::string& request) {
  if (fd_ < 0) throw std::runtime_error("the connection to the rendezvous store at " + what_ + " is closed");
  std::string body;
  try {
    send_all(fd_, frame(request));
    body = recv_frame(fd_);
  } catch (const std::exception& e) {
    throw std::runtime_error("lost the rendezvous store at " + what_ + ": " + e.what());
  }
  if (!body.empty() && body[0] == 1) {
    Reader r(body);
    r.u8();
    throw std::runtime_error("the rendezvous store at " + what_ + " refused a request: " + r.str(kMaxValueBytes));
  }
  if (body.empty() || body[0] != 0)
    throw std::runtime_error("the rendezvous store at " + what_ + " sent a malformed answer");
  return body.substr(1);
}

void StoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  std::string req(1, static_cast<char>(kSet));
  put_str(req, key);
  put_str(req, std::string(value.begin(), value.end()));
  std::lock_guard<std::mutex> lk(mu_);
  call(req);
}

std::vector<uint8_t> StoreClient::compareSet(const std::string& key, const std::vector<uint8_t>& currentValue,
                                             const std::vector<uint8_t>& newValue) {
  std::string req(1, static_cast<char>(kCompareSet));
  put_str(req, key);
  put_str(req, std::string(currentValue.begin(), currentValue.end()));
  put_str(req, std::string(newValue.begin(), newValue.end()));
  std::lock_guard<std::mutex> lk(mu_);
  const std::string body = call(req);
  Reader r(body);
  const std::string v = r.str(kMaxValueBytes);
  if (!r.done()) throw std::runtime_error("the rendezvous store at " + what_ + " sent a malformed answer");
  return std::vector<uint8_t>(v.begin(), v.end());
}

std::optional<std::vector<uint8_t>> StoreClient::try_get(const std::string& key) {
  std::string req(1, static_cast<char>(kGet));
  put_str(req, key);
  std::lock_guard<std::mutex> lk(mu_);
  const std::string body = call(req);
  Reader r(body);
  const uint8_t found = r.u8();
  const std::string v = r.str(kMaxValueBytes);
  if (!r.done()) throw std::runtime_error("the rendezvous store at " + what_ + " sent a malformed answer");
  if (!found) return std::nullopt;
  return std::vector<uint8_t>(v.begin(), v.end());
}

std::vector<uint8_t> StoreClient::get(const std::string& key) {
  wait_for({key}, timeout_);
  auto v = try_get(key);
  if (!v) throw std::runtime_error("key '" + key + "' vanished from the rendezvous store at " + what_);
  return *v;
}

int64_t StoreClient::add(const std::string& key, int64_t value) {
  std::string req(1, static_cast<char>(kAdd));
  put_str(req, key);
  put_i64(req, value);
  std::lock_guard<std::mutex> lk(mu_);
  const std::string body = call(req);
  Reader r(body);
  const int64_t sum = r.i64();
  if (!r.done()) throw std::runtime_error("the rendezvous store at " + what_ + " sent a malformed answer");
  return sum;
}

bool StoreClient::deleteKey(const std::string& key) {
  std::string req(1, static_cast<char>(kDelete));
  put_str(req, key);
  std::lock_guard<std::mutex> lk(mu_);
  const std::string body = call(req);
  return !body.empty() && body[0] == 1;
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  if (keys.size() > kMaxKeysPerRequest)
    throw std::invalid_argument("check() of " + std::to_string(keys.size()) + " keys: the store takes at most " +
                                std::to_string(kMaxKeysPerRequest) + " at once");
  std::string req(1, static_cast<char>(kCheck));
  put_u32(req, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) put_str(req, k);
  std::lock_guard<std::mutex> lk(mu_);
  const std::string body = call(req);
  return !body.empty() && body[0] == 1;
}

int64_t StoreClient::getNumKeys() {
  std::string req(1, static_cast<char>(kNumKeys));
  std::lock_guard<std::mutex> lk(mu_);
  const std::string body = call(req);
  Reader r(body);
  return r.i64();
}

void StoreClient::wait(const std::vector<std::string>& keys) { wait_for(keys, timeout_); }

void StoreClient::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  wait_for(keys, timeout == kNoTimeout ? wait_limit_ : std::min(timeout, wait_limit_));
}

void StoreClient::check_abort() {
  const int own = abort_watch_rank_;
  if (own == kNotWatching) return;
  std::string req(1, static_cast<char>(kGet));
  put_str(req, kAbortKey);
  std::lock_guard<std::mutex> lk(mu_);
  const std::string body = call(req);
  Reader r(body);
  const uint8_t found = r.u8();
  const std::string v = r.str(kMaxValueBytes);
  if (!found) return;
  const auto [failed, message] = parse_abort(v);
  if (failed == own)
    throw std::runtime_error("this rank (" + std::to_string(own) + ") reported a failure: " + message);
  throw RemoteFailure(failed, message);
}

std::string StoreClient::refusal_note() {
  try {
    const auto v = try_get(kRefusedKey);
    if (v && !v->empty()) return " (" + std::string(v->begin(), v->end()) + ")";
  } catch (const std::exception&) {
  }
  return "";
}

void StoreClient::wait_for(const std::vector<std::string>& keys, milliseconds timeout) {
  const auto start = Clock::now();
  const bool forever = timeout == kNoTimeout;
  milliseconds pause{1};
  WaitNotes notes;
  for (;;) {
    if (!forever && notes.due())
      notes.tick("for " + key_list(keys) + " in the rendezvous store at " + what_ +
                 ": has every rank started, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?" + refusal_note(),
                 timeout);
    // Keys already there are read even after a failure report: only real waiting ends with it (a rank
    // that reads the rendezvous data another rank published just before failing finishes its part).
    if (check(keys)) return;
    check_abort();
    if (!forever && Clock::now() - start >= timeout)
      throw std::runtime_error("timed out after " + std::to_string(timeout.count() / 1000) + " s waiting for " +
                               key_list(keys) + " in the rendezvous store at " + what_ +
                               ": has every rank started, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?" +
                               refusal_note());
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, milliseconds(50));
  }
}

}  // namespace pipetrain

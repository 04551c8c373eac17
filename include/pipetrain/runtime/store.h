// The rendezvous store of a multi-process run: a small key-value server (StoreServer) and its client
// (StoreClient, a c10d::Store, so ProcessGroupGloo rendezvouses through it). It replaces LibTorch 1.13's
// TCPStore, which listens on every interface and lets anyone who reaches the port write its keys.
//
// Who hosts it: `pipetrain launch` / launch_local (a thread in the launcher, on 127.0.0.1), else rank 0 of
// the gloo transport (a thread in rank 0's process), on the address of MASTER_ADDR only. Under torchrun
// neither: the ranks join the agent's own c10d::TCPStore (transport_gloo.cpp).
//
// Security. The server binds only the address it is given (never the wildcard unless the user asks,
// PIPETRAIN_STORE_BIND=0.0.0.0), and every connection must first present the run's token
// (PIPETRAIN_RUN_TOKEN, which the launcher makes from /dev/urandom; compared in constant time) and the
// run's WORLD_SIZE. A connection with another token is refused, and its client reports
//   "ADDR:PORT (MASTER_ADDR:MASTER_PORT) hosts another pipetrain run (its token differs): ..."
// without disturbing the run. Ranks started by hand without PIPETRAIN_RUN_TOKEN use the empty token: the
// store then accepts any client without a token (rank 0 warns when it listens on a non-loopback address).
// The token travels in clear text: it keeps out strays and other users' runs, not a network eavesdropper.
// Everything read from the network is bounded (kMaxKeyBytes, kMaxValueBytes, kMaxKeys, kMaxStoredBytes,
// kMaxKeysPerRequest, kMaxConnections, kMaxBufferedBytes over all connections, 512 bytes and 10 s for an
// unauthenticated connection to say who it is), so a hostile client cannot make the server allocate
// without limit: a request over a limit is refused with the limit, a frame over it ends the connection.
//
// Failure board. Keys are the run's; kAbortKey ("pipetrain/abort" = "<rank>\n<message>", the first writer
// wins) is the run's failure report. A client that connected as rank K and closes its connection without
// a goodbye (killed, crashed, _exit) makes the server post "rank K went away ... during PHASE" there
// (PHASE: the value of phase_key(K), which the transport keeps current), unless a failure was reported
// already. The blocking calls of StoreClient (get, wait) poll the store instead of blocking on it, and
// throw RemoteFailure as soon as kAbortKey appears: a rank that dies during the rendezvous stops the
// others within a poll period.
//
// Threads. StoreServer runs one thread of its own (poll loop); its public methods may be called from any
// thread. A StoreClient may be used from several threads (one request at a time, under its mutex); its
// connection belongs to it.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace pipetrain {

// Limits on what the server accepts from the network.
constexpr std::size_t kMaxKeyBytes = 1024;
constexpr std::size_t kMaxValueBytes = 1 << 20;          // 1 MiB
constexpr std::size_t kMaxKeys = 1 << 16;                // keys stored at once
constexpr std::size_t kMaxStoredBytes = 64u << 20;       // keys + values stored at once
constexpr std::size_t kMaxKeysPerRequest = 4096;         // in one check()/wait()
constexpr std::size_t kMaxTokenBytes = 256;
constexpr int kMaxConnections = 1024;                    // authenticated + not yet authenticated
constexpr int kMaxPendingConnections = 64;               // not yet authenticated
constexpr std::size_t kMaxBufferedBytes = 256u << 20;   // requests and answers in flight, all connections

// The run's failure report: "<rank>\n<message>" (the first writer wins, by compareSet with {}).
extern const std::string kAbortKey;
std::string encode_abort(int rank, const std::string& message);
// (rank, message) of an abort value; rank -1 when the value has no rank line.
std::pair<int, std::string> parse_abort(const std::string& value);
// The server's note of the last process it refused although it had the run's token (asked to join with
// another WORLD_SIZE, as a rank that has joined already, or beyond WORLD_SIZE): a get() of this key is
// answered from that note (not a stored key: getNumKeys does not count it). A refused process never
// disturbs the run, but a rank waiting for one that was refused says so in its waiting notes and timeout
// message, instead of only waiting out the rendezvous timeout.
extern const std::string kRefusedKey;
// Where a rank says what it is doing, for the server's "went away during PHASE" report.
std::string phase_key(int rank);

// A per-run secret: 32 hex digits from /dev/urandom. Throws std::runtime_error when it cannot be read.
std::string make_run_token();

// Equal strings, in time that depends only on their lengths (a token's bytes leak nothing).
bool equal_constant_time(const std::string& a, const std::string& b);

// The key-value server. Binds `bind_address:port` (an IPv4 or IPv6 literal or a host name, resolved;
// the first address that binds is used), accepts clients that present `token` and `world_size` (0 =
// any world size), and serves until destroyed. Throws std::runtime_error naming the address, the port
// and the reason when it cannot listen (e.g. the port is taken).
class StoreServer {
 public:
  StoreServer(const std::string& bind_address, int port, std::string token, int world_size);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }
  const std::string& address() const { return address_; }  // the numeric address it listens on

  // Posts `encode_abort(rank, message)` as kAbortKey unless a failure was reported already; returns true
  // when this call's report is the one stored.
  bool post_abort(int rank, const std::string& message);
  // The value of a key, if set.
  std::optional<std::string> value(const std::string& key) const;
  // Whether a client ever authenticated as `rank` (a rank's first connection is its joining).
  bool joined(int rank) const;

 private:
  struct Connection;
  void serve();
  void accept_clients();
  bool room_for_client() const;  // under kMaxConnections and kMaxPendingConnections
  bool read_from(Connection& c);  // false: drop the connection
  bool process(Connection& c);    // serves the whole frames read so far; false: drop the connection
  bool handle_hello(Connection& c, const std::string& body);
  bool handle_request(Connection& c, const std::string& body);
  void reply(Connection& c, const std::string& bytes);
  std::size_t buffered_bytes() const;  // in + out of every connection (server thread)
  bool flush(Connection& c);
  void connection_closed(Connection& c);
  bool store_value(const std::string& key, std::string value, std::string& error);  // mu_ held
  bool post_abort_locked(int rank, const std::string& message);

  std::string token_;
  int world_size_;
  std::string address_;
  int port_ = 0;
  int listen_fd_ = -1;
  int wake_fd_[2] = {-1, -1};
  std::atomic<bool> stop_{false};

  mutable std::mutex mu_;
  std::map<std::string, std::string> data_;
  std::size_t stored_bytes_ = 0;
  std::string refused_;  // the note kRefusedKey answers with (empty: nobody refused)
  std::vector<std::string> joined_;  // per rank: the nonce of the process that joined as it; empty: none yet
  std::vector<std::unique_ptr<Connection>> connections_;  // the server thread's
  std::thread thread_;
};

// The client: a c10d::Store over one TCP connection to a StoreServer.
class StoreClient : public c10d::Store {
 public:
  // Connects to `host:port`, retrying refused connections until `timeout` (the server may not be up
  // yet), and authenticates as `rank` of `world_size` (rank -1: not a rank, e.g. a tool) with `token`.
  // `what` names the address in messages, e.g. "127.0.0.1:29500 (MASTER_ADDR:MASTER_PORT)". Throws
  // std::runtime_error when it cannot connect or is refused (another run's token or world size).
  // get() and wait() wait up to `timeout` (setTimeout changes it).
  StoreClient(const std::string& host, int port, const std::string& token, int rank, int world_size,
              std::chrono::milliseconds timeout, std::string what = "");
  ~StoreClient() override;  // says goodbye: the server does not report this rank as gone

  // A new client on its own connection to the same server, as the same rank, with the same timeout and
  // abort watch. LibTorch 2.7+ declares clone() in c10d::Store (pure virtual), and this overrides it; with
  // an older LibTorch it is an extra method (no `override`, so one declaration fits every version; the
  // runtime checks that StoreClient is not abstract).
  virtual c10::intrusive_ptr<c10d::Store> clone();

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& currentValue,
                                  const std::vector<uint8_t>& newValue) override;
  std::vector<uint8_t> get(const std::string& key) override;  // waits for the key
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  // The value of `key` if it is set, without waiting.
  std::optional<std::vector<uint8_t>> try_get(const std::string& key);
  // From now on get() and wait() throw RemoteFailure as soon as kAbortKey is set (std::runtime_error
  // when it names `own_rank`); kNotWatching turns that off again.
  static constexpr int kNotWatching = -2;
  void stop_waiting_on_abort(int own_rank) { abort_watch_rank_ = own_rank; }
  // Closes the connection without a goodbye, as a crash would (for tests).
  void drop_without_goodbye();

 private:
  std::string call(const std::string& request);  // one request, one response body; mu_ held
  void check_abort();  // throws when kAbortKey is set (see stop_waiting_on_abort)
  void wait_for(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  std::string refusal_note();  // " (" + the server's kRefusedKey note + ")", or "" (none, or unreadable)

  std::string what_;
  // How to connect again (clone()).
  std::string host_;
  int port_;
  std::string token_;
  int rank_;
  int world_size_;
  // The constructor's timeout (PIPETRAIN_RENDEZVOUS_TIMEOUT for the gloo transport): Gloo waits on the
  // store only while its ranks connect, and passes its own operation timeout (30 min) to wait(keys,
  // timeout); a wait never lasts longer than this, so a rank whose peers never come stops in time.
  std::chrono::milliseconds wait_limit_;
  std::mutex mu_;
  int fd_ = -1;
  std::atomic<int> abort_watch_rank_{kNotWatching};
};

}  // namespace pipetrain

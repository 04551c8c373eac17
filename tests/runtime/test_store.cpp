// Checks the rendezvous store (runtime/store.h) in one process: it listens only on the address it is
// given; a client with another token or world
// size is refused with a message naming the address, and the run's keys and failure report stay as they
// were; c10d::Store semantics (set/get/add/compareSet/deleteKey/check/getNumKeys/wait) hold; a rank's
// connection that closes without a goodbye posts "rank K went away during PHASE", one with a goodbye
// does not; wait() ends with RemoteFailure once a failure is reported; and what a hostile client sends
// is bounded: oversized frames and unauthenticated garbage end its connection, oversized values and too
// many keys are refused, and the server goes on serving the others.
#include "listening.h"
#include "pipetrain/runtime/store.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "pipetrain/runtime/transport.h"

namespace pipetrain {
namespace {

using std::chrono::milliseconds;

std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

using pipetrain::testing::listening_addresses;


std::string refusal(const std::string& host, int port, const std::string& token, int rank, int world) {
  try {
    StoreClient c(host, port, token, rank, world, milliseconds(3000), host + ":" + std::to_string(port));
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(accepted)";
}

// A raw TCP connection to 127.0.0.1:port.
int raw_connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// True when the server closed `fd` within `limit`.
bool closed_by_peer(int fd, milliseconds limit) {
  timeval tv{static_cast<time_t>(limit.count() / 1000), static_cast<suseconds_t>((limit.count() % 1000) * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char buf[256];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
  }
}

TEST(Store, ListensOnlyOnTheAddressItIsGiven) {
  StoreServer server("127.0.0.1", 0, "t", 1);
  EXPECT_EQ(server.address(), "127.0.0.1");
  EXPECT_EQ(listening_addresses(server.port()), "0100007F ");
}

TEST(Store, MakeRunTokenIsFreshHex) {
  const std::string a = make_run_token(), b = make_run_token();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, b);
  EXPECT_TRUE(equal_constant_time(a, a));
  EXPECT_FALSE(equal_constant_time(a, b));
  EXPECT_FALSE(equal_constant_time("abc", "abcd"));
  EXPECT_FALSE(equal_constant_time("", "a"));
  EXPECT_TRUE(equal_constant_time("", ""));
}

TEST(Store, ClientWithAnotherTokenIsRefusedAndTheRunIsUndisturbed) {
  StoreServer server("127.0.0.1", 0, "run-a", 2);
  const int port = server.port();
  StoreClient rank0("127.0.0.1", port, "run-a", 0, 2, milliseconds(3000));
  rank0.set("k", bytes("v"));
  const std::string e = refusal("127.0.0.1", port, "run-b", 1, 2);
  EXPECT_NE(e.find("127.0.0.1:" + std::to_string(port) + " hosts another pipetrain run (its token differs)"),
            std::string::npos)
      << e;
  EXPECT_NE(refusal("127.0.0.1", port, "", 1, 2).find("its token differs"), std::string::npos);
  const std::string w = refusal("127.0.0.1", port, "run-a", 1, 3);
  EXPECT_NE(w.find("WORLD_SIZE=2"), std::string::npos) << w;
  EXPECT_FALSE(server.joined(1));
  EXPECT_FALSE(server.value(kAbortKey).has_value());  // the refused ones reported nothing
  EXPECT_EQ(text(rank0.get("k")), "v");
  StoreClient rank1("127.0.0.1", port, "run-a", 1, 2, milliseconds(3000));
  EXPECT_TRUE(server.joined(1));
}

TEST(Store, ARankWaitingForOneThatWasRefusedSaysWhy) {
  StoreServer server("127.0.0.1", 0, "run-a", 2);
  const int port = server.port();
  StoreClient rank0("127.0.0.1", port, "run-a", 0, 2, milliseconds(3000));
  auto waited = [&] {
    try {
      rank0.wait({"rank1-ready"}, milliseconds(300));
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("(no timeout)");
  };
  EXPECT_EQ(waited().find("refused"), std::string::npos);  // nobody refused yet
  refusal("127.0.0.1", port, "run-b", 1, 3);  // another run's token: not noted
  EXPECT_EQ(waited().find("refused"), std::string::npos);
  const int keys = static_cast<int>(rank0.getNumKeys());
  refusal("127.0.0.1", port, "run-a", 1, 3);  // this run's rank 1, started with WORLD_SIZE=3
  const std::string w = waited();
  EXPECT_NE(w.find("timed out"), std::string::npos) << w;
  EXPECT_NE(w.find("refused a process asking to join as RANK=1 of WORLD_SIZE=3: this run has WORLD_SIZE=2"),
            std::string::npos)
      << w;
  EXPECT_EQ(rank0.getNumKeys(), keys);  // the note is not one of the run's keys
  EXPECT_FALSE(server.value(kAbortKey).has_value());
}

TEST(Store, C10dStoreSemantics) {
  StoreServer server("127.0.0.1", 0, "", 0);
  auto c = c10::make_intrusive<StoreClient>("127.0.0.1", server.port(), "", -1, 0, milliseconds(2000));
  c->set("a", bytes("1"));
  EXPECT_EQ(text(c->get("a")), "1");
  EXPECT_EQ(c->add("n", 2), 2);
  EXPECT_EQ(c->add("n", 3), 5);
  EXPECT_EQ(text(c->get("n")), "5");  // decimal text, as TCPStore keeps counters
  EXPECT_EQ(text(c->compareSet("x", {}, bytes("first"))), "first");
  EXPECT_EQ(text(c->compareSet("x", {}, bytes("second"))), "first");  // taken: the current value
  EXPECT_EQ(text(c->compareSet("x", bytes("first"), bytes("third"))), "third");
  EXPECT_EQ(text(c->compareSet("absent", bytes("old"), bytes("new"))), "old");
  EXPECT_FALSE(c->check({"absent"}));
  EXPECT_TRUE(c->check({"a", "n", "x"}));
  EXPECT_EQ(c->getNumKeys(), 3);
  EXPECT_TRUE(c->deleteKey("a"));
  EXPECT_FALSE(c->deleteKey("a"));
  EXPECT_THROW(c->add("x", 1), std::runtime_error);  // not an integer
  std::thread late([port = server.port()] {
    std::this_thread::sleep_for(milliseconds(200));
    StoreClient other("127.0.0.1", port, "", -1, 0, milliseconds(2000));
    other.set("late", bytes("here"));
  });
  c->setTimeout(milliseconds(30000));  // a loaded machine may run the other thread's connect late
  EXPECT_EQ(text(c->get("late")), "here");  // get waits for the key
  c->setTimeout(milliseconds(2000));
  late.join();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(c->wait({"never"}, milliseconds(300)), std::runtime_error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(Store, WaitEndsWithRemoteFailureOnceAFailureIsReported) {
  StoreServer server("127.0.0.1", 0, "", 2);
  StoreClient c("127.0.0.1", server.port(), "", 0, 2, milliseconds(60000));
  c.stop_waiting_on_abort(0);
  std::thread poster([&] {
    std::this_thread::sleep_for(milliseconds(300));
    server.post_abort(1, "it exited with code 3");
  });
  const auto start = std::chrono::steady_clock::now();
  try {
    c.wait({"never"});
    ADD_FAILURE() << "wait returned";
  } catch (const RemoteFailure& e) {
    EXPECT_EQ(e.failed_rank(), 1);
    EXPECT_NE(std::string(e.what()).find("rank 1 failed: it exited with code 3"), std::string::npos) << e.what();
  }
  poster.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_FALSE(server.post_abort(0, "later"));  // the first report stays
  EXPECT_EQ(parse_abort(*server.value(kAbortKey)).second, "it exited with code 3");
}

TEST(Store, ARankThatLeavesWithoutAGoodbyeIsReportedWithItsPhase) {
  StoreServer server("127.0.0.1", 0, "tok", 3);
  {
    StoreClient polite("127.0.0.1", server.port(), "tok", 2, 3, milliseconds(2000));
  }  // goodbye
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_FALSE(server.value(kAbortKey).has_value());
  StoreClient crashing("127.0.0.1", server.port(), "tok", 1, 3, milliseconds(2000));
  crashing.set(phase_key(1), bytes("the run"));
  crashing.drop_without_goodbye();
  for (int i = 0; i < 100 && !server.value(kAbortKey); ++i) std::this_thread::sleep_for(milliseconds(20));
  ASSERT_TRUE(server.value(kAbortKey).has_value());
  const auto [rank, message] = parse_abort(*server.value(kAbortKey));
  EXPECT_EQ(rank, 1);
  EXPECT_NE(message.find("went away (killed or crashed?) during the run"), std::string::npos) << message;
}

TEST(Store, WhatAHostileClientSendsIsBounded) {
  StoreServer server("127.0.0.1", 0, "tok", 0);
  StoreClient good("127.0.0.1", server.port(), "tok", -1, 0, milliseconds(2000));
  // Unauthenticated: a frame claiming 4 GiB, and bytes that are not a hello, are hung up on.
  int fd = raw_connect(server.port());
  ASSERT_GE(fd, 0);
  const unsigned char huge[4] = {0xff, 0xff, 0xff, 0xff};
  ASSERT_EQ(::send(fd, huge, 4, 0), 4);
  EXPECT_TRUE(closed_by_peer(fd, milliseconds(3000)));
  ::close(fd);
  fd = raw_connect(server.port());
  ASSERT_GE(fd, 0);
  const char junk[] = "\x10\x00\x00\x00GET / HTTP/1.1\r\n";
  ASSERT_GT(::send(fd, junk, sizeof junk - 1, 0), 0);
  EXPECT_TRUE(closed_by_peer(fd, milliseconds(3000)));
  ::close(fd);
  // Authenticated but over the limits: refused, the store unchanged.
  const std::string big(kMaxValueBytes + 1, 'x');
  try {
    good.set("big", bytes(big));
    ADD_FAILURE() << "a value of " << big.size() << " bytes was stored";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("at most " + std::to_string(kMaxValueBytes)), std::string::npos) << e.what();
  }
  EXPECT_THROW(good.set(std::string(kMaxKeyBytes + 1, 'k'), bytes("v")), std::runtime_error);
  EXPECT_FALSE(good.check({"big"}));
  // Values up to the limit fill the store only up to kMaxStoredBytes.
  const std::string mib(kMaxValueBytes, 'y');
  std::size_t stored = 0;
  bool refused = false;
  for (int i = 0; i < 200 && !refused; ++i) {
    try {
      good.set("fill/" + std::to_string(i), bytes(mib));
      stored += mib.size();
    } catch (const std::runtime_error& e) {
      refused = true;
      EXPECT_NE(std::string(e.what()).find("more than"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(refused);
  EXPECT_LE(stored, kMaxStoredBytes);
  // And it still serves.
  good.set("after", bytes("ok"));
  EXPECT_EQ(text(good.get("after")), "ok");
}

TEST(Store, AFloodOfSilentConnectionsOnlyDelaysTheRanks) {
  // More strangers than kMaxPendingConnections connect and say nothing: the server hangs up on each after
  // 10 s, and a rank that comes meanwhile waits in the listen backlog instead of being refused.
  StoreServer server("127.0.0.1", 0, "tok", 1);
  std::vector<int> silent;
  for (int i = 0; i < kMaxPendingConnections + 6; ++i) {
    const int fd = raw_connect(server.port());
    ASSERT_GE(fd, 0);
    silent.push_back(fd);
  }
  const auto start = std::chrono::steady_clock::now();
  StoreClient rank("127.0.0.1", server.port(), "tok", 0, 1, milliseconds(30000));
  rank.set("k", bytes("v"));
  EXPECT_EQ(text(rank.get("k")), "v");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(25));
  EXPECT_TRUE(closed_by_peer(silent.front(), milliseconds(1000)));
  for (int fd : silent) ::close(fd);
}

}  // namespace
}  // namespace pipetrain

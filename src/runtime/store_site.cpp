// find_or_host_store (transport_util.h): where the gloo and shm transports meet.
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

#include "transport_util.h"

namespace pipetrain::detail {

namespace {

// Whether every address of host:port refuses a TCP connection (nothing listens there for it): a probe of
// 2 s at most per address. Unresolvable, silent or reached: false (not known to be refused).
bool connection_refused(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || found == nullptr) return false;
  bool refused = true;
  for (addrinfo* a = found; a != nullptr && refused; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      refused = false;
      break;
    }
    int err = 0;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        err = ETIMEDOUT;
        if (::poll(&p, 1, 2000) == 1) {
          socklen_t len = sizeof err;
          if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = EIO;
        }
      }
    }
    ::close(fd);
    if (err != ECONNREFUSED) refused = false;
  }
  ::freeaddrinfo(found);
  return refused;
}

}  // namespace

StoreSite find_or_host_store(const Rendezvous& rv, int rank, int world_size) {
  StoreSite s;
  s.token = getenv_string("PIPETRAIN_RUN_TOKEN").value_or("");
  s.host = rv.master_addr;
  s.port = rv.master_port;
  const std::string master = rv.master_addr + ":" + std::to_string(rv.master_port);
  s.what = master + " (MASTER_ADDR:MASTER_PORT)";
  if (const auto hosted = getenv_string("PIPETRAIN_LAUNCHER_STORE")) {
    // pipetrain launch hosts the store (on another port than MASTER_PORT): every rank joins it.
    const auto colon = hosted->rfind(':');
    const auto p = colon == std::string::npos ? std::nullopt : parse_integer(hosted->substr(colon + 1));
    if (!p || *p < 1 || *p > 65535 || colon == 0)
      throw UsageError("PIPETRAIN_LAUNCHER_STORE=" + *hosted +
                       " is not HOST:PORT: it is set by pipetrain launch; unset it when starting ranks by hand");
    s.host = hosted->substr(0, colon);
    s.port = static_cast<int>(*p);
    s.what = *hosted + " (the launcher's store, PIPETRAIN_LAUNCHER_STORE)";
    s.launcher = true;
    return s;
  }
  if (rank != 0) return s;
  // Rank 0 hosts the store, on MASTER_ADDR's address only (PIPETRAIN_STORE_BIND overrides it).
  const auto bind = getenv_string("PIPETRAIN_STORE_BIND");
  const std::string bind_address = bind && !bind->empty() ? *bind : rv.master_addr;
  try {
    s.server = std::make_unique<StoreServer>(bind_address, rv.master_port, s.token, world_size);
  } catch (const std::exception& e) {
    throw std::runtime_error(
        "rank 0 could not host the rendezvous store at " + s.what + ": " + e.what() +
        ". If the port is taken, pick another MASTER_PORT; MASTER_ADDR must be an address of rank 0's host (or set "
        "PIPETRAIN_STORE_BIND to the address to listen on, e.g. 0.0.0.0 for every interface)");
  }
  const std::string bound = s.server->address();
  const bool loopback = bound.rfind("127.", 0) == 0 || bound == "::1";
  if (bind && !bind->empty()) {
    std::fprintf(stderr, "pipetrain rank 0: the rendezvous store listens on %s:%d (PIPETRAIN_STORE_BIND=%s)\n",
                 bound.c_str(), s.server->port(), bind->c_str());
    // Every rank, rank 0 too, joins at MASTER_ADDR: where that refuses, no one ever could (rank 0 waited the
    // whole rendezvous timeout for its own store, asking whether its first rank was running).
    if (connection_refused(rv.master_addr, s.server->port()))
      throw UsageError("rank 0 hosts the rendezvous store on " + bound + ":" + std::to_string(s.server->port()) +
                       " (PIPETRAIN_STORE_BIND=" + *bind + "), but MASTER_ADDR=" + rv.master_addr +
                       " does not reach it (connection refused), and every rank joins there: bind an address that "
                       "MASTER_ADDR leads to (0.0.0.0 for every IPv4 interface; :: is IPv6 only), or set MASTER_ADDR "
                       "to the store's address");
  }
  if (s.token.empty() && !loopback)
    std::fprintf(stderr,
                 "pipetrain rank 0: warning: PIPETRAIN_RUN_TOKEN is not set, so the rendezvous store at %s:%d "
                 "accepts any pipetrain rank that reaches it; set PIPETRAIN_RUN_TOKEN to the same secret on every "
                 "rank (pipetrain launch does this for you)\n",
                 bound.c_str(), s.server->port());
  return s;
}

}  // namespace pipetrain::detail

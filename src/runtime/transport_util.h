// Internal to pipetrain_runtime: pieces the transports share: environment parsing, the start-up fault
// hook for tests, how a message's tensor is described in errors, and matching queues per tag.
#pragma once

#include <ATen/ATen.h>
#include <signal.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

#include "pipetrain/core/error.h"

namespace pipetrain::detail {

inline std::optional<std::string> getenv_string(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

// The whole text as a decimal integer, or nothing.
inline std::optional<long long> parse_integer(const std::string& text) {
  long long value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end || text.empty()) return std::nullopt;
  return value;
}

// Seconds from an environment variable, or `fallback` when unset; a bad value is a UsageError.
inline std::chrono::milliseconds env_seconds(const char* name, std::chrono::milliseconds fallback) {
  const auto text = getenv_string(name);
  if (!text) return fallback;
  char* end = nullptr;
  const double s = std::strtod(text->c_str(), &end);
  if (text->empty() || *end != '\0' || !(s > 0) || s > 1e7)
    throw UsageError(std::string(name) + "=" + *text + " is not a number of seconds: set it to a number > 0 (default " +
                     std::to_string(fallback.count() / 1000) + ")");
  return std::chrono::milliseconds(static_cast<long long>(s * 1000));
}

// How long a transport's final barrier (its destructor) waits for the other ranks to finish before it
// names the ones that did not and goes: PIPETRAIN_FINAL_BARRIER_TIMEOUT seconds, default 30 min (a rank
// still working legitimately, say on a long evaluation, must not be cut short). Read at construction:
// the destructor must not throw.
inline std::chrono::milliseconds final_barrier_limit() {
  return env_seconds("PIPETRAIN_FINAL_BARRIER_TIMEOUT", std::chrono::minutes(30));
}

// "30 min", "2 s": a limit for messages.
inline std::string describe_limit(std::chrono::milliseconds limit) {
  const long long s = limit.count() / 1000;
  return s >= 60 && s % 60 == 0 ? std::to_string(s / 60) + " min" : std::to_string(s) + " s";
}

// Test hook: PIPETRAIN_RENDEZVOUS_FAULT="RANK:POINT[:SECONDS]" makes rank RANK wait SECONDS (default 0)
// and then SIGKILL itself at POINT of its rendezvous: "before-join" (before it connects to the store) or
// "after-join" (joined the store, before the transport connects). For the tests of a rank that dies
// during start-up.
inline void rendezvous_fault(int rank, const std::string& point) {
  const auto spec = getenv_string("PIPETRAIN_RENDEZVOUS_FAULT");
  if (!spec) return;
  const auto c1 = spec->find(':');
  const auto c2 = c1 == std::string::npos ? std::string::npos : spec->find(':', c1 + 1);
  const auto r = parse_integer(spec->substr(0, c1));
  const std::string where =
      c1 == std::string::npos ? "" : spec->substr(c1 + 1, c2 == std::string::npos ? c2 : c2 - c1 - 1);
  if (!r || (where != "before-join" && where != "after-join"))
    throw UsageError("PIPETRAIN_RENDEZVOUS_FAULT='" + *spec +
                     "' must read RANK:POINT[:SECONDS] with POINT before-join or after-join, e.g. 1:before-join:1");
  if (*r != rank || where != point) return;
  if (c2 != std::string::npos) {
    const double s = std::strtod(spec->c_str() + c2 + 1, nullptr);
    if (s > 0) std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<long long>(s * 1000)));
  }
  ::kill(::getpid(), SIGKILL);
}

inline int64_t byte_size(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// "Float [8, 16] (512 bytes)": a message's tensor in errors; at most `max_dims` sizes are shown.
inline std::string describe(c10::ScalarType dtype, const int64_t* sizes, int ndim, int64_t nbytes, int max_dims) {
  std::string s = std::string(c10::toString(dtype)) + " [";
  for (int i = 0; i < ndim; ++i) {
    if (i == max_dims) {
      s += ", ...";
      break;
    }
    s += (i ? ", " : "") + std::to_string(sizes[i]);
  }
  return s + "] (" + std::to_string(nbytes) + " bytes)";
}

// Messages or receives waiting per key ((source, tag) and the like), first in, first out: the oldest
// waiting for `key`, taken out, or nothing. A key whose queue empties is erased, so a program that uses
// new tags all the time does not grow the map (transport.h's contract).
template <class Map>
std::optional<typename Map::mapped_type::value_type> take_oldest(Map& waiting, const typename Map::key_type& key) {
  auto it = waiting.find(key);
  if (it == waiting.end()) return std::nullopt;
  auto oldest = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) waiting.erase(it);
  return oldest;
}

// A CPU, contiguous view of `t` (itself when it already is one; else a copy).
inline at::Tensor cpu_contiguous(const at::Tensor& t) {
  at::Tensor c = t.device().is_cpu() ? t : t.to(at::kCPU);
  return c.is_contiguous() ? c : c.contiguous();
}

}  // namespace pipetrain::detail

#include "pipetrain/runtime/store.h"
#include "pipetrain/runtime/transport.h"

namespace pipetrain::detail {

// Where a rank of a process transport finds pipetrain's rendezvous store: the launcher's
// (PIPETRAIN_LAUNCHER_STORE, set by pipetrain launch), else the one rank 0 hosts on MASTER_ADDR:MASTER_PORT
// (bound to MASTER_ADDR, or PIPETRAIN_STORE_BIND). On rank 0 without a launcher `server` is that store,
// started here; rank 0 warns when it listens beyond loopback without a run token. Throws UsageError for a
// malformed PIPETRAIN_LAUNCHER_STORE, runtime_error when the store cannot be hosted.
struct StoreSite {
  std::string host;
  int port = 0;
  std::string token;  // PIPETRAIN_RUN_TOKEN, or empty
  std::string what;   // the store as error messages name it
  bool launcher = false;  // the launcher's store (PIPETRAIN_LAUNCHER_STORE)
  std::unique_ptr<StoreServer> server;
};
StoreSite find_or_host_store(const Rendezvous& rv, int rank, int world_size);

// A local transport's group (make_local_transports) once a rank of it failed: that rank and its message;
// nullopt while none has, or for another kind of transport.
std::optional<std::pair<int, std::string>> local_transport_failure(const Transport& t);

}  // namespace pipetrain::detail

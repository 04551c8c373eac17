// Point-to-point ping-pong between ranks 0 and 1 of a process transport (transport.h): for each message
// size, the median round trip of --iters exchanges after --warmup, one thread per rank. Rank 0 prints
// one line per size: round trip, one-way time (half of it), one-way bandwidth, and this machine's memcpy
// bandwidth at that size (median of --iters copies between two fresh buffers, measured on rank 0 in the
// same run) with the ratio of the two.
//
//   build/pipetrain launch -n 2 -- build/bench/bench_transport --transport shm
//   build/pipetrain launch -n 2 -- build/bench/bench_transport --transport gloo
//   mpirun --allow-run-as-root --oversubscribe --mca btl self,vader --mca oob_tcp_if_include lo
//          -n 2 build/bench/bench_transport --transport mpi        (one command line)
//   build/pipetrain launch -n 2 -- build/bench/bench_transport --transport gloo-raw
//   build/pipetrain launch -n 2 -- build/bench/bench_transport --transport gloo --quick   (`make test`)
//
// gloo-raw is c10d::ProcessGroupGloo's send/recv without pipetrain's header and watchdog: what the
// size check costs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "pipetrain/runtime/transport.h"
#include "torch_compat.h"

#include "bench_util.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Pair {
  int rank = 0;
  std::function<void(at::Tensor&, int, int)> send, recv;
};

using pipetrain::bench::median;

// memcpy bandwidth (GB/s) between two buffers of `bytes`, median of `iters` copies after `warmup`.
double memcpy_gbs(long long bytes, int warmup, int iters) {
  if (bytes <= 0) return 0;
  std::vector<char> a(static_cast<std::size_t>(bytes), 1), b(static_cast<std::size_t>(bytes), 2);
  std::vector<double> us;
  const long long reps = std::max(1LL, (1LL << 20) / bytes);  // small sizes: time a run of copies
  for (int i = 0; i < warmup + iters; ++i) {
    const auto t0 = Clock::now();
    for (long long k = 0; k < reps; ++k) {
      std::memcpy(b.data(), a.data(), a.size());
      a[static_cast<std::size_t>(k) % a.size()] ^= b[0];
    }
    const double d = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / static_cast<double>(reps);
    if (i >= warmup) us.push_back(d);
  }
  return static_cast<double>(bytes) / median(us) / 1e3;
}

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s --transport shm|gloo|mpi|gloo-raw [--iters N (50)] [--warmup N (5)] [--sizes BYTES,...] [--quick]\n"
               "--quick (the `make test` run): sizes 4096,65536, 5 iterations, 1 warm-up (later flags still apply)\n"
               "run as two ranks, e.g. pipetrain launch -n 2 -- %s --transport gloo\n",
               argv0, argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string transport;
  int iters = 50, warmup = 5;
  std::vector<long long> sizes = {4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      sizes = {4 << 10, 64 << 10};
      iters = 5;
      warmup = 1;
      continue;
    }
    if (i + 1 >= argc) return usage(argv[0]);
    const std::string v = argv[++i];
    if (a == "--transport") transport = v;
    else if (a == "--iters") iters = std::atoi(v.c_str());
    else if (a == "--warmup") warmup = std::atoi(v.c_str());
    else if (a == "--sizes") {
      sizes.clear();
      for (size_t b = 0; b <= v.size();) {
        size_t e = v.find(',', b);
        if (e == std::string::npos) e = v.size();
        sizes.push_back(std::atoll(v.substr(b, e - b).c_str()));
        b = e + 1;
      }
    } else return usage(argv[0]);
  }
  if (transport.empty() || iters < 1) return usage(argv[0]);
  at::set_num_threads(1);

  std::shared_ptr<pipetrain::Transport> t;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
  c10::intrusive_ptr<c10d::TCPStore> store;
  Pair p;
  if (transport == "gloo-raw") {
    const pipetrain::Rendezvous rv = pipetrain::Rendezvous::from_environment();
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(rv.master_port);
    so.isServer = rv.rank == 0;
    so.numWorkers = rv.world_size;
    store = pipetrain::compat::make_tcp_store<c10d::TCPStore>(rv.master_addr, so);
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(rv.master_addr));
    options->threads = 1;
    pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rv.rank, rv.world_size, options);
    p.rank = rv.rank;
    p.send = [&](at::Tensor& x, int dst, int tag) {
      std::vector<at::Tensor> v{x};
      pg->send(v, dst, tag)->wait();
    };
    p.recv = [&](at::Tensor& x, int src, int tag) {
      std::vector<at::Tensor> v{x};
      pg->recv(v, src, tag)->wait();
    };
  } else {
    t = pipetrain::make_process_transport(transport);
    p.rank = t->rank();
    p.send = [&](at::Tensor& x, int dst, int tag) { t->send(x, dst, tag); };
    p.recv = [&](at::Tensor& x, int src, int tag) { t->recv(x, src, tag); };
  }
  if (p.rank == 0)
    std::printf("%-9s %10s %12s %12s %10s %12s %8s %12s\n", "transport", "bytes", "rtt_us", "one_way_us", "GB/s",
                "memcpy_GB/s", "ratio", "max_rtt_us");
  for (long long bytes : sizes) {
    at::Tensor x = at::ones({bytes / 4}, at::kFloat);
    std::vector<double> rtt;
    for (int i = 0; i < warmup + iters; ++i) {
      if (p.rank == 0) {
        const auto t0 = Clock::now();
        p.send(x, 1, 7);
        p.recv(x, 1, 7);
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (i >= warmup) rtt.push_back(us);
      } else if (p.rank == 1) {
        p.recv(x, 0, 7);
        p.send(x, 0, 7);
      }
    }
    if (p.rank == 0) {
      const double m = median(rtt);
      const double gbs = static_cast<double>(bytes) / (m / 2) / 1e3;
      const double copy = memcpy_gbs(bytes, warmup, iters);
      std::printf("%-9s %10lld %12.2f %12.2f %10.2f %12.2f %8.2f %12.1f\n", transport.c_str(), bytes, m, m / 2, gbs, copy,
                  gbs / copy, *std::max_element(rtt.begin(), rtt.end()));
      std::fflush(stdout);
    }
  }
  if (pg) {  // a last exchange so neither rank tears the store down under the other
    pg->barrier()->wait();
  }
  return 0;
}

// Internal to pipetrain_runtime (torch-free): the waiting primitives of the shm transport, shared with
// bench/wake_handoff.cpp so that the benchmark measures the very calls the transport makes.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>

namespace pipetrain::detail {

// Sleeps while *word == expected, for at most `timeout` (spurious and early returns are the caller's
// to handle: it re-checks what it waits for).
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::milliseconds timeout) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  ts.tv_nsec = static_cast<long>((timeout.count() % 1000) * 1000000);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

// Wakes every thread sleeping on `word`, in any process that maps it.
inline void futex_wake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// One step of a spin-wait: tells the core this thread is spinning.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace pipetrain::detail

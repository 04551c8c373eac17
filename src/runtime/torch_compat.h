// What differs between the LibTorch versions pipetrain builds against (1.13, 2.6, 2.11), in one place.
// Internal (not installed); the runtime and its tests include it instead of spelling a version's API.
//
// - The optimizer state (torch::optim::Optimizer::state()) is keyed by the parameter's TensorImpl: in 1.x
//   by the pointer's text (as an ostream writes it), since 2.0 by the pointer itself (void*).
//   optimizer_state_key() gives the key either way.
// - c10d::Store gained a pure virtual clone() (2.11 has it, 2.6 not): StoreClient declares clone() as a
//   plain virtual, which overrides it where it exists and is an unused extra elsewhere
//   (runtime/store.h); store.cpp asserts that StoreClient is not abstract on every version.
// - c10d::TCPStoreOptions gained useLibUV (true by default in 2.x); a LibTorch built without libuv
//   (Debian 13's 2.6) then refuses to make any TCPStore, client or server. make_tcp_store() asks for
//   the default first and, refused for that reason, makes the store without libuv.
// - Torch's bundled fmt (fmt 11 in pip's 2.x) needs <fmt/ranges.h> for fmt::join: include it wherever
//   fmt::join is used (Debian's fmt 9 has it in both headers).
// - c10::Event::elapsedTime (2.x; not in 1.13): event_elapsed_ms() where it exists. A CUDA build of 1.13
//   times a rank's actions with the host clock after synchronising its stream instead (device.cpp).
// - The device allocator's statistics through c10 (c10::getDeviceAllocator(type)->getDeviceStats(i), in
//   the 2.x releases since 2.9; 2.6 has the DeviceStats struct but no way to reach it without CUDA
//   headers): device_allocator_peaks() gives nothing where it is absent. Defining
//   PIPETRAIN_NO_DEVICE_ALLOCATOR_STATS leaves it out on any version.
// - Autocast's switches: 1.13 has one function per device (set_enabled for CUDA, set_cpu_enabled, ...);
//   2.4 on take the device type (set_autocast_enabled(type, ...)), and the old names are deprecated.
//   AutocastGuard and autocast_dtype() speak both.
// - Hooks on an autograd node: 1.x keeps those of Tensor::register_hook among the node's pre_hooks(),
//   2.x in tensor_pre_hooks() and retains_grad_hooks(). clear_pre_hooks() removes them all (the B/W split
//   through autograd, autograd_split.cpp, so that W does not run a tensor's hook a second time).
// - c10d::ProcessGroupNCCL (the nccl transport, CUDA builds of 2.x only): shutdown() (2.3 on) ends its
//   communicators and watchdog in order; a group destroyed without it warns, and before 2.3 there is
//   nothing to call. shutdown_process_group() calls it where it exists.
// pipetrain does nothing else differently per version; losses then agree to float32 rounding across
// versions (LibTorch's own kernels differ), and bitwise within one.
#pragma once

#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>

#include <c10/core/Event.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <string>
#include <type_traits>
#include <utility>

#if TORCH_VERSION_MAJOR < 2
#include <sstream>
#endif
#if __has_include(<c10/core/CachingDeviceAllocator.h>)
#include <c10/core/CachingDeviceAllocator.h>
#endif

#include <cstddef>
#include <cstdint>
#include <optional>

namespace pipetrain::compat {

// The key type of this LibTorch's optimizer state map.
using OptimizerStateKey =
    typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

// The key under which `optimizer.state()` keeps parameter `p`'s state.
inline OptimizerStateKey optimizer_state_key(const at::Tensor& p) {
#if TORCH_VERSION_MAJOR < 2
  // 1.x's optimizers key by the pointer's text as an ostream writes it (what their to_string helper
  // does); written out here, as that helper is gone from 2.x's headers.
  std::ostringstream text;
  text << static_cast<const void*>(p.unsafeGetTensorImpl());
  return text.str();
#else
  return static_cast<void*>(p.unsafeGetTensorImpl());
#endif
}

template <class Options, class = void>
struct HasUseLibUV : std::false_type {};
template <class Options>
struct HasUseLibUV<Options, std::void_t<decltype(std::declval<Options&>().useLibUV)>> : std::true_type {};

// c10::make_intrusive<Store>(host, options) for Store = c10d::TCPStore (a template, so that this header
// needs no c10d headers), without libuv where this LibTorch has none.
template <class Store, class Options>
c10::intrusive_ptr<Store> make_tcp_store(const std::string& host, Options options) {
  try {
    return c10::make_intrusive<Store>(host, options);
  } catch (const c10::Error& e) {
    if constexpr (HasUseLibUV<Options>::value) {
      if (options.useLibUV && std::string(e.what()).find("without libuv") != std::string::npos) {
        options.useLibUV = false;
        return c10::make_intrusive<Store>(host, options);
      }
    }
    throw;
  }
}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define PIPETRAIN_AUTOCAST_BY_DEVICE_TYPE 1
#endif

// The dtype autocast casts to on `type` (kCPU or kCUDA) on this thread, or nothing while it is off there.
inline std::optional<at::ScalarType> autocast_dtype(c10::DeviceType type) {
#ifdef PIPETRAIN_AUTOCAST_BY_DEVICE_TYPE
  if (!at::autocast::is_autocast_enabled(type)) return std::nullopt;
  return at::autocast::get_autocast_dtype(type);
#else
  if (type == c10::DeviceType::CPU)
    return at::autocast::is_cpu_enabled() ? std::optional<at::ScalarType>(at::autocast::get_autocast_cpu_dtype())
                                          : std::nullopt;
  if (type == c10::DeviceType::CUDA)
    return at::autocast::is_enabled() ? std::optional<at::ScalarType>(at::autocast::get_autocast_gpu_dtype())
                                      : std::nullopt;
  return std::nullopt;
#endif
}

// Autocast to `dtype` on `type` for this thread while it lives (nothing when `dtype` is empty); the
// previous state comes back after, and the cache of cast weights is emptied when the outermost guard ends
// (the weights change at the next optimizer step).
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType type, std::optional<at::ScalarType> dtype) : type_(type), active_(dtype.has_value()) {
    if (!active_) return;
    previous_ = autocast_dtype(type);
    set(true, *dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!active_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    if (previous_) set(true, *previous_);
    else set(false, at::kBFloat16);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  void set(bool on, at::ScalarType dtype) {
#ifdef PIPETRAIN_AUTOCAST_BY_DEVICE_TYPE
    at::autocast::set_autocast_enabled(type_, on);
    if (on) at::autocast::set_autocast_dtype(type_, dtype);
#else
    if (type_ == c10::DeviceType::CPU) {
      at::autocast::set_cpu_enabled(on);
      if (on) at::autocast::set_autocast_cpu_dtype(dtype);
    } else {
      at::autocast::set_enabled(on);
      if (on) at::autocast::set_autocast_gpu_dtype(dtype);
    }
#endif
  }
  c10::DeviceType type_;
  bool active_;
  std::optional<at::ScalarType> previous_;
};

template <class E, class = void>
struct HasElapsedTime : std::false_type {};
template <class E>
struct HasElapsedTime<E, std::void_t<decltype(std::declval<const E&>().elapsedTime(std::declval<const E&>()))>>
    : std::true_type {};

// Whether c10::Event reads the time between two recorded events (made with EventFlag::BACKEND_DEFAULT).
inline constexpr bool kEventElapsedTime = HasElapsedTime<c10::Event>::value;

// Milliseconds from event `from` to event `to` (both recorded and complete); 0 where kEventElapsedTime is false.
template <class E>
double event_elapsed_ms(const E& from, const E& to) {
  if constexpr (HasElapsedTime<E>::value) return from.elapsedTime(to);
  else return 0.0;
}

namespace allocator_probe {
// Chosen only where c10 has no getDeviceAllocator(DeviceType), which argument-dependent lookup finds
// (an exact match beats the ellipsis).
inline std::nullptr_t getDeviceAllocator(...) { return nullptr; }
inline auto find(c10::DeviceType type) {
#ifdef PIPETRAIN_NO_DEVICE_ALLOCATOR_STATS
  return getDeviceAllocator(0);
#else
  return getDeviceAllocator(type);
#endif
}
struct AllocatorBytes {
  int64_t allocated = 0, peak_allocated = 0, peak_reserved = 0;
};
template <class A>
std::optional<AllocatorBytes> peaks(A* allocator, c10::DeviceIndex index) {
  const auto stats = allocator->getDeviceStats(index);
  AllocatorBytes b;  // [0]: every pool together
  b.allocated = static_cast<int64_t>(stats.allocated_bytes[0].current);
  b.peak_allocated = static_cast<int64_t>(stats.allocated_bytes[0].peak);
  b.peak_reserved = static_cast<int64_t>(stats.reserved_bytes[0].peak);
  return b;
}
inline std::optional<AllocatorBytes> peaks(std::nullptr_t, c10::DeviceIndex) { return std::nullopt; }
template <class A>
bool reset(A* allocator, c10::DeviceIndex index) {
  allocator->resetPeakStats(index);
  return true;
}
inline bool reset(std::nullptr_t, c10::DeviceIndex) { return false; }
}  // namespace allocator_probe

// The device allocator's bytes in tensors now, and its peaks (allocated, reserved), on device `index` of
// `type`, where c10 offers them.
inline std::optional<allocator_probe::AllocatorBytes> device_allocator_peaks(c10::DeviceType type,
                                                                             c10::DeviceIndex index) {
  return allocator_probe::peaks(allocator_probe::find(type), index);
}
// Resets those peaks; false where c10 offers none.
inline bool reset_device_allocator_peaks(c10::DeviceType type, c10::DeviceIndex index) {
  return allocator_probe::reset(allocator_probe::find(type), index);
}

// Removes every pre-hook of autograd node `node` (a torch::autograd::Node; a template, so that this
// header needs no autograd headers).
template <class Node>
void clear_pre_hooks(Node& node) {
  node.pre_hooks().clear();
#if TORCH_VERSION_MAJOR >= 2
  node.tensor_pre_hooks().clear();
  node.retains_grad_hooks().clear();
#endif
}

// Ends a c10d process group's communicators in order where the group has shutdown() (ProcessGroupNCCL
// since 2.3); elsewhere nothing (its destructor does what that version does).
template <class PG, class = void>
struct HasShutdown : std::false_type {};
template <class PG>
struct HasShutdown<PG, std::void_t<decltype(std::declval<PG&>().shutdown())>> : std::true_type {};
template <class PG>
void shutdown_process_group(PG& pg) {
  if constexpr (HasShutdown<PG>::value) pg.shutdown();
}

}  // namespace pipetrain::compat

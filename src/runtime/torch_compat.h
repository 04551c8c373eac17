// What differs between the LibTorch versions pipetrain builds against (1.13, 2.6, 2.11), in one place.
// Internal (not installed); the runtime and its tests include it instead of spelling a version's API.
//
// - The optimizer state (torch::optim::Optimizer::state()) is keyed by the parameter's TensorImpl: in 1.x
//   by its text (c10::guts::to_string of the pointer), since 2.0 by the pointer itself (void*), and
//   c10::guts::to_string is gone. optimizer_state_key() gives the key either way.
// - c10d::Store gained a pure virtual clone() (2.11 has it, 2.6 not): StoreClient declares clone() as a
//   plain virtual, which overrides it where it exists and is an unused extra elsewhere
//   (runtime/store.h); store.cpp asserts that StoreClient is not abstract on every version.
// - c10d::TCPStoreOptions gained useLibUV (true by default in 2.x); a LibTorch built without libuv
//   (Debian 13's 2.6) then refuses to make any TCPStore, client or server. make_tcp_store() asks for
//   the default first and, refused for that reason, makes the store without libuv.
// - Torch's bundled fmt (fmt 11 in pip's 2.x) needs <fmt/ranges.h> for fmt::join: include it wherever
//   fmt::join is used (Debian's fmt 9 has it in both headers).
// - Hooks on an autograd node: 1.x keeps those of Tensor::register_hook among the node's pre_hooks(),
//   2.x in tensor_pre_hooks() and retains_grad_hooks(). clear_pre_hooks() removes them all (the B/W split
//   through autograd, autograd_split.cpp, so that W does not run a tensor's hook a second time).
// pipetrain does nothing else differently per version; losses then agree to float32 rounding across
// versions (LibTorch's own kernels differ), and bitwise within one.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <string>
#include <type_traits>
#include <utility>

#if TORCH_VERSION_MAJOR < 2
#include <c10/util/C++17.h>  // c10::guts::to_string
#endif

namespace pipetrain::compat {

// The key type of this LibTorch's optimizer state map.
using OptimizerStateKey =
    typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

// The key under which `optimizer.state()` keeps parameter `p`'s state.
inline OptimizerStateKey optimizer_state_key(const at::Tensor& p) {
#if TORCH_VERSION_MAJOR < 2
  return c10::guts::to_string(p.unsafeGetTensorImpl());
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

}  // namespace pipetrain::compat

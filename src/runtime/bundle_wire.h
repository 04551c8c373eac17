// Internal to pipetrain_runtime: how a bundle (runtime/bundle.h) crosses a stage boundary. One header
// message describes the entries (name, dtype, shape, whether a gradient comes back); the data travels as
// one message: the tensor itself when the bundle has one entry, else one byte buffer holding every entry
// at an aligned offset, which the receiver views without copying.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

#include "pipetrain/runtime/bundle.h"

namespace pipetrain::detail {

struct EntryLayout {
  std::string name;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  bool grad = false;  // a gradient of this entry comes back

  friend bool operator==(const EntryLayout& a, const EntryLayout& b) {
    return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.grad == b.grad;
  }
};

struct BundleLayout {
  std::vector<EntryLayout> entries;
  friend bool operator==(const BundleLayout& a, const BundleLayout& b) { return a.entries == b.entries; }
  friend bool operator!=(const BundleLayout& a, const BundleLayout& b) { return !(a == b); }
};

// The header message's length in int64s: names, dtypes and shapes of all entries must fit.
inline constexpr int kBundleHeaderLen = 256;

// The layout of `b`; `grad[k]` says whether entry k gets a gradient back (empty: none does).
BundleLayout layout_of(const Bundle& b, const std::vector<char>& grad);
// True if `b` (with those flags) has exactly layout `l` (no allocation: the per-transfer check).
bool matches(const BundleLayout& l, const Bundle& b, const std::vector<char>& grad);
// "{x: [8, 16] Float (grad), mask: [8, 16] Bool}".
std::string describe(const BundleLayout& l);

// The header message; throws UsageError when the layout does not fit (names too long, too many entries).
torch::Tensor encode_header(const BundleLayout& l);
// Throws std::runtime_error on a malformed header (a peer speaking another protocol).
BundleLayout decode_header(const torch::Tensor& header);

// `t` cut from its autograd graph, for sending (a send that is kept until it completes must not keep
// the graph alive): `t` itself when it has none; else an alias of its data made without an operator call
// (variable_data: the alias does not share t's version counter, which nothing that sends it reads).
inline torch::Tensor without_graph(const torch::Tensor& t) { return t.requires_grad() ? t.variable_data() : t; }

// The data message of `b` (laid out as `l`) and the buffer that receives it.
torch::Tensor pack(const Bundle& b, const BundleLayout& l);
torch::Tensor empty_buffer(const BundleLayout& l);
// The entries of a received buffer (views of it; the buffer stays alive as long as they do).
Bundle unpack(const torch::Tensor& buffer, const BundleLayout& l);

}  // namespace pipetrain::detail

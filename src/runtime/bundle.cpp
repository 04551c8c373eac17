#include "pipetrain/runtime/bundle.h"

#include <cstring>

#include "bundle_wire.h"
#include "pass_util.h"
#include "pipetrain/core/error.h"

namespace pipetrain {

Bundle::Bundle(torch::Tensor x) { items_.emplace_back(kMainTensor, std::move(x)); }

Bundle::Bundle(std::initializer_list<Item> items) {
  for (const auto& [name, t] : items) {
    if (has(name)) throw UsageError("bundle entry '" + name + "' is given twice: give each name once");
    items_.emplace_back(name, t);
  }
}

bool Bundle::has(const std::string& name) const {
  for (const auto& item : items_)
    if (item.first == name) return true;
  return false;
}

const torch::Tensor& Bundle::at(const std::string& name) const {
  for (const auto& item : items_)
    if (item.first == name) return item.second;
  throw UsageError("the bundle has no entry '" + name + "'; it holds " + describe(*this) +
                   ": give it in the input bundle or add it in an earlier layer (a skip's name must be declared in "
                   "the stashes() of the layer that adds it)");
}

void Bundle::set(const std::string& name, torch::Tensor t) {
  for (auto& item : items_)
    if (item.first == name) {
      item.second = std::move(t);
      return;
    }
  items_.emplace_back(name, std::move(t));
}

torch::Tensor Bundle::take(const std::string& name) {
  for (auto it = items_.begin(); it != items_.end(); ++it)
    if (it->first == name) {
      torch::Tensor t = std::move(it->second);
      items_.erase(it);
      return t;
    }
  return {};
}

std::vector<std::string> Bundle::names() const {
  std::vector<std::string> out;
  for (const auto& item : items_) out.push_back(item.first);
  return out;
}

Bundle Bundle::slice(int64_t begin, int64_t end) const {
  Bundle out;
  for (const auto& [name, t] : items_) {
    if (!t.defined())  // LibTorch said only "Expected a proper Tensor but got None ... argument #0 'self'"
      throw UsageError("bundle entry '" + name + "' is an undefined tensor; every entry of a batch needs one row per "
                       "sample (fill it, or leave the entry out)");
    if (t.dim() == 0)
      throw UsageError("bundle entry '" + name + "' is a scalar; every entry of a batch needs one row per sample "
                       "(expand it to [N, ...])");
    out.items_.emplace_back(name, t.slice(0, begin, end));
  }
  return out;
}

Bundle Bundle::to(const torch::Device& device) const {
  Bundle out;
  out.items_.reserve(items_.size());
  for (const auto& [name, t] : items_)  // a tensor already there is kept as is: no operator call
    out.items_.emplace_back(name, t.defined() && t.device() != device ? t.to(device) : t);
  return out;
}

std::string describe(const Bundle& b) {
  std::string s = "{";
  for (const auto& [name, t] : b.items()) {
    s += (s.size() > 1 ? ", " : "") + name + ": ";
    s += t.defined() ? detail::shape_text(t.sizes().vec(), t.scalar_type()) : std::string("undefined");
  }
  return s + "}";
}

}  // namespace pipetrain

// ---- wire format (bundle_wire.h) ----------------------------------------------------------------------
namespace pipetrain::detail {

namespace {

constexpr int64_t kAlign = 64;  // byte offset of every entry in a packed buffer

int64_t entry_bytes(const EntryLayout& e) {
  int64_t n = 1;
  for (int64_t d : e.shape) n *= d;
  return n * static_cast<int64_t>(c10::elementSize(e.dtype));
}

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

int64_t packed_bytes(const BundleLayout& l) {
  int64_t total = 0;
  for (const auto& e : l.entries) total = aligned(total) + entry_bytes(e);
  return total;
}

}  // namespace

BundleLayout layout_of(const Bundle& b, const std::vector<char>& grad) {
  BundleLayout l;
  std::size_t k = 0;
  for (const auto& [name, t] : b.items()) {
    l.entries.push_back(EntryLayout{name, t.scalar_type(), t.sizes().vec(), k < grad.size() && grad[k] != 0});
    ++k;
  }
  return l;
}

bool matches(const BundleLayout& l, const Bundle& b, const std::vector<char>& grad) {
  if (l.entries.size() != b.size()) return false;
  for (std::size_t k = 0; k < b.size(); ++k) {
    const EntryLayout& e = l.entries[k];
    const auto& [name, t] = b.items()[k];
    const bool g = k < grad.size() && grad[k] != 0;
    if (e.name != name || e.dtype != t.scalar_type() || e.grad != g || t.sizes() != c10::IntArrayRef(e.shape))
      return false;
  }
  return true;
}

std::string describe(const BundleLayout& l) {
  std::string s = "{";
  for (const auto& e : l.entries) {
    s += (s.size() > 1 ? ", " : "") + e.name + ": " + shape_text(e.shape, e.dtype);
    if (e.grad) s += " (grad)";
  }
  return s + "}";
}

// Header: [entries, then per entry: name length, dtype, grad, dims, sizes..., name bytes packed 8 per int64].
torch::Tensor encode_header(const BundleLayout& l) {
  std::vector<int64_t> h{static_cast<int64_t>(l.entries.size())};
  for (const auto& e : l.entries) {
    h.push_back(static_cast<int64_t>(e.name.size()));
    h.push_back(static_cast<int64_t>(e.dtype));
    h.push_back(e.grad ? 1 : 0);
    h.push_back(static_cast<int64_t>(e.shape.size()));
    h.insert(h.end(), e.shape.begin(), e.shape.end());
    for (std::size_t at = 0; at < e.name.size(); at += 8) {
      uint64_t word = 0;
      for (std::size_t c = 0; c < 8 && at + c < e.name.size(); ++c)
        word |= static_cast<uint64_t>(static_cast<unsigned char>(e.name[at + c])) << (8 * c);
      h.push_back(static_cast<int64_t>(word));
    }
  }
  if (h.size() > static_cast<std::size_t>(kBundleHeaderLen))
    throw UsageError("the bundle " + describe(l) + " needs a header of " + std::to_string(h.size()) +
                     " words, more than the " + std::to_string(kBundleHeaderLen) +
                     " a boundary carries: send fewer entries or shorter names");
  torch::Tensor out = torch::zeros({kBundleHeaderLen}, torch::kLong);
  std::copy(h.begin(), h.end(), out.data_ptr<int64_t>());
  return out;
}

BundleLayout decode_header(const torch::Tensor& header) {
  const int64_t* h = header.data_ptr<int64_t>();
  const int64_t n = header.numel();
  int64_t at = 0;
  auto next = [&]() -> int64_t {
    if (at >= n) throw std::runtime_error("malformed bundle header from a peer (truncated)");
    return h[at++];
  };
  BundleLayout l;
  const int64_t entries = next();
  if (entries < 0 || entries > kBundleHeaderLen) throw std::runtime_error("malformed bundle header from a peer");
  for (int64_t k = 0; k < entries; ++k) {
    EntryLayout e;
    const int64_t len = next();
    e.dtype = static_cast<c10::ScalarType>(next());
    e.grad = next() != 0;
    const int64_t dims = next();
    if (len < 0 || len > 8 * kBundleHeaderLen || dims < 0 || dims > kBundleHeaderLen)
      throw std::runtime_error("malformed bundle header from a peer");
    for (int64_t d = 0; d < dims; ++d) e.shape.push_back(next());
    for (int64_t c = 0; c < len; c += 8) {
      const auto word = static_cast<uint64_t>(next());
      for (int64_t j = 0; j < 8 && c + j < len; ++j) e.name.push_back(static_cast<char>((word >> (8 * j)) & 0xff));
    }
    l.entries.push_back(std::move(e));
  }
  return l;
}

torch::Tensor pack(const Bundle& b, const BundleLayout& l) {
  if (b.size() == 1) return without_graph(b.items().front().second).contiguous();
  torch::Tensor buf = torch::empty({packed_bytes(l)}, torch::kByte);
  auto* base = static_cast<char*>(buf.data_ptr());
  int64_t at = 0;
  for (std::size_t k = 0; k < b.size(); ++k) {
    at = aligned(at);
    const torch::Tensor t = without_graph(b.items()[k].second).to(torch::kCPU).contiguous();
    const int64_t n = entry_bytes(l.entries[k]);
    if (n > 0) std::memcpy(base + at, t.data_ptr(), static_cast<std::size_t>(n));
    at += n;
  }
  return buf;
}

torch::Tensor empty_buffer(const BundleLayout& l) {
  if (l.entries.size() == 1)
    return torch::empty(l.entries.front().shape, torch::TensorOptions().dtype(l.entries.front().dtype));
  return torch::empty({packed_bytes(l)}, torch::kByte);
}

Bundle unpack(const torch::Tensor& buffer, const BundleLayout& l) {
  Bundle out;
  if (l.entries.size() == 1) {
    out.set(l.entries.front().name, buffer);
    return out;
  }
  auto* base = static_cast<char*>(buffer.data_ptr());
  int64_t at = 0;
  for (const auto& e : l.entries) {
    at = aligned(at);
    torch::Tensor keep = buffer;  // the views own a reference to the buffer
    out.set(e.name, torch::from_blob(base + at, e.shape, [keep](void*) mutable { keep = torch::Tensor(); },
                                     torch::TensorOptions().dtype(e.dtype)));
    at += entry_bytes(e);
  }
  return out;
}

}  // namespace pipetrain::detail

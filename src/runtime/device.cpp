#include "pipetrain/runtime/device.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include "bundle_wire.h"
#include "device_context.h"
#include "pass_util.h"
#include "torch_compat.h"

namespace pipetrain {

std::optional<DeviceMemory> device_memory_peak(const torch::Device& device) {
  if (device.is_cpu()) return std::nullopt;
  try {
    const c10::DeviceIndex index = device.has_index() ? device.index() : 0;
    const auto peaks = compat::device_allocator_peaks(device.type(), index);
    if (!peaks) return std::nullopt;
    return DeviceMemory{peaks->allocated, peaks->peak_allocated, peaks->peak_reserved};
  } catch (const c10::Error&) {  // an allocator that keeps no statistics
    return std::nullopt;
  }
}

void reset_device_memory_peak(const torch::Device& device) {
  if (device.is_cpu()) return;
  try {
    compat::reset_device_allocator_peaks(device.type(), device.has_index() ? device.index() : 0);
  } catch (const c10::Error&) {
  }
}

double memory_in_use(const torch::Device& device) {
  if (const auto m = device_memory_peak(device)) return static_cast<double>(m->allocated);
  return detail::heap_in_use();
}

bool device_memory_measured(const torch::Device& device) { return device_memory_peak(device).has_value(); }

bool device_event_timing(const torch::Device& device) { return device.is_cuda() && compat::kEventElapsedTime; }

namespace detail {

RankDevice::RankDevice(const torch::Device& device) : device_(device) {
  if (!device.is_cuda()) return;
  const torch::Device d(device.type(), device.has_index() ? device.index() : 0);
  device_ = d;
  // A stream of its own, so that ranks in one process (threads sharing a GPU, or a process driving
  // several GPUs) never serialise on the default stream.
  stream_ = c10::impl::VirtualGuardImpl(d.type()).getStreamFromGlobalPool(d, /*isHighPriority=*/false);
  events_ = compat::kEventElapsedTime;
}

RankDevice::Scope::Scope(const RankDevice& d) : d_(d) {
  if (!d.stream_) return;
  // The rank's stream first waits for what the caller queued before (a checkpoint's weights copied in,
  // inputs made on the default stream).
  const c10::impl::VirtualGuardImpl impl(d.device_.type());
  const c10::Stream caller = impl.getStream(d.device_);
  if (caller != *d.stream_) {
    c10::Event ready(d.device_.type());
    ready.record(caller);
    ready.block(*d.stream_);
  }
  guard_.reset_stream(*d.stream_);
}

RankDevice::Scope::~Scope() {
  if (!d_.stream_) return;
  try {
    d_.stream_->synchronize();
  } catch (...) {  // a failed kernel reports itself through the work that waits on it; never throw here
  }
}

c10::Event& RankDevice::event(std::size_t k) {
  while (pool_.size() <= k) pool_.emplace_back(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
  return pool_[k];
}

void RankDevice::begin_timing() {
  marks_.clear();
  host_ms_.clear();
  used_ = 0;
  if (!stream_) return;
  stream_->synchronize();  // the anchor: the device is idle, so its clock and the host's meet here
  if (events_) event(used_++).record(*stream_);
  anchor_host_ms_ = now_ms();
}

std::size_t RankDevice::start_action() {
  const std::size_t handle = marks_.size();
  if (!stream_) {
    marks_.emplace_back(host_ms_.size(), host_ms_.size());
    host_ms_.push_back(now_ms());
  } else if (events_) {
    event(used_).record(*stream_);
    marks_.emplace_back(used_, used_);
    ++used_;
  } else {  // no elapsed times from events: wait for the stream, then read the host clock
    stream_->synchronize();
    marks_.emplace_back(host_ms_.size(), host_ms_.size());
    host_ms_.push_back(now_ms());
  }
  return handle;
}

void RankDevice::end_action(std::size_t handle) {
  auto& mark = marks_.at(handle);
  if (stream_ && events_) {
    event(used_).record(*stream_);
    mark.second = used_++;
    return;
  }
  if (stream_) stream_->synchronize();
  mark.second = host_ms_.size();
  host_ms_.push_back(now_ms());
}

std::vector<std::pair<double, double>> RankDevice::finish_timing() {
  std::vector<std::pair<double, double>> out;
  out.reserve(marks_.size());
  if (stream_ && events_) {
    stream_->synchronize();
    const c10::Event& anchor = pool_.front();
    for (const auto& [a, b] : marks_)
      out.emplace_back(anchor_host_ms_ + compat::event_elapsed_ms(anchor, pool_[a]),
                       anchor_host_ms_ + compat::event_elapsed_ms(anchor, pool_[b]));
  } else {
    for (const auto& [a, b] : marks_) out.emplace_back(host_ms_[a], host_ms_[b]);
  }
  return out;
}

void RankDevice::hand_over(const torch::Tensor& t) const {
  if (!stream_ || !t.defined() || !t.device().is_cuda() || !t.has_storage()) return;
  const c10::impl::VirtualGuardImpl impl(t.device().type());
  const c10::Stream current = impl.getStream(t.device());
  if (current == *stream_) return;
  impl.recordDataPtrOnStream(t.storage().data_ptr(), current);
}

torch::Tensor RankDevice::place(const torch::Tensor& t) const { return t.device() == device_ ? t : t.to(device_); }

Bundle RankDevice::place(const Bundle& b) const { return b.to(device_); }

torch::Tensor RankDevice::receive_buffer(const BundleLayout& l, bool transport_carries_device_tensors) const {
  if (l.entries.size() == 1 && !device_.is_cpu() && transport_carries_device_tensors)
    return torch::empty(l.entries.front().shape, torch::TensorOptions().dtype(l.entries.front().dtype).device(device_));
  return empty_buffer(l);
}

torch::Tensor RankDevice::sendable(const torch::Tensor& t, bool transport_carries_device_tensors) const {
  return t.device().is_cpu() || transport_carries_device_tensors ? t : t.cpu();
}

}  // namespace detail
}  // namespace pipetrain

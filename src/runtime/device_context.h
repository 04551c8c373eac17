// A pipeline rank's device (internal; the public part is pipetrain/runtime/device.h): what the executor's
// interpreter does differently per device, behind one interface. On CUDA: the rank's own stream from
// LibTorch's pool, event-based timing of its actions, received tensors on the GPU where the transport
// carries device tensors. On the CPU: no stream, the host clock, host memory.
#pragma once

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <torch/types.h>

#include <cstddef>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "pipetrain/runtime/bundle.h"

namespace pipetrain::detail {

struct BundleLayout;  // bundle_wire.h

class RankDevice {
 public:
  explicit RankDevice(const torch::Device& device);
  bool cuda() const { return stream_.has_value(); }
  const torch::Device& device() const { return device_; }

  // While a Scope lives, this thread computes on the rank's stream, which first waits for the work the
  // caller's current stream had queued. On leaving, the stream is synchronised, so that whatever the
  // rank made may be used on any stream of the caller's.
  class Scope {
   public:
    explicit Scope(const RankDevice& d);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    const RankDevice& d_;
    c10::OptionalStreamGuard guard_;
  };

  // Timing of one action list: begin_timing() first (on CUDA, synchronises the stream and anchors the
  // device clock to the host's), start_action()/end_action() around each action, finish_timing() at
  // the end (on CUDA, synchronises), which gives each started action's [start, end] on the host clock,
  // in ms, in the order started; an action never ended gets its start twice. On the CPU the marks are
  // the host clock itself; on CUDA, events on the stream (or, where LibTorch cannot read elapsed times
  // from events, the host clock after synchronising the stream).
  void begin_timing();
  std::size_t start_action();
  void end_action(std::size_t handle);
  std::vector<std::pair<double, double>> finish_timing();

  // `t`, made on the rank's stream, is handed to the calling thread's current stream: the caching
  // allocator is told, so its memory is not reused before that stream is done with it.
  void hand_over(const torch::Tensor& t) const;

  // Where the rank's tensors live. place(): `t`, or each tensor of `b`, on the rank's device, itself
  // (no operator call) when it is there already.
  torch::Tensor place(const torch::Tensor& t) const;
  Bundle place(const Bundle& b) const;
  // The buffer a received bundle lands in: on the rank's GPU when the transport carries device tensors
  // and the bundle is one tensor (sent as it is); else in host memory (several tensors travel packed in
  // host bytes).
  torch::Tensor receive_buffer(const BundleLayout& l, bool transport_carries_device_tensors) const;
  // What a send hands the transport: `t` itself where the transport carries device tensors (ordered by
  // events: the local transport) or `t` is in host memory; else its copy in host memory.
  torch::Tensor sendable(const torch::Tensor& t, bool transport_carries_device_tensors) const;

 private:
  c10::Event& event(std::size_t k);
  torch::Device device_;
  std::optional<c10::Stream> stream_;
  bool events_ = false;            // elapsed times from events (else: host clock after a synchronisation)
  std::deque<c10::Event> pool_;    // reused from list to list: a CUDA event is made once
  std::size_t used_ = 0;
  double anchor_host_ms_ = 0;
  std::vector<std::pair<std::size_t, std::size_t>> marks_;  // event indices (or host samples) per action
  std::vector<double> host_ms_;    // without event timing: host times at the marks
};

}  // namespace pipetrain::detail

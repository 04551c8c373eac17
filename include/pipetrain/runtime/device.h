// What a device changes for a pipeline rank (issue 26): the stream it computes on, how its actions are
// timed, and its memory statistics. On the CPU there is no stream, actions are timed by the host clock,
// and there is no device memory to report; on CUDA each rank computes on its own stream from LibTorch's
// pool, actions are timed by events recorded on that stream, and the caching allocator's peaks are read.
// Everything here goes through c10's device-generic interfaces (c10::Stream, c10::Event, the device
// guard), so it compiles without CUDA headers and without a GPU; the CUDA paths run where the LibTorch
// has CUDA and a GPU is present.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>

namespace pipetrain {

// The caching allocator's peaks on one device, in bytes: tensors' memory (allocated) and what the
// allocator holds from the device (reserved), since the process started or the last reset.
struct DeviceMemory {
  int64_t allocated = 0;  // in tensors now
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
};

// The allocator's bytes on `device`, or nothing where they cannot be read: a CPU device, or a LibTorch whose
// device allocator offers no statistics through c10 (before 2.9; CUDA builds of those LibTorches have
// torch.cuda.max_memory_allocated from Python only).
std::optional<DeviceMemory> device_memory_peak(const torch::Device& device);

// Starts the peaks of `device` afresh (nothing on the CPU). Ranks that share a GPU share its peaks.
void reset_device_memory_peak(const torch::Device& device);

// The bytes a step's memory growth is measured in (PipelineOptions::measure_memory, the profiler's memory
// columns): on a GPU whose allocator offers statistics (device_memory_peak), its bytes in tensors now;
// else the C heap's bytes in use (the CPU; a GPU without statistics, whose tensors that does not see:
// device_memory_measured says which). Ranks that share a process (CPU) or a GPU share what it counts.
double memory_in_use(const torch::Device& device);
// Whether memory_in_use(device) counts the device's own memory: false on the CPU and on a GPU without
// allocator statistics.
bool device_memory_measured(const torch::Device& device);

// Whether actions on `device` are timed by device events (CUDA with a LibTorch whose c10::Event reads
// elapsed times, 2.x); false on the CPU and where the host clock is used after a stream synchronisation.
bool device_event_timing(const torch::Device& device);

}  // namespace pipetrain

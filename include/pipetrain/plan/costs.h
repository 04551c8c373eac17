// Per-stage cost models from a profile: what the simulator needs to predict a pipeline before running
// it. Torch-free.
#pragma once

#include <vector>

#include "pipetrain/core/cost.h"
#include "pipetrain/plan/profile.h"

namespace pipetrain {

// A layer's time at micro-batch size b (forward or whole backward). With measurements at two or more
// sizes (the profile's own and by_micro_batch) a least-squares line t(b) = a + c b, which keeps the fixed
// per-micro-batch cost that makes tiny micro-batches slow; with one, t scales with b. Never negative.
double layer_time_at(const LayerProfile& layer, int profiled_size, double b, bool forward);

struct StageCostOptions {
  double micro_batch = 1;              // samples per micro-batch
  double bandwidth_bytes_per_ms = 0;   // between ranks; 0 = transfers cost only the latency
  double latency_ms = 0;               // per transfer
};

// Costs of the stages a balance cuts the profile into: F = sum of forward times, B and W = each layer's
// backward split in its measured B:W proportion (all B for layers without a split), activation = the
// bytes a micro-batch keeps (sum of the stage's layer outputs), comm = latency + the largest boundary
// activation / bandwidth (the cost model has one transfer time). Throws UsageError if the balance does
// not fit the profile.
CostModel stage_costs(const Profile& profile, const std::vector<int>& balance, const StageCostOptions& options);

// Per-stage static bytes: 2 x parameters (weights and gradients) + optimizer state.
std::vector<double> stage_static_bytes(const Profile& profile, const std::vector<int>& balance);

}  // namespace pipetrain

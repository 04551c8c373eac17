// Per-stage cost models from a profile: what the simulator needs to predict a pipeline before running
// it. Torch-free.
#pragma once

#include <optional>
#include <vector>

#include "pipetrain/core/cost.h"
#include "pipetrain/plan/profile.h"

namespace pipetrain {

// A layer's time at micro-batch size b (forward or whole backward). With measurements at two or more
// sizes (the profile's own and by_micro_batch): between the smallest and the largest, piecewise linear
// through them; outside, a least-squares line t(b) = a + c b, which keeps the fixed per-micro-batch cost
// that makes tiny micro-batches slow. With one, t scales with b. Never negative.
double layer_time_at(const LayerProfile& layer, int profiled_size, double b, bool forward);

struct StageCostOptions {
  double micro_batch = 1;              // samples per micro-batch
  double bandwidth_bytes_per_ms = 0;   // between ranks; 0 = transfers cost only the latency
  double latency_ms = 0;               // per transfer
  // Per compute action (CostModel::overhead); unset: the profile's measured runtime overhead, 0 without.
  std::optional<double> overhead_ms;
};

// Costs of the stages a balance cuts the profile into: F = sum of forward times, B and W = each layer's
// backward split in its measured B:W proportion (all B for layers without a split), activation = the
// bytes a micro-batch keeps (sum of the stage's layers' held_bytes), boundary_comm[s] = latency + the
// bytes crossing cut s (stage s's last layer's activation_bytes at the micro-batch size) / bandwidth, one
// per cut (the plan search prices its candidates' transfers the same way), comm = the largest of them
// (what explicit send/receive actions cost), overhead = options.overhead_ms
// or the profile's runtime overhead, b_release_fraction = 1 - (what split layers keep after B for W,
// w_held_bytes) / (what all layers keep) when the profile measured it for every split layer, else the
// default. stage_step = the sum of the stage's layers' optimizer_ms where the profile measured any (else
// empty: the step costs nothing). For the heap model (core/heap.h): w_held = the w_held_bytes of the
// stage's split layers (0 without any) where the profile measured them, gradient_w = the parameter bytes of the stage's split layers,
// gradient_b those of its other layers, message = its last layer's activation_bytes at the micro-batch size.
// Throws UsageError if the balance does not fit the profile.
CostModel stage_costs(const Profile& profile, const std::vector<int>& balance, const StageCostOptions& options);

// One transfer of `bytes`: latency + bytes / bandwidth; a bandwidth <= 0 or infinite makes the bytes free.
double transfer_ms(double bytes, double bandwidth_bytes_per_ms, double latency_ms);

// The transfer options a measured profile gives: its runtime's latency and bandwidth (an unlimited one
// as the largest double, so checks for a finite bandwidth > 0 pass). Profiles without runtime costs:
// nullopt.
struct TransferOptions {
  double bandwidth_bytes_per_ms = 0;
  double latency_ms = 0;
};
// The transfers a measured profile gives (nullopt without runtime costs). A fit that found no
// bandwidth term (latency only) gives an infinite bandwidth: the bytes cost nothing.
std::optional<TransferOptions> profile_transfers(const Profile& profile);

// The runtime's data-parallel all-reduce of `bytes` over `replicas` ranks, from a profile's measured samples
// (RuntimeCosts::allreduce over `measured_ranks` ranks): at the measured rank count, piecewise linear
// through the samples between the smallest and the largest size, the samples' fitted line (fit_transfers,
// at most the smallest sample's time) below, the slope of the two largest above (the time of the largest
// scaled with the bytes for one sample); other replica counts as the group algorithm scales, each member
// sending 2 (d-1)/d of the bytes: the time at bytes x ((d-1)/d) / ((r-1)/r). It holds the local copies
// and the sum, which the link's transfer fit leaves out. 0 for one replica. Sorted and fitted once, so the
// plan search asks it for every candidate's stages at no allocation.
class MeasuredAllReduce {
 public:
  // Throws UsageError without samples, with measured_ranks < 2, or with a negative or non-finite sample.
  MeasuredAllReduce(std::vector<TransferSample> samples, int measured_ranks);
  double ms(double bytes, int replicas) const;

 private:
  std::vector<TransferSample> samples_;  // by bytes
  int ranks_;
  double line_latency_ms_, line_bandwidth_;  // the fit below the smallest sample (bandwidth 0: none)
};
// MeasuredAllReduce(samples, measured_ranks).ms(bytes, replicas).
double measured_allreduce_ms(const std::vector<TransferSample>& samples, int measured_ranks, double bytes, int replicas);

// Per-stage static bytes: 2 x parameters (weights and gradients) + optimizer state.
std::vector<double> stage_static_bytes(const Profile& profile, const std::vector<int>& balance);

// A ring all-reduce of `bytes` over `ranks`: every link carries 2 (r-1)/r of them in 2 (r-1) messages.
// bandwidth <= 0 or infinite: the bytes cost nothing, only the latency counts. 0 for one rank.
double ring_allreduce_ms(double bytes, int ranks, double bandwidth_bytes_per_ms, double latency_ms);

// The runtime's all-reduce over a group of `ranks` (make_group_transport, which data parallelism and stage
// replication use): a reduce-scatter and an all-gather, each one round of concurrent messages, so every
// member sends (and receives) 2 (r-1)/r of the bytes and waits for 2 latencies. bandwidth <= 0 or
// infinite: the bytes cost nothing, only the latency counts. 0 for one rank.
double group_allreduce_ms(double bytes, int ranks, double bandwidth_bytes_per_ms, double latency_ms);
// What the replicas of a data-parallel step sum besides the gradients, exactly (as doubles) in a second
// group all-reduce: the step's loss and token count.
inline constexpr double kReplicaLossBytes = 2 * sizeof(double);

// Adds `extra` (one time per stage, e.g. an all-reduce over replicas) to the costs' per-stage step times,
// which stage_costs fills with the optimizer's where the profile measured them.
void add_stage_step(CostModel& costs, const std::vector<double>& extra);

// Stage replication (1F1B-RR): per stage the group all-reduce of its parameters' gradients (bytes as the
// profile gives them: in the parameters' dtype, which the runtime sends) over its replicas, the extra
// cost of its optimizer step (CostModel::stage_step). Throws UsageError if the balance does not
// fit the profile or the replication has another stage count.
std::vector<double> replica_allreduce_ms(const Profile& profile, const std::vector<int>& balance,
                                         const std::vector<int>& replication, double bandwidth_bytes_per_ms,
                                         double latency_ms);

}  // namespace pipetrain

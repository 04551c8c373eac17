// Per-layer profiles: what the balancers (plan/balance.h) and the planners (plan/planner.h) read.
// Torch-free: the runtime's profiler fills a Profile, other frameworks write the JSON form by hand or
// by script (the format is documented in docs/PROFILE.md), and PipeDream's published profiles are read
// from its text format.
//
// Units: times in milliseconds, sizes in bytes, all measured at `micro_batch_size` samples.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace pipetrain {

// Forward and whole-backward time of one layer at another micro-batch size. UMPIPE (docs/ALGORITHMS.md §7)
// plans with unequal micro-batches and needs the time as a function of the size; the plan layer only
// stores and validates these.
struct SizeMeasurement {
  int micro_batch_size = 1;
  double forward_ms = 0;
  double backward_ms = 0;
};

struct LayerProfile {
  std::string name;  // unique within the model is advisable but not required
  std::string type;  // module type name, e.g. "Linear"; what balance kind type:REGEX matches
  double forward_ms = 0;
  // The whole backward (input gradient and weight gradient in one pass), as used by balance kind
  // `time` and the PipeDream planner.
  double backward_ms = 0;
  // Whether the layer's backward splits into an input-gradient part (B) and a weight-gradient part (W)
  // (docs/ALGORITHMS.md §4.4.1). With the split, the two are measured separately and need not add up to
  // `backward_ms` exactly. Without it, input_grad_ms and weight_grad_ms are not used (b_ms() is the
  // whole backward and w_ms() is 0), so code that fills a profile may leave them alone.
  bool bw_split = false;
  double input_grad_ms = 0;   // B, when bw_split
  double weight_grad_ms = 0;  // W, when bw_split
  double b_ms() const { return bw_split ? input_grad_ms : backward_ms; }
  double w_ms() const { return bw_split ? weight_grad_ms : 0.0; }
  double activation_bytes = 0;  // the layer's output for one micro-batch; what crosses a stage boundary after it
  // What the layer keeps for its backward per micro-batch: the heap growth of one forward with autograd
  // on (its output included), measured by `pipetrain profile`. A transformer block keeps many times its
  // output (attention scores, the MLP's hidden layer). 0 = not measured: memory models fall back on
  // activation_bytes. Use held_bytes().
  double saved_bytes = 0;
  double held_bytes() const { return saved_bytes > 0 ? saved_bytes : activation_bytes; }
  // Split layers (bw_split): what the layer still holds after its B for its W per micro-batch (the
  // weight-gradient store's saved inputs and output gradients), measured by `pipetrain profile` as heap
  // growth after B. < 0 = not measured. stage_costs turns it into the cost model's b_release_fraction.
  double w_held_bytes = -1;
  double parameter_bytes = 0;   // trainable weights
  double optimizer_bytes = 0;   // optimizer state for those weights (e.g. Adam: 2 x parameter_bytes)
  // What the runtime's optimizer step costs for this layer's weights, once per mini-batch whatever the
  // micro-batch: the gradient norm's pass, the gradient scaling and the optimizer's update, as a stage's
  // flush runs them (`pipetrain profile` measures it with the profile's optimizer). 0 = not measured
  // (profiles before version 3, PipeDream's): the step is then free in every prediction.
  double optimizer_ms = 0;
  std::vector<SizeMeasurement> by_micro_batch;  // optional; strictly increasing sizes
};

// One ping-pong measurement: a message of `bytes` took `one_way_ms` from one rank to the other (half
// the median round trip).
struct TransferSample {
  double bytes = 0;
  double one_way_ms = 0;
};

// What the runtime costs besides the layers' compute, measured by `pipetrain profile --transport NAME`:
// one transfer between two ranks costs latency_ms + bytes / bandwidth_bytes_per_ms, and every compute
// action (F, B, W, BW) costs overhead_ms on top of its measured time (the executor's own work).
struct RuntimeCosts {
  std::string transport;              // local | gloo | shm | mpi: what was measured
  double latency_ms = 0;              // per transfer
  double bandwidth_bytes_per_ms = 0;  // 0: unlimited (the bytes cost nothing)
  double overhead_ms = 0;             // per compute action
  std::vector<TransferSample> transfers;  // the measurements latency and bandwidth were fitted to
  // The data-parallel step's gradient all-reduce as the runtime runs it over `allreduce_ranks` ranks (version
  // 3; 0 ranks and no samples: not measured): per sample, `bytes` of float32 gradients copied into one
  // buffer, summed over the group (reduce-scatter and all-gather) and written back divided by the ranks,
  // in `one_way_ms` (the median over repeats). costs.h measured_allreduce_ms() prices replicas with them.
  int allreduce_ranks = 0;
  std::vector<TransferSample> allreduce;
  // latency_ms + bytes / bandwidth (bandwidth 0: the latency only).
  double transfer_ms(double bytes) const;
};

// Least-squares line one_way_ms = latency + bytes / bandwidth through the samples, in relative error
// (each weighted by 1 / its time^2, so small messages' latency counts as much as large ones' bandwidth):
// the intercept is the latency (clamped at 0), the inverse slope the bandwidth (0, unlimited, when the
// slope is not positive; the latency is then the mean time). One sample, or samples of one size: its
// time is the latency and the bandwidth is unlimited. Throws
// UsageError if there are no samples or one is negative or not finite.
RuntimeCosts fit_transfers(const std::vector<TransferSample>& samples);

struct Profile {
  std::string model;
  int micro_batch_size = 1;  // samples per micro-batch at which times and activations were measured
  int threads = 1;           // intra-op threads used while measuring
  std::string source;        // free text: who made it ("pipetrain profile", "pipedream graph.txt", ...)
  std::vector<LayerProfile> layers;
  // Transfers and per-action overhead; absent in profiles of compute only (version 1 files, PipeDream's).
  std::optional<RuntimeCosts> runtime;
};

inline constexpr const char* kProfileFormat = "pipetrain-profile";
// Version 2 added the optional "runtime" object, version 3 the layers' optional "optimizer_ms". A profile
// is written with the lowest version that holds what it has (one without either is still version 1).
inline constexpr int kProfileVersion = 3;

// Sets input_grad_ms = backward_ms and weight_grad_ms = 0 on every layer without a B/W split, so the
// fields read the same as b_ms() and w_ms().
void normalise_bw_split(Profile& profile);

// Throws UsageError naming the field, the layer index and name, and the fix: no layers, a micro-batch
// size or thread count below 1, an empty type, a negative or non-finite number (B and W are checked only
// when bw_split), or by_micro_batch sizes that are not strictly increasing and >= 1; with `runtime`, a
// negative or non-finite latency, bandwidth, overhead or transfer sample, or an empty transport name.
void validate_profile(const Profile& profile, const std::string& origin = "profile");

// JSON form (docs/PROFILE.md). The reader is strict: `format` must be "pipetrain-profile", `version`
// at most kProfileVersion, every required field present with the right type, no unknown keys (a typo
// such as "foward_ms" is an error, not a silently missing value). Errors are UsageError and name
// `origin` (a path, or "profile"), the JSON path of the field (e.g. layers[3].forward_ms) and the fix.
nlohmann::json profile_to_json(const Profile& profile);
Profile profile_from_json(const nlohmann::json& j, const std::string& origin = "profile");
std::string profile_to_json_text(const Profile& profile);  // pretty-printed, ends with a newline
Profile profile_from_json_text(const std::string& text, const std::string& origin = "profile");

// Options for PipeDream's text format, which records neither the batch size nor the thread count.
struct PipeDreamOptions {
  std::string model = "pipedream";
  int micro_batch_size = 1;  // the profiled mini-batch (PipeDream's VGG-16 profile: 128)
  int threads = 1;
  double optimizer_bytes_per_parameter_byte = 0;  // e.g. 2 for Adam; PipeDream does not record it
  // One layer per node, as the states PipeDream's planner optimises over, instead of folding side
  // branches (below). Each layer's activation_bytes is then what crosses the cut after it: the outputs
  // of every node up to it that a later node consumes (VGG-16's Size layer carries pool5's output and
  // its own 4 bytes, PipeDream's antichain {pool5, Size}). VGG-16 gives 40 layers, PipeDream's 40 states.
  // Used to compare plans with PipeDream's state for state (data/pipedream/README.md); it matches
  // PipeDream's states when they form a chain, as in every profile PipeDream ships for a chain-like model.
  // A range's activation sum then counts a branch's input twice (the memory estimates only).
  bool planner_states = false;
};

// Reads PipeDream's profile text format (docs/ALGORITHMS.md §2.1): node lines
//   nodeK -- <description> -- forward_compute_time=<ms>, backward_compute_time=<ms>,
//            activation_size=<bytes or [b1; b2; ...]>, parameter_size=<bytes>[ -- stage_id=<s>]
// and tab-indented edge lines `nodeA -- nodeB`. Conversion, as PipeDream's planner does it:
//  - source nodes whose description starts with "Input" and sink nodes starting with "__getitem__" are
//    dropped (PipeDream zeroes and removes them: the input always lives on the first stage);
//  - the rest is sorted topologically (Kahn; among ready nodes the smallest number K of "nodeK" first,
//    then file order); a cycle is a UsageError naming a node on it;
//  - the order is then cut into layers only where exactly one tensor crosses: a boundary after node v
//    is kept iff v has a consumer after it and no earlier node does. Other boundaries are merged away,
//    so side branches fold into the layer that consumes them (VGG-16: Size fuses with View) and a
//    residual block becomes one layer. A merged layer sums times and parameter bytes, takes the output
//    bytes of its last node as activation_bytes, is named "nodeA+nodeB" and typed "TypeA+TypeB";
//    activations of its inner nodes other than the last are not counted (4 bytes in VGG-16);
//  - with PipeDreamOptions::planner_states, nothing is folded: one layer per node (see there).
// The type is the description up to its first '(' (e.g. "Conv2d"). No layer has a B/W split.
// Errors (UsageError) name `origin`, the line number and the expected form.
Profile parse_pipedream_graph(const std::string& text, const PipeDreamOptions& options = {},
                              const std::string& origin = "pipedream profile");

// File helpers. load_profile detects the format: text whose first non-blank character is '{' is JSON,
// anything else PipeDream's format (with default PipeDreamOptions). save_profile writes JSON atomically.
Profile load_profile(const std::string& path);
Profile load_pipedream_graph(const std::string& path, const PipeDreamOptions& options = {});
void save_profile(const std::string& path, const Profile& profile);

// Convenience columns over the layers.
std::vector<double> forward_plus_backward_ms(const Profile& profile);

}  // namespace pipetrain

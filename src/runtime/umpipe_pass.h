// Internal to pipetrain_runtime: the UMPIPE training pass (docs/ALGORITHMS.md §7.1/§7.2, docs/UMPIPE.md
// "Runtime"). PipelineRank::train_steps hands a step to run_umpipe_pass when PipelineOptions::umpipe is
// set; the executor then does the flush (global loss and norm, clipping, the optimizer step) as for any
// synchronous schedule.
//
// One stage per rank (stage j on rank j). Stage j cuts the mini-batch of N samples by its own forward
// partition X_j and backward partition Y_j, GPipe order: all forward chunks, then all backward chunks,
// both in stream order.
//  - Forward: runs without an autograd graph. The stage keeps its input rows for all N samples (the
//    stash); received chunks land directly in their rows of it. Chunk k (rows [X̄_{k-1}, X̄_k)) starts
//    once every upstream chunk overlapping those rows has arrived, and its output goes downstream as
//    one message.
//  - Backward: chunk k of Y_j recomputes the stage's forward on exactly its rows, taken from the stash
//    (re-materialisation), and backpropagates the output-gradient rows that stage j+1's backward chunks
//    delivered; the input gradient goes upstream as one message. Because every backward chunk
//    recomputes, X_j and Y_j need not share boundaries; layers must be per-sample separable and
//    deterministic (no BatchNorm, no active dropout), which check_umpipe_pipeline enforces.
//  - The last stage has no forward chunks: its outputs would only feed its own backward, which
//    recomputes them anyway. Its forward phase is the wait for every input row (GPipe order), so X_{p-1}
//    is not used; the planner models this stage with a zero forward cost (cmd_plan.cpp).
//  - Loss: the last stage's backward chunk of b samples backpropagates loss_fn(output, target) x b / N,
//    so the accumulated gradients are the full-batch mean's (§1.8); the pass returns the sum of these.
//
// Messages: one per (direction, chunk), tags in [kUmpipeTagBase, 32767) (above the executor's tags for
// small passes; 32767 is the group transports' collective tag). Chunk sizes come from the plan, which
// every rank holds; the trailing shape and dtype of the activations crossing a boundary are sent once,
// in a header before the first forward chunk ever sent (UmpipeLink keeps them across steps). Gradients
// have the activations' shape, so they need no header.
#pragma once

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <functional>
#include <vector>

#include "pipetrain/core/action.h"
#include "pipetrain/core/schedule.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/plan/umpipe.h"
#include "pipetrain/runtime/stage.h"
#include "pipetrain/runtime/transport.h"

namespace pipetrain {

constexpr int kUmpipeTagBase = 16384;
// Chunks per row at most: the tags of chunk k are kUmpipeTagBase + 1 + 2k (activation) and + 2 + 2k
// (gradient), below 32767.
constexpr int kUmpipeMaxChunks = (32766 - kUmpipeTagBase - 2) / 2 + 1;

// The shape of the activations crossing one boundary, per sample, and their dtype: agreed by a header
// on first use and kept for later steps.
struct UmpipeLink {
  bool agreed = false;
  std::vector<int64_t> trailing;  // sizes after the sample dimension
  c10::ScalarType dtype = c10::ScalarType::Float;
};
struct UmpipeLinks {
  UmpipeLink in;   // stage j-1 -> j, as received
  UmpipeLink out;  // stage j -> j+1, as sent
};

struct UmpipePassContext {
  Transport& transport;
  Stage& stage;
  int stage_index = 0;
  int stages = 1;
  const LossFn& loss;
  const UmpipePlan& plan;
  torch::Device device = torch::kCPU;
  int threads = 0;              // intra-op threads; 0 = as is
  bool measure_memory = false;  // sample the heap after every chunk
  int step = 0;                 // the global step, for before_action
  const std::function<void(int rank, int step, const Action& action)>* before_action = nullptr;
  UmpipeLinks& links;
  Timeline& timeline;  // events are appended: F / BW per chunk, RF / RB for the waits
};

struct UmpipePassResult {
  double loss = 0;              // this rank's sum of scaled losses (non-zero on the last stage only)
  double peak_heap_growth = 0;  // with measure_memory, bytes
};

// Runs this rank's stage of one UMPIPE step over `samples` samples (input on stage 0, target on the last
// stage) and leaves the gradients accumulated in the stage's parameters. Collective over the pipeline.
// Throws UsageError when the plan does not cut `samples`; on any failure aborts the transport with a
// message naming the rank, the chunk and the error, so every rank stops.
UmpipePassResult run_umpipe_pass(UmpipePassContext& context, const torch::Tensor& input, const torch::Tensor& target,
                                 int64_t samples);

// Checks a pipeline that is to run `plan` (PipelineRank's constructor, when PipelineOptions::umpipe is
// set); every rank checks the whole model, so all of them refuse the same way. Throws UsageError naming
// the value and the fix: a schedule other than gpipe, virtual stages, data-parallel replicas, a stage not
// on its own rank, a plan whose stage count differs from the ranks or whose rows are not compositions of
// one N or hold more than kUmpipeMaxChunks chunks, and layers that are not per-sample separable or not
// deterministic under recomputation (any BatchNorm, any Dropout with p > 0).
// `schedule_name`, `virtual_stages` and `replicas` (data-parallel copies) are PipelineOptions' fields.
void check_umpipe_pipeline(const torch::nn::Sequential& model, const UmpipePlan& plan, const std::string& schedule_name,
                           int virtual_stages, int replicas, const Schedule& schedule, int ranks);

}  // namespace pipetrain

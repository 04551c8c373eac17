// Zero-bubble B/W split of any stage's backward through autograd (docs/ALGORITHMS.md §4.4.1, "any layer").
// Internal (not installed): the executor's B actions and bench/backward_split.cpp use it.
//
// B asks autograd for the gradients of the stage input only (the engine runs just the nodes on a path
// from the stage output to the input, keeping the graph); W later computes the parameters' gradients
// from the kept graph. W does not start again from the stage output: B records, with a pre-hook, the
// gradients flowing into each "frontier" node — a node on the input path with an edge to a part of the
// graph that leads only to parameters (e.g. the AddmmBackward of a torch::nn::Linear, whose edges go to
// the layer input and to its weight and bias) — and W runs the engine from those nodes with the captured
// gradients, asking only for parameters: each frontier node then computes only its parameter-side
// outputs (dW = dY^T X, not dX again), and the nodes past it on the parameter side run once, in W. Output
// entries with no path to the input (a stage whose input needs no gradient: stage 0) start W directly
// with their received gradients. After B the frontier nodes' edges to the input side are cut: W cannot
// flow back there (which would count those paths twice), and the input side's nodes, with what they
// saved (activations only dX needed), are freed with the stage output at the end of B. What W needs (the
// frontier nodes with their saved tensors, the parameter-side nodes, the captured gradients) is kept
// from B to W; W frees it.
//
// pipetrain::nn::Linear's explicit split (split_linear.h) is the fast path (docs/BENCHMARKS.md): with
// `explicit_linear`, its nodes queue their own weight gradients on the store during B and are no frontier.
//
// Re-materialisation (--checkpoint) works unchanged: B re-runs the forward with a graph, and that graph
// is what W keeps.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <vector>

namespace pipetrain {
class WeightGradStore;

namespace detail {

// The input-gradient half: the gradient of every root (a stage output entry, or the loss) w.r.t. each
// of `inputs` (leaves requiring grad, the stage input entries that carry a gradient), with `grads` the
// roots' gradients (none for a scalar loss root: then `grads` is empty). Each input's gradient is stored
// in its .grad (zeros where no path reaches it are left undefined). The weight-gradient half is queued on
// `store`: its run() (the W action) accumulates every parameter's gradient into .grad as a fused
// backward would, then releases the graph. Nothing is queued when no parameter is reached.
void backward_input(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& inputs, WeightGradStore& store, bool explicit_linear);

// Whether every trainable parameter of `layer` (and its submodules) is in a pipetrain::nn::Linear:
// backward_split "auto" then runs the stage's B as the explicit split alone, without the graph walk
// (faster on small layers, docs/BENCHMARKS.md).
bool only_split_linear_parameters(const std::shared_ptr<torch::nn::Module>& layer);

}  // namespace detail
}  // namespace pipetrain

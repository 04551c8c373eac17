#include "autograd_split.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <ATen/ops/ones_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "pipetrain/runtime/split_linear.h"
#include "torch_compat.h"

namespace pipetrain::detail {
namespace {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

// Records the gradients flowing into a node when the engine runs it (B), passing them on unchanged.
struct Capture final : torch::autograd::FunctionPreHook {
  explicit Capture(variable_list* slot) : slot(slot) {}
  variable_list operator()(const variable_list& grads) override {
    *slot = grads;
    return grads;
  }
  variable_list* slot;  // owned by the Deferred W below, which outlives the hook (removed after B)
};

// What W needs from B: where to start the engine again, with which gradients, and the parameters.
struct Deferred {
  edge_list roots;     // output entries with no path to the stage input, and their gradients
  variable_list grads;
  std::vector<std::shared_ptr<Node>> frontier;  // frontier nodes and what flowed into each in B
  std::vector<variable_list> captured;
  edge_list params;    // every parameter's AccumulateGrad below the roots

  void run() {
    edge_list from = std::move(roots);
    variable_list with = std::move(grads);
    for (std::size_t k = 0; k < frontier.size(); ++k)
      for (std::size_t i = 0; i < captured[k].size(); ++i)
        if (captured[k][i].defined()) {
          from.emplace_back(frontier[k], static_cast<uint32_t>(i));
          with.push_back(std::move(captured[k][i]));
        }
    frontier.clear();
    captured.clear();
    edge_list wanted = std::move(params);
    params.clear();
    if (!from.empty())  // keep_graph false: each node W runs frees its saved tensors
      torch::autograd::Engine::get_default_engine().execute(from, with, /*keep_graph=*/false, /*create_graph=*/false,
                                                            /*accumulate_grad=*/true, wanted);
    // `from`, `with` and `wanted` go here: the last references to the graph, with what it saved.
  }
};

// Removes the capture hooks from their nodes however B ends (the hooks point into a Deferred).
struct HookGuard {
  std::vector<std::pair<Node*, torch::autograd::FunctionPreHook*>> hooks;
  ~HookGuard() {
    for (auto [node, hook] : hooks) {
      auto& list = node->pre_hooks();
      for (auto it = list.begin(); it != list.end(); ++it)
        if (it->get() == hook) {
          list.erase(it);
          break;
        }
    }
  }
};

// Sets `store.queue_all()` for the duration of B and puts it back.
struct QueueAll {
  WeightGradStore& store;
  bool previous;
  QueueAll(WeightGradStore& s, bool on) : store(s), previous(s.queue_all()) { store.set_queue_all(on); }
  ~QueueAll() { store.set_queue_all(previous); }
};

enum : uint8_t { kReachesInput = 1, kReachesParam = 2 };

}  // namespace

void backward_input(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& inputs, WeightGradStore& store, bool explicit_linear) {
  TORCH_CHECK(grads.empty() || grads.size() == roots.size(), "backward_input: ", roots.size(), " roots but ",
              grads.size(), " gradients");
  variable_list root_grads;
  edge_list root_edges;
  for (std::size_t j = 0; j < roots.size(); ++j) {
    root_edges.push_back(torch::autograd::impl::gradient_edge(roots[j]));
    root_grads.push_back(grads.empty() ? at::ones_like(roots[j]) : grads[j]);
  }
  std::unordered_set<const Node*> input_nodes;
  for (const at::Tensor& x : inputs) {
    TORCH_CHECK(x.is_leaf() && x.requires_grad(), "backward_input: the stage inputs must be leaves requiring grad");
    if (auto acc = torch::autograd::impl::try_get_grad_accumulator(x)) input_nodes.insert(acc.get());
  }

  // Every node below the roots, children first, marked with what it leads to.
  std::unordered_map<const Node*, uint8_t> mark;
  std::vector<Node*> order;
  std::vector<std::pair<Node*, std::size_t>> stack;
  for (const Edge& root : root_edges) {
    Node* start = root.function.get();
    if (start == nullptr || mark.count(start)) continue;
    mark.emplace(start, 0);
    stack.emplace_back(start, 0);
    while (!stack.empty()) {
      Node* n = stack.back().first;
      const std::size_t k = stack.back().second;
      if (k < n->num_outputs()) {
        ++stack.back().second;
        Node* child = n->next_edge(k).function.get();
        if (child != nullptr && mark.emplace(child, 0).second) stack.emplace_back(child, 0);
        continue;
      }
      uint8_t f = 0;
      if (input_nodes.count(n))
        f = kReachesInput;
      else if (dynamic_cast<const torch::autograd::AccumulateGrad*>(n) != nullptr)
        f = kReachesParam;
      for (const Edge& e : n->next_edges())
        if (e.function) f |= mark.at(e.function.get());
      mark[n] = f;
      order.push_back(n);
      stack.pop_back();
    }
  }

  auto deferred = std::make_shared<Deferred>();
  for (std::size_t j = 0; j < root_edges.size(); ++j) {
    const Node* n = root_edges[j].function.get();
    if (n != nullptr && mark.at(n) == kReachesParam) {  // no path to the input: all of it is W's
      deferred->roots.push_back(root_edges[j]);
      deferred->grads.push_back(root_grads[j]);
    }
  }
  for (Node* n : order) {
    const uint8_t f = mark.at(n);
    if (f == kReachesParam && input_nodes.count(n) == 0 && dynamic_cast<torch::autograd::AccumulateGrad*>(n))
      deferred->params.emplace_back(n->shared_from_this(), 0);
    if (!(f & kReachesInput) || !(f & kReachesParam)) continue;
    if (explicit_linear && is_split_linear_node(*n)) continue;  // queues its own W on the store
    bool frontier = false;
    for (const Edge& e : n->next_edges())
      if (e.function && mark.at(e.function.get()) == kReachesParam) frontier = true;
    if (frontier) deferred->frontier.push_back(n->shared_from_this());
  }

  const bool any_input = std::any_of(root_edges.begin(), root_edges.end(), [&](const Edge& e) {
    return e.function && (mark.at(e.function.get()) & kReachesInput);
  });
  if (any_input) {
    deferred->captured.resize(deferred->frontier.size());
    HookGuard guard;
    for (std::size_t k = 0; k < deferred->frontier.size(); ++k) {
      auto hook = std::make_unique<Capture>(&deferred->captured[k]);
      guard.hooks.emplace_back(deferred->frontier[k].get(), hook.get());
      deferred->frontier[k]->add_pre_hook(std::move(hook));
    }
    std::vector<at::Tensor> wanted;
    std::vector<std::size_t> where;
    for (std::size_t k = 0; k < inputs.size(); ++k)
      if (input_nodes.count(torch::autograd::impl::try_get_grad_accumulator(inputs[k]).get())) {
        wanted.push_back(inputs[k]);
        where.push_back(k);
      }
    variable_list got;
    {
      QueueAll queue(store, explicit_linear);
      std::unique_ptr<WeightGradStore::Scope> scope;
      if (explicit_linear) scope = std::make_unique<WeightGradStore::Scope>(&store);
      got = torch::autograd::grad(roots, wanted, root_grads, /*retain_graph=*/true, /*create_graph=*/false,
                                  /*allow_unused=*/true);
    }
    // W starts at the frontier nodes and must not flow back into the input side (B did that; the
    // frontier's gradients already sum every path to it): cut each frontier node's edges to it
    // (set_next_edge asserts on a node with a parent). The input side's other nodes never run again:
    // what they saved goes now (as a backward without retain_graph frees it), not after W. (A saved
    // input keeps its producer's node alive, so freeing the nodes themselves waits for W.)
    // Release first: cutting an edge may free the node behind it, which `order` points to.
    std::unordered_set<const Node*> keep;
    for (const auto& n : deferred->frontier) keep.insert(n.get());
    for (Node* n : order)
      if ((mark.at(n) & kReachesInput) && keep.count(n) == 0) n->release_variables();
    // And W must not run the frontier's hooks again: a tensor's hook ran in B, before the capture (the
    // last hook) recorded its result; the capture itself goes with them.
    guard.hooks.clear();
    for (const auto& n : deferred->frontier) {
      compat::clear_pre_hooks(*n);
      for (std::size_t k = 0; k < n->num_outputs(); ++k) {
        const Node* child = n->next_edge(k).function.get();
        if (child != nullptr && (mark.at(child) & kReachesInput)) n->next_edges()[k] = Edge();
      }
    }
    for (std::size_t k = 0; k < got.size(); ++k) {
      if (!got[k].defined()) continue;
      at::Tensor x = inputs[where[k]];
      if (x.grad().defined())
        x.mutable_grad() = x.grad() + got[k];
      else
        x.mutable_grad() = got[k];
    }
  } else {
    deferred->frontier.clear();  // B has nothing to compute: W starts from the roots
  }
  if (deferred->roots.empty() && deferred->frontier.empty()) return;
  store.push([deferred]() { deferred->run(); });
}

bool only_split_linear_parameters(const std::shared_ptr<torch::nn::Module>& layer) {
  for (const auto& m : layer->modules(/*include_self=*/true)) {
    if (dynamic_cast<const nn::LinearImpl*>(m.get()) != nullptr) continue;
    for (const auto& t : m->parameters(/*recurse=*/false))
      if (t.requires_grad()) return false;
  }
  return true;
}

}  // namespace pipetrain::detail

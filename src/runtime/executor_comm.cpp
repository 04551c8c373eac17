// How PipelineRank's data moves between stages: bundles across stage boundaries (sends, receives, the
// layouts agreed at first use, the fast path's posted receives), and skip connections, handed over in
// memory when both ends are on this rank, else sent straight between their stages. Declared in
// executor_impl.h.
#include "executor_impl.h"

#include <algorithm>

#include "pipetrain/core/error.h"
#include "pass_util.h"

namespace pipetrain {

namespace {

using detail::now_ms;

}  // namespace

std::size_t PipelineRank::Impl::route_of(const Action& a) const {
  const bool at_from = a.kind == ActionKind::SendAct || a.kind == ActionKind::RecvGrad;
  const int from = at_from ? a.stage : a.peer, to = at_from ? a.peer : a.stage;
  for (std::size_t r = 0; r < skips.size(); ++r)
    if (skips[r].from == from && skips[r].to == to) return r;
  throw std::logic_error("skip transfer " + to_string(a) + " names no skip route of the model");
}

bool PipelineRank::Impl::routed(int s, const std::string& name) const {
  for (const auto& r : skips)
    if (r.from == s && std::find(r.names.begin(), r.names.end(), name) != r.names.end()) return true;
  return false;
}

Bundle PipelineRank::Impl::outgoing(int s, const Slot& sl, std::vector<char>& flags) const {
  if (skips.empty()) {  // everything goes on
    flags = sl.out_grad;
    return sl.output;
  }
  Bundle out;
  flags.clear();
  for (std::size_t k = 0; k < sl.output.size(); ++k) {
    const auto& [name, t] = sl.output.items()[k];
    if (routed(s, name)) continue;
    out.set(name, t);
    flags.push_back(k < sl.out_grad.size() ? sl.out_grad[k] : 0);
  }
  return out;
}

Bundle PipelineRank::Impl::skip_part(std::size_t r, int i, std::vector<char>& flags) {
  const Slot& sl = slot(skips[r].from, i);
  Bundle part;
  flags.clear();
  for (const std::string& name : skips[r].names) {
    std::size_t k = 0;
    while (k < sl.output.size() && sl.output.items()[k].first != name) ++k;
    if (k == sl.output.size())
      throw UsageError("stage " + std::to_string(skips[r].from) + " stashes '" + name + "' for stage " +
                       std::to_string(skips[r].to) + " but its output " + describe(sl.output) +
                       " lacks it: the layer that declares the stash must add the entry");
    part.set(name, sl.output.items()[k].second);
    flags.push_back(k < sl.out_grad.size() ? sl.out_grad[k] : 0);
  }
  return part;
}

void PipelineRank::Impl::hand_over_skips(int s, int i) {
  for (std::size_t r = 0; r < skips.size(); ++r) {
    if (skips[r].from != s || pass->rank_of(skips[r].to, i) != rank()) continue;
    std::vector<char> flags;
    const Bundle part = skip_part(r, i, flags);
    Slot& dst = slot(skips[r].to, i);
    for (std::size_t k = 0; k < part.size(); ++k) {
      dst.skip_in.set(part.items()[k].first, part.items()[k].second);
      dst.skip_in_grad.push_back(flags[k]);
    }
  }
}

void PipelineRank::Impl::send_skip(const Action& a) {
  const std::size_t r = route_of(a);
  std::vector<char> flags;
  const Bundle part = skip_part(r, a.index, flags);
  send_bundle(-1 - static_cast<int>(r), 0, a.index, part, flags, pass->rank_of(skips[r].to, a.index),
              skip_tag(r, a.index, 0, 0), skip_tag(r, a.index, 0, 1), true);
}

bool PipelineRank::Impl::skip_has_grad(std::size_t r, int i) {
  const Slot& sl = slot(skips[r].from, i);
  for (std::size_t k = 0; k < sl.output.size() && k < sl.out_grad.size(); ++k)
    if (sl.out_grad[k] && std::find(skips[r].names.begin(), skips[r].names.end(), sl.output.items()[k].first) !=
                              skips[r].names.end())
      return true;
  return false;
}

bool PipelineRank::Impl::send_skip_grad(const Action& a) {
  const std::size_t r = route_of(a);
  Slot& sl = slot(a.stage, a.index);
  Bundle part;
  for (const std::string& name : skips[r].names)
    if (sl.skip_grad_out.has(name)) part.set(name, sl.skip_grad_out.take(name));
  if (part.empty()) return false;
  send_bundle(-1 - static_cast<int>(r), 1, a.index, part, {}, pass->rank_of(skips[r].from, a.index),
              skip_tag(r, a.index, 1, 0), skip_tag(r, a.index, 1, 1), true);
  return true;
}

void PipelineRank::Impl::deliver_skip(const Action& a, const torch::Tensor& buffer, const BundleLayout& l) {
  const Bundle part = detail::unpack(buffer, l);
  Slot& sl = slot(a.stage, a.index);
  for (std::size_t k = 0; k < part.size(); ++k) {
    if (a.kind == ActionKind::RecvAct) {
      sl.skip_in.set(part.items()[k].first, part.items()[k].second);
      sl.skip_in_grad.push_back(l.entries[k].grad ? 1 : 0);
    } else {
      sl.skip_grad.set(part.items()[k].first, part.items()[k].second);
    }
  }
}

bool PipelineRank::Impl::receive_skip(const Action& a, int pos) {
  const std::size_t r = route_of(a);
  const bool act = a.kind == ActionKind::RecvAct;
  if (!act && !skip_has_grad(r, a.index)) return false;
  const int dir = act ? 0 : 1;
  const int src = pass->rank_of(a.peer, a.index);
  const int key = -1 - static_cast<int>(r);
  const int data_tag = skip_tag(r, a.index, dir, 0), header_tag = skip_tag(r, a.index, dir, 1);
  if (!options.reference) {
    if (const BundleLayout* l = recv_layout(key, dir, a.index, src, false, header_tag)) {
      PendingSkip& p = posted_skips[pos];
      p.action = a;
      p.recv.buffer = receive_buffer(*l);
      p.recv.layout = l;
      p.recv.work = transport->irecv(p.recv.buffer, src, data_tag);
      slot(a.stage, a.index).pending_skips.push_back(pos);
      return false;
    }
  }
  const auto [buf, l] = recv_bundle(key, dir, a.index, src, data_tag, header_tag);
  deliver_skip(a, buf, l);
  return true;
}

void PipelineRank::Impl::take_skips(int s, int i, Bundle& x, std::vector<char>& flags) {
  Slot& sl = slot(s, i);
  for (const SkipRoute& route : skips) {
    if (route.to != s) continue;
    for (const std::string& name : route.names) {
      std::size_t k = 0;
      while (k < sl.skip_in.size() && sl.skip_in.items()[k].first != name) ++k;
      if (k == sl.skip_in.size())
        throw std::logic_error("forward " + std::to_string(s) + "F" + std::to_string(i) + " has no skip '" + name + "'");
      x.set(name, on_device(sl.skip_in.items()[k].second));
      flags.push_back(sl.skip_in_grad[k]);
    }
  }
  sl.skip_in = Bundle();
  sl.skip_in_grad.clear();
}

void PipelineRank::Impl::route_skip_grads(int s, int i, Bundle& grads) {
  for (const SkipRoute& route : skips) {
    if (route.to != s) continue;
    const bool local = pass->rank_of(route.from, i) == rank();
    Bundle& dst = local ? slot(route.from, i).skip_grad : slot(s, i).skip_grad_out;
    for (const std::string& name : route.names)
      if (grads.has(name)) dst.set(name, grads.take(name));
  }
}

void PipelineRank::Impl::take_skip_grads(int s, int i, Bundle& g) {
  Slot& sl = slot(s, i);
  for (const auto& [name, t] : sl.skip_grad.items()) g.set(name, t);
  sl.skip_grad = Bundle();
}

void PipelineRank::Impl::send(int boundary, int dir, int i, const Bundle& b, const std::vector<char>& grad, int dst) {
  send_bundle(boundary, dir, i, b, grad, dst, tag(boundary, i, dir, 0), tag(boundary, i, dir, 1), false);
}

void PipelineRank::Impl::send_bundle(int key_boundary, int dir, int i, const Bundle& b, const std::vector<char>& grad,
                                     int dst, int data_tag, int header_tag, bool async) {
  const auto key = std::make_tuple(key_boundary, dir, micro_size(i), dst, forward_mode);
  auto it = agreed.find(key);
  BundleLayout fresh;  // this transfer's layout, when it carries a header
  if (options.variable_shapes || it == agreed.end()) {
    fresh = detail::layout_of(b, grad);
    torch::Tensor header = detail::encode_header(fresh);
    if (async)  // a skip's header: never wait for a stage that is still waiting for this rank's sends
      pending_sends.emplace_back(header, transport->isend(header, dst, header_tag));
    else
      transport->send(header, dst, header_tag);
    if (!options.variable_shapes) it = agreed.emplace(key, std::move(fresh)).first;
  } else if (!detail::matches(it->second, b, grad)) {
    const std::string where = key_boundary >= 0 ? "stage " + std::to_string(key_boundary)
                                                : "skip connection " + std::to_string(-1 - key_boundary);
    throw std::runtime_error(std::string(dir == 0 ? "activations" : "gradients") + " of " + where + " for micro-batch " + std::to_string(i) + " are " +
                             detail::describe(detail::layout_of(b, grad)) + " but what was agreed at first use is " +
                             detail::describe(it->second) +
                             ": a stage's outputs must keep their names, dtypes and shapes between micro-batches of "
                             "the same size, unless the pipeline runs with variable shapes (variable_shapes, "
                             "--variable-length)");
  }
  torch::Tensor t = detail::pack(b, options.variable_shapes ? fresh : it->second);
  t = rank_device->sendable(t, transport->carries_device_tensors());
  if (options.reference && !async) {
    transport->send(t, dst, data_tag);
  } else {
    auto work = transport->isend(t, dst, data_tag);
    pending_sends.emplace_back(t, std::move(work));
  }
}

const detail::BundleLayout* PipelineRank::Impl::recv_layout(int boundary, int dir, int i, int src, bool may_block) {
  return recv_layout(boundary, dir, i, src, may_block, tag(boundary, i, dir, 1));
}

const detail::BundleLayout* PipelineRank::Impl::recv_layout(int key_boundary, int dir, int i, int src, bool may_block,
                                                            int header_tag) {
  const auto key = std::make_tuple(key_boundary, dir, micro_size(i), src, forward_mode);
  auto it = agreed.find(key);
  if (it != agreed.end() && !options.variable_shapes) return &it->second;
  if (!may_block) return nullptr;
  torch::Tensor header = torch::zeros({detail::kBundleHeaderLen}, torch::kLong);
  transport->recv(header, src, header_tag);
  BundleLayout l = detail::decode_header(header);
  if (it == agreed.end())
    it = agreed.emplace(key, std::move(l)).first;
  else
    it->second = std::move(l);  // variable shapes: this transfer's layout, used at once
  return &it->second;
}

std::pair<torch::Tensor, detail::BundleLayout> PipelineRank::Impl::recv_bundle(int key_boundary, int dir, int i,
                                                                               int src, int data_tag, int header_tag) {
  BundleLayout l = *recv_layout(key_boundary, dir, i, src, true, header_tag);
  torch::Tensor buf = receive_buffer(l);
  transport->recv(buf, src, data_tag);
  return {buf, std::move(l)};
}

void PipelineRank::Impl::deliver(const Action& a, const torch::Tensor& buffer, const BundleLayout& l) {
  Slot& sl = slot(a.stage, a.index);
  if (a.kind == ActionKind::RecvAct) {
    sl.input = detail::unpack(buffer, l);
    sl.in_grad.clear();
    for (const auto& e : l.entries) sl.in_grad.push_back(e.grad ? 1 : 0);
  } else {
    sl.recv_grad = detail::unpack(buffer, l);
  }
}

bool PipelineRank::Impl::receive(const Action& a, int pos) {
  const bool act = a.kind == ActionKind::RecvAct;
  if (!options.reference && (posted.count(pos) || post_receive(a, pos))) {
    Slot& sl = slot(a.stage, a.index);
    (act ? sl.pending_input : sl.pending_grad) = pos;
    return false;
  }
  const int boundary = act ? a.stage - 1 : a.stage + 1;
  const int dir = act ? 0 : 1;
  const int src = pass->rank_of(boundary, a.index);
  const auto [buf, l] = recv_bundle(boundary, dir, a.index, src, tag(boundary, a.index, dir, 0), tag(boundary, a.index, dir, 1));
  deliver(a, buf, l);
  return true;
}

void PipelineRank::Impl::await_inputs(const Action& a, Timeline& timeline) {
  if (a.kind != ActionKind::F && a.kind != ActionKind::B && a.kind != ActionKind::BW) return;
  Slot& sl = slot(a.stage, a.index);
  if (!sl.pending_skips.empty()) {
    const ActionKind want = a.kind == ActionKind::F ? ActionKind::RecvAct : ActionKind::RecvGrad;
    std::vector<int> later;  // the other direction's (a stage both pops and stashes)
    for (int key : sl.pending_skips) {
      auto it = posted_skips.find(key);
      if (it->second.action.kind != want) {
        later.push_back(key);
        continue;
      }
      const double t0 = now_ms();
      it->second.recv.work->wait();
      deliver_skip(it->second.action, it->second.recv.buffer, *it->second.recv.layout);
      timeline.events.push_back(TimedAction{rank(), it->second.action, t0, now_ms()});
      posted_skips.erase(it);
    }
    sl.pending_skips = std::move(later);
  }
  int& pending = a.kind == ActionKind::F ? sl.pending_input : sl.pending_grad;
  if (pending < 0) return;
  const double t0 = now_ms();
  auto it = posted.find(pending);
  it->second.work->wait();
  pending = -1;
  const Action recv{a.kind == ActionKind::F ? ActionKind::RecvAct : ActionKind::RecvGrad, a.stage, a.index};
  deliver(recv, it->second.buffer, *it->second.layout);
  posted.erase(it);
  timeline.events.push_back(TimedAction{rank(), recv, t0, now_ms()});
}

bool PipelineRank::Impl::post_receive(const Action& a, int pos) {
  const bool act = a.kind == ActionKind::RecvAct;
  const int boundary = act ? a.stage - 1 : a.stage + 1;
  const int dir = act ? 0 : 1;
  const int src = pass->rank_of(boundary, a.index);
  const BundleLayout* l = recv_layout(boundary, dir, a.index, src, false);
  if (!l) return false;
  PendingRecv& p = posted[pos];
  p.buffer = receive_buffer(*l);
  p.layout = l;
  p.work = transport->irecv(p.buffer, src, tag(boundary, a.index, dir, 0));
  return true;
}

void PipelineRank::Impl::prefetch_from(const std::vector<Action>& actions, std::size_t pos) {
  prefetch_cursor = std::max(prefetch_cursor, pos);
  while (prefetch_cursor < actions.size() && posted.size() < static_cast<std::size_t>(options.prefetch)) {
    const Action& a = actions[prefetch_cursor];
    if ((a.kind == ActionKind::RecvAct || a.kind == ActionKind::RecvGrad) && a.peer < 0)  // not a skip's
      if (!post_receive(a, static_cast<int>(prefetch_cursor))) return;
    ++prefetch_cursor;
  }
}

void PipelineRank::Impl::reap_sends() {
  const std::size_t keep = static_cast<std::size_t>(std::max(1, options.prefetch));
  while (pending_sends.size() > keep) {
    pending_sends.front().second->wait();
    pending_sends.erase(pending_sends.begin());
  }
}

void PipelineRank::Impl::finish_sends() {
  for (auto& [t, work] : pending_sends) work->wait();
  pending_sends.clear();
}

}  // namespace pipetrain

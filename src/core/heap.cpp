#include "pipetrain/core/heap.h"

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "pipetrain/core/error.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/skip.h"
#include "pipetrain/core/validate.h"

namespace pipetrain {

HeapOptions HeapOptions::fast_path(int prefetch) { return HeapOptions{prefetch, std::max(1, prefetch)}; }
HeapOptions HeapOptions::reference() { return HeapOptions{0, 0}; }

namespace {

// A compute action's change of the rank's activation bytes: the cost model's, except that a stage with
// a measured w_held (StageCost) holds exactly that between its B and its W.
double activation_delta(const CostModel& c, const Action& a) {
  if (a.kind == ActionKind::B || a.kind == ActionKind::W) {
    const StageCost& sc = c.stage.at(static_cast<std::size_t>(a.stage));
    if (sc.w_held >= 0) return a.kind == ActionKind::B ? sc.w_held - sc.activation : -sc.w_held;
  }
  return c.memory_delta(a);
}

using Slot = std::pair<int, int>;  // (stage, micro-batch)

bool has_transfers(const Schedule& s) {
  for (const auto& row : s.actions)
    for (const Action& a : row)
      if (is_comm(a.kind)) return true;
  return false;
}

bool boundary_receive(const Action& a) {
  return (a.kind == ActionKind::RecvAct || a.kind == ActionKind::RecvGrad) && a.peer < 0;
}

// One rank's walk over its lowered list (heap.h has the rules; the comments name the executor's code
// each step mirrors).
class RankWalk {
 public:
  RankWalk(const Schedule& s, const CostModel& c, const HeapOptions& o, int rank)
      : s_(s), c_(c), o_(o), rank_(rank), list_(s.actions[static_cast<std::size_t>(rank)]),
        b_on_(static_cast<std::size_t>(s.stages), 0), w_on_(b_on_) {}

  std::vector<HeapParts> run() {
    std::vector<HeapParts> samples;
    samples.reserve(list_.size());
    walk([&](std::size_t, const HeapParts& h) { samples.push_back(h); });
    return samples;
  }

  // The first largest total with its parts, keeping nothing per action.
  HeapPeak peak() {
    HeapPeak out;
    walk([&](std::size_t pos, const HeapParts& h) {
      if (h.total() > out.total()) {
        static_cast<HeapParts&>(out) = h;
        out.position = static_cast<int>(pos);
        out.after = list_[pos];
      }
    });
    return out;
  }

 private:
  // Calls on_sample(position, parts) after every action of the rank's list.
  template <class OnSample>
  void walk(OnSample&& on_sample) {
    for (std::size_t pos = 0; pos < list_.size(); ++pos) {
      if (o_.receives_ahead > 0) prefetch(pos);
      act(list_[pos], static_cast<int>(pos));
      // The fast path's reap_sends after every action; the reference path's sends completed in place.
      while (!sends_.empty() && (o_.sends_in_flight == 0 || sends_.size() > static_cast<std::size_t>(o_.sends_in_flight)))
        release_oldest_send();
      on_sample(pos, HeapParts{act_, grads_, xfer_});
    }
  }

  struct Send {
    bool activation = false;  // a boundary SendAct (its output may outlive the stage's backward)
    Slot slot;
    double bytes = 0;  // what only this send keeps alive
  };

  const StageCost& cost(int stage) const { return c_.stage[static_cast<std::size_t>(stage)]; }
  double receive_bytes(const Action& a) const {
    return a.kind == ActionKind::RecvAct ? cost(a.stage - 1).message : cost(a.stage).message;
  }

  // A receive's buffer, held by its slot until the slot's backward.
  void allocate(const Action& a) {
    const double bytes = receive_bytes(a);
    xfer_ += bytes;
    held_[{a.stage, a.index}] += bytes;
  }

  // prefetch_from: post receives in list order while fewer than receives_ahead are posted and unconsumed.
  void prefetch(std::size_t pos) {
    cursor_ = std::max(cursor_, pos);
    while (cursor_ < list_.size() && posted_.size() < static_cast<std::size_t>(o_.receives_ahead)) {
      const Action& a = list_[cursor_];
      if (boundary_receive(a)) {
        posted_.insert(static_cast<int>(cursor_));
        (a.kind == ActionKind::RecvAct ? posted_input_ : posted_grad_)[{a.stage, a.index}] = static_cast<int>(cursor_);
        allocate(a);
      }
      ++cursor_;
    }
  }

  // await_inputs: the action that needs a posted receive consumes it (it stops counting as posted).
  void consume(std::map<Slot, int>& posted_of, const Slot& slot) {
    auto it = posted_of.find(slot);
    if (it == posted_of.end()) return;
    posted_.erase(it->second);
    posted_of.erase(it);
  }

  void release_oldest_send() {
    xfer_ -= sends_.front().bytes;
    sends_.pop_front();
  }

  void add_gradients(int stage, bool b_part, bool w_part) {
    const auto us = static_cast<std::size_t>(stage);
    if (b_part && !b_on_[us]) grads_ += cost(stage).gradient_b, b_on_[us] = 1;
    if (w_part && !w_on_[us]) grads_ += cost(stage).gradient_w, w_on_[us] = 1;
  }

  // Skip activations held on their consumer's rank end with the consumer's W or BW (as in simulate).
  void release_skips(int stage) {
    for (const SkipEdge& route : s_.skips)
      if (route.to_stage == stage) act_ -= route.size;
  }

  void backward(const Action& a) {
    const Slot slot{a.stage, a.index};
    consume(posted_grad_, slot);
    act_ += activation_delta(c_, a);
    add_gradients(a.stage, true, a.kind == ActionKind::BW);
    // The slot's received input and output gradient go with its backward.
    if (auto it = held_.find(slot); it != held_.end()) {
      xfer_ -= it->second;
      held_.erase(it);
    }
    // The input gradient the next stage handed over on this rank is taken.
    if (a.stage + 1 < s_.stages && s_.rank_of(a.stage + 1, a.index) == rank_)
      if (auto it = input_grad_.find({a.stage + 1, a.index}); it != input_grad_.end()) {
        xfer_ -= it->second;
        input_grad_.erase(it);
      }
    if (a.stage > 0) {  // this backward's input gradient, until taken or sent
      const double bytes = cost(a.stage - 1).message;
      input_grad_[slot] = bytes;
      xfer_ += bytes;
    }
    // The output the backward frees lives on while its send is in flight.
    for (Send& send : sends_)
      if (send.activation && send.slot == slot) {
        send.bytes += cost(a.stage).message;
        xfer_ += cost(a.stage).message;
      }
    if (a.kind == ActionKind::BW) release_skips(a.stage);
  }

  void act(const Action& a, int pos) {
    const Slot slot{a.stage, a.index};
    switch (a.kind) {
      case ActionKind::F:
        consume(posted_input_, slot);
        act_ += activation_delta(c_, a);
        for (const SkipToken& t : skip_makes(s_, a))  // a skip to a stage on this rank is held from here
          if (!t.grad && s_.rank_of(skip_user_stage(s_, t), t.micro) == rank_)
            act_ += s_.skips[static_cast<std::size_t>(t.route)].size;
        break;
      case ActionKind::B:
      case ActionKind::BW: backward(a); break;
      case ActionKind::W:
        act_ += activation_delta(c_, a);
        add_gradients(a.stage, false, true);
        release_skips(a.stage);
        break;
      case ActionKind::RecvAct:
      case ActionKind::RecvGrad:
        if (a.peer >= 0) {  // a skip: its activation is held from here until the consumer's W or BW
          if (a.kind == ActionKind::RecvAct) {
            const auto t = skip_carried(s_, a);
            if (t) act_ += s_.skips[static_cast<std::size_t>(t->route)].size;
          }
        } else if (!posted_.count(pos)) {  // not posted ahead: posted here (receive), its consumer waits
          allocate(a);
          posted_.insert(pos);  // it fills the window until consumed, as one posted ahead does
          (a.kind == ActionKind::RecvAct ? posted_input_ : posted_grad_)[{a.stage, a.index}] = pos;
        }
        break;
      case ActionKind::SendAct: sends_.push_back(Send{a.peer < 0, slot, 0.0}); break;
      case ActionKind::SendGrad: {
        double bytes = 0;  // the input gradient leaves the slot with its send
        if (auto it = input_grad_.find(slot); a.peer < 0 && it != input_grad_.end()) {
          bytes = it->second;
          input_grad_.erase(it);
        }
        sends_.push_back(Send{false, slot, bytes});
        break;
      }
      case ActionKind::Step: {
        // A synchronous step's flush waits for every send at the rank's first Step of the step.
        if (s_.synchronous && reduced_.insert(a.index).second)
          while (!sends_.empty()) release_oldest_send();
        const auto us = static_cast<std::size_t>(a.stage);
        if (b_on_[us]) grads_ -= cost(a.stage).gradient_b;
        if (w_on_[us]) grads_ -= cost(a.stage).gradient_w;
        b_on_[us] = w_on_[us] = 0;
        break;
      }
    }
  }

  const Schedule& s_;
  const CostModel& c_;
  const HeapOptions& o_;
  const int rank_;
  const std::vector<Action>& list_;
  double act_ = 0, grads_ = 0, xfer_ = 0;
  std::size_t cursor_ = 0;                    // next position prefetch may post
  std::set<int> posted_;                      // posted, unconsumed receives (list positions)
  std::map<Slot, int> posted_input_, posted_grad_;  // their positions by the slot that consumes them
  std::map<Slot, double> held_;               // received buffers by the slot whose backward frees them
  std::map<Slot, double> input_grad_;         // input gradients made, not yet taken or sent
  std::deque<Send> sends_;                    // in flight, oldest first
  std::vector<char> b_on_, w_on_;             // per stage: gradient_b / gradient_w allocated this step
  std::set<int> reduced_;                     // steps whose flush has run
};

}  // namespace

namespace {

void check_heap_inputs(const Schedule& schedule, const CostModel& costs, const HeapOptions& options) {
  if (options.receives_ahead < 0 || options.sends_in_flight < 0)
    throw UsageError("the heap model's receives ahead (" + std::to_string(options.receives_ahead) +
                     ") and sends in flight (" + std::to_string(options.sends_in_flight) + ") must be >= 0");
  check_ranges(schedule);
  costs.check(schedule.stages);
}

// Whether the walk needs the lowered schedule: only transfers that carry bytes (a message > 0) and skip
// routes (their activation is held from its receive) change the heap at a send or receive. Without them
// every transfer adds and removes 0, so the totals after the compute and step actions, and the first
// position of the largest, are those of the schedule without its transfers.
bool needs_lowering(const Schedule& schedule, const CostModel& costs) {
  if (schedule.ranks <= 1 || has_transfers(schedule)) return false;
  if (!schedule.skips.empty()) return true;
  for (const StageCost& c : costs.stage)
    if (c.message != 0) return true;
  return false;
}

}  // namespace

HeapWalk heap_walk(const Schedule& schedule, const CostModel& costs, const HeapOptions& options) {
  check_heap_inputs(schedule, costs, options);
  HeapWalk out;
  // The runtime lowers with unit costs unless given others (PipelineOptions::costs).
  out.lowered = schedule.ranks > 1 && !has_transfers(schedule) ? insert_communication(schedule) : schedule;
  for (int r = 0; r < out.lowered.ranks; ++r) out.samples.push_back(RankWalk(out.lowered, costs, options, r).run());
  return out;
}

std::vector<HeapPeak> predict_heap(const Schedule& schedule, const CostModel& costs, const HeapOptions& options) {
  check_heap_inputs(schedule, costs, options);
  // Neither the lowered copy (2-3 actions per action) nor a sample per action is kept when not needed:
  // at p = 512, m = 2048 they took ~470 MB (docs/BENCHMARKS.md, issue 28).
  const bool lower = needs_lowering(schedule, costs);
  const Schedule lowered = lower ? insert_communication(schedule) : Schedule{};
  const Schedule& walked = lower ? lowered : schedule;
  std::vector<HeapPeak> out;
  out.reserve(static_cast<std::size_t>(walked.ranks));
  for (int r = 0; r < walked.ranks; ++r) out.push_back(RankWalk(walked, costs, options, r).peak());
  return out;
}

}  // namespace pipetrain

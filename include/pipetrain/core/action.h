// The action IR: one unit of work on one rank.
//
// An action names a kind, the (virtual) stage it belongs to and a micro-batch (or, for Step, the index
// of the optimizer step). Its text form is `<stage><KIND><index>`:
//
//   2F0   stage 2, forward of micro-batch 0
//   1B3   stage 1, input-gradient backward of micro-batch 3 (zero-bubble split)
//   1W3   stage 1, weight-gradient backward of micro-batch 3
//   0BW5  stage 0, fused backward (B and W) of micro-batch 5
//   1RF2  stage 1 receives its input activation for micro-batch 2 (from the stage before)
//   0SF2  stage 0 sends its output activation of micro-batch 2 (to the stage after)
//   3RB2  stage 3 receives the gradient of its output for micro-batch 2 (from the stage after)
//   2SB2  stage 2 sends the gradient of its input for micro-batch 2 (to the stage before)
//   1S0   stage 1 applies optimizer step 0
//   0SF2@3  stage 0 sends its skip activation of micro-batch 2 straight to stage 3 (a skip route, schedule.h)
//   3RF2@0  stage 3 receives that skip activation from stage 0
//   3SB2@0  stage 3 sends the skip's gradient of micro-batch 2 back to stage 0
//   0RB2@3  stage 0 receives it
//
// A transfer without `@` goes to the neighbouring stage (peer = -1); `@<stage>` names its peer stage and
// marks a skip transfer, which only send and receive actions carry.
//
// parse_action(to_string(a)) == a for every valid action. Values are plain data; any thread may use them.
//
// Paired slots (PyTorch's OVERLAP_F_B, DualPipe's overlapped forward and backward): a forward marked
// `paired` and the next compute action on its rank, a backward (BW or B) of another stage, form one cell
// of the schedule, written `(0F7;7BW3)`. The simulator charges both passes and the runtime runs both (its
// fast path overlaps the pair's transfers with their compute). Pairing is a property of the slot, not of
// the work: ==, < and the hash ignore it, so a schedule with and without pairs does the same work.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace pipetrain {

enum class ActionKind : std::uint8_t {
  F,         // forward
  B,         // gradient w.r.t. the stage input only (weight gradient deferred to W)
  W,         // gradient w.r.t. the stage weights (after B of the same micro-batch)
  BW,        // fused backward: B and W at once
  SendAct,   // send the forward output to the next stage
  RecvAct,   // receive the forward input from the previous stage
  SendGrad,  // send the input gradient to the previous stage
  RecvGrad,  // receive the output gradient from the next stage
  Step,      // optimizer step; `index` is the step number
};

struct Action {
  ActionKind kind = ActionKind::F;
  int stage = 0;  // virtual stage, numbered from the input side
  int index = 0;  // micro-batch, or step number for Step
  bool paired = false;  // opens a paired slot with the rank's next compute action (see above)
  int peer = -1;  // transfers only: the peer stage of a skip transfer; -1 = the neighbouring stage

  friend bool operator==(const Action& a, const Action& b) {
    return a.kind == b.kind && a.stage == b.stage && a.index == b.index && a.peer == b.peer;
  }
  friend bool operator!=(const Action& a, const Action& b) { return !(a == b); }
  friend bool operator<(const Action& a, const Action& b) {
    if (a.stage != b.stage) return a.stage < b.stage;
    if (a.kind != b.kind) return a.kind < b.kind;
    if (a.index != b.index) return a.index < b.index;
    return a.peer < b.peer;
  }
};

// Kind mnemonic as used in the text form: "F", "B", "W", "BW", "SF", "RF", "SB", "RB", "S".
std::string_view kind_name(ActionKind kind);

// True for F, B, W, BW (work that takes compute time); false for communication and Step.
bool is_compute(ActionKind kind);
// True for SendAct, RecvAct, SendGrad, RecvGrad.
bool is_comm(ActionKind kind);

// The text form of one action; a paired action prints like an unpaired one (see cell_texts).
std::string to_string(const Action& a);

// A rank's actions as schedule cells: one per action, except a pair, which is one cell `(a;b)`.
std::vector<std::string> cell_texts(const std::vector<Action>& row);

// Parses one cell: an action, or a pair `(<forward>;<backward>)` whose first action comes back `paired`.
// Throws UsageError naming the text and the accepted forms.
std::vector<Action> parse_cell(std::string_view text);

// Parses the text form; surrounding spaces are ignored. Throws UsageError naming the text and the
// accepted form on anything else.
Action parse_action(std::string_view text);

}  // namespace pipetrain

template <>
struct std::hash<pipetrain::Action> {
  std::size_t operator()(const pipetrain::Action& a) const noexcept {
    return (static_cast<std::size_t>(a.stage) * 1000003u + static_cast<std::size_t>(a.index)) * 16u +
           static_cast<std::size_t>(a.kind) + static_cast<std::size_t>(a.peer + 1) * 7919u;
  }
};

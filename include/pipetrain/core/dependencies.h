// Data dependencies between actions (docs/ALGORITHMS.md §1.2), shared by the validator, the simulator and
// the lowering pass so that all three agree on what an action waits for.
//
// Data is named by tokens: Act(s, i) is stage s's forward output for micro-batch i (made by F);
// Grad(s, i) is the gradient of stage s's input for micro-batch i (made by B or BW).
//   F(s,i)       needs Act(s-1,i)                  (s > 0)
//   B/BW(s,i)    needs Act(s,i) (its own forward)  and Grad(s+1,i)  (s < S-1)
//   W(s,i)       needs Grad(s,i) (its own B)
// A send/recv pair moves one token between ranks: SendAct(s,i)->RecvAct(s+1,i) moves Act(s,i);
// SendGrad(s,i)->RecvGrad(s-1,i) moves Grad(s,i). Step needs no token (the simulator adds a synchronous
// step's barrier across ranks itself, simulate.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "pipetrain/core/action.h"

namespace pipetrain {

struct Token {
  enum Kind : std::uint8_t { Act, Grad } kind = Act;
  int stage = 0;
  int micro = 0;
  friend bool operator==(const Token& a, const Token& b) {
    return a.kind == b.kind && a.stage == b.stage && a.micro == b.micro;
  }
};

// Tokens a compute action needs before it can start (empty for communication and Step).
std::vector<Token> required_tokens(const Action& a, int num_stages);
// The token a compute action makes, if any.
std::optional<Token> produced_token(const Action& a);
// The token a send or receive action carries, if it is one (skip transfers carry a SkipToken, skip.h).
std::optional<Token> carried_token(const Action& a);
// The action on the peer rank that completes a send or receive (SendAct(s,i) <-> RecvAct(s+1,i),
// SendGrad(s,i) <-> RecvGrad(s-1,i); a skip transfer s..@t <-> t..@s).
Action matching_comm(const Action& a);

// Dense index for tokens of a schedule with `stages` stages and `micros` micro-batches.
inline std::size_t token_index(const Token& t, int stages, int micros) {
  return (static_cast<std::size_t>(t.kind) * static_cast<std::size_t>(stages) + static_cast<std::size_t>(t.stage)) *
             static_cast<std::size_t>(micros) +
         static_cast<std::size_t>(t.micro);
}

}  // namespace pipetrain

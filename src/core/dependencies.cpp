#include "pipetrain/core/dependencies.h"

namespace pipetrain {

std::vector<Token> required_tokens(const Action& a, int num_stages) {
  switch (a.kind) {
    case ActionKind::F:
      if (a.stage > 0) return {Token{Token::Act, a.stage - 1, a.index}};
      return {};
    case ActionKind::B:
    case ActionKind::BW:
      if (a.stage + 1 < num_stages)
        return {Token{Token::Act, a.stage, a.index}, Token{Token::Grad, a.stage + 1, a.index}};
      return {Token{Token::Act, a.stage, a.index}};
    case ActionKind::W: return {Token{Token::Grad, a.stage, a.index}};
    default: return {};
  }
}

std::optional<Token> produced_token(const Action& a) {
  switch (a.kind) {
    case ActionKind::F: return Token{Token::Act, a.stage, a.index};
    case ActionKind::B:
    case ActionKind::BW: return Token{Token::Grad, a.stage, a.index};
    default: return std::nullopt;
  }
}

std::optional<Token> carried_token(const Action& a) {
  if (a.peer >= 0) return std::nullopt;  // a skip transfer carries a SkipToken (skip.h)
  switch (a.kind) {
    case ActionKind::SendAct: return Token{Token::Act, a.stage, a.index};
    case ActionKind::RecvAct: return Token{Token::Act, a.stage - 1, a.index};
    case ActionKind::SendGrad: return Token{Token::Grad, a.stage, a.index};
    case ActionKind::RecvGrad: return Token{Token::Grad, a.stage + 1, a.index};
    default: return std::nullopt;
  }
}

Action matching_comm(const Action& a) {
  if (a.peer >= 0 && is_comm(a.kind)) {  // a skip transfer: its peer names the other end
    static constexpr ActionKind kOther[] = {ActionKind::F, ActionKind::F, ActionKind::F, ActionKind::F,
                                            ActionKind::RecvAct, ActionKind::SendAct, ActionKind::RecvGrad,
                                            ActionKind::SendGrad};
    Action m{kOther[static_cast<int>(a.kind)], a.peer, a.index};
    m.peer = a.stage;
    return m;
  }
  switch (a.kind) {
    case ActionKind::SendAct: return {ActionKind::RecvAct, a.stage + 1, a.index};
    case ActionKind::RecvAct: return {ActionKind::SendAct, a.stage - 1, a.index};
    case ActionKind::SendGrad: return {ActionKind::RecvGrad, a.stage - 1, a.index};
    case ActionKind::RecvGrad: return {ActionKind::SendGrad, a.stage + 1, a.index};
    default: return a;
  }
}

}  // namespace pipetrain

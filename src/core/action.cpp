#include "pipetrain/core/action.h"

#include <array>
#include <cctype>
#include <utility>

#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"

namespace pipetrain {
namespace {

// Longest mnemonics first, so "BW" is not read as "B" followed by garbage.
constexpr std::array<std::pair<std::string_view, ActionKind>, 9> kMnemonics{{
    {"BW", ActionKind::BW},
    {"SF", ActionKind::SendAct},
    {"RF", ActionKind::RecvAct},
    {"SB", ActionKind::SendGrad},
    {"RB", ActionKind::RecvGrad},
    {"F", ActionKind::F},
    {"B", ActionKind::B},
    {"W", ActionKind::W},
    {"S", ActionKind::Step},
}};

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Reads a non-negative decimal number that fits an int; returns -1 if `s` is not one.
int read_count(std::string_view s) {
  if (s.empty() || s.size() > 9) return -1;
  int v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

}  // namespace

std::string_view kind_name(ActionKind kind) {
  for (const auto& [name, k] : kMnemonics)
    if (k == kind) return name;
  return "?";
}

bool is_compute(ActionKind kind) {
  return kind == ActionKind::F || kind == ActionKind::B || kind == ActionKind::W || kind == ActionKind::BW;
}

bool is_comm(ActionKind kind) {
  return kind == ActionKind::SendAct || kind == ActionKind::RecvAct || kind == ActionKind::SendGrad ||
         kind == ActionKind::RecvGrad;
}

std::string to_string(const Action& a) {
  std::string out = std::to_string(a.stage);
  out += kind_name(a.kind);
  out += std::to_string(a.index);
  if (a.peer >= 0) out += "@" + std::to_string(a.peer);
  return out;
}

Action parse_action(std::string_view text) {
  const std::string_view t = trim(text);
  auto fail = [&]() -> Action {
    throw UsageError("malformed action '" + excerpt(t) +
                     "': expected <stage><KIND><micro-batch> such as 2F0, 1B3, 1W3, 0BW5, 0SF2, 1RF2, 2SB2, "
                     "3RB2 or 1S0 (KIND is one of F B W BW SF RF SB RB S); a skip transfer adds its peer stage, "
                     "as in 0SF2@3");
  };
  std::size_t i = 0;
  while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) ++i;
  const int stage = read_count(t.substr(0, i));
  if (stage < 0) return fail();
  const std::string_view rest = t.substr(i);
  for (const auto& [name, kind] : kMnemonics) {
    if (rest.substr(0, name.size()) != name) continue;
    std::string_view tail = rest.substr(name.size());
    int peer = -1;
    if (const std::size_t at = tail.find('@'); at != std::string_view::npos) {
      if (!is_comm(kind)) return fail();
      peer = read_count(tail.substr(at + 1));
      if (peer < 0) return fail();
      tail = tail.substr(0, at);
    }
    const int index = read_count(tail);
    if (index < 0) return fail();
    Action a{kind, stage, index};
    a.peer = peer;
    return a;
  }
  return fail();
}

std::vector<std::string> cell_texts(const std::vector<Action>& row) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < row.size(); ++i) {
    if (!row[i].paired) {
      out.push_back(to_string(row[i]));
      continue;
    }
    std::size_t j = i + 1;  // the pair closes at the next compute action
    while (j < row.size() && !is_compute(row[j].kind)) ++j;
    if (j == row.size()) {  // a dangling pair (the validator names it); print what is there
      out.push_back(to_string(row[i]));
      continue;
    }
    for (std::size_t k = i + 1; k < j; ++k) out.push_back(to_string(row[k]));  // transfers between them
    out.push_back("(" + to_string(row[i]) + ";" + to_string(row[j]) + ")");
    i = j;
  }
  return out;
}

std::vector<Action> parse_cell(std::string_view text) {
  const std::string_view t = trim(text);
  if (t.empty() || t.front() != '(') return {parse_action(t)};
  const std::size_t semi = t.find(';');
  if (t.back() != ')' || semi == std::string_view::npos || t.find(';', semi + 1) != std::string_view::npos)
    throw UsageError("malformed paired cell '" + excerpt(t) +
                     "': expected (<forward>;<backward>) such as (0F7;7BW3), a forward and a backward of another stage");
  Action first = parse_action(t.substr(1, semi - 1));
  const Action second = parse_action(t.substr(semi + 1, t.size() - semi - 2));
  first.paired = true;
  return {first, second};
}

}  // namespace pipetrain

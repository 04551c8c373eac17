#include "pipetrain/core/pattern.h"

#include <cctype>
#include <memory>

#include "pipetrain/core/error.h"

namespace pipetrain {

namespace {
constexpr std::size_t kMaxPattern = 1000;
constexpr std::size_t kMaxStates = 2000;
constexpr int kMaxRepeat = 100;

// The parsed pattern.
struct Node {
  enum Kind { kEmpty, kChar, kAny, kClass, kBol, kEol, kConcat, kAlt, kRepeat } kind = kEmpty;
  unsigned char c = 0;
  int cls = -1;
  int min = 0, max = -1;  // kRepeat; max -1 = unbounded
  std::vector<std::unique_ptr<Node>> kids;
};
using NodeP = std::unique_ptr<Node>;
}  // namespace

class PatternCompiler {
 public:
  PatternCompiler(Pattern& p) : p_(p), s_(p.pattern_) {}

  void run() {
    if (s_.size() > kMaxPattern)
      throw UsageError("regular expression of " + std::to_string(s_.size()) + " characters: the limit is " +
                       std::to_string(kMaxPattern) + "; give a shorter pattern");
    NodeP root = alternation(0);
    if (at_ < s_.size()) fail("unmatched ')'", "remove it or add the '(' it closes");
    Frag f = emit(*root);
    const int match = add(Pattern::State{});
    patch(f, match);
    p_.start_ = f.start;
  }

 private:
  struct Frag {
    int start = -1;
    std::vector<std::pair<int, int>> outs;  // (state, 0 = next, 1 = alt) still unconnected
  };

  [[noreturn]] void fail(const std::string& what, const std::string& fix) const {
    throw UsageError("regular expression '" + s_ + "' at position " + std::to_string(at_) + ": " + what + "; " + fix +
                     " (supported: literals . [..] [^..] \\d \\w \\s ^ $ ( ) (?: ) | * + ? {n,m})");
  }

  bool more() const { return at_ < s_.size(); }
  char peek() const { return s_[at_]; }

  NodeP alternation(int depth) {
    if (depth > 200) fail("groups nested too deeply", "nest at most 200 groups");
    NodeP first = concat(depth);
    if (!more() || peek() != '|') return first;
    auto alt = std::make_unique<Node>();
    alt->kind = Node::kAlt;
    alt->kids.push_back(std::move(first));
    while (more() && peek() == '|') {
      ++at_;
      alt->kids.push_back(concat(depth));
    }
    return alt;
  }

  NodeP concat(int depth) {
    auto cat = std::make_unique<Node>();
    cat->kind = Node::kConcat;
    while (more() && peek() != '|' && peek() != ')') cat->kids.push_back(repeat(depth));
    return cat;
  }

  int number() {
    if (!more() || !std::isdigit(static_cast<unsigned char>(peek()))) fail("expected a number in {n,m}", "write e.g. {2,4}");
    long v = 0;
    while (more() && std::isdigit(static_cast<unsigned char>(peek()))) {
      v = v * 10 + (peek() - '0');
      if (v > kMaxRepeat) fail("repeat count over " + std::to_string(kMaxRepeat), "use * or + for long runs");
      ++at_;
    }
    return static_cast<int>(v);
  }

  NodeP repeat(int depth) {
    NodeP atom_node = atom(depth);
    while (more()) {
      int lo, hi;
      const std::size_t op = at_;
      if (peek() == '*') {
        lo = 0, hi = -1, ++at_;
      } else if (peek() == '+') {
        lo = 1, hi = -1, ++at_;
      } else if (peek() == '?') {
        lo = 0, hi = 1, ++at_;
      } else if (peek() == '{') {
        ++at_;
        lo = number();
        hi = lo;
        if (more() && peek() == ',') {
          ++at_;
          hi = more() && peek() == '}' ? -1 : number();
        }
        if (!more() || peek() != '}') fail("unclosed {n,m}", "close it with '}'");
        ++at_;
        if (hi >= 0 && hi < lo) fail("{n,m} with m < n", "give n <= m");
      } else {
        break;
      }
      if (atom_node->kind == Node::kBol || atom_node->kind == Node::kEol) {
        at_ = op;
        fail("a quantifier after an anchor", "remove the quantifier");
      }
      if (more() && peek() == '?') ++at_;  // lazy: the same set of matches
      auto r = std::make_unique<Node>();
      r->kind = Node::kRepeat;
      r->min = lo;
      r->max = hi;
      r->kids.push_back(std::move(atom_node));
      atom_node = std::move(r);
    }
    return atom_node;
  }

  int new_class() {
    p_.classes_.emplace_back(256, false);
    return static_cast<int>(p_.classes_.size()) - 1;
  }

  // Adds the class escape \d \w \s (or their negations) to `set`; false if `e` is none of them.
  static bool class_escape(char e, std::vector<bool>& set) {
    auto in = [&](int ch) {
      switch (std::tolower(static_cast<unsigned char>(e))) {
        case 'd': return ch >= '0' && ch <= '9';
        case 'w': return std::isalnum(ch) != 0 || ch == '_';
        case 's': return ch == ' ' || (ch >= '\t' && ch <= '\r');
      }
      return false;
    };
    const char lower = static_cast<char>(std::tolower(static_cast<unsigned char>(e)));
    if (lower != 'd' && lower != 'w' && lower != 's') return false;
    const bool negate = e != lower;
    for (int ch = 0; ch < 256; ++ch)
      if (in(ch) != negate) set[static_cast<std::size_t>(ch)] = true;
    return true;
  }

  // The character an escape `\e` (outside a class escape) stands for.
  unsigned char escaped(char e) {
    switch (e) {
      case 'n': return '\n';
      case 't': return '\t';
      case 'r': return '\r';
      case 'f': return '\f';
      case 'v': return '\v';
      case '0': return '\0';
    }
    if (std::isdigit(static_cast<unsigned char>(e))) fail("back-references are not supported", "remove \\" + std::string(1, e));
    if (e == 'b' || e == 'B') fail("word boundaries are not supported", "anchor with ^ or $ instead");
    if (std::isalnum(static_cast<unsigned char>(e)))
      fail(std::string("unknown escape \\") + e, "escape only punctuation, or use \\d \\w \\s");
    return static_cast<unsigned char>(e);
  }

  NodeP atom(int depth) {
    auto n = std::make_unique<Node>();
    const char ch = peek();
    switch (ch) {
      case '(': {
        ++at_;
        if (more() && peek() == '?') {
          if (at_ + 1 < s_.size() && s_[at_ + 1] == ':') {
            at_ += 2;
          } else {
            fail("look-arounds and other (? groups are not supported", "use a plain group ( ) or (?: )");
          }
        }
        NodeP inside = alternation(depth + 1);
        if (!more() || peek() != ')') fail("unclosed '('", "close the group with ')'");
        ++at_;
        return inside;
      }
      case '*':
      case '+':
      case '?':
      case '{':
        fail(std::string("'") + ch + "' repeats nothing", "escape it as \\" + std::string(1, ch) + " or put an atom before it");
      case '.':
        ++at_;
        n->kind = Node::kAny;
        return n;
      case '^':
        ++at_;
        n->kind = Node::kBol;
        return n;
      case '$':
        ++at_;
        n->kind = Node::kEol;
        return n;
      case '[':
        return char_class();
      case '\\': {
        ++at_;
        if (!more()) fail("a trailing '\\'", "escape something or remove it");
        const char e = s_[at_++];
        std::vector<bool> set(256, false);
        if (class_escape(e, set)) {
          n->kind = Node::kClass;
          n->cls = new_class();
          p_.classes_[static_cast<std::size_t>(n->cls)] = set;
          return n;
        }
        n->kind = Node::kChar;
        n->c = escaped(e);
        return n;
      }
      default:
        ++at_;
        n->kind = Node::kChar;
        n->c = static_cast<unsigned char>(ch);
        return n;
    }
  }

  NodeP char_class() {
    ++at_;  // '['
    std::vector<bool> set(256, false);
    bool negate = false;
    if (more() && peek() == '^') negate = true, ++at_;
    bool first = true;
    for (;;) {
      if (!more()) fail("unclosed '['", "close the class with ']'");
      if (peek() == ']' && !first) break;
      first = false;
      int lo;
      if (peek() == '\\') {
        ++at_;
        if (!more()) fail("unclosed '['", "close the class with ']'");
        const char e = s_[at_++];
        if (class_escape(e, set)) continue;
        lo = e == 'b' ? '\b' : escaped(e);
      } else {
        lo = static_cast<unsigned char>(s_[at_++]);
      }
      int hi = lo;
      if (at_ + 1 < s_.size() && peek() == '-' && s_[at_ + 1] != ']') {
        ++at_;
        if (peek() == '\\') {
          ++at_;
          if (!more()) fail("unclosed '['", "close the class with ']'");
          hi = escaped(s_[at_++]);
        } else {
          hi = static_cast<unsigned char>(s_[at_++]);
        }
        if (hi < lo) fail("a range whose end comes before its start", "write the range low-high, e.g. [a-z]");
      }
      for (int c = lo; c <= hi; ++c) set[static_cast<std::size_t>(c)] = true;
    }
    ++at_;  // ']'
    if (p_.icase_)  // fold before negating: [^a] matches neither a nor A
      for (int c = 'a'; c <= 'z'; ++c) {
        const bool any = set[static_cast<std::size_t>(c)] || set[static_cast<std::size_t>(c - 'a' + 'A')];
        set[static_cast<std::size_t>(c)] = set[static_cast<std::size_t>(c - 'a' + 'A')] = any;
      }
    if (negate) set.flip();
    auto n = std::make_unique<Node>();
    n->kind = Node::kClass;
    n->cls = new_class();
    p_.classes_[static_cast<std::size_t>(n->cls)] = set;
    return n;
  }

  int add(Pattern::State st) {
    if (p_.states_.size() >= kMaxStates)
      throw UsageError("regular expression '" + s_ + "' expands to more than " + std::to_string(kMaxStates) +
                       " states: use smaller {n,m} counts");
    p_.states_.push_back(st);
    return static_cast<int>(p_.states_.size()) - 1;
  }

  void patch(const Frag& f, int to) {
    for (const auto& [state, which] : f.outs) {
      Pattern::State& st = p_.states_[static_cast<std::size_t>(state)];
      (which == 0 ? st.next : st.alt) = to;
    }
  }

  Frag single(Pattern::State::Kind kind, unsigned char c = 0, int cls = -1) {
    Pattern::State st;
    st.kind = kind;
    st.c = c;
    st.cls = cls;
    const int id = add(st);
    return Frag{id, {{id, 0}}};
  }

  Frag epsilon() { return single(Pattern::State::kJump); }

  Frag concat_frags(Frag a, Frag b) {
    patch(a, b.start);
    return Frag{a.start, std::move(b.outs)};
  }

  Frag star(Frag body) {  // body*
    Pattern::State split;
    split.kind = Pattern::State::kSplit;
    const int s = add(split);
    p_.states_[static_cast<std::size_t>(s)].next = body.start;
    patch(body, s);
    return Frag{s, {{s, 1}}};
  }

  Frag optional(Frag body) {  // body?
    Pattern::State split;
    split.kind = Pattern::State::kSplit;
    const int s = add(split);
    p_.states_[static_cast<std::size_t>(s)].next = body.start;
    Frag f{s, std::move(body.outs)};
    f.outs.emplace_back(s, 1);
    return f;
  }

  Frag emit(const Node& n) {
    switch (n.kind) {
      case Node::kEmpty:
        return epsilon();
      case Node::kChar:
        return single(Pattern::State::kChar, p_.icase_ ? static_cast<unsigned char>(std::tolower(n.c)) : n.c);
      case Node::kAny:
        return single(Pattern::State::kAny);
      case Node::kClass:
        return single(Pattern::State::kClass, 0, n.cls);
      case Node::kBol:
        return single(Pattern::State::kBol);
      case Node::kEol:
        return single(Pattern::State::kEol);
      case Node::kConcat: {
        Frag f = epsilon();
        for (const auto& k : n.kids) f = concat_frags(std::move(f), emit(*k));
        return f;
      }
      case Node::kAlt: {
        Frag f = emit(*n.kids.front());
        for (std::size_t i = 1; i < n.kids.size(); ++i) {
          Frag other = emit(*n.kids[i]);
          Pattern::State split;
          split.kind = Pattern::State::kSplit;
          const int s = add(split);
          p_.states_[static_cast<std::size_t>(s)].next = f.start;
          p_.states_[static_cast<std::size_t>(s)].alt = other.start;
          Frag joined{s, std::move(f.outs)};
          joined.outs.insert(joined.outs.end(), other.outs.begin(), other.outs.end());
          f = std::move(joined);
        }
        return f;
      }
      case Node::kRepeat: {
        const Node& body = *n.kids.front();
        Frag f = epsilon();
        for (int i = 0; i < n.min; ++i) f = concat_frags(std::move(f), emit(body));
        if (n.max < 0) {
          f = concat_frags(std::move(f), star(emit(body)));
        } else {
          for (int i = n.min; i < n.max; ++i) f = concat_frags(std::move(f), optional(emit(body)));
        }
        return f;
      }
    }
    return epsilon();
  }

  Pattern& p_;
  const std::string& s_;
  std::size_t at_ = 0;
};

Pattern::Pattern(const std::string& pattern, bool ignore_case) : pattern_(pattern), icase_(ignore_case) {
  PatternCompiler(*this).run();  // \d \w \s and their negations are the same in either case
}

bool Pattern::search(const std::string& text) const {
  const std::size_t n = states_.size();
  std::vector<int> current, next, stack;
  std::vector<std::size_t> mark(n, static_cast<std::size_t>(-1));  // last position a state was added at
  current.reserve(n);
  next.reserve(n);
  // Adds state s and what it reaches without consuming a character, at position pos.
  auto add = [&](std::vector<int>& list, int s0, std::size_t pos) {
    stack.clear();
    stack.push_back(s0);
    while (!stack.empty()) {
      const int s = stack.back();
      stack.pop_back();
      if (s < 0 || mark[static_cast<std::size_t>(s)] == pos) continue;
      mark[static_cast<std::size_t>(s)] = pos;
      const State& st = states_[static_cast<std::size_t>(s)];
      switch (st.kind) {
        case State::kJump:
          stack.push_back(st.next);
          break;
        case State::kSplit:
          stack.push_back(st.alt);
          stack.push_back(st.next);
          break;
        case State::kBol:
          if (pos == 0) stack.push_back(st.next);
          break;
        case State::kEol:
          if (pos == text.size()) stack.push_back(st.next);
          break;
        default:
          list.push_back(s);
      }
    }
  };
  for (std::size_t pos = 0;; ++pos) {
    add(current, start_, pos);  // a match may start anywhere (search)
    for (int s : current)
      if (states_[static_cast<std::size_t>(s)].kind == State::kMatch) return true;
    if (pos == text.size()) return false;
    unsigned char ch = static_cast<unsigned char>(text[pos]);
    if (icase_) ch = static_cast<unsigned char>(std::tolower(ch));
    next.clear();
    for (int s : current) {
      const State& st = states_[static_cast<std::size_t>(s)];
      bool ok = false;
      if (st.kind == State::kChar) ok = st.c == ch;
      else if (st.kind == State::kAny) ok = ch != '\n' && ch != '\r';
      else if (st.kind == State::kClass) ok = classes_[static_cast<std::size_t>(st.cls)][ch];
      if (ok) add(next, st.next, pos + 1);
    }
    current.swap(next);
  }
}

}  // namespace pipetrain

// A small regular-expression matcher that never backtracks: the pattern compiles to a Thompson NFA and
// a search runs every state in step over the text, so its time is O(text length x pattern size) for any
// pattern (std::regex backtracks, and `(a*)*b` over 18 characters ran for minutes). Torch-free.
//
// The subset (a subset of ECMAScript's syntax; what `type:REGEX` balancing documents, docs/PROFILE.md):
//   literals; `.` (any character); classes `[abc]`, `[a-z0-9_]`, `[^...]`; escapes `\d \w \s \D \W \S`
//   and `\` before any punctuation for the character itself; anchors `^` and `$`; groups `(...)` and
//   `(?:...)`; alternation `|`; quantifiers `*`, `+`, `?`, `{n}`, `{n,}`, `{n,m}` (n, m <= 100; a lazy
//   `?` after a quantifier is accepted and changes nothing, since only whether it matches is asked).
// Not supported, and refused with a UsageError naming the construct: back-references (`\1`),
// look-arounds (`(?=`, `(?!`, `(?<`), word boundaries (`\b`), and patterns over 1000 characters or that
// expand past 2000 NFA states (a search costs text length x states).
#pragma once

#include <string>
#include <vector>

namespace pipetrain {

class Pattern {
 public:
  // Throws UsageError naming the pattern, the offending position and the fix.
  explicit Pattern(const std::string& pattern, bool ignore_case = false);
  // Whether the pattern matches some substring of `text` (ECMAScript regex_search semantics for this
  // subset).
  bool search(const std::string& text) const;
  const std::string& text() const { return pattern_; }

  struct State {
    enum Kind { kChar, kAny, kClass, kSplit, kJump, kBol, kEol, kMatch } kind = kMatch;
    int next = -1, alt = -1;  // successors (kSplit uses both)
    unsigned char c = 0;      // kChar
    int cls = -1;             // kClass: index into classes_
  };

 private:
  std::string pattern_;
  bool icase_ = false;
  std::vector<State> states_;
  std::vector<std::vector<bool>> classes_;  // 256 entries each
  int start_ = 0;
  friend class PatternCompiler;
};

}  // namespace pipetrain

// Config files and name suggestions for the command line. Torch-free, so the config parser can be
// tested and fuzzed without LibTorch.
#pragma once

#include <string>
#include <vector>

namespace pipetrain {

// One key of a `--config FILE` JSON object: the flag ("--stages") and its values as command-line words
// (none for `true`). `is_array` says the value was a JSON array (several values).
struct ConfigFlag {
  std::string key;
  std::string flag;
  std::vector<std::string> values;
  bool is_array = false;
  bool off = false;  // the key's value was false: an on/off flag left out (no values)
};

// Parses a config file's text: a JSON object whose keys are flag names without the dashes. true adds
// the flag, false leaves it out (returned with `off` set, so that the caller can refuse false for a flag
// that takes a value: {"steps": false} read as no --steps trained the default count), strings and numbers become values, arrays one value
// each. Throws UsageError naming `origin` (the file) and the key: invalid JSON, not an object, a value
// of another type (null, an object, nested arrays), a non-finite number, an empty or dashed key, or a
// "config" key (no nesting).
std::vector<ConfigFlag> parse_config_text(const std::string& text, const std::string& origin);

// Edit distance: insert, delete, substitute, or swap two neighbouring characters, each 1 (optimal
// string alignment).
std::size_t edit_distance(const std::string& a, const std::string& b);

// The candidate nearest to `name` by edit distance, if it is close enough to be a likely typo (at most
// 1 edit for names up to 4 characters, else at most a third of the name's length, at least 2), else "".
// Ties go to the earlier candidate.
std::string nearest_name(const std::string& name, const std::vector<std::string>& candidates);

// " (did you mean 'X'?)" for nearest_name's answer, or "" when there is none.
std::string did_you_mean(const std::string& name, const std::vector<std::string>& candidates);

}  // namespace pipetrain

#include "pipetrain/core/config.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"

namespace pipetrain {

std::vector<ConfigFlag> parse_config_text(const std::string& text, const std::string& origin) {
  const nlohmann::json j = parse_json_text(text, "--config " + origin);
  if (!j.is_object())
    throw UsageError("--config " + origin + " must hold a JSON object of flags, e.g. {\"stages\": 4, \"schedule\": \"1f1b\"}");
  auto value = [&](const std::string& key, const nlohmann::json& v) -> std::string {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_number_integer()) return v.is_number_unsigned() ? std::to_string(v.get<uint64_t>()) : std::to_string(v.get<int64_t>());
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (!std::isfinite(d))
        throw UsageError("--config " + origin + ": key '" + excerpt(key) + "' has value " + json_excerpt(v) + "; give a finite number");
      return v.dump();
    }
    throw UsageError("--config " + origin + ": key '" + excerpt(key) + "' has value " + json_excerpt(v) +
                     "; use a string, a number, true/false or an array of those");
  };
  std::vector<ConfigFlag> out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    if (key == "config") throw UsageError("--config " + origin + " names another config file; nest no config files");
    if (key.empty() || key[0] == '-' || key.find_first_of(" =\t\n") != std::string::npos)
      throw UsageError("--config " + origin + ": key '" + excerpt(key) +
                       "' is not a flag name; write flag names without dashes, e.g. \"stages\"");
    ConfigFlag f;
    f.key = key;
    f.flag = "--" + key;
    const nlohmann::json& v = it.value();
    if (v.is_boolean()) {
      f.off = !v.get<bool>();
    } else if (v.is_array()) {
      f.is_array = true;
      if (v.empty())
        throw UsageError("--config " + origin + ": key '" + excerpt(key) + "' is an empty array; give at least one value or drop the key");
      for (const auto& x : v) f.values.push_back(value(key, x));
    } else {
      f.values.push_back(value(key, v));
    }
    out.push_back(std::move(f));
  }
  return out;
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  // Optimal string alignment: insert, delete, substitute, and swapping two neighbours, each 1.
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<std::size_t>> d(n + 1, std::vector<std::size_t>(m + 1, 0));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= n; ++i)
    for (std::size_t j = 1; j <= m; ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}

std::string nearest_name(const std::string& name, const std::vector<std::string>& candidates) {
  if (name.size() > 200) return "";
  const std::size_t limit = name.size() <= 4 ? 1 : std::max<std::size_t>(2, name.size() / 3);
  std::string best;
  std::size_t best_d = limit + 1;
  for (const std::string& c : candidates) {
    if (c == name) continue;
    const std::size_t d = edit_distance(name, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

std::string did_you_mean(const std::string& name, const std::vector<std::string>& candidates) {
  const std::string n = nearest_name(name, candidates);
  return n.empty() ? "" : " (did you mean '" + n + "'?)";
}

}  // namespace pipetrain

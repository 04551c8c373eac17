// The bounded JSON reader and the message quoting of core/json_limits.h, on any bytes: what the
// checkpoint manifest reader (runtime) and every other JSON reader builds on. A parsed value of any shape
// must quote as a short excerpt; any text must escape to bytes a terminal shows as text.
#include <cstdlib>

#include "fuzz_common.h"
#include "pipetrain/core/json_limits.h"

namespace {
void check_printable(const std::string& s, bool newlines_allowed) {
  for (const char c : s) {
    const auto b = static_cast<unsigned char>(c);
    if ((b < 0x20 && !(newlines_allowed && (c == '\n' || c == '\t'))) || b == 0x7F) __builtin_trap();
  }
}
}  // namespace

PIPETRAIN_FUZZ_JSON_TARGET({
  check_printable(pipetrain::escape_controls(text), true);
  const std::string e = pipetrain::excerpt(text);
  check_printable(e, false);
  if (e.size() > 4 * pipetrain::kExcerptBytes + 32) __builtin_trap();  // \xNN is 4 bytes per input byte
  const nlohmann::json j = pipetrain::parse_json_text(text, "manifest.json");
  const std::string q = pipetrain::json_excerpt(j);
  check_printable(q, false);
  if (q.size() > 6 * pipetrain::kExcerptBytes + 64) __builtin_trap();
  if (j.is_object() && j.contains("version")) check_printable(pipetrain::json_excerpt(j["version"]), false);
  (void)j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);  // within the depth bound: safe
})

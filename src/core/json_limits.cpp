#include "pipetrain/core/json_limits.h"

#include <fmt/format.h>

#include "pipetrain/core/error.h"

namespace pipetrain {

namespace {

// Length of the valid UTF-8 sequence starting at text[i] (2..4) and its code point, or 0 when the bytes
// there are not valid UTF-8 (a stray continuation byte, an overlong form, a surrogate, past U+10FFFF,
// or cut short).
std::size_t utf8_sequence(std::string_view text, std::size_t i, char32_t& cp) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(text[i + k]); };
  const unsigned char c = b(0);
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2, cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3, cp = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4, cp = c & 0x07;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    const unsigned char x = b(k);
    if (x < (k == 1 ? lo : 0x80) || x > (k == 1 ? hi : 0xBF)) return 0;
    cp = (cp << 6) | (x & 0x3F);
  }
  return n;
}

void hex_byte(std::string& out, unsigned char c) { out += fmt::format("\\x{:02X}", c); }

// Appends the escaped form of text[i...] (one character or byte) to `out` and returns how many input
// bytes it took. `one_line`: newline and tab are escaped too.
std::size_t escape_one(std::string_view text, std::size_t i, bool one_line, std::string& out) {
  const auto c = static_cast<unsigned char>(text[i]);
  if (c < 0x80) {
    if (c == '\n' || c == '\t') {
      if (one_line)
        out += c == '\n' ? "\\n" : "\\t";
      else
        out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7F) {
      hex_byte(out, c);
    } else {
      out += static_cast<char>(c);
    }
    return 1;
  }
  char32_t cp = 0;
  const std::size_t n = utf8_sequence(text, i, cp);
  if (n == 0) {
    hex_byte(out, c);
    return 1;
  }
  if (cp >= 0x80 && cp <= 0x9F) {  // C1 controls: CSI (U+009B) starts terminal sequences as ESC [ does
    for (std::size_t k = 0; k < n; ++k) hex_byte(out, static_cast<unsigned char>(text[i + k]));
  } else {
    out.append(text.substr(i, n));
  }
  return n;
}

std::string escaped(std::string_view text, bool one_line, std::size_t max_bytes, bool& cut) {
  std::string out;
  std::size_t i = 0;
  cut = false;
  while (i < text.size()) {
    if (i >= max_bytes) {
      cut = true;
      break;
    }
    i += escape_one(text, i, one_line, out);
  }
  return out;
}

// Compact JSON for json_excerpt, as dump() writes it ({"a":[1,2]}): stops descending below kLevels and once `out` passes `budget`.
void render(const nlohmann::json& v, std::size_t level, std::size_t budget, std::string& out) {
  constexpr std::size_t kLevels = 8;
  if (out.size() > budget) return;
  if (v.is_string()) {
    bool cut = false;
    std::string s;
    const std::string& text = v.get_ref<const std::string&>();
    for (std::size_t i = 0; i < text.size() && !cut;) {
      if (out.size() + s.size() > budget) {
        cut = true;
        break;
      }
      if (text[i] == '"' || text[i] == '\\') {
        s += '\\';
        s += text[i++];
      } else {
        i += escape_one(text, i, true, s);
      }
    }
    out += '"' + s + (cut ? "..." : "\"");
  } else if (v.is_array() || v.is_object()) {
    const bool array = v.is_array();
    out += array ? '[' : '{';
    if (level >= kLevels && !v.empty()) {
      out += "...";
    } else {
      bool first = true;
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (out.size() > budget) {
          out += ",...";
          break;
        }
        if (!first) out += ',';
        first = false;
        if (!array) {
          render(nlohmann::json(it.key()), level + 1, budget, out);
          out += ':';
        }
        render(*it, level + 1, budget, out);
      }
    }
    out += array ? ']' : '}';
  } else {
    out += v.dump();  // a number, true, false or null: no recursion, a few bytes
  }
}

}  // namespace

std::string_view skip_utf8_bom(std::string_view text) {
  if (text.size() >= 3 && text.substr(0, 3) == "\xEF\xBB\xBF") text.remove_prefix(3);
  return text;
}

nlohmann::json parse_json_text(std::string_view text, const std::string& what, std::size_t max_depth) {
  text = skip_utf8_bom(text);
  // One pass over the bytes, outside strings counting the open arrays and objects, before nlohmann
  // builds a value that later recursion could not walk.
  std::size_t depth = 0;
  bool in_string = false, backslash = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\0')
      throw UsageError(fmt::format(
          "{}: byte {} is a NUL byte, which JSON text never holds (the {} bytes after it would be ignored): "
          "remove it and what follows, or check that the file is the right one and not truncated or binary",
          what, i, text.size() - i - 1));
    if (in_string) {
      if (backslash)
        backslash = false;
      else if (c == '\\')
        backslash = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth)
        throw UsageError(fmt::format("{}: arrays and objects nest more than {} levels deep (at byte {}): no "
                                     "pipetrain file nests more than a few; check that the file is the right one",
                                     what, max_depth, i));
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::parse_error& e) {
    throw UsageError(what + " is not valid JSON (" + excerpt(e.what(), 240) + "); fix the syntax at the byte it names");
  } catch (const nlohmann::json::exception& e) {  // e.g. out_of_range for 1e309: a number no double holds
    throw UsageError(what + ": cannot read the JSON (" + excerpt(e.what(), 240) +
                     "); every number must be finite and fit a double (at most about 1.8e308)");
  }
}

std::string escape_controls(std::string_view text) {
  bool cut = false;
  return escaped(text, false, text.size(), cut);
}

std::string excerpt(std::string_view text, std::size_t max_bytes) {
  bool cut = false;
  std::string out = escaped(text, true, max_bytes, cut);
  if (cut) out += fmt::format("... ({} bytes)", text.size());
  return out;
}

std::string json_excerpt(const nlohmann::json& value, std::size_t max_bytes) {
  std::string out;
  render(value, 0, max_bytes, out);  // past the budget by a closing bracket per level and one scalar at most
  return out;
}

}  // namespace pipetrain

// Reading JSON from input files, and quoting input in messages, without crashing or flooding the
// terminal (issue 23). Torch-free, so every layer uses it: the config, profile and plan readers here,
// the checkpoint manifest reader in the runtime layer.
//
// Why a depth bound: nlohmann's parser is iterative, but dump(), copies and comparisons recurse once per
// nesting level; a 600 KB file of 70,000 '[' overflowed the stack (SIGSEGV) when a reader echoed the
// value into its message. Every JSON file pipetrain reads nests at most 5 levels (a profile's
// layers[i].by_micro_batch[k]); kMaxJsonDepth = 64 leaves ample room for hand-written "meta" objects while
// keeping every recursive walk a few kilobytes of stack, even on a rank thread's smaller stack.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace pipetrain {

inline constexpr std::size_t kMaxJsonDepth = 64;
// Bytes of input a message quotes at most (an excerpt ends in "... (N bytes)" when cut).
inline constexpr std::size_t kExcerptBytes = 80;

// `text` without a leading UTF-8 byte order mark (EF BB BF), which editors on Windows write.
std::string_view skip_utf8_bom(std::string_view text);

// Parses JSON text read from an input. `what` names the input in messages ("--config run.json",
// "profile gpt.json", "checkpoint manifest ckpt/manifest.json"). Skips a leading UTF-8 BOM. Throws
// UsageError (exit 2), naming `what`, for:
//  - a NUL byte anywhere (nlohmann stops at one and ignores the rest): names its byte offset;
//  - arrays/objects nested deeper than `max_depth`: names the limit and the byte where it was passed;
//  - invalid JSON or a number no double holds (1e309): nlohmann's message, cut to a short excerpt.
nlohmann::json parse_json_text(std::string_view text, const std::string& what, std::size_t max_depth = kMaxJsonDepth);

// `text` made safe for a terminal: C0 control characters (but newline and tab), DEL, C1 controls
// (U+0080..U+009F) and bytes that are not valid UTF-8 become \xNN; other UTF-8 text stays readable.
// For whole messages (multi-line ones keep their lines).
std::string escape_controls(std::string_view text);

// A short, one-line, escaped quote of `text` for a message: as escape_controls, newline and tab also
// escaped (\n, \t), at most `max_bytes` of input, then "... (N bytes)" naming the whole length.
std::string excerpt(std::string_view text, std::size_t max_bytes = kExcerptBytes);

// A JSON value as a short excerpt of its compact text ("[[[[...", {"a": 1, ...}): never recurses deeper
// than a few levels and stops after about `max_bytes` of output, so any value (however deep or large,
// even one parsed without parse_json_text) is safe to quote. Strings are escaped as by excerpt().
std::string json_excerpt(const nlohmann::json& value, std::size_t max_bytes = kExcerptBytes);

}  // namespace pipetrain

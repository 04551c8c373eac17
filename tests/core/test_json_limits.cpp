// Checks core/json_limits.h (issue 23): the bounded JSON reader refuses depth bombs, NUL bytes and bad
// JSON with a short message naming the input and the limit, skips a byte order mark; the quoting helpers
// escape control characters and invalid UTF-8 but keep UTF-8 text, and cut long values short. Then every
// JSON reader built on it (config, profile, plan, plan file): before issue 23 a file nested 70,000
// levels deep crashed them (stack overflow while echoing the value) and 50,000 levels echoed 300 KB.
#include <gtest/gtest.h>

#include "pipetrain/core/config.h"
#include "error_of.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/plan/planner.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/plan/search.h"

using namespace pipetrain;

namespace {
using pipetrain::testing::error_of;
std::string nested(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// A message quotes at most a short excerpt of the file: never the bulk of a 140 KB value.
void expect_short(const std::string& e) {
  EXPECT_LT(e.size(), 1000u) << e.substr(0, 300);
  EXPECT_NE(e, "accepted");
}

const std::string kProfileHead =
    R"({"format": "pipetrain-profile", "version": 1, "model": "m", "micro_batch_size": 1, "threads": )";
const std::string kProfileTail = R"(, "layers": [{"name": "a", "type": "Linear", "forward_ms": 1, "backward_ms": 1,
    "activation_bytes": 1, "parameter_bytes": 1, "optimizer_bytes": 0}]})";
}  // namespace

TEST(ParseJsonText, RefusesNestingPastTheLimitNamingItAndTheInput) {
  EXPECT_NO_THROW(parse_json_text(nested(kMaxJsonDepth), "x.json"));
  const std::string e = error_of([] { parse_json_text(nested(kMaxJsonDepth + 1), "profile x.json"); });
  EXPECT_NE(e.find("profile x.json"), std::string::npos) << e;
  EXPECT_NE(e.find("more than 64 levels"), std::string::npos) << e;
  EXPECT_NE(e.find("at byte 64"), std::string::npos) << e;
  // Brackets inside strings do not count.
  EXPECT_NO_THROW(parse_json_text("{\"a\": \"" + std::string(1000, '[') + "\\\"[\"}", "x.json"));
  expect_short(error_of([] { parse_json_text(nested(70000), "x.json"); }));
}

TEST(ParseJsonText, RefusesANulByteNamingItsOffset) {
  // nlohmann stops at a NUL: {"stages": 2}\0garbage was read as {"stages": 2}.
  const std::string text = std::string("{\"stages\": 2}") + '\0' + "garbage";
  const std::string e = error_of([&] { parse_json_text(text, "--config run.json"); });
  EXPECT_NE(e.find("--config run.json"), std::string::npos) << e;
  EXPECT_NE(e.find("byte 13 is a NUL byte"), std::string::npos) << e;
  EXPECT_NE(e.find("7 bytes after it"), std::string::npos) << e;
}

TEST(ParseJsonText, SkipsAByteOrderMark) {
  EXPECT_EQ(parse_json_text("\xEF\xBB\xBF{\"a\": 1}", "x.json").at("a"), 1);
  EXPECT_EQ(skip_utf8_bom("\xEF\xBB\xBFrest"), "rest");
  EXPECT_EQ(skip_utf8_bom("\xEF\xBBrest"), "\xEF\xBBrest");
}

TEST(ParseJsonText, InvalidJsonMessageIsShort) {
  // nlohmann's message quotes the token it stopped in: an unclosed 200 KB string was echoed whole.
  const std::string e = error_of([] { parse_json_text("{\"a\": \"" + std::string(200000, 'x'), "x.json"); });
  EXPECT_NE(e.find("x.json is not valid JSON"), std::string::npos) << e.substr(0, 300);
  expect_short(e);
  EXPECT_NE(error_of([] { parse_json_text("[1e309]", "x.json"); }).find("finite"), std::string::npos);
}

TEST(EscapeControls, EscapesTerminalSequencesKeepsUtf8AndNewlines) {
  EXPECT_EQ(escape_controls("\x1b[2J\x1b]0;pwned\x07"), "\\x1B[2J\\x1B]0;pwned\\x07");
  EXPECT_EQ(escape_controls("caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80"), "caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80");
  EXPECT_EQ(escape_controls("line 1\nline 2\tx\r"), "line 1\nline 2\tx\\x0D");
  EXPECT_EQ(escape_controls("del\x7F"), "del\\x7F");
  EXPECT_EQ(escape_controls("csi\xC2\x9B" "31m"), "csi\\xC2\\x9B31m");        // C1 control U+009B
  EXPECT_EQ(escape_controls("raw\x9B" "31m"), "raw\\x9B31m");                 // a lone byte: invalid UTF-8
  EXPECT_EQ(escape_controls("\xFF\xC3"), "\\xFF\\xC3");                       // invalid, and cut short
  EXPECT_EQ(escape_controls("\xED\xA0\x80"), "\\xED\\xA0\\x80");              // a surrogate
  EXPECT_EQ(escape_controls("\xC0\xAF"), "\\xC0\\xAF");                       // overlong '/'
}

TEST(Excerpt, IsOneLineAndCutsLongTextNamingItsLength) {
  EXPECT_EQ(excerpt("a\nb\tc"), "a\\nb\\tc");
  const std::string e = excerpt(std::string(300000, 'x'));
  EXPECT_EQ(e, std::string(kExcerptBytes, 'x') + "... (300000 bytes)");
  // Never cuts inside a UTF-8 character.
  const std::string accents = excerpt(std::string(3, 'a') + "\xC3\xA9\xC3\xA9", 4);
  EXPECT_EQ(accents, "aaa\xC3\xA9... (7 bytes)");
}

TEST(JsonExcerpt, QuotesAnyValueShortly) {
  EXPECT_EQ(json_excerpt(nlohmann::json::parse(R"({"a": [1, 2.5, true, null], "b": "x\"y"})")),
            R"({"a":[1,2.5,true,null],"b":"x\"y"})");  // as dump() writes it
  // Deep (built without the reader's bound: the runtime may hold such a value) and long values.
  nlohmann::json deep = 1;
  for (int i = 0; i < 100000; ++i) deep = nlohmann::json::array({std::move(deep)});
  const std::string d = json_excerpt(deep);
  EXPECT_LT(d.size(), 200u) << d;
  EXPECT_EQ(d.rfind("[[[[", 0), 0u) << d;
  EXPECT_LT(json_excerpt(nlohmann::json(std::vector<int>(100000, 7))).size(), 200u);
  EXPECT_LT(json_excerpt(std::string(100000, 'z')).size(), 200u);
  EXPECT_EQ(json_excerpt("\x1b[2J\xFF"), "\"\\x1B[2J\\xFF\"");  // no dump(): invalid UTF-8 made it throw
}

TEST(JsonReaders, ConfigDepthBombIsAnErrorNotACrash) {
  for (const std::string& text : {"{\"lr\": " + nested(70000) + "}", nested(70000), "{\"balance\": " + nested(50000) + "}"}) {
    const std::string e = error_of([&] { parse_config_text(text, "run.json"); });
    EXPECT_NE(e.find("run.json"), std::string::npos) << e;
    EXPECT_NE(e.find("64 levels"), std::string::npos) << e;
    expect_short(e);
  }
  // Within the bound, the echoed value is still an excerpt.
  const std::string e = error_of([] { parse_config_text("{\"lr\": [" + std::string(100000, '1') + "]}", "run.json"); });
  expect_short(e);
}

TEST(JsonReaders, ConfigRefusesBytesAfterANul) {
  const std::string e = error_of([] { parse_config_text(std::string("{\"stages\": 2}") + '\0' + "garbage", "run.json"); });
  EXPECT_NE(e.find("run.json"), std::string::npos) << e;
  EXPECT_NE(e.find("byte 13"), std::string::npos) << e;
  EXPECT_EQ(parse_config_text("\xEF\xBB\xBF{\"stages\": 2}", "run.json").at(0).values.at(0), "2");
}

TEST(JsonReaders, ConfigKeyIsQuotedShortAndEscaped) {
  const std::string e = error_of([] { parse_config_text("{\"-" + std::string(100000, 'k') + "\": 1}", "run.json"); });
  expect_short(e);
  const std::string esc = error_of([] { parse_config_text(R"({"-\u001b[2J": 1})", "run.json"); });
  EXPECT_EQ(esc.find('\x1b'), std::string::npos) << esc;
  EXPECT_NE(esc.find("\\x1B[2J"), std::string::npos) << esc;
}

TEST(JsonReaders, ProfileDepthBombAndLongValuesAreShortErrors) {
  const std::string e = error_of([] { profile_from_json_text(kProfileHead + nested(70000) + kProfileTail, "p.json"); });
  EXPECT_NE(e.find("p.json"), std::string::npos) << e;
  EXPECT_NE(e.find("64 levels"), std::string::npos) << e;
  expect_short(e);
  // 50 levels pass the bound; the value is quoted as an excerpt (was the whole value).
  expect_short(error_of([] { profile_from_json_text(kProfileHead + nested(50) + kProfileTail, "p.json"); }));
  expect_short(error_of([] { profile_from_json_text(kProfileHead + "\"" + std::string(300000, 't') + "\"" + kProfileTail, "p.json"); }));
}

TEST(JsonReaders, PlanAndPlanFileDepthBombsAreShortErrors) {
  for (const std::string field : {"version", "balance"}) {
    const std::string text = R"({"format": "pipetrain-plan", "version": 1, "model": "m", "layers": 2, ")" + field +
                             "\": " + nested(70000) + "}";
    const std::string e = error_of([&] { plan_from_json_text(text, "plan.json"); });
    EXPECT_NE(e.find("64 levels"), std::string::npos) << e;
    expect_short(e);
    const std::string shallow = R"({"format": "pipetrain-plan", "version": 1, "model": "m", "layers": 2, ")" + field +
                                "\": " + nested(60) + "}";
    expect_short(error_of([&] { plan_from_json_text(shallow, "plan.json"); }));
    expect_short(error_of([&] { plan_file_from_json(parse_json_text(shallow, "plan.json"), "plan.json"); }));
  }
}

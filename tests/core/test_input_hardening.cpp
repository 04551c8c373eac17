// Issue 16: inputs that blew up, were accepted although wrong, or were refused with a misleading
// message, in the torch-free layers. Each test failed before its fix (a crash, a hang, a wrong result
// or a message that named nothing).
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <random>
#include <regex>

#include "pipetrain/core/config.h"
#include "error_of.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/pattern.h"
#include "pipetrain/core/read_file.h"
#include "pipetrain/core/schedule.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/planner.h"
#include "pipetrain/plan/profile.h"

using namespace pipetrain;

namespace {
using pipetrain::testing::error_of;
std::string temp_dir() { return pipetrain::testing::temp_dir("pipetrain-hardening"); }

void write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string pd_node(long long k, const std::string& desc) {
  return "node" + std::to_string(k) + " -- " + desc +
         " -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=10.0, parameter_size=4.0\n";
}
}  // namespace

// --- A: the type:REGEX matcher never backtracks --------------------------------------------------

TEST(Pattern, AgreesWithStdRegexOnTheDocumentedSubset) {
  const std::vector<std::string> patterns = {
      "Block", "lock", "^Linear$", "^(embedding|head)$", "a.c", "[a-c]+x", "[^0-9]+", "\\d+", "\\w+Norm",
      "Conv[12]d", "(ab)*c", "a{2,3}", "a{2}b", "a{1,}b", "x?y", "(?:re)+lu", "^$", "\\.", "a|b|c", "[\\d_]+$",
      "Re(LU|lu)?6?", "[A-Z][a-z]+[A-Z]", "(a|ab)(c|bcd)(d*)", "b+?", "\\s", "[-a]", "[a-]", "^[^a]+$", "[^B]lock",
      "\\W", "^\\D+$"};
  const std::vector<std::string> texts = {"",       "Block",  "TransformerBlock", "Linear", "linear2", "abc",
                                          "aabbx",  "12_34",  "LayerNorm",        "Conv2d", "ababc",   "aaab",
                                          "y",      "ReLU6",  "relu",             "a.c",    "x y",     "embedding",
                                          "HEAD",   "abcd",   "-",                "BatchNorm2d"};
  for (const std::string& p : patterns) {
    const Pattern mine(p, true);
    const std::regex theirs(p, std::regex::ECMAScript | std::regex::icase);
    for (const std::string& t : texts)
      EXPECT_EQ(mine.search(t), std::regex_search(t, theirs)) << "pattern " << p << " text " << t;
  }
  EXPECT_TRUE(Pattern("Block").search("TransformerBlock"));
  EXPECT_FALSE(Pattern("block").search("TransformerBlock"));  // case-sensitive unless asked
}

TEST(Pattern, RefusesWhatItDoesNotSupportNamingIt) {
  EXPECT_NE(error_of([] { Pattern("(a)\\1"); }).find("back-references"), std::string::npos);
  EXPECT_NE(error_of([] { Pattern("a(?=b)"); }).find("look-arounds"), std::string::npos);
  EXPECT_NE(error_of([] { Pattern("(a"); }).find("unclosed '('"), std::string::npos);
  EXPECT_NE(error_of([] { Pattern("a)"); }).find("unmatched ')'"), std::string::npos);
  EXPECT_NE(error_of([] { Pattern("*a"); }).find("repeats nothing"), std::string::npos);
  EXPECT_NE(error_of([] { Pattern("[a"); }).find("unclosed '['"), std::string::npos);
  EXPECT_NE(error_of([] { Pattern("a{1000}"); }).find("repeat count"), std::string::npos);
  EXPECT_NE(error_of([] { Pattern("(((a{100}){100}){100})"); }).find("states"), std::string::npos);
}

TEST(Pattern, NestedStarsOnLongNamesAreLinear) {
  // std::regex backtracked: type:(a*)*b on 18-character names ran past 100 s, and on a long name it
  // overflowed the stack (a crash).
  Profile p;
  p.model = "x";
  for (int i = 0; i < 4; ++i) {
    LayerProfile l;
    l.name = "l" + std::to_string(i);
    l.type = std::string(i == 0 ? 18 : 100000, 'a') + (i == 3 ? "b" : "");
    p.layers.push_back(l);
  }
  EXPECT_EQ(balance_costs(p, "type:(a*)*b"), (std::vector<double>{0, 0, 0, 1}));
  EXPECT_EQ(balance_costs(p, "type:^(a|aa)+$"), (std::vector<double>{1, 1, 1, 0}));
  EXPECT_NE(error_of([&] { balance_costs(p, "type:(a"); }).find("not a valid regular expression"), std::string::npos);
}

// --- A: plans on 100k layers ----------------------------------------------------------------------

TEST(Scale, HundredThousandLayersPlan) {
  // PipeDream's planner and the min-max balance were O(L^2): 100k layers took 198 s. The bound here is
  // generous (the fixed code takes well under a second); the point is that it finishes.
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> u(0.1, 2.0);
  Profile p;
  p.model = "big";
  for (int i = 0; i < 100000; ++i) {
    LayerProfile l;
    l.name = "l" + std::to_string(i);
    l.type = "Linear";
    l.forward_ms = u(rng);
    l.backward_ms = u(rng);
    l.parameter_bytes = 1e6 * u(rng);
    l.activation_bytes = 1e5 * u(rng);
    p.layers.push_back(l);
  }
  const auto start = std::chrono::steady_clock::now();
  PlannerOptions o;
  o.levels = {NetworkLevel{4, 10e9}};
  const Plan plan = plan_pipedream(p, o);
  EXPECT_NO_THROW(check_balance(plan.balance, 100000));
  for (const std::string kind : {"time", "parameters", "memory"}) {
    const std::vector<int> b = plan_balance(p, 4, kind);
    EXPECT_NO_THROW(check_balance(b, 100000));
    // Optimal: moving any boundary by one layer does not lower the bottleneck.
    const std::vector<double> cost = balance_costs(p, kind);
    const double best = bottleneck(cost, b);
    for (std::size_t s = 0; s + 1 < b.size(); ++s)
      for (int d : {-1, 1}) {
        std::vector<int> moved = b;
        moved[s] += d;
        moved[s + 1] -= d;
        EXPECT_GE(bottleneck(cost, moved), best - 1e-9 * best);
      }
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 60.0);
}

// --- A: capped, checked reads ----------------------------------------------------------------------

TEST(ReadFile, RefusesFoldersDevicesAndOversizedFiles) {
  const std::string dir = temp_dir();
  EXPECT_NE(error_of([&] { load_csv_file(dir); }).find("is a folder"), std::string::npos);  // was "no rows"
  EXPECT_NE(error_of([&] { load_profile(dir); }).find("is a folder"), std::string::npos);
  EXPECT_NE(error_of([&] { load_plan(dir); }).find("is a folder"), std::string::npos);
  // /dev/zero was read until memory ran out; /dev/null read as an empty file.
  EXPECT_NE(error_of([] { load_csv_file("/dev/zero"); }).find("'/dev/zero' is not a regular file"), std::string::npos);
  EXPECT_NE(error_of([] { load_profile("/dev/zero"); }).find("not a regular file"), std::string::npos);
  EXPECT_NE(error_of([] { load_plan("/dev/null"); }).find("not a regular file"), std::string::npos);
  EXPECT_NE(error_of([&] { load_csv_file(dir + "/missing.csv"); }).find("check the path"), std::string::npos);
  write(dir + "/big.csv", std::string(5000, 'x'));
  const std::string big = error_of([&] { read_file_capped(dir + "/big.csv", "schedule file", 4096); });
  EXPECT_NE(big.find(dir + "/big.csv"), std::string::npos) << big;
  EXPECT_NE(big.find("5000 bytes"), std::string::npos) << big;
  EXPECT_NE(big.find("cap of 4096 bytes"), std::string::npos) << big;
  EXPECT_EQ(read_file_capped(dir + "/big.csv", "schedule file", 5000).size(), 5000u);
}

// --- B: an empty cell in the middle of a CSV row -----------------------------------------------------

TEST(ScheduleCsvCells, EmptyCellBetweenActionsIsAnError) {
  const std::string e = error_of([] { from_csv("0F0,,0BW0,0S0\n"); });
  EXPECT_NE(e.find("CSV line 1"), std::string::npos) << e;
  EXPECT_NE(e.find("column 2"), std::string::npos) << e;
  EXPECT_NE(e.find("empty cell"), std::string::npos) << e;
  EXPECT_NE(error_of([] { from_csv("0F0,0BW0\n1F0, ,1BW0\n"); }).find("CSV line 2 (rank 1), column 2"), std::string::npos);
  // Trailing empty cells (rows padded to one width) stay fine.
  EXPECT_EQ(from_csv("0F0,0BW0,,\n").actions[0].size(), 2u);
}

TEST(ScheduleCsvCells, HugeStageNumbersAreRefused) {
  // Found by fuzz_schedule_csv: one action on stage 88888888 made the reader size tables for 89 million
  // stages (a timeout, then out of memory).
  const std::string e = error_of([] { from_csv("88888888B0,0W0\n"); });
  EXPECT_NE(e.find("88888889 stages"), std::string::npos) << e;
  EXPECT_NE(e.find("limits"), std::string::npos) << e;
  EXPECT_NE(error_of([] { from_csv("# pipetrain schedule microbatches=2000000000\n0F0,0BW0\n"); }).find("2000000000 micro-batches"),
            std::string::npos);
}

// --- C: PipeDream graphs and JSON numbers --------------------------------------------------------------

TEST(PipeDreamGraph, HugeNodeIdIsNamed) {
  const std::string e = error_of([] { parse_pipedream_graph(pd_node(1, "Linear(1)") .replace(4, 1, "99999999999999999999999"), {}, "g.txt"); });
  EXPECT_NE(e.find("g.txt: line 1"), std::string::npos) << e;
  EXPECT_NE(e.find("node99999999999999999999999"), std::string::npos) << e;
  EXPECT_NE(e.find("64 bits"), std::string::npos) << e;
}

TEST(PipeDreamGraph, UnconnectedNodesAreRefusedByName) {
  // With its edge lines deleted, a chain became one merged layer without a word.
  const std::string chain = pd_node(1, "Linear(1)") + pd_node(2, "ReLU()") + pd_node(3, "Linear(2)");
  EXPECT_EQ(parse_pipedream_graph(chain + "\tnode1 -- node2\n\tnode2 -- node3\n").layers.size(), 3u);
  const std::string e = error_of([&] { parse_pipedream_graph(chain, {}, "g.txt"); });
  EXPECT_NE(e.find("g.txt"), std::string::npos) << e;
  EXPECT_NE(e.find("3 unconnected parts"), std::string::npos) << e;
  EXPECT_NE(e.find("node2, node3"), std::string::npos) << e;
  EXPECT_NE(e.find("edge"), std::string::npos) << e;
}

TEST(PipeDreamGraph, CycleIsNamedNodeByNode) {
  const std::string g = pd_node(1, "Linear(1)") + pd_node(2, "ReLU()") + pd_node(3, "Linear(2)") + pd_node(4, "Tanh()") +
                        "\tnode1 -- node2\n\tnode2 -- node3\n\tnode3 -- node4\n\tnode4 -- node2\n";
  const std::string e = error_of([&] { parse_pipedream_graph(g, {}, "g.txt"); });
  EXPECT_NE(e.find("cycle"), std::string::npos) << e;
  for (const char* n : {"node2", "node3", "node4"}) EXPECT_NE(e.find(n), std::string::npos) << e;
  EXPECT_NE(e.find("->"), std::string::npos) << e;
}

TEST(ProfileJson, OverflowingNumberNamesTheFile) {
  const std::string text = R"({"format": "pipetrain-profile", "version": 1, "model": "m", "micro_batch_size": 1,
    "threads": 1, "layers": [{"name": "a", "type": "Linear", "forward_ms": 1e309, "backward_ms": 1,
    "bw_split": false, "activation_bytes": 1, "parameter_bytes": 1, "optimizer_bytes": 0}]})";
  const std::string e = error_of([&] { profile_from_json_text(text, "p.json"); });
  EXPECT_NE(e.find("p.json"), std::string::npos) << e;
  EXPECT_NE(e.find("finite"), std::string::npos) << e;
  const std::string plan = error_of([] { plan_from_json_text(R"({"format": "pipetrain-plan", "time_ms": 1e400})", "plan.json"); });
  EXPECT_NE(plan.find("plan.json"), std::string::npos) << plan;
}

// --- D: names: suggestions and config files -----------------------------------------------------------

TEST(Names, NearestNameSuggestsTypos) {
  EXPECT_EQ(nearest_name("trian", {"schedule", "simulate", "train", "plan"}), "train");
  EXPECT_EQ(nearest_name("--schedul", {"--stages", "--schedule", "--steps"}), "--schedule");
  EXPECT_EQ(nearest_name("zzzzzz", {"train", "plan"}), "");
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("plna", "plan"), 1u);  // a swap is one edit
  EXPECT_EQ(nearest_name("plna", {"schedule", "simulate", "train", "plan"}), "plan");
  const std::string e = error_of([] {
    GeneratorOptions o;
    o.ranks = 2;
    o.microbatches = 4;
    generate("1f1c", o);
  });
  EXPECT_NE(e.find("did you mean '1f1b'"), std::string::npos) << e;
  EXPECT_EQ(e.find("not implemented"), std::string::npos) << e;
}

TEST(ConfigFile, ParsesFlagsAndNamesTheKeyAndFile) {
  const auto flags = parse_config_text(R"({"stages": 4, "schedule": "zb-h1", "memory": true, "quiet": false,
                                           "microbatch-counts": [1, 2]})",
                                       "run.json");
  ASSERT_EQ(flags.size(), 5u);
  EXPECT_EQ(flags[0].flag, "--memory");
  EXPECT_TRUE(flags[0].values.empty());
  EXPECT_FALSE(flags[0].off);
  EXPECT_EQ(flags[1].values, (std::vector<std::string>{"1", "2"}));
  EXPECT_EQ(flags[2].flag, "--quiet");  // false: returned switched off, for the caller to check
  EXPECT_TRUE(flags[2].off);
  EXPECT_TRUE(flags[2].values.empty());
  for (const char* bad : {R"({"stages": null})", R"({"stages": {"a": 1}})", R"({"stages": [[1]]})", R"({"stages": []})",
                          R"({"--stages": 2})", R"({"config": "x.json"})"}) {
    const std::string e = error_of([&] { parse_config_text(bad, "run.json"); });
    EXPECT_NE(e.find("run.json"), std::string::npos) << bad << ": " << e;
  }
  EXPECT_NE(error_of([] { parse_config_text(R"({"stages": null})", "run.json"); }).find("'stages'"), std::string::npos);
  EXPECT_NE(error_of([] { parse_config_text("[1]", "run.json"); }).find("JSON object"), std::string::npos);
  EXPECT_NE(error_of([] { parse_config_text("{", "run.json"); }).find("not valid JSON"), std::string::npos);
}

// Checks profiles (plan/profile.h): the JSON form round-trips, the strict reader names the field, the
// layer and the fix for each kind of mistake, and PipeDream's text format converts as documented
// (Input dropped, side branches merged into the layer that consumes them, cycles rejected). The real
// VGG-16 profile is checked against totals computed here by a separate scan of the file's numbers.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "pipetrain/core/error.h"
#include "pipetrain/plan/profile.h"
#include "shared_data.h"

using namespace pipetrain;
using nlohmann::json;

namespace {
using pipetrain::testing::vgg16_path;

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

Profile small_profile() {
  Profile p;
  p.model = "tiny";
  p.micro_batch_size = 4;
  p.threads = 2;
  p.source = "hand-made";
  LayerProfile a;
  a.name = "embed";
  a.type = "Embedding";
  a.forward_ms = 0.5;
  a.backward_ms = 0.75;
  a.input_grad_ms = 0.75;
  a.activation_bytes = 4096;
  a.parameter_bytes = 1 << 20;
  a.optimizer_bytes = 2 << 20;
  LayerProfile b;
  b.name = "fc";
  b.type = "Linear";
  b.forward_ms = 1.25;
  b.backward_ms = 2.5;
  b.bw_split = true;
  b.input_grad_ms = 1.0;
  b.weight_grad_ms = 1.75;  // measured apart, so B + W need not equal backward_ms
  b.activation_bytes = 1024.5;
  b.parameter_bytes = 4000;
  b.optimizer_bytes = 0;
  b.by_micro_batch = {{1, 0.4, 0.7}, {8, 2.2, 4.9}};
  p.layers = {a, b};
  return p;
}

std::string json_error(const std::function<void(json&)>& mutate) {
  json j = profile_to_json(small_profile());
  mutate(j);
  try {
    profile_from_json(j, "p.json");
  } catch (const UsageError& e) {
    return e.what();
  }
  return "accepted";
}

std::string validate_error(const Profile& p) {
  try {
    validate_profile(p, "x");
  } catch (const UsageError& e) {
    return e.what();
  }
  return "accepted";
}

std::string pipedream_error(const std::string& text) {
  try {
    parse_pipedream_graph(text, {}, "g.txt");
  } catch (const UsageError& e) {
    return e.what();
  }
  return "accepted";
}

std::string node(int k, const std::string& desc, double f, double b, const std::string& act, double params) {
  std::ostringstream s;
  s << "node" << k << " -- " << desc << " -- forward_compute_time=" << f << ", backward_compute_time=" << b
    << ", activation_size=" << act << ", parameter_size=" << params << "\n";
  return s.str();
}
}  // namespace

TEST(Profile, JsonRoundTripKeepsEveryField) {
  const Profile p = small_profile();
  const std::string text = profile_to_json_text(p);
  const Profile q = profile_from_json_text(text, "mem");
  EXPECT_EQ(q.model, "tiny");
  EXPECT_EQ(q.micro_batch_size, 4);
  EXPECT_EQ(q.threads, 2);
  EXPECT_EQ(q.source, "hand-made");
  ASSERT_EQ(q.layers.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    const LayerProfile &x = p.layers[i], &y = q.layers[i];
    EXPECT_EQ(x.name, y.name);
    EXPECT_EQ(x.type, y.type);
    EXPECT_EQ(x.forward_ms, y.forward_ms);
    EXPECT_EQ(x.backward_ms, y.backward_ms);
    EXPECT_EQ(x.bw_split, y.bw_split);
    EXPECT_EQ(x.input_grad_ms, y.input_grad_ms);
    EXPECT_EQ(x.weight_grad_ms, y.weight_grad_ms);
    EXPECT_EQ(x.activation_bytes, y.activation_bytes);
    EXPECT_EQ(x.parameter_bytes, y.parameter_bytes);
    EXPECT_EQ(x.optimizer_bytes, y.optimizer_bytes);
    ASSERT_EQ(x.by_micro_batch.size(), y.by_micro_batch.size());
    for (std::size_t k = 0; k < x.by_micro_batch.size(); ++k) {
      EXPECT_EQ(x.by_micro_batch[k].micro_batch_size, y.by_micro_batch[k].micro_batch_size);
      EXPECT_EQ(x.by_micro_batch[k].forward_ms, y.by_micro_batch[k].forward_ms);
      EXPECT_EQ(x.by_micro_batch[k].backward_ms, y.by_micro_batch[k].backward_ms);
    }
  }
  // Without a split, B is the whole backward and W is 0, and the file does not repeat them.
  const json j = json::parse(text);
  EXPECT_FALSE(j["layers"][0].contains("input_grad_ms"));
  EXPECT_EQ(q.layers[0].input_grad_ms, 0.75);
  EXPECT_EQ(q.layers[0].weight_grad_ms, 0.0);
  // Whole byte counts are written as integers.
  EXPECT_TRUE(j["layers"][0]["parameter_bytes"].is_number_integer());
  EXPECT_EQ(j["format"], "pipetrain-profile");
  EXPECT_EQ(j["version"], 1);
}

TEST(Profile, StrictReaderNamesFieldLayerAndFix) {
  struct Case {
    std::function<void(json&)> mutate;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["layers"][1].erase("forward_ms"); },
       {"p.json", "layers[1] (\"fc\")", "\"forward_ms\" is missing", "add it"}},
      {[](json& j) { j["layers"][0]["backward_ms"] = -1.5; },
       {"layers[0] (\"embed\").backward_ms", "is -1.5", "cannot be negative"}},
      {[](json& j) { j["layers"][0]["parameter_bytes"] = "1MB"; },
       {"layers[0] (\"embed\").parameter_bytes", "is string", "write a number of bytes"}},
      {[](json& j) { j["layers"][0]["activation_bytes"] = true; }, {"activation_bytes", "is boolean"}},
      {[](json& j) { j["layers"][1]["foward_ms"] = 1; }, {"layers[1] (\"fc\")", "unknown field \"foward_ms\""}},
      {[](json& j) { j["extra"] = 1; }, {"unknown field \"extra\""}},
      {[](json& j) { j["format"] = "pipedream"; }, {"format", "\"pipetrain-profile\""}},
      {[](json& j) { j["version"] = 4; }, {"version", "is 4", "reads versions 1..3"}},
      {[](json& j) { j["layers"][1]["optimizer_ms"] = 0.5; },
       {"layers[1] (\"fc\").optimizer_ms", "version 1 profile", "write \"version\": 3"}},
      {[](json& j) {
         j["version"] = 3;
         j["layers"][0]["optimizer_ms"] = -0.5;
       },
       {"layers[0] (\"embed\").optimizer_ms", "cannot be negative"}},
      {[](json& j) { j.erase("version"); }, {"\"version\" is missing"}},
      {[](json& j) { j["micro_batch_size"] = 0; }, {"micro_batch_size", "is 0", ">= 1"}},
      {[](json& j) { j["threads"] = 1.5; }, {"threads", "write an integer"}},
      {[](json& j) { j["layers"] = json::array(); }, {"layers", "is empty"}},
      {[](json& j) { j["layers"][0]["input_grad_ms"] = 0.1; }, {"input_grad_ms", "bw_split is false"}},
      {[](json& j) { j["layers"][1].erase("weight_grad_ms"); },
       {"layers[1] (\"fc\")", "\"weight_grad_ms\" is missing"}},
      {[](json& j) { j["layers"][1]["bw_split"] = 1; }, {"bw_split", "write true or false"}},
      {[](json& j) { j["layers"][0]["type"] = ""; }, {"layers[0] (\"embed\").type", "is empty"}},
      {[](json& j) { j["layers"][1]["by_micro_batch"][1]["micro_batch_size"] = 1; },
       {"by_micro_batch[1].micro_batch_size", "strictly increasing"}},
      {[](json& j) { j["layers"][1]["by_micro_batch"][0]["forward_ms"] = -2; },
       {"by_micro_batch[0].forward_ms", "cannot be negative"}},
  };
  for (const Case& c : cases) {
    const std::string msg = json_error(c.mutate);
    for (const std::string& part : c.expected) EXPECT_NE(msg.find(part), std::string::npos) << msg << " lacks " << part;
  }
  EXPECT_EQ(json_error([](json&) {}), "accepted");
  EXPECT_THROW(profile_from_json_text("{\"format\": ", "x"), UsageError);
}

// A layer's optimizer step time (version 3) round-trips; a file is written with the lowest version that
// holds what it has, so a profile without step times stays readable by earlier pipetrains.
TEST(Profile, OptimizerStepTimesComeWithVersion3) {
  Profile p = small_profile();
  EXPECT_EQ(profile_to_json(p)["version"], 1);
  p.runtime = fit_transfers({{1024, 0.1}, {1 << 20, 1.0}});
  p.runtime->transport = "shm";
  EXPECT_EQ(profile_to_json(p)["version"], 2);
  p.layers[1].optimizer_ms = 0.375;
  const json j = profile_to_json(p);
  EXPECT_EQ(j["version"], 3);
  EXPECT_FALSE(j["layers"][0].contains("optimizer_ms"));  // 0: not measured, not written
  const Profile q = profile_from_json(j, "mem");
  EXPECT_EQ(q.layers[0].optimizer_ms, 0.0);
  EXPECT_EQ(q.layers[1].optimizer_ms, 0.375);
  p.layers[1].optimizer_ms = std::nan("");
  EXPECT_NE(validate_error(p).find("optimizer_ms"), std::string::npos) << validate_error(p);
}

// The measured data-parallel all-reduce (runtime.allreduce, version 3) round-trips and is checked.
TEST(Profile, MeasuredAllReducesComeWithVersion3) {
  Profile p = small_profile();
  p.runtime = fit_transfers({{1024, 0.1}, {1 << 20, 1.0}});
  p.runtime->transport = "shm";
  p.runtime->allreduce_ranks = 2;
  p.runtime->allreduce = {{262144, 0.25}, {4194304, 2.5}};
  const json j = profile_to_json(p);
  EXPECT_EQ(j["version"], 3);
  const Profile q = profile_from_json(j, "mem");
  ASSERT_TRUE(q.runtime.has_value());
  EXPECT_EQ(q.runtime->allreduce_ranks, 2);
  ASSERT_EQ(q.runtime->allreduce.size(), 2u);
  EXPECT_EQ(q.runtime->allreduce[1].bytes, 4194304.0);
  EXPECT_EQ(q.runtime->allreduce[1].one_way_ms, 2.5);
  json older = j;
  older["version"] = 2;
  try {
    profile_from_json(older, "p.json");
    ADD_FAILURE() << "a version 2 file with runtime.allreduce was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("write \"version\": 3"), std::string::npos) << e.what();
  }
  json one_rank = j;
  one_rank["runtime"]["allreduce"]["ranks"] = 1;
  try {
    profile_from_json(one_rank, "p.json");
    ADD_FAILURE() << "an all-reduce over 1 rank was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("runtime.allreduce.ranks"), std::string::npos) << e.what();
  }
  p.runtime->allreduce[0].one_way_ms = -1;
  EXPECT_NE(validate_error(p).find("runtime.allreduce.samples[0].ms"), std::string::npos) << validate_error(p);
}

TEST(Profile, BAndWFieldsCountOnlyWithTheSplit) {
  Profile p = small_profile();
  p.layers[0].input_grad_ms = 0;  // left unset by code that fills a profile without a split
  p.layers[0].weight_grad_ms = -3;
  EXPECT_NO_THROW(validate_profile(p));
  EXPECT_EQ(p.layers[0].b_ms(), 0.75);  // the whole backward
  EXPECT_EQ(p.layers[0].w_ms(), 0.0);
  EXPECT_EQ(p.layers[1].b_ms(), 1.0);  // with the split, the measured parts
  EXPECT_EQ(p.layers[1].w_ms(), 1.75);
  normalise_bw_split(p);
  EXPECT_EQ(p.layers[0].input_grad_ms, 0.75);
  EXPECT_EQ(p.layers[0].weight_grad_ms, 0.0);
  p.layers[1].weight_grad_ms = -1;
  EXPECT_NE(validate_error(p).find("x: layers[1] (\"fc\").weight_grad_ms: is -1"), std::string::npos);
  p.layers[1].weight_grad_ms = 1;
  p.layers[1].forward_ms = std::numeric_limits<double>::infinity();
  EXPECT_THROW(validate_profile(p), UsageError);
}

TEST(Profile, FilesAreDetectedByContent) {
  const std::string dir = ::testing::TempDir();
  const std::string json_path = dir + "/pipetrain_profile_test.json";
  save_profile(json_path, small_profile());
  EXPECT_EQ(load_profile(json_path).layers[1].name, "fc");
  const std::string pd_path = dir + "/pipetrain_profile_test.txt";
  {
    std::ofstream f(pd_path);
    f << node(1, "Input", 1, 0, "10.000", 0) << node(2, "Linear(in_features=2, out_features=2)", 1, 2, "8.000", 24)
      << "\tnode1 -- node2\n";
  }
  const Profile p = load_profile(pd_path);
  ASSERT_EQ(p.layers.size(), 1u);
  EXPECT_EQ(p.layers[0].type, "Linear");
  EXPECT_THROW(load_profile(dir + "/no_such_profile.json"), UsageError);
  std::remove(json_path.c_str());
  std::remove(pd_path.c_str());
}

TEST(PipeDreamProfile, ChainDropsInputAndKeepsOrder) {
  // Lines out of order, as PipeDream writes them; node numbers give the order among ready nodes.
  const std::string text =
      node(3, "ReLU(inplace)", 0.5, 0.25, "100.000", 0) + node(1, "Input", 9, 0, "50.000", 0) +
      node(2, "Conv2d(3, 8, kernel_size=(3, 3))", 2, 3, "100.000", 224) +
      node(4, "Linear(in_features=100, out_features=10, bias=True)", 1, 1.5, "[30.000; 10.000]", 4040) +
      "\tnode3 -- node4\n\tnode1 -- node2\n\tnode2 -- node3\n";
  PipeDreamOptions o;
  o.model = "toy";
  o.micro_batch_size = 16;
  o.optimizer_bytes_per_parameter_byte = 2;
  const Profile p = parse_pipedream_graph(text, o, "toy.txt");
  EXPECT_EQ(p.model, "toy");
  EXPECT_EQ(p.micro_batch_size, 16);
  ASSERT_EQ(p.layers.size(), 3u);  // Input dropped
  EXPECT_EQ(p.layers[0].name, "node2");
  EXPECT_EQ(p.layers[0].type, "Conv2d");
  EXPECT_EQ(p.layers[1].type, "ReLU");
  EXPECT_EQ(p.layers[2].type, "Linear");
  EXPECT_DOUBLE_EQ(p.layers[0].forward_ms, 2);
  EXPECT_DOUBLE_EQ(p.layers[0].backward_ms, 3);
  EXPECT_DOUBLE_EQ(p.layers[0].input_grad_ms, 3);  // no split: B is the whole backward
  EXPECT_DOUBLE_EQ(p.layers[0].weight_grad_ms, 0);
  EXPECT_DOUBLE_EQ(p.layers[2].activation_bytes, 40);  // a list of outputs is summed
  EXPECT_DOUBLE_EQ(p.layers[2].optimizer_bytes, 2 * 4040);
}

TEST(PipeDreamProfile, SideBranchesAndResidualsMergeIntoOneLayer) {
  // a -> b -> d, a -> c -> d (a diamond, as a residual block), then d -> e. Order a b c d e. The boundary
  // after a carries only a's output; after b, a's output still flows to c (and b's to d); after c, b's
  // output still flows to d; after d, only d's. So the layers are a | b+c+d | e.
  const std::string text = node(1, "A(x)", 1, 1, "10", 1) + node(2, "B(x)", 2, 2, "20", 2) +
                           node(3, "C(x)", 3, 3, "30", 3) + node(4, "D(x)", 4, 4, "40", 4) +
                           node(5, "E(x)", 5, 5, "50", 5) +
                           "\tnode1 -- node2\n\tnode1 -- node3\n\tnode2 -- node4\n\tnode3 -- node4\n\tnode4 -- node5\n";
  const Profile p = parse_pipedream_graph(text);
  ASSERT_EQ(p.layers.size(), 3u);
  EXPECT_EQ(p.layers[1].name, "node2+node3+node4");
  EXPECT_EQ(p.layers[1].type, "B+C+D");
  EXPECT_DOUBLE_EQ(p.layers[1].forward_ms, 2 + 3 + 4);
  EXPECT_DOUBLE_EQ(p.layers[1].parameter_bytes, 2 + 3 + 4);
  EXPECT_DOUBLE_EQ(p.layers[1].activation_bytes, 40);  // the merged layer's output is D's
  // A __getitem__ sink is dropped as PipeDream drops it, and a stage_id suffix (planner output) is read.
  const std::string with_sink =
      "node1 -- A(x) -- forward_compute_time=1.000, backward_compute_time=1.000, "
      "activation_size=10.000, parameter_size=1.000 -- stage_id=0\n" +
      node(2, "__getitem__(0)", 7, 7, "5", 0) + "\tnode1 -- node2\n";
  const Profile q = parse_pipedream_graph(with_sink);
  ASSERT_EQ(q.layers.size(), 1u);
  EXPECT_EQ(q.layers[0].name, "node1");
}

TEST(PipeDreamProfile, BadInputIsNamed) {
  const std::string a = node(1, "A(x)", 1, 1, "10", 1), b = node(2, "B(x)", 1, 1, "10", 1);
  EXPECT_NE(pipedream_error(a + b + "\tnode1 -- node2\n\tnode2 -- node1\n").find("cycle"), std::string::npos);
  EXPECT_NE(pipedream_error(a + "\tnode1 -- node9\n").find("node9, which has no node line"), std::string::npos);
  EXPECT_NE(pipedream_error(a + a).find("defined again"), std::string::npos);
  EXPECT_NE(pipedream_error("node1 -- A -- forward_compute_time=1, backward_compute_time=1\n").find("line 1: no "),
            std::string::npos);
  EXPECT_NE(pipedream_error(node(1, "A(x)", -1, 1, "10", 1)).find("forward_compute_time=\"-1\""), std::string::npos);
  EXPECT_NE(pipedream_error("garbage\n").find("line 1: expected"), std::string::npos);
  EXPECT_NE(pipedream_error("").find("no node lines"), std::string::npos);
  EXPECT_NE(pipedream_error(a + "\tnode1 node2\n").find("line 2"), std::string::npos);
}

TEST(PipeDreamProfile, Vgg16MatchesTheFileByIndependentArithmetic) {
  const std::string path = vgg16_path();
  ASSERT_TRUE(std::ifstream(path).good()) << path << " is missing; it is part of the repository (data/pipedream/)";
  const std::string text = slurp(path);
  // A separate scan: every node line's numbers, by regular expression, and which line is what.
  const std::regex line_re(
      R"(^(node\d+) -- ([^ (]+).* -- forward_compute_time=([\d.]+), backward_compute_time=([\d.]+), )"
      R"(activation_size=([\d.]+), parameter_size=([\d.]+)$)");
  double f = 0, b = 0, act = 0, params = 0;
  int nodes = 0, convs = 0, linears = 0;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::smatch m;
    if (!std::regex_match(line, m, line_re)) continue;
    ++nodes;
    const std::string type = m[2];
    convs += type == "Conv2d";
    linears += type == "Linear";
    if (type == "Input") continue;  // PipeDream's planner drops the input node
    f += std::stod(m[3]);
    b += std::stod(m[4]);
    params += std::stod(m[6]);
    if (type != "Size") act += std::stod(m[5]);  // Size merges into View, whose output the layer keeps
  }
  ASSERT_EQ(nodes, 41);
  PipeDreamOptions o;
  o.model = "vgg16";
  o.micro_batch_size = 128;
  const Profile p = load_pipedream_graph(path, o);
  // 41 nodes less Input, less one for Size merged into View.
  ASSERT_EQ(p.layers.size(), 39u);
  double pf = 0, pb = 0, pa = 0, pp = 0;
  int pconvs = 0, plinears = 0;
  for (const LayerProfile& l : p.layers) {
    pf += l.forward_ms;
    pb += l.backward_ms;
    pa += l.activation_bytes;
    pp += l.parameter_bytes;
    pconvs += l.type == "Conv2d";
    plinears += l.type == "Linear";
  }
  EXPECT_NEAR(pf, f, 1e-9 * f);
  EXPECT_NEAR(pb, b, 1e-9 * b);
  EXPECT_NEAR(pa, act, 1e-9 * act);
  EXPECT_NEAR(pp, params, 1e-9 * params);
  // VGG-16 is 13 convolutions and 3 fully connected layers, and all of them survive as their own layer.
  EXPECT_EQ(convs, 13);
  EXPECT_EQ(linears, 3);
  EXPECT_EQ(pconvs, 13);
  EXPECT_EQ(plinears, 3);
  // The chain starts at the first convolution and ends at the classifier.
  EXPECT_EQ(p.layers.front().name, "node2");
  EXPECT_EQ(p.layers.back().name, "node41");
  int merged = 0;
  for (const LayerProfile& l : p.layers) merged += l.name == "node33+node34" && l.type == "Size+View";
  EXPECT_EQ(merged, 1);
  // Its parameters: 138,357,544 weights of 4 bytes (VGG-16's well-known count, 1000 classes).
  EXPECT_NEAR(pp, 138357544.0 * 4, 0.5);
}

TEST(PipeDreamProfile, PlannerStatesKeepOneLayerPerNodeWithWhatCrossesEachCut) {
  // The diamond above with planner_states: one layer per node; each cut carries every output still
  // needed later: after a, a's (10); after b, a's and b's (10 + 20); after c, b's and c's (20 + 30);
  // after d, d's (40); e, the last, its own (50).
  const std::string text = node(1, "A(x)", 1, 1, "10", 1) + node(2, "B(x)", 2, 2, "20", 2) +
                           node(3, "C(x)", 3, 3, "30", 3) + node(4, "D(x)", 4, 4, "40", 4) +
                           node(5, "E(x)", 5, 5, "50", 5) +
                           "\tnode1 -- node2\n\tnode1 -- node3\n\tnode2 -- node4\n\tnode3 -- node4\n\tnode4 -- node5\n";
  PipeDreamOptions o;
  o.planner_states = true;
  o.optimizer_bytes_per_parameter_byte = 2;
  const Profile p = parse_pipedream_graph(text, o);
  ASSERT_EQ(p.layers.size(), 5u);
  const double crossing[] = {10, 30, 50, 40, 50};
  for (std::size_t l = 0; l < 5; ++l) {
    EXPECT_EQ(p.layers[l].name, "node" + std::to_string(l + 1));
    EXPECT_DOUBLE_EQ(p.layers[l].forward_ms, static_cast<double>(l + 1));
    EXPECT_DOUBLE_EQ(p.layers[l].activation_bytes, crossing[l]) << l;
    EXPECT_DOUBLE_EQ(p.layers[l].optimizer_bytes, 2.0 * static_cast<double>(l + 1));
  }
  // VGG-16: PipeDream's 40 states; the totals are those of the folded 39 layers, and the one extra layer
  // is Size, whose cut carries pool5's output as well as its own 4 bytes.
  const Profile folded = load_pipedream_graph(vgg16_path());
  const Profile states = load_pipedream_graph(vgg16_path(), o);
  ASSERT_EQ(states.layers.size(), 40u);
  double tf = 0, ts = 0, wf = 0, ws = 0;
  for (const LayerProfile& l : folded.layers) tf += l.forward_ms + l.backward_ms, wf += l.parameter_bytes;
  for (const LayerProfile& l : states.layers) ts += l.forward_ms + l.backward_ms, ws += l.parameter_bytes;
  EXPECT_NEAR(ts, tf, 1e-12 * tf);
  EXPECT_NEAR(ws, wf, 1e-12 * wf);
  for (std::size_t l = 0; l < 31; ++l) {
    EXPECT_EQ(states.layers[l].name, folded.layers[l].name);
    EXPECT_DOUBLE_EQ(states.layers[l].activation_bytes, folded.layers[l].activation_bytes);
  }
  EXPECT_EQ(states.layers[31].type, "Size");
  EXPECT_DOUBLE_EQ(states.layers[31].activation_bytes, states.layers[30].activation_bytes + 4);
  EXPECT_EQ(folded.layers[31].name, "node33+node34");
  for (std::size_t l = 32; l < 40; ++l)
    EXPECT_DOUBLE_EQ(states.layers[l].activation_bytes, folded.layers[l - 1].activation_bytes);
}

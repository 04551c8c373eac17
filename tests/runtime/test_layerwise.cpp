// Models given layer by layer (runtime/layers.h): each rank builds only its own layers, with the
// initial weights of the whole model (build_all) whatever the cut; training matches the whole-model
// pipeline bitwise; ties across ranks get one value; checkpoints saved at 2 stages resume at 3; the
// zoo's gpt tells its layers without building them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>

#include <unistd.h>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/checkpoint.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/layers.h"
#include "pipetrain/runtime/profiler.h"
#include "pipetrain/zoo/models.h"

using namespace pipetrain;
namespace fs = std::filesystem;

namespace {

constexpr int kLayers = 6;
constexpr int64_t kWidth = 8, kBatch = 12;

// Linear layers of width 8 with Tanh between them; counts how often each layer is built.
struct Counted {
  std::array<std::atomic<int>, kLayers> built{};
  LayerwiseModel model(uint64_t seed, bool with_info = true) {
    LayerwiseModel m;
    m.layers = kLayers;
    m.seed = seed;
    m.build = [this](int i) {
      ++built[static_cast<std::size_t>(i)];
      if (i % 2 == 1) return torch::nn::AnyModule(torch::nn::Tanh());
      return torch::nn::AnyModule(torch::nn::Linear(kWidth, kWidth));
    };
    if (with_info)
      m.info = [](int i) {
        LayerInfo info;
        info.type = i % 2 == 1 ? "Tanh" : "Linear";
        info.parameters = i % 2 == 1 ? 0 : kWidth * kWidth + kWidth;
        return info;
      };
    return m;
  }
};

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); }

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(100 + step);
  return {torch::randn({kBatch, kWidth}), torch::randn({kBatch, kWidth})};
}

PipelineOptions options(const std::string& schedule = "1f1b") {
  PipelineOptions o;
  o.schedule = schedule;
  o.microbatches = 4;
  o.optimizer.name = "adam";
  o.optimizer.lr = 1e-2;
  return o;
}

// Layer -> its parameters' values, from every rank of a pipeline.
std::map<int, std::vector<torch::Tensor>> layer_values(LocalPipeline& pipe, int ranks) {
  std::map<int, std::vector<torch::Tensor>> out;
  for (int r = 0; r < ranks; ++r)
    for (int l : pipe.rank(r).local_layers())
      for (const auto& [name, t] : pipe.rank(r).layer_state(l))
        if (name.rfind("param/", 0) == 0) out[l].push_back(t);
  return out;
}

void expect_equal(const std::map<int, std::vector<torch::Tensor>>& a, const std::map<int, std::vector<torch::Tensor>>& b,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [l, ts] : a) {
    ASSERT_EQ(ts.size(), b.at(l).size()) << what << " layer " << l;
    for (std::size_t k = 0; k < ts.size(); ++k) EXPECT_TRUE(torch::equal(ts[k], b.at(l)[k])) << what << " layer " << l;
  }
}

}  // namespace

TEST(Layerwise, EachRankBuildsOnlyItsLayersWithTheWholeModelsWeights) {
  Counted c;
  LocalPipeline pipe(c.model(7), mse, 3, options());
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(c.built[static_cast<std::size_t>(l)].load(), 1) << "layer " << l;
  for (int r = 0; r < 3; ++r) EXPECT_EQ(pipe.rank(r).local_layers(), (std::vector<int>{2 * r, 2 * r + 1}));
  // The weights are build_all's, and a cut at 2 stages gives the same layers.
  Counted c2;
  LocalPipeline whole(build_all(c2.model(7)), mse, 3, options());
  LocalPipeline two(c2.model(7), mse, 2, options());
  expect_equal(layer_values(pipe, 3), layer_values(whole, 3), "3 stages vs build_all");
  expect_equal(layer_values(pipe, 3), layer_values(two, 2), "3 stages vs 2");
  // Another seed, other weights.
  Counted c3;
  LocalPipeline other(c3.model(8), mse, 3, options());
  EXPECT_FALSE(torch::equal(layer_values(pipe, 3).at(0).front(), layer_values(other, 3).at(0).front()));
  // And they train as the whole model does, bitwise.
  for (int step = 0; step < 3; ++step) {
    const auto [x, y] = batch(step);
    EXPECT_EQ(pipe.train_step(x, y).loss, whole.train_step(x, y).loss) << "step " << step;
  }
}

TEST(Layerwise, WithoutInfoOtherLayersAreBuiltOnlyToBeReadAndTheBalanceIsTheWholeModels) {
  Counted c;
  PipelineOptions o = options();
  o.balance = "parameters";
  LocalPipeline pipe(c.model(3, /*with_info=*/false), mse, 2, o);
  LocalPipeline whole(build_all(c.model(3)), mse, 2, o);
  EXPECT_EQ(pipe.balance(), whole.balance());
  // Each of the 2 ranks built every layer once to read it and dropped it, its own once more to keep, and
  // build_all once: 2 + 1 + 1.
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(c.built[static_cast<std::size_t>(l)].load(), 4) << "layer " << l;
}

TEST(Layerwise, TiedMembersOnOtherRanksGetTheFirstMembersValue) {
  PipelineOptions o = options();
  o.tied = {{{0, "weight"}, {4, "weight"}}};  // on ranks 0 and 2
  Counted c, c2;
  LocalPipeline pipe(c.model(5), mse, 3, o);
  LocalPipeline whole(build_all(c2.model(5)), mse, 3, o);
  for (int step = 0; step < 3; ++step) {
    const auto [x, y] = batch(step);
    EXPECT_EQ(pipe.train_step(x, y).loss, whole.train_step(x, y).loss) << "step " << step;
  }
  // Layer 4 stores its tied weight with layer 0 (checkpoints): compare the live parameters.
  const torch::Tensor w0 = pipe.rank(0).parameters().front(), w4 = pipe.rank(2).parameters().front();
  EXPECT_TRUE(torch::equal(w0, w4));
}

// The same tie given by the layers' names (LayerwiseModel::names), which build_all gives its children.
TEST(Layerwise, TiedMembersByPathUseTheModelsNames) {
  PipelineOptions o = options();
  o.tied = {{{0, "weight"}, {4, "weight"}}};
  Counted c, c2;
  LocalPipeline by_index(c.model(5), mse, 3, o);
  LayerwiseModel named = c2.model(5);
  named.names = {"in", "l1", "l2", "l3", "out", "l5"};  // kLayers
  o.tied = {{ParameterRef::path("in.weight"), ParameterRef::path("out.weight")}};
  LocalPipeline by_name(named, mse, 3, o);
  for (int step = 0; step < 3; ++step) {
    const auto [x, y] = batch(step);
    EXPECT_EQ(by_name.train_step(x, y).loss, by_index.train_step(x, y).loss) << "step " << step;
  }
  const torch::nn::Sequential whole = build_all(named);
  EXPECT_EQ(whole->named_children().keys().front(), "in");
  // Names that cannot name layers are refused, naming the bad one.
  LayerwiseModel short_list = c2.model(5);
  short_list.names = {"a"};
  try {
    layer_names(short_list);
    ADD_FAILURE() << "accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("1 names for 6 layers"), std::string::npos) << e.what();
  }
  LayerwiseModel dup = c2.model(5);
  dup.names = named.names;
  dup.names[1] = "in";
  EXPECT_THROW(layer_names(dup), UsageError);
  LayerwiseModel dotted = c2.model(5);
  dotted.names = named.names;
  dotted.names[2] = "a.b";
  EXPECT_THROW(layer_names(dotted), UsageError);
}

// A model given layer by layer is profiled one layer at a time (no two layers alive at once; the measured
// balance of `train --balance time` relies on it), with the layers the whole model has.
TEST(Layerwise, ProfiledOneLayerAtATimeAsTheWholeModel) {
  std::vector<std::weak_ptr<torch::nn::Module>> made;
  int most_alive = 0;
  LayerwiseModel m = Counted().model(5);
  m.build = [&](int i) {
    int alive = 1;
    for (const auto& w : made) alive += !w.expired();
    most_alive = std::max(most_alive, alive);
    torch::nn::AnyModule layer = i % 2 == 1 ? torch::nn::AnyModule(torch::nn::Tanh())
                                            : torch::nn::AnyModule(torch::nn::Linear(kWidth, kWidth));
    made.push_back(layer.ptr());
    return layer;
  };
  ProfilerOptions o;
  o.repeats = 2;
  o.warmup = 0;
  o.loss = mse;
  o.target = batch(0).second;
  const Profile by_layer = profile_model(m, batch(0).first, o);
  EXPECT_EQ(most_alive, 1);
  EXPECT_EQ(made.size(), static_cast<std::size_t>(kLayers));  // each layer built once
  const Profile whole = profile_model(build_all(m), batch(0).first, o);
  ASSERT_EQ(by_layer.layers.size(), whole.layers.size());
  for (std::size_t l = 0; l < whole.layers.size(); ++l) {
    EXPECT_EQ(by_layer.layers[l].type, whole.layers[l].type) << l;
    EXPECT_EQ(by_layer.layers[l].parameter_bytes, whole.layers[l].parameter_bytes) << l;
    EXPECT_EQ(by_layer.layers[l].activation_bytes, whole.layers[l].activation_bytes) << l;
    EXPECT_EQ(by_layer.layers[l].bw_split, whole.layers[l].bw_split) << l;
  }
}

TEST(Layerwise, CheckpointSavedAtTwoStagesResumesAtThree) {
  const fs::path dir = fs::temp_directory_path() / ("pipetrain_layerwise_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  Counted c;
  LocalPipeline two(c.model(9), mse, 2, options());
  for (int step = 0; step < 2; ++step) {
    const auto [x, y] = batch(step);
    two.train_step(x, y);
  }
  run_on_threads(2, [&](int r) { save_checkpoint(two.rank(r), *two.transport(r), dir.string(), {{"model", "layerwise"}}); });
  std::vector<double> continued;
  for (int step = 2; step < 4; ++step) {
    const auto [x, y] = batch(step);
    continued.push_back(two.train_step(x, y).loss);
  }
  Counted c3;
  LocalPipeline three(c3.model(99), mse, 3, options());  // other initial weights: all come from the file
  run_on_threads(3, [&](int r) { load_checkpoint(three.rank(r), dir.string()); });
  for (int step = 2; step < 4; ++step) {
    const auto [x, y] = batch(step);
    const double want = continued[static_cast<std::size_t>(step - 2)];
    EXPECT_NEAR(three.train_step(x, y).loss, want, 1e-6 * want) << "step " << step;
  }
  fs::remove_all(dir);
}

TEST(Layerwise, ZooGptTellsItsLayersWithoutBuildingThem) {
  for (const bool variable : {false, true})
    for (const bool tie : {false, true}) {
      zoo::GptConfig g;
      g.vocab = 11;
      g.seq_len = 8;
      g.d_model = 16;
      g.heads = 2;
      g.layers = 2;
      g.variable_length = variable;
      g.tie_embeddings = tie;
      LayerwiseModel m = zoo::gpt_layers(g, 4);
      const std::vector<LayerInfo> told = layer_infos(m);
      m.info = nullptr;
      const std::vector<LayerInfo> read = layer_infos(m);
      ASSERT_EQ(told.size(), 4u);
      for (std::size_t l = 0; l < told.size(); ++l) {
        EXPECT_EQ(told[l].type, read[l].type) << "layer " << l;
        EXPECT_EQ(told[l].parameters, read[l].parameters) << "layer " << l;
      }
    }
}

TEST(Layerwise, BadModelsAreRefused) {
  LayerwiseModel m;
  m.layers = 0;
  EXPECT_THROW({ LocalPipeline p(m, mse, 2, options()); }, UsageError);
  Counted c;
  m = c.model(1);
  m.layers = 2;  // fewer layers than 3 stages
  EXPECT_THROW({ LocalPipeline p(m, mse, 3, options()); }, UsageError);
}

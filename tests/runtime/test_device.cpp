// Checks what a device changes for a rank (issue 26; pipetrain/runtime/device.h, src/runtime/device.cpp).
// Without a GPU: the CPU path keeps the host clock, no stream and no device memory, and the version
// probes answer. With one (skipped with a message elsewhere): actions are timed by events on the rank's
// own stream, the allocator's peaks are read, and every schedule the runtime runs gives on CUDA the loss
// and the gradients it gives on the CPU, within float tolerance.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <c10/core/impl/VirtualGuardImpl.h>

#include <thread>

#include "device_context.h"
#include "pass_util.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/runtime/device.h"
#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/profiler.h"
#include "pipetrain/runtime/split_linear.h"
#include "pipetrain/runtime/transport.h"
#include "torch_compat.h"

using namespace pipetrain;

namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here: this check runs on a GPU machine"

TEST(Device, TheCpuKeepsTheHostClockAndHasNoDeviceMemory) {
  pipetrain::detail::RankDevice cpu(torch::kCPU);
  EXPECT_FALSE(cpu.cuda());
  EXPECT_FALSE(device_event_timing(torch::kCPU));
  EXPECT_FALSE(device_memory_peak(torch::kCPU).has_value());
  reset_device_memory_peak(torch::kCPU);  // nothing to reset, and no error
  const pipetrain::detail::RankDevice::Scope scope(cpu);
  cpu.begin_timing();
  const double before = pipetrain::detail::now_ms();
  const std::size_t a = cpu.start_action();
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  cpu.end_action(a);
  const std::size_t b = cpu.start_action();
  cpu.end_action(b);
  const auto times = cpu.finish_timing();
  ASSERT_EQ(times.size(), 2u);
  EXPECT_GE(times[0].first, before);
  EXPECT_GE(times[0].second - times[0].first, 4.5);  // the sleep, on the host clock
  EXPECT_LE(times[0].second, times[1].first);
  EXPECT_LE(times[1].first, times[1].second);
  EXPECT_LE(times[1].second, pipetrain::detail::now_ms());
}

TEST(Device, TheVersionProbesAnswerWithoutAGpu) {
  // c10::Event reads elapsed times from 2.0 on; 1.13's CUDA builds fall back to synchronised host times.
  EXPECT_EQ(compat::kEventElapsedTime, TORCH_VERSION_MAJOR >= 2);
  // Asking a machine without a GPU for CUDA's peaks is no error: there are none.
  if (!torch::cuda::is_available()) {
    EXPECT_NO_THROW(device_memory_peak(torch::Device(torch::kCUDA, 0)));
  }
}

// On a GPU the autograd engine runs a backward on its own device thread, not on the thread that set the
// weight-gradient store: pipetrain::nn::Linear's backward must still find that store (before, it computed
// its weight gradient at once there, which in a B through autograd was then dropped: zb-h1 trained the
// GPT on CUDA with missing gradients). Run here on the CPU by starting the backward from another thread
// while the forward's thread holds the store, as the engine's device thread does.
TEST(Device, ASplitLinearsBackwardOnAnotherThreadQueuesOnItsForwardThreadsStore) {
  torch::manual_seed(2);
  nn::Linear layer(4, 3), plain(4, 3);
  {
    torch::NoGradGuard no_grad;
    plain->weight.copy_(layer->weight);
    plain->bias.copy_(layer->bias);
  }
  const torch::Tensor x = torch::randn({5, 4});
  WeightGradStore store;
  {
    const WeightGradStore::Scope scope(&store);
    const torch::Tensor y = layer->forward(x);
    std::thread engine([&] { torch::autograd::backward({y}, {torch::ones_like(y)}); });
    engine.join();
  }
  EXPECT_FALSE(layer->weight.grad().defined()) << "the weight gradient was not deferred to the store";
  ASSERT_EQ(store.size(), 1u);
  store.run();
  const torch::Tensor y = plain->forward(x);
  torch::autograd::backward({y}, {torch::ones_like(y)});
  ASSERT_TRUE(layer->weight.grad().defined());
  EXPECT_TRUE(torch::allclose(layer->weight.grad(), plain->weight.grad()));
  EXPECT_TRUE(torch::allclose(layer->bias.grad(), plain->bias.grad()));
}

TEST(DeviceCuda, EventsTimeTheWorkOnTheRanksStream) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  pipetrain::detail::RankDevice d(cuda);
  ASSERT_TRUE(d.cuda());
  const torch::Tensor a = torch::randn({2048, 2048}, torch::TensorOptions().device(cuda));
  const pipetrain::detail::RankDevice::Scope scope(d);
  d.begin_timing();
  const std::size_t work = d.start_action();
  torch::Tensor x = a;
  for (int i = 0; i < 20; ++i) x = torch::tanh(torch::mm(x, a) * 1e-3);
  d.end_action(work);
  const std::size_t empty = d.start_action();
  d.end_action(empty);
  const auto times = d.finish_timing();
  const double done = pipetrain::detail::now_ms();
  ASSERT_EQ(times.size(), 2u);
  const double work_ms = times[0].second - times[0].first, empty_ms = times[1].second - times[1].first;
  EXPECT_GT(work_ms, 0.0);
  EXPECT_GE(empty_ms, 0.0);
  EXPECT_GT(work_ms, empty_ms) << "20 products of 2048x2048 matrices took no longer than nothing";
  EXPECT_LE(times[0].second, times[1].first + 1e-3);
  EXPECT_LE(times[1].second, done + 1.0);  // the device clock is anchored to the host's
  EXPECT_TRUE(torch::isfinite(x).all().item<bool>());
}

TEST(DeviceCuda, PeakMemorySeesA256MiBTensor) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  reset_device_memory_peak(cuda);
  if (!device_memory_peak(cuda)) GTEST_SKIP() << "this LibTorch's allocator offers no statistics through c10";
  {
    const torch::Tensor big = torch::empty({64 * 1024 * 1024}, torch::TensorOptions().device(cuda));  // 256 MiB
    const auto during = device_memory_peak(cuda);
    ASSERT_TRUE(during.has_value());
    EXPECT_GE(during->peak_allocated, int64_t{256} << 20);
    EXPECT_GE(during->peak_reserved, during->peak_allocated);
  }
  reset_device_memory_peak(cuda);
  EXPECT_LT(device_memory_peak(cuda)->peak_allocated, int64_t{256} << 20);
}

constexpr int64_t kIn = 16, kHidden = 32, kOut = 4, kBatch = 16;

torch::nn::Sequential make_model() {
  torch::manual_seed(7);
  torch::nn::Sequential m;
  m->push_back(nn::Linear(kIn, kHidden));
  m->push_back(torch::nn::Tanh());
  m->push_back(torch::nn::Linear(kHidden, kHidden));  // no B/W split: its weight gradient stays in B
  m->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
  m->push_back(nn::Linear(kHidden, kHidden));  // stage 1 (of 2) mixes split and unsplit layers and takes
  m->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));  // a gradient: B through autograd
  m->push_back(nn::Linear(kHidden, kHidden));
  m->push_back(nn::Linear(kHidden, kOut));
  return m;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); }

// bf16 (PipelineOptions::precision): forwards under autocast to bfloat16, float32 weights and loss. Checked
// on the CPU, whose autocast does bf16 too: the pipeline's gradients equal plain training under the same
// autocast; the transfer between the stages is bf16; the loss moved off float32's (autocast ran).
std::vector<c10::ScalarType> g_seen_by_stage1;
torch::nn::Sequential make_bf16_model() {
  torch::manual_seed(17);
  torch::nn::Sequential m;
  m->push_back(nn::Linear(kIn, kHidden));
  m->push_back(torch::nn::Tanh());
  m->push_back(torch::nn::Linear(kHidden, kHidden));  // LibTorch's own: autocast casts it
  m->push_back(torch::nn::GELU());
  m->push_back(torch::nn::Functional([](const torch::Tensor& x) {  // first layer of stage 1 (of 2)
    g_seen_by_stage1.push_back(x.scalar_type());
    return x;
  }));
  // No layer norm: LibTorch 1.13's CPU autocast leaves it to run on bf16 input with float32 weights, which
  // it refuses (CUDA's autocast runs layer norms in float32).
  m->push_back(torch::nn::Tanh());
  m->push_back(nn::Linear(kHidden, kHidden));
  m->push_back(nn::Linear(kHidden, kOut));
  return m;
}

TEST(Device, Bf16RunsForwardsUnderAutocastWithFloat32WeightsAndLoss) {
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  for (const std::string schedule : {"1f1b", "zb-h1"}) {
    // Plain training under the same autocast, micro-batch by micro-batch.
    auto plain = make_bf16_model();
    double plain_loss = 0;
    for (const auto& [b, e] : split_equal(kBatch, 4)) {
      torch::Tensor out;
      {
        const compat::AutocastGuard autocast(c10::DeviceType::CPU, at::kBFloat16);
        out = plain->forward(x.slice(0, b, e));
      }
      torch::Tensor l = mse(out.to(torch::kFloat), y.slice(0, b, e)) * (double(e - b) / kBatch);
      l.backward();
      plain_loss += l.item<double>();
    }
    PipelineOptions o;
    o.schedule = schedule;
    o.microbatches = 4;
    o.precision = "bf16";
    auto model = make_bf16_model();
    const auto params = model->parameters();
    std::vector<torch::Tensor> grads(params.size());
    o.on_gradients = [&](int, const std::vector<torch::Tensor>& mine) {
      for (const auto& p : mine)
        for (std::size_t k = 0; k < params.size(); ++k)
          if (params[k].unsafeGetTensorImpl() == p.unsafeGetTensorImpl() && p.grad().defined()) grads[k] = p.grad().clone();
    };
    g_seen_by_stage1.clear();
    LocalPipeline pipe(model, mse, 2, o);
    const StepStats s = pipe.train_step(x, y);
    EXPECT_NEAR(s.loss, plain_loss, 1e-5 * std::abs(plain_loss)) << schedule;
    const auto want = plain->parameters();
    for (std::size_t k = 0; k < params.size(); ++k) {
      ASSERT_TRUE(grads[k].defined()) << schedule << " parameter " << k;
      EXPECT_EQ(grads[k].scalar_type(), torch::kFloat) << schedule << " parameter " << k;
      EXPECT_EQ(params[k].scalar_type(), torch::kFloat) << schedule << " parameter " << k;
      const double scale = want[k].grad().abs().max().item<double>() + 1e-12;
      EXPECT_LE((grads[k] - want[k].grad()).abs().max().item<double>(), 1e-3 * scale) << schedule << " parameter " << k;
    }
    ASSERT_FALSE(g_seen_by_stage1.empty());
    for (const auto t : g_seen_by_stage1) EXPECT_EQ(t, torch::kBFloat16) << schedule << ": the transfer was not bf16";
  }
  // The same step in float32 gives another loss: autocast changed the arithmetic.
  PipelineOptions fp32;
  fp32.microbatches = 4;
  LocalPipeline full(make_bf16_model(), mse, 2, fp32);
  PipelineOptions bf16 = fp32;
  bf16.precision = "bf16";
  LocalPipeline half(make_bf16_model(), mse, 2, bf16);
  const double a = full.train_step(x, y).loss, b = half.train_step(x, y).loss;
  EXPECT_NE(a, b);
  // bf16 keeps 8 significant bits (relative rounding 2^-9, about 2e-3 per operand); through a handful of
  // products and sums the loss moves by a few of those, so 2e-2 bounds it with room and still catches a
  // run that was not the same model (a loss near 1 off).
  EXPECT_NEAR(a, b, 2e-2 * std::abs(a));
  PipelineOptions bad;
  bad.precision = "fp16";
  try {
    LocalPipeline p(make_bf16_model(), mse, 2, bad);
    ADD_FAILURE() << "precision fp16 was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("precision 'fp16' is unknown: use fp32 or bf16"), std::string::npos) << e.what();
  }
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;  // after the steps, on the CPU
  StepStats last;
};

TrainRun train(const std::string& schedule, const torch::Device& device, int steps) {
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({kBatch, kIn}), y = torch::randn({kBatch, kOut});
  PipelineOptions o;
  o.schedule = schedule;
  o.microbatches = schedule_traits(schedule).one_microbatch_per_step ? 1 : 4;
  o.virtual_stages = schedule_traits(schedule).virtual_stages ? 2 : 1;
  o.device = device;
  o.optimizer.name = "adam";
  o.optimizer.lr = 1e-2;
  auto model = make_model();
  LocalPipeline pipe(model, mse, 2, o);
  TrainRun r;
  if (!schedule_traits(schedule).synchronous) {
    r.last = pipe.train_steps(x, y, steps);
    r.losses = r.last.losses;
  } else {
    for (int k = 0; k < steps; ++k) {
      r.last = pipe.train_step(x, y);
      r.losses.push_back(r.last.loss);
    }
  }
  for (const auto& p : model->parameters()) r.params.push_back(p.detach().to(torch::kCPU));
  return r;
}

TEST(DeviceCuda, EveryScheduleTrainsOnCudaAsOnTheCpu) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min",
                                     "dualpipev", "interleaved-zb", "looped-bfs", "pipedream", "2bw", "spectrain"}) {
    const TrainRun cpu = train(schedule, torch::kCPU, 3), gpu = train(schedule, cuda, 3);
    ASSERT_EQ(cpu.losses.size(), gpu.losses.size()) << schedule;
    for (std::size_t k = 0; k < cpu.losses.size(); ++k)
      EXPECT_NEAR(gpu.losses[k], cpu.losses[k], 1e-4 * std::max(1.0, std::abs(cpu.losses[k])))
          << schedule << " step " << k;
    ASSERT_EQ(cpu.params.size(), gpu.params.size());
    for (std::size_t k = 0; k < cpu.params.size(); ++k)
      EXPECT_TRUE(torch::allclose(gpu.params[k], cpu.params[k], 1e-3, 1e-4)) << schedule << " parameter " << k;
    // The measured timeline comes from the device: every action has a duration, none negative.
    ASSERT_FALSE(gpu.last.timeline.events.empty()) << schedule;
    for (const TimedAction& e : gpu.last.timeline.events) EXPECT_GE(e.end, e.start) << schedule;
  }
}

// The profiler on a GPU (its timed runs are bursts of calls there): the layers it reports are the CPU's
// (types, bytes, which layers split B from W), every time is positive and finite, split layers have a
// W, and the model comes back as it went in (its weights unchanged, no gradients).
TEST(DeviceCuda, TheProfilerMeasuresEveryLayerOnTheGpuAsOnTheCpu) {
  SKIP_WITHOUT_CUDA();
  auto model_on = [](const torch::Device& d) {
    torch::manual_seed(3);
    torch::nn::Sequential m(pipetrain::nn::Linear(16, 32), torch::nn::Tanh(), pipetrain::nn::Linear(32, 4));
    m->to(d);
    return m;
  };
  auto mse = [](const torch::Tensor& out, const torch::Tensor& target) { return (out - target).pow(2).mean(); };
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({8, 16}), y = torch::randn({8, 4});
  Profile on[2];
  for (int k = 0; k < 2; ++k) {
    const torch::Device d = k == 0 ? torch::Device(torch::kCPU) : torch::Device(torch::kCUDA, 0);
    torch::nn::Sequential m = model_on(d);
    std::vector<torch::Tensor> before;
    for (const auto& p : m->parameters()) before.push_back(p.detach().clone());
    ProfilerOptions o;
    o.repeats = 3;
    o.warmup = 1;
    o.loss = mse;
    o.target = y;
    o.device = d;
    o.extra_sizes = {4};
    on[k] = profile_model(m, x, o);
    const auto after = m->parameters();
    for (std::size_t i = 0; i < after.size(); ++i) {
      EXPECT_TRUE(torch::equal(after[i].detach(), before[i])) << d << " parameter " << i;
      EXPECT_FALSE(after[i].grad().defined() && after[i].grad().abs().sum().item<double>() > 0) << d << " parameter " << i;
    }
  }
  ASSERT_EQ(on[0].layers.size(), on[1].layers.size());
  for (std::size_t l = 0; l < on[1].layers.size(); ++l) {
    const LayerProfile &c = on[0].layers[l], &g = on[1].layers[l];
    EXPECT_EQ(g.type, c.type) << l;
    EXPECT_EQ(g.parameter_bytes, c.parameter_bytes) << l;
    EXPECT_EQ(g.activation_bytes, c.activation_bytes) << l;
    EXPECT_EQ(g.bw_split, c.bw_split) << l;
    for (double t : {g.forward_ms, g.backward_ms, g.input_grad_ms})
      EXPECT_TRUE(std::isfinite(t) && t > 0) << l << ": " << t;
    if (g.bw_split) EXPECT_GT(g.weight_grad_ms, 0) << l;
    if (g.parameter_bytes > 0) EXPECT_GT(g.optimizer_ms, 0) << l;
    ASSERT_EQ(g.by_micro_batch.size(), 1u) << l;
    EXPECT_GT(g.by_micro_batch[0].forward_ms, 0) << l;
  }
  EXPECT_TRUE(on[1].layers[0].bw_split);  // a pipetrain::nn::Linear alone splits
}

TEST(DeviceCuda, TheRankComputesOnItsOwnStreamAndHandsItsOutputsOver) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  pipetrain::detail::RankDevice d(cuda);
  const c10::Stream caller = c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(cuda);
  {
    const pipetrain::detail::RankDevice::Scope scope(d);
    const c10::Stream inside = c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(cuda);
    EXPECT_NE(inside, caller) << "the rank computes on the caller's stream";
  }
  EXPECT_EQ(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(cuda), caller);
  // Forward outputs made on the rank's stream are used on the caller's: the values arrive whole.
  auto model = make_model();
  PipelineOptions o;
  o.device = cuda;
  LocalPipeline pipe(model, mse, 2, o);
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({kBatch, kIn});
  const torch::Tensor out = pipe.forward_only(Bundle(x), kBatch, 4);
  torch::NoGradGuard no_grad;
  model->eval();
  auto plain = make_model();
  plain->eval();
  EXPECT_TRUE(torch::allclose(out.to(torch::kCPU), plain->forward(x), 1e-4, 1e-5));
}

TEST(DeviceCuda, TheLocalTransportMovesGpuTensorsBetweenRanksStreams) {
  SKIP_WITHOUT_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  auto transports = make_local_transports(2);
  ASSERT_TRUE(transports[0]->carries_device_tensors());
  torch::manual_seed(9);
  const torch::Tensor a = torch::randn({512, 512});
  torch::Tensor want = a;
  for (int i = 0; i < 8; ++i) want = torch::tanh(torch::mm(want, a) * 1e-2);
  torch::Tensor got;
  run_on_threads(2, [&](int r) {
    pipetrain::detail::RankDevice d(cuda);
    const pipetrain::detail::RankDevice::Scope scope(d);
    if (r == 0) {
      // Queued work the receiver must not overtake: the send is ordered after it by an event, not a wait.
      const torch::Tensor ad = a.to(cuda);
      torch::Tensor x = ad;
      for (int i = 0; i < 8; ++i) x = torch::tanh(torch::mm(x, ad) * 1e-2);
      transports[0]->isend(x, 1, 5)->wait();
    } else {
      torch::Tensor buffer = torch::empty({512, 512}, torch::TensorOptions().device(cuda));
      transports[1]->irecv(buffer, 0, 5)->wait();
      got = buffer.to(torch::kCPU);
    }
  });
  EXPECT_TRUE(torch::allclose(got, want, 1e-4, 1e-5));
}

}  // namespace

// Plain LibTorch training of pipetrain's GPT, the reference for the issue-3 runtime benchmark.
//
// Same model (zoo::gpt_layers(c, seed) built whole, the weights train's ranks draw), same data (zoo::make_synthetic_tokens with
// seed + 1), same loss and optimizer (Adam lr 1e-3) as `pipetrain train --model gpt`, but in one process
// with no pipeline: each step runs forward + backward over the same micro-batches (split_equal), each
// micro-batch loss scaled by b_k / N, so the accumulated gradient is the full-batch gradient; then one
// optimizer step. The loss printed per step is therefore the one pipetrain prints (a check that both
// train the same thing).
//
//   build/bench/bench_plain_gpt --layers 8 --d-model 256 --heads 4 --vocab 96 --seq-len 128
//       --batch-size 32 --microbatches 4 --steps 10 --threads 2   (one command line)
//   build/bench/bench_plain_gpt ... --memory --balance 5,5     # activation bytes per micro-batch per stage
//   build/bench/bench_plain_gpt --quick --stage-times --memory # tiny sizes (`make test`)
//
// Prints one line per step and a final JSON line {"bench":"plain_gpt", "median_step_ms": ...} whose
// median skips the first 2 steps (warm-up). With --stage-times each micro-batch runs stage by stage of
// --balance (each stage's input a detached leaf, as on a pipeline rank; same numbers) and the JSON gets
// the mean forward and backward ms per micro-batch of every stage: the pipeline's F and BW, serially,
// in one process. With --memory it also measures, for one micro-batch, the
// heap growth (glibc mallinfo2: uordblks + hblkhd, as pipetrain's --memory) after the forward of each
// pipeline layer with the autograd graph kept, i.e. the activation memory a stage holds per micro-batch,
// summed per stage of --balance (default: pipetrain's uniform balance over --stages, default 2).
#include <ATen/Parallel.h>
#include <malloc.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/layers.h"
#include "pipetrain/runtime/info.h"
#include "pipetrain/zoo/data.h"
#include "pipetrain/zoo/models.h"

namespace {

double heap_in_use() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd);
}

int usage(const char* argv0, bool help = false) {
  std::fprintf(help ? stdout : stderr,
               "usage: %s [--layers N (4)] [--d-model C (128)] [--heads H (4)] [--vocab V (96)] [--seq-len T (64)]\n"
               "          [--batch-size B (16)] [--microbatches M (4)] [--steps K (10)] [--threads N (1)] [--seed S (0)]\n"
               "          [--memory] [--stage-times] [--stages P (2)] [--balance a,b,...] [--device D (cpu)] [--quick]\n"
               "--quick (the `make test` run): defaults of 2 layers, d-model 32, 2 heads, seq-len 16, batch 8, 2\n"
               "micro-batches, 3 steps; flags given after it still apply\n",
               argv0);
  return help ? 0 : 2;
}

std::vector<int> parse_list(const std::string& v) {
  std::vector<int> out;
  for (size_t b = 0; b <= v.size();) {
    size_t e = v.find(',', b);
    if (e == std::string::npos) e = v.size();
    out.push_back(std::atoi(v.substr(b, e - b).c_str()));
    b = e + 1;
  }
  return out;
}

// pipetrain's uniform balance: layer counts, the remainder spread over the first stages.
std::vector<int> uniform(int layers, int stages) {
  std::vector<int> out(static_cast<size_t>(stages), layers / stages);
  for (int s = 0; s < layers % stages; ++s) ++out[static_cast<size_t>(s)];
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  pipetrain::zoo::GptConfig c;
  int64_t batch_size = 16;
  int microbatches = 4, steps = 10, threads = 1, stages = 2;
  uint64_t seed = 0;
  bool memory = false, stage_times = false;
  std::string balance_text, device_text = "cpu";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--memory" || a == "--stage-times") {
      (a == "--memory" ? memory : stage_times) = true;
      continue;
    }
    if (a == "--quick") {  // tiny sizes: only shows the program runs
      c.layers = 2;
      c.d_model = 32;
      c.heads = 2;
      c.seq_len = 16;
      batch_size = 8;
      microbatches = 2;
      steps = 3;
      continue;
    }
    if (a == "--help" || a == "-h") return usage(argv[0], true);
    if (i + 1 >= argc) return usage(argv[0]);
    const std::string v = argv[++i];
    if (a == "--layers") c.layers = std::atoi(v.c_str());
    else if (a == "--d-model") c.d_model = std::atoll(v.c_str());
    else if (a == "--heads") c.heads = std::atoll(v.c_str());
    else if (a == "--vocab") c.vocab = std::atoll(v.c_str());
    else if (a == "--seq-len") c.seq_len = std::atoll(v.c_str());
    else if (a == "--batch-size") batch_size = std::atoll(v.c_str());
    else if (a == "--microbatches") microbatches = std::atoi(v.c_str());
    else if (a == "--steps") steps = std::atoi(v.c_str());
    else if (a == "--threads") threads = std::atoi(v.c_str());
    else if (a == "--seed") seed = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--stages") stages = std::atoi(v.c_str());
    else if (a == "--balance") balance_text = v;
    else if (a == "--device") device_text = v;
    else return usage(argv[0]);
  }
  if (steps < 1 || threads < 1 || stages < 1) return usage(argv[0]);
  try {
    at::set_num_threads(threads);
    // The weights `pipetrain train` builds: each layer from (seed, layer), as its ranks draw them.
    torch::nn::Sequential model = pipetrain::build_all(pipetrain::zoo::gpt_layers(c, seed));
    const torch::Device device(device_text);  // --device cuda: the same steps on a GPU (the loss read syncs)
    model->to(device);
    auto data = pipetrain::zoo::make_synthetic_tokens(c.vocab, c.seq_len, seed + 1);
    const auto ranges = pipetrain::split_equal(batch_size, microbatches);
    int64_t params = 0;
    for (const auto& p : model->parameters()) params += p.numel();
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
    std::printf("plain_gpt: %d blocks, d_model %lld, %lld heads, vocab %lld, context %lld, %lld parameters; batch %lld, "
                "m=%d, %d thread(s)\n  %s\n",
                c.layers, static_cast<long long>(c.d_model), static_cast<long long>(c.heads),
                static_cast<long long>(c.vocab), static_cast<long long>(c.seq_len), static_cast<long long>(params),
                static_cast<long long>(batch_size), microbatches, at::get_num_threads(),
                pipetrain::describe(pipetrain::runtime_info()).c_str());

    const std::vector<int> balance =
        balance_text.empty() ? uniform(static_cast<int>(model->size()), stages) : parse_list(balance_text);
    int sum = 0;
    for (int n : balance) sum += n;
    if (sum != static_cast<int>(model->size())) {
      std::fprintf(stderr, "--balance sums to %d but the model has %zu layers\n", sum, model->size());
      return 2;
    }
    std::vector<double> step_ms;
    double peak_growth = 0;
    // --stage-times: per stage of the balance, the summed forward and backward ms of steps 3.. (each stage's
    // input a leaf, as on a pipeline stage), i.e. what the pipeline's F and BW actions do, run here serially.
    std::vector<double> stage_f(balance.size(), 0.0), stage_bw(balance.size(), 0.0);
    int timed_microbatches = 0;
    auto now = [] { return std::chrono::steady_clock::now(); };
    auto ms_since = [](auto t) { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count(); };
    for (int step = 0; step < steps; ++step) {
      pipetrain::zoo::Batch b = data->batch(step, batch_size);
      b.input = b.input.to(device);
      b.target = b.target.to(device);
      const double heap0 = heap_in_use();
      const auto t0 = std::chrono::steady_clock::now();
      double loss_sum = 0;
      for (const auto& [begin, end] : ranges) {
        if (stage_times) {
          const bool record = step >= 2;
          std::vector<torch::Tensor> ins, outs;
          torch::Tensor x = b.input.slice(0, begin, end);
          int layer = 0;
          for (size_t s = 0; s < balance.size(); ++s) {
            const auto t = now();
            if (s > 0) x = x.detach().requires_grad_(true);
            ins.push_back(x);
            for (int k = 0; k < balance[s]; ++k, ++layer) x = (model->begin() + layer)->forward<torch::Tensor>(x);
            if (s + 1 == balance.size())
              x = pipetrain::zoo::cross_entropy(x, b.target.slice(0, begin, end)) *
                  (static_cast<double>(end - begin) / static_cast<double>(batch_size));
            outs.push_back(x);
            if (record) stage_f[s] += ms_since(t);
          }
          peak_growth = std::max(peak_growth, heap_in_use() - heap0);
          loss_sum += x.item<double>();
          for (size_t s = balance.size(); s-- > 0;) {
            const auto t = now();
            if (s + 1 == balance.size())
              outs[s].backward();
            else
              outs[s].backward(ins[s + 1].grad());
            if (record) stage_bw[s] += ms_since(t);
          }
          if (record) ++timed_microbatches;
          continue;
        }
        torch::Tensor out = model->forward(b.input.slice(0, begin, end));
        torch::Tensor loss = pipetrain::zoo::cross_entropy(out, b.target.slice(0, begin, end)) *
                             (static_cast<double>(end - begin) / static_cast<double>(batch_size));
        peak_growth = std::max(peak_growth, heap_in_use() - heap0);
        loss.backward();
        peak_growth = std::max(peak_growth, heap_in_use() - heap0);
        loss_sum += loss.item<double>();
      }
      opt.step();
      for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();  // as pipetrain releases them
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      step_ms.push_back(ms);
      std::printf("step %4d/%d  loss %.4f  %.1f ms  %.1f samples/s\n", step + 1, steps, loss_sum, ms,
                  1000.0 * static_cast<double>(batch_size) / ms);
      std::fflush(stdout);
    }
    std::vector<double> timed(step_ms.begin() + std::min<size_t>(2, step_ms.size() - 1), step_ms.end());
    std::sort(timed.begin(), timed.end());
    const double median = timed.size() % 2 ? timed[timed.size() / 2]
                                           : 0.5 * (timed[timed.size() / 2 - 1] + timed[timed.size() / 2]);

    std::string extra_json;
    if (stage_times && timed_microbatches > 0) {
      extra_json += ", \"stage_f_ms\": [";
      std::printf("stage times per micro-batch (ms, steps 3..):");
      for (size_t s = 0; s < balance.size(); ++s) {
        std::printf(" stage %zu F %.2f BW %.2f;", s, stage_f[s] / timed_microbatches, stage_bw[s] / timed_microbatches);
        extra_json += (s ? ", " : "") + std::to_string(stage_f[s] / timed_microbatches);
      }
      extra_json += "], \"stage_bw_ms\": [";
      for (size_t s = 0; s < balance.size(); ++s)
        extra_json += (s ? ", " : "") + std::to_string(stage_bw[s] / timed_microbatches);
      extra_json += "]";
      std::printf("\n");
    }
    if (memory) {
      // One micro-batch (the first range's size), forward layer by layer with the graph kept: the heap
      // growth after layer l is what the slot of a stage ending at l holds until its backward.
      pipetrain::zoo::Batch b = data->batch(0, batch_size);
      b.input = b.input.to(device);
      b.target = b.target.to(device);
      const int64_t mb = ranges[0].second - ranges[0].first;
      torch::Tensor x = b.input.slice(0, 0, mb);
      std::vector<double> per_layer;
      std::vector<double> per_stage;
      torch::Tensor loss;
      {
        std::vector<torch::Tensor> keep;
        const double h0 = heap_in_use();
        double prev = h0;
        int layer = 0;
        for (int n : balance) {
          const double stage_start = prev;
          for (int k = 0; k < n; ++k, ++layer) {
            x = (model->begin() + layer)->forward<torch::Tensor>(x);
            keep.push_back(x);
            const double h = heap_in_use();
            per_layer.push_back(h - prev);
            prev = h;
          }
          per_stage.push_back(prev - stage_start);
        }
        loss = pipetrain::zoo::cross_entropy(x, b.target.slice(0, 0, mb));
        const double h = heap_in_use();
        per_stage.back() += h - prev;  // the loss (and its graph) live on the last stage
        keep.clear();
      }
      loss.backward();
      const double act_bytes = static_cast<double>(mb * c.seq_len * c.d_model * 4);
      std::printf("memory: micro-batch of %lld samples; boundary activation %.3f MiB; heap growth per layer (MiB):",
                  static_cast<long long>(mb), act_bytes / 1048576.0);
      for (double v : per_layer) std::printf(" %.3f", v / 1048576.0);
      std::printf("\nmemory: per stage (balance");
      for (int n : balance) std::printf(" %d", n);
      std::printf("), activations kept for backward per micro-batch (MiB):");
      extra_json = ", \"activation_mib_per_microbatch\": [";
      for (size_t s = 0; s < per_stage.size(); ++s) {
        std::printf(" %.3f", per_stage[s] / 1048576.0);
        extra_json += (s ? ", " : "") + std::to_string(per_stage[s] / 1048576.0);
      }
      extra_json += "], \"boundary_activation_mib\": " + std::to_string(act_bytes / 1048576.0);
      std::printf("\n");
    }
    std::printf(
        "{\"bench\": \"plain_gpt\", \"threads\": %d, \"microbatches\": %d, \"batch_size\": %lld, \"parameters\": %lld, "
        "\"steps\": %d, \"median_step_ms\": %.3f, \"min_step_ms\": %.3f, \"max_step_ms\": %.3f, "
        "\"peak_heap_growth_mib\": %.3f%s}\n",
        threads, microbatches, static_cast<long long>(batch_size), static_cast<long long>(params), steps, median,
        timed.front(), timed.back(), peak_growth / 1048576.0, extra_json.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_plain_gpt: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

// Flags and plumbing shared by the commands that run a real pipeline (`train`, `selftest`): the model,
// the data, the pipeline options, and how ranks come to exist (threads, a launcher, or self-launch).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <string>

#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/transport.h"
#include "pipetrain/zoo/data.h"
#include "pipetrain/zoo/models.h"

namespace pipetrain::cli {

struct ModelFlags {
  std::string model = "gpt";  // gpt | mlp
  zoo::GptConfig gpt;
  zoo::MlpConfig mlp;
  uint64_t seed = 0;
  void add_to(CLI::App& app);
  // A factory that builds the same model on every call (seeded).
  std::function<torch::nn::Sequential()> factory() const;
  LossFn loss() const;
  std::unique_ptr<zoo::Dataset> dataset() const;
  std::string describe() const;
};

struct PipelineFlags {
  int stages = 2;
  std::string schedule = "1f1b";
  int microbatches = 4;
  int virtual_stages = 1;
  std::string balance = "uniform";
  std::string checkpoint = "never";
  std::string transport = "auto";  // local | gloo | mpi | auto
  int threads = 0;
  bool reference = false;
  std::string device = "cpu";  // cpu | cuda | cuda:N
  CLI::Option* stages_option = nullptr;
  void add_to(CLI::App& app);
  // `local_rank` picks the GPU for --device cuda (rank r uses GPU r mod the GPU count).
  PipelineOptions options(uint64_t seed, int local_rank = 0) const;
};

// Runs `body` on every rank. transport "local": one thread per rank in this process, body called once
// per rank concurrently. Otherwise with the rendezvous environment set (a launcher started us): this
// process is one rank. Without it: relaunches this command as `stages` local processes (gloo, or mpirun
// is required for mpi) and returns their combined exit code.
int run_ranks(const PipelineFlags& flags, int argc, char** argv,
              const std::function<int(std::shared_ptr<Transport>)>& body);

}  // namespace pipetrain::cli

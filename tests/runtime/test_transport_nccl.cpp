// Checks the nccl transport of transport.h (transport_nccl.cpp) as far as one machine allows:
// - everywhere: a build without it refuses --transport nccl with the reason and the alternatives
//   (UsageError, no hang), and `auto` never picks it there, nor for CPU ranks, nor for ranks that
//   would share a GPU;
// - with a GPU and a build with NCCL: one rank (world size 1): all_reduce_sum on CUDA and CPU tensors,
//   barrier, its refusals of bad peers and devices, and `pipetrain train --transport nccl --stages 1
//   --device cuda` (skipped, with the reason, elsewhere).
// Not checked anywhere yet (it needs two GPUs): messages between ranks (headers, stashing, the
// per-direction process groups), the failure paths while NCCL is blocked, two ranks refused on one GPU.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/launch.h"
#include "pipetrain/runtime/transport.h"
#include "env_guard.h"

namespace pipetrain {
namespace {

using Env = testing::EnvGuard;
using testing::unset;
using testing::usage_error_of;

// A process started by nobody: no launcher, no mpirun, no torchrun.
std::map<std::string, std::optional<std::string>> plain_process(std::optional<std::string> local_world_size = unset) {
  return {{"OMPI_COMM_WORLD_SIZE", unset}, {"OMPI_COMM_WORLD_RANK", unset}, {"PIPETRAIN_SHM_PREFIX", unset},
          {"LOCAL_WORLD_SIZE", local_world_size}, {"TORCHELASTIC_USE_AGENT_STORE", unset}};
}

// What `auto` resolves to, or "(refused)" where it refuses (a build without gloo, for ranks it would give gloo).
std::string choice(const torch::Device& device, bool by_rank = true) {
  try {
    return resolve_process_transport("auto", device, by_rank);
  } catch (const UsageError&) {
    return "(refused)";
  }
}

TEST(NcclTransport, ABuildWithoutItRefusesWithTheReasonAndTheAlternatives) {
  if (nccl_transport_available()) {
    EXPECT_EQ(nccl_transport_absent_reason(), "");
    GTEST_SKIP() << "this build has the nccl transport; its refusal is not built";
  }
  const std::string reason = nccl_transport_absent_reason();
  EXPECT_NE(reason.find("built against a LibTorch without NCCL ("), std::string::npos) << reason;
  EXPECT_NE(reason.find("use --transport gloo|shm|mpi, or rebuild against a CUDA LibTorch"), std::string::npos)
      << reason;
  const torch::Device cuda(torch::kCUDA, 0);
  EXPECT_EQ(usage_error_of([&] { make_nccl_transport(Rendezvous{}, cuda); }), reason);
  Env env(plain_process());
  EXPECT_EQ(usage_error_of([&] { make_process_transport("nccl", cuda); }), reason);
  EXPECT_EQ(resolve_process_transport("nccl", cuda), "nccl");  // named: made (and refused) as it is
}

TEST(NcclTransport, AutoPicksItOnlyForCudaRanksOnDistinctGpusOfABuildWithIt) {
  const torch::Device cpu = torch::kCPU, cuda0(torch::kCUDA, 0);
  const int gpus = static_cast<int>(torch::cuda::device_count());
  {
    Env env(plain_process());
    EXPECT_NE(choice(cpu), "nccl");
    EXPECT_EQ(choice(cuda0) == "nccl", kAutoPicksNccl && nccl_transport_available() && gpus >= 1);
  }
  {
    // More ranks on this host than GPUs, or one cuda:N named for them all: they would share a GPU.
    Env env(plain_process(std::to_string(gpus + 1)));
    EXPECT_NE(choice(cuda0), "nccl");
    EXPECT_NE(choice(cuda0, /*by_rank=*/false), "nccl");
  }
  {
    Env env(plain_process("1"));  // one rank per host may name its GPU
    EXPECT_EQ(choice(cuda0, false) == "nccl", kAutoPicksNccl && nccl_transport_available() && gpus >= 1);
  }
  {
    Env env(plain_process());
    ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);  // mpirun's ranks stay on mpi
    EXPECT_EQ(choice(cuda0), "mpi");
  }
  {
    Env env(plain_process());
    ::setenv("PIPETRAIN_SHM_PREFIX", "/pipetrain-test", 1);
    EXPECT_EQ(choice(cpu), "shm");
  }
}

TEST(NcclTransport, UnknownNamesListIt) {
  const std::string e = usage_error_of([] { resolve_process_transport("nccl2"); });
  EXPECT_NE(e.find("unknown transport 'nccl2': use shm, gloo, mpi, nccl or auto"), std::string::npos) << e;
}

// The CUDA checks: one GPU and a build with NCCL.
class NcclOnGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!nccl_transport_available()) GTEST_SKIP() << nccl_transport_absent_reason();
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here: the nccl checks run on a GPU machine";
  }
};

TEST_F(NcclOnGpu, OneRankReducesOnTheGpuAndFromTheCpuAndPassesBarriers) {
  Env env(plain_process());
  Rendezvous rv;
  rv.master_port = pick_free_port();
  const torch::Device cuda0(torch::kCUDA, 0);
  auto t = make_nccl_transport(rv, cuda0);
  EXPECT_EQ(t->name(), "nccl");
  EXPECT_EQ(t->world_size(), 1);
  EXPECT_TRUE(t->carries_device_tensors());
  at::Tensor x = at::full({3}, 2.0, at::TensorOptions().dtype(at::kFloat).device(cuda0));
  t->all_reduce_sum(x);
  EXPECT_TRUE(at::equal(x.cpu(), at::full({3}, 2.0, at::kFloat)));
  at::Tensor h = at::arange(6, at::kDouble).reshape({2, 3}).t();  // CPU, not contiguous: copied there and back
  t->all_reduce_sum(h);
  EXPECT_TRUE(at::equal(h, at::arange(6, at::kDouble).reshape({2, 3}).t()));
  t->barrier();
  t->barrier();
  EXPECT_THROW(t->isend(x, 0, 0), std::invalid_argument);  // not a peer
  EXPECT_THROW(t->irecv(x, 1, 0), std::invalid_argument);
}

TEST_F(NcclOnGpu, ACpuDeviceIsRefusedWithTheFix) {
  Env env(plain_process());
  Rendezvous rv;
  rv.master_port = pick_free_port();
  const std::string e = usage_error_of([&] { make_nccl_transport(rv, torch::kCPU); });
  EXPECT_NE(e.find("use --device cuda"), std::string::npos) << e;
}

// `pipetrain train --transport nccl --stages 1 --device cuda`: the pipetrain command next to this test.
TEST_F(NcclOnGpu, TrainsOneStageOverNccl) {
  char self[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  ASSERT_GT(n, 0);
  const auto bin = std::filesystem::path(std::string(self, n)).parent_path() / "pipetrain";
  if (!std::filesystem::exists(bin)) GTEST_SKIP() << bin << " is not built (cmake --build BUILD --target pipetrain)";
  const std::string cmd = "timeout 300 " + bin.string() +
                          " train --model gpt --data synthetic --layers 2 --d-model 32 --heads 2 --seq-len 16 "
                          "--vocab 32 --batch-size 8 -m 2 --steps 3 --eval-every 0 --sample 0 --progress quiet "
                          "--stages 1 --device cuda --transport nccl 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t got = std::fread(buf, 1, sizeof buf, p)) out.append(buf, got);
  const int status = ::pclose(p);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << cmd << "\n" << out;
}

}  // namespace
}  // namespace pipetrain

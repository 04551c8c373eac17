// Checks runtime_info()/describe() against what the linked LibTorch really does, and that a small
// autograd computation runs (so the LibTorch link works end to end).
#include "pipetrain/runtime/info.h"
#include "pipetrain/runtime/transport.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

namespace pipetrain {
namespace {

TEST(RuntimeInfo, VersionMatchesTheHeadersWeCompiledAgainst) {
  const RuntimeInfo info = runtime_info();
  ASSERT_FALSE(info.torch_version.empty());
  EXPECT_EQ(info.torch_version, TORCH_VERSION);
  const std::string major_minor =
      std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + ".";
  EXPECT_EQ(info.torch_version.rfind(major_minor, 0), 0u) << info.torch_version;
}

TEST(RuntimeInfo, ReportsTheIntraOpThreadCountThatWasSet) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  EXPECT_EQ(runtime_info().intra_op_threads, 2);
  at::set_num_threads(1);
  EXPECT_EQ(runtime_info().intra_op_threads, 1);
  at::set_num_threads(before);
  EXPECT_GE(runtime_info().inter_op_threads, 1);
}

TEST(RuntimeInfo, BuildConfigAndBlasAreFilledIn) {
  const RuntimeInfo info = runtime_info();
  EXPECT_NE(info.build_config.find("BLAS"), std::string::npos) << info.build_config;
  EXPECT_FALSE(info.blas.empty());
  if (info.blas == "generic") {
    // Debian's LibTorch calls the system libblas.so.3; the process must resolve it somewhere.
    EXPECT_FALSE(info.blas_library.empty());
  }
}

TEST(RuntimeInfo, TransportsOfThisBuildAreListed) {
  const RuntimeInfo info = runtime_info();
  EXPECT_EQ(info.gloo, gloo_transport_available());
  EXPECT_EQ(info.nccl, nccl_transport_available());
  const std::string text = describe(info);
  EXPECT_NE(text.find("Transports: local, shm, mpi"), std::string::npos) << text;
  EXPECT_EQ(text.find(", nccl") != std::string::npos, info.nccl) << text;
  EXPECT_EQ(text.find("no nccl in this build") != std::string::npos, !info.nccl && info.gloo) << text;
}

TEST(RuntimeInfo, CudaFieldsAgree) {
  const RuntimeInfo info = runtime_info();
  EXPECT_EQ(info.cuda_available, info.cuda_devices > 0);
  EXPECT_EQ(info.cuda_available, torch::cuda::is_available());
}

TEST(RuntimeInfo, DescribeMentionsVersionThreadsBlasAndCuda) {
  RuntimeInfo info = runtime_info();
  info.intra_op_threads = 7;  // a number no other field will print
  const std::string text = describe(info);
  EXPECT_NE(text.find("LibTorch " + info.torch_version), std::string::npos) << text;
  EXPECT_NE(text.find("7 intra-op thread"), std::string::npos) << text;
  EXPECT_NE(text.find("BLAS: " + info.blas), std::string::npos) << text;
  EXPECT_NE(text.find(info.cuda_available ? "CUDA: 1" : "CUDA: none"), std::string::npos) << text;
}

// d/dA sum(A @ B) = ones @ B^T; checked against central differences, in double precision.
TEST(LibTorchLink, MatmulGradientMatchesFiniteDifferences) {
  const auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  torch::Tensor a = torch::tensor({{1.0, 2.0}, {3.0, 4.0}}, opts).requires_grad_();
  const torch::Tensor b = torch::tensor({{0.5, -1.0}, {2.0, 0.25}}, opts);
  torch::mm(a, b).sum().backward();
  ASSERT_TRUE(a.grad().defined());
  EXPECT_TRUE(torch::allclose(a.grad(), torch::ones({2, 2}, opts).mm(b.t())));

  torch::NoGradGuard no_grad;
  const double h = 1e-6;
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      torch::Tensor plus = a.detach().clone(), minus = a.detach().clone();
      plus[i][j] += h;
      minus[i][j] -= h;
      const double numeric =
          (torch::mm(plus, b).sum().item<double>() - torch::mm(minus, b).sum().item<double>()) /
          (2 * h);
      EXPECT_NEAR(a.grad()[i][j].item<double>(), numeric, 1e-6) << "at (" << i << "," << j << ")";
    }
  }
}

}  // namespace
}  // namespace pipetrain

// Compute threads of a rank: LibTorch's intra-op threads and OpenBLAS's follow one setting.

#include <gtest/gtest.h>

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <thread>

#include "pipemat/core/error.h"
#include "pipemat/pp/compute.h"

namespace pipemat::pp {
namespace {

TEST(ComputeThreads, OneSettingForLibTorchAndOpenBlas) {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(default_compute_threads(1), hw < 1 ? 1 : hw);
  EXPECT_EQ(default_compute_threads(hw * 4), 1) << "at least one thread per rank";
  EXPECT_EQ(default_compute_threads(0), default_compute_threads(1));

  const ComputeInfo two = set_compute_threads(2);
  EXPECT_EQ(two.threads, 2);
  EXPECT_EQ(at::get_num_threads(), 2);
  using GetThreads = int (*)();
  auto* openblas = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (openblas != nullptr) {
    EXPECT_EQ(openblas(), 2);
    EXPECT_EQ(two.blas.rfind("OpenBLAS", 0), 0u) << two.blas;
    EXPECT_FALSE(two.reference_blas);
  }
  const ComputeInfo one = set_compute_threads(1);
  EXPECT_EQ(one.threads, 1);
  if (openblas != nullptr) {
    EXPECT_EQ(openblas(), 1);
  }
  EXPECT_THROW(set_compute_threads(0), ConfigError);
}

}  // namespace
}  // namespace pipemat::pp

#include "pipemat/pp/compute.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <malloc.h>
#include <sys/resource.h>
#include <torch/version.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/stats.h"

namespace pipemat::pp {
namespace {

std::atomic<bool> g_freed_memory_retained{false};
std::mutex g_choice_mutex;
std::optional<ThreadChoice> g_choice;  // guarded by g_choice_mutex

void set_threads(int threads, std::optional<ThreadChoice> choice) {
  PIPEMAT_CHECK(threads >= 1, ConfigError, "compute threads must be at least 1, got ", threads);
  at::set_num_threads(threads);
  const std::lock_guard<std::mutex> lock(g_choice_mutex);
  g_choice = std::move(choice);
}

// "MKL 2024.2" from LibTorch's parallel-info line "Intel(R) oneAPI Math Kernel Library Version
// 2024.2-Product Build ..."; otherwise the BLAS_INFO of LibTorch's build configuration.
std::string blas_name(const std::string& parallel_info) {
  const std::string mkl = "Math Kernel Library Version ";
  const size_t at = parallel_info.find(mkl);
  if (at != std::string::npos) {
    const size_t begin = at + mkl.size();
    const size_t end = parallel_info.find_first_of("- \n", begin);
    return "MKL " + parallel_info.substr(begin, end - begin);
  }
  const std::string config = at::show_config();
  const std::string key = "BLAS_INFO=";
  const size_t info = config.find(key);
  if (info == std::string::npos) return "unknown";
  const size_t begin = info + key.size();
  return config.substr(begin, config.find_first_of(", \n", begin) - begin);
}

// N of the line "\tmkl_get_max_threads() : N"; -1 when there is none.
int blas_threads(const std::string& parallel_info) {
  const std::string key = "mkl_get_max_threads() : ";
  const size_t at = parallel_info.find(key);
  if (at == std::string::npos) return -1;
  return std::atoi(parallel_info.c_str() + at + key.size());
}

}  // namespace

int default_compute_threads(int ranks_on_host) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int ranks = ranks_on_host < 1 ? 1 : ranks_on_host;
  return cores / ranks < 1 ? 1 : cores / ranks;
}

bool retain_freed_memory() {
#if defined(__GLIBC__)
  const bool ok =
      mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
  if (ok) g_freed_memory_retained = true;
  return ok;
#else
  return false;
#endif
}

ComputeInfo compute_info() {
  ComputeInfo info;
  info.threads = at::get_num_threads();
  info.freed_memory_retained = g_freed_memory_retained;
  {
    const std::lock_guard<std::mutex> lock(g_choice_mutex);
    info.choice = g_choice;
  }
  info.torch_version = TORCH_VERSION;
  const std::string parallel = at::get_parallel_info();
  info.blas = blas_name(parallel);
  info.blas_threads = blas_threads(parallel);
  return info;
}

int64_t peak_resident_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

ComputeInfo set_compute_threads(int threads) {
  set_threads(threads, std::nullopt);
  return compute_info();
}

ThreadChoice choose_compute_threads(int threads, const std::function<void()>& work, int rounds) {
  PIPEMAT_CHECK(threads >= 1, ConfigError, "compute threads must be at least 1, got ", threads);
  PIPEMAT_CHECK(rounds >= 1, ConfigError, "a thread probe needs at least 1 round, got ", rounds);
  ThreadChoice choice;
  choice.asked = threads;
  choice.threads = threads;
  if (const char* policy = std::getenv("OMP_WAIT_POLICY")) choice.wait_policy = policy;
  if (threads == 1) {
    set_threads(1, choice);
    return choice;
  }
  // Alternating rounds: a machine that gets busier or quieter during the probe slows both.
  const auto timed = [&](int n) {
    set_threads(n, std::nullopt);
    const auto t0 = std::chrono::steady_clock::now();
    work();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  timed(1);
  timed(threads);
  std::vector<double> one, many;
  for (int r = 0; r < rounds; ++r) {
    one.push_back(timed(1));
    many.push_back(timed(threads));
  }
  choice.probed = true;
  choice.rounds = rounds;
  choice.one_ms = median(one);
  choice.asked_ms = median(many);
  choice.threads = choice.asked_ms <= choice.one_ms ? threads : 1;
  set_threads(choice.threads, choice);
  return choice;
}

}  // namespace pipemat::pp

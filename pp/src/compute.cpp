#include "pipemat/pp/compute.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <link.h>
#include <malloc.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "pipemat/core/error.h"

namespace pipemat::pp {
namespace {

std::atomic<bool> g_freed_memory_retained{false};

// The path of the loaded libblas.so.3 (the Debian alternative), if any.
std::string loaded_blas_path() {
  std::string path;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        const char* name = info->dlpi_name;
        if (name != nullptr && std::strstr(name, "libblas.so") != nullptr) {
          *static_cast<std::string*>(out) = name;
          return 1;
        }
        return 0;
      },
      &path);
  return path;
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
  using GetConfig = char* (*)();
  if (auto* config = reinterpret_cast<GetConfig>(dlsym(RTLD_DEFAULT, "openblas_get_config"))) {
    info.blas = config();  // "OpenBLAS 0.3.21 ... MAX_THREADS=64"
    return info;
  }
  const std::string path = loaded_blas_path();
  info.blas = path.empty() ? "no libblas.so.3 loaded" : path;
  info.reference_blas = path.find("/blas/") != std::string::npos;  // Debian's reference BLAS
  return info;
}

ComputeInfo set_compute_threads(int threads) {
  PIPEMAT_CHECK(threads >= 1, ConfigError, "compute threads must be at least 1, got ", threads);
  at::set_num_threads(threads);
  using SetThreads = void (*)(int);
  if (auto* set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set(threads);
  }
  return compute_info();
}

}  // namespace pipemat::pp

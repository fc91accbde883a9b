// The remat debug trace (pack / unpack / rederive / fallback decisions): its switch, set by
// PIPEMAT_REMAT_TRACE or set_trace_sink, and the sink trace_line writes to (stderr by default).

#include <atomic>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <mutex>
#include <string>

#include "internal.h"
#include "pipemat/remat/region.h"

namespace pipemat::remat {
namespace {

std::mutex g_trace_mutex;
std::function<void(const std::string&)> g_trace_sink;
std::atomic<bool> g_trace_on{[] {
  const char* env = std::getenv("PIPEMAT_REMAT_TRACE");
  return env != nullptr && env[0] != '\0' && env[0] != '0';
}()};

}  // namespace

namespace detail {

bool trace_enabled() { return g_trace_on.load(std::memory_order_relaxed); }

void trace_line(const std::string& line) {
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  if (g_trace_sink) {
    g_trace_sink(line);
  } else {
    std::cerr << "[pipemat remat] " << line << "\n";
  }
}

}  // namespace detail

void set_trace_sink(std::function<void(const std::string&)> sink) {
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  g_trace_on.store(sink != nullptr);
  g_trace_sink = std::move(sink);
}

}  // namespace pipemat::remat

// Per-thread CPU generators (Note [Per-thread CPU generators]) and the generator state that
// checkpoint units record and replay restores (Note [Replay RNG alignment]).

#include "pipemat/remat/rng.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include "internal.h"
#include "pipemat/core/error.h"

// Note [LibTorch generator internals]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// This file is remat's one reach into LibTorch's random-number internals, in two places:
//  * the per-thread generators (Note [Per-thread CPU generators]) register a process-wide boxed
//    fallback on the TESTING_ONLY_GenericMode dispatch key, free for that in LibTorch, and
//    switch it per thread through c10::impl's thread-local included-key set;
//  * the state a checkpoint unit records and replay restores (Note [Replay RNG alignment]) is
//    read and written through at::CPUGeneratorImpl's engine and cached normal samples, copied by
//    value (RngState), not through get_state() (which allocates a tensor per unit call). A
//    CUDA generator's state goes through the public get_state()/set_state() (a seed and an
//    offset), recorded only in a process that sees a GPU.
// Both are details of LibTorch: another version may use the key or change what a CPU
// generator's state is. The key and the generator's engine and normal-sample accessors are the
// same in every LibTorch the configure step accepts (2.11 to 2.15, Note [Finding LibTorch] in
// cmake/PipematTorch.cmake; a CPU generator has no offset, and its offset accessors refuse to
// run); check them before widening that range.
namespace pipemat::remat {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

thread_local at::Generator* tls_generator = nullptr;

// Fills the `generator` argument of a random op that got none with this thread's generator,
// then runs the op below this key.
void fill_generator(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                    torch::jit::Stack* stack) {
  // A CUDA op draws from its device's generator: the thread's generator is a CPU one.
  if (tls_generator != nullptr && !keys.has_backend(c10::BackendComponent::CUDABit)) {
    const auto& args = op.schema().arguments();
    const size_t n = args.size();
    for (size_t i = 0; i < n; ++i) {
      if (args[i].name() != "generator") continue;
      c10::IValue& value = (*stack)[stack->size() - n + i];
      if (value.isNone()) value = c10::IValue(*tls_generator);
    }
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fill_generator>());
}

}  // namespace

ThreadGeneratorScope::ThreadGeneratorScope(uint64_t seed)
    : ThreadGeneratorScope(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

ThreadGeneratorScope::ThreadGeneratorScope(at::Generator generator)
    : generator_(std::move(generator)),
      previous_(tls_generator),
      key_was_included_(c10::impl::tls_is_dispatch_key_included(kKey)) {
  PIPEMAT_CHECK(generator_.defined() && generator_.device().is_cpu(), ConfigError,
                "ThreadGeneratorScope needs a CPU generator");
  tls_generator = &generator_;
  c10::impl::tls_set_dispatch_key_included(kKey, true);
}

ThreadGeneratorScope::~ThreadGeneratorScope() {
  tls_generator = previous_;
  c10::impl::tls_set_dispatch_key_included(kKey, key_was_included_);
}

at::Generator current_cpu_generator() {
  return tls_generator != nullptr ? *tls_generator : at::detail::getDefaultCPUGenerator();
}

namespace detail {

namespace {

// The current CUDA device, or -1 when the process sees no GPU (asked once: a CUDA build without
// a GPU answers false, and CPU runs then never touch CUDA).
c10::DeviceIndex current_cuda_device() {
  static const bool has_cuda = at::globalContext().hasCUDA();
  if (!has_cuda) return -1;
  return c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index();
}

at::Generator cuda_generator(c10::DeviceIndex device) {
  return at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, device));
}

}  // namespace

RngState cpu_rng_state() {
  RngState out;
  {
    auto gen = current_cpu_generator();  // Note [Per-thread CPU generators]
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
    out.engine = impl->engine();
    out.next_float_normal = impl->next_float_normal_sample();
    out.next_double_normal = impl->next_double_normal_sample();
  }
  out.cuda_device = current_cuda_device();
  if (out.cuda_device >= 0) {
    auto gen = cuda_generator(out.cuda_device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.cuda = gen.get_state();
  }
  return out;
}

void set_cpu_rng_state(const RngState& state) {
  {
    auto gen = current_cpu_generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
    impl->set_engine(state.engine);
    impl->set_next_float_normal_sample(state.next_float_normal);
    impl->set_next_double_normal_sample(state.next_double_normal);
  }
  if (state.cuda_device >= 0) {
    auto gen = cuda_generator(state.cuda_device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state.cuda);
  }
}

bool same_rng_state(const RngState& a, const RngState& b) {
  const at::mt19937_data_pod x = a.engine.data();
  const at::mt19937_data_pod y = b.engine.data();
  return x.seed_ == y.seed_ && x.left_ == y.left_ && x.seeded_ == y.seeded_ && x.next_ == y.next_ &&
         x.state_ == y.state_ && a.next_float_normal == b.next_float_normal &&
         a.next_double_normal == b.next_double_normal && a.cuda_device == b.cuda_device &&
         (a.cuda_device < 0 || a.cuda.equal(b.cuda));
}

namespace {

// Note [Shared generator detection]: the open windows of every thread.
struct OpenWindow {
  std::thread::id thread;
  std::string marked_by;  // a unit of another thread that drew while this window was open
};
std::mutex g_windows_mutex;
std::map<uint64_t, OpenWindow> g_windows;
uint64_t g_next_window = 1;

std::string thread_name(std::thread::id id) {
  std::ostringstream out;
  out << id;
  return out.str();
}

}  // namespace

SharedGeneratorWindow::SharedGeneratorWindow(const Invocation& inv) : inv_(inv) {
  if (tls_generator != nullptr) return;  // this thread's own generator
  std::lock_guard<std::mutex> lock(g_windows_mutex);
  serial_ = g_next_window++;
  g_windows.emplace(serial_, OpenWindow{std::this_thread::get_id(), ""});
}

SharedGeneratorWindow::~SharedGeneratorWindow() {
  if (serial_ == 0) return;
  std::lock_guard<std::mutex> lock(g_windows_mutex);
  g_windows.erase(serial_);
}

void SharedGeneratorWindow::close(bool drew) {
  if (serial_ == 0) return;
  std::string marked_by;
  {
    std::lock_guard<std::mutex> lock(g_windows_mutex);
    auto it = g_windows.find(serial_);
    marked_by = std::move(it->second.marked_by);
    g_windows.erase(it);
    serial_ = 0;
    if (drew) {
      const std::thread::id self = std::this_thread::get_id();
      for (auto& [serial, window] : g_windows) {
        if (window.thread != self && window.marked_by.empty()) {
          window.marked_by = concat(inv_.where(), " on thread ", thread_name(self));
        }
      }
    }
  }
  PIPEMAT_CHECK(!drew || marked_by.empty(), RematError, inv_.where(), " on thread ",
                thread_name(std::this_thread::get_id()),
                " drew random numbers from LibTorch's process-wide CPU generator while ", marked_by,
                " drew from it too: their draws interleave, so replay cannot draw what the "
                "forward drew and the gradients would be silently wrong. Give each thread that "
                "trains its own generator: a pipemat::remat::ThreadGeneratorScope at the top of "
                "the thread (pipemat/remat/rng.h; pp::Pipeline makes one per rank when "
                "PipelineOptions::seed is set)");
}

namespace {
thread_local uint64_t tls_layer_streams = 0;
}  // namespace

uint64_t layer_streams_entered() { return tls_layer_streams; }

}  // namespace detail

uint64_t layer_seed(uint64_t seed, int64_t key) {
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  return mix(mix(seed) ^ static_cast<uint64_t>(key));
}

struct LayerStream::Saved {
  detail::RngState state;
};

// Note [Layer streams]: saved with the state a checkpoint unit records (the CPU generator, and
// the current CUDA device's where the process sees a GPU), so the scope restores what replay
// restores.
LayerStream::LayerStream(int64_t key)
    : saved_(std::make_unique<Saved>(Saved{detail::cpu_rng_state()})) {
  {
    at::Generator gen = current_cpu_generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(layer_seed(gen.current_seed(), key));
  }
  if (saved_->state.cuda_device >= 0) {
    at::Generator gen = detail::cuda_generator(saved_->state.cuda_device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(layer_seed(gen.current_seed(), key));
  }
  ++detail::tls_layer_streams;
}

LayerStream::~LayerStream() { detail::set_cpu_rng_state(saved_->state); }

}  // namespace pipemat::remat

// Per-thread CPU generators (Note [Per-thread CPU generators]) and the generator state that
// checkpoint units record and replay restores (Note [Replay RNG alignment]).

#include "pipemat/remat/rng.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/version.h>

#include <mutex>

#include "internal.h"
#include "pipemat/core/error.h"

// Note [LibTorch generator internals]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// This file is remat's one reach into LibTorch's random-number internals, in two places:
//  * the per-thread generators (Note [Per-thread CPU generators]) register a process-wide boxed
//    fallback on the TESTING_ONLY_GenericMode dispatch key, free for that in LibTorch 1.13, and
//    switch it per thread through c10::impl's thread-local included-key set;
//  * the state a checkpoint unit records and replay restores (Note [Replay RNG alignment]) is
//    read and written through at::CPUGeneratorImpl's engine and cached normal samples, copied by
//    value (RngState), not through get_state() (which allocates a tensor per unit call).
// Both are details of LibTorch 1.13: another version may use the key or change what a CPU
// generator's state is, so the build stops there.
#if TORCH_VERSION_MAJOR != 1 || TORCH_VERSION_MINOR != 13
#error \
    "pipemat: the per-thread generators and replay's RNG state reach into LibTorch 1.13 internals (Note [LibTorch generator internals]); check them against this version"
#endif

namespace pipemat::remat {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

thread_local at::Generator* tls_generator = nullptr;

// Fills the `generator` argument of a random op that got none with this thread's generator,
// then runs the op below this key.
void fill_generator(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                    torch::jit::Stack* stack) {
  if (tls_generator != nullptr) {
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

RngState cpu_rng_state() {
  auto gen = current_cpu_generator();  // Note [Per-thread CPU generators]
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
  return RngState{impl->engine(), impl->next_float_normal_sample(),
                  impl->next_double_normal_sample()};
}

void set_cpu_rng_state(const RngState& state) {
  auto gen = current_cpu_generator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
  impl->set_engine(state.engine);
  impl->set_next_float_normal_sample(state.next_float_normal);
  impl->set_next_double_normal_sample(state.next_double_normal);
}

}  // namespace detail

}  // namespace pipemat::remat

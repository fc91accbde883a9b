#pragma once
// Per-thread CPU generators.
//
// Note [Per-thread CPU generators]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// LibTorch draws every random op that gets no explicit generator (dropout, bernoulli, randn,
// normal_, randperm, ...) from one process-wide CPU generator. Threads that train at the same
// time in one process (pipeline ranks over the local transport, a user's own threads) then
// interleave their draws: a forward is not reproducible, and a checkpoint unit's replay, which
// rewinds the generator to the unit's entry state, races with the other threads and can draw
// other dropout masks than the forward did (silently wrong gradients).
//
// A ThreadGeneratorScope gives the calling thread a generator of its own. While it is alive,
// every random op called on this thread without a generator draws from it: a dispatcher
// fallback on a dispatch key that only this scope enables fills in the op's `generator`
// argument, so no op and no user code changes. Checkpoint units record and rewind the
// current generator (current_cpu_generator()), so replay reproduces the forward's stream
// whatever other threads do. Backward on CPU runs on the thread that calls it, under the
// dispatch state captured when it started, so replays inside backward see the same generator.
// Without a scope nothing changes and nothing is intercepted. Random ops on CUDA tensors draw
// from their device's generator as always (a scope supplies CPU generators only).
//
// The dispatch key is LibTorch's TESTING_ONLY_GenericMode, a key free for a process-wide boxed
// fallback in the LibTorch versions pipemat accepts (2.11 to 2.15); a program
// that registers its own fallback on that key cannot use scopes.
//
// Threading: scopes are per thread and nest (the innermost wins). Non-copyable.

#include <ATen/core/Generator.h>

#include <cstdint>

namespace pipemat::remat {

class ThreadGeneratorScope {
 public:
  // A fresh CPU generator seeded with `seed`.
  explicit ThreadGeneratorScope(uint64_t seed);
  // `generator` (a CPU generator, shared: its state advances for its owner too).
  explicit ThreadGeneratorScope(at::Generator generator);
  ~ThreadGeneratorScope();
  ThreadGeneratorScope(const ThreadGeneratorScope&) = delete;
  ThreadGeneratorScope& operator=(const ThreadGeneratorScope&) = delete;

  at::Generator& generator() { return generator_; }

 private:
  at::Generator generator_;
  at::Generator* previous_;
  bool key_was_included_;
};

// The generator random ops on this thread draw from: the innermost scope's, else LibTorch's
// default CPU generator.
at::Generator current_cpu_generator();

}  // namespace pipemat::remat

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
//
// Note [Layer streams]
// ~~~~~~~~~~~~~~~~~~~~
// A LayerStream(key) scope gives the random ops of one layer a stream that depends on the
// generator's seed and the key only, not on what was drawn before it: at entry it saves the
// state of the thread's current CPU generator (current_cpu_generator()) and reseeds it with
// layer_seed(current_seed(), key), and at exit it restores the saved state, so the draws after
// the scope continue as if it had drawn nothing. Draws do not change a generator's seed, so
// layers that run one after the other from one reseed (a pipeline stage's forward, Note [Random
// streams of a step] in pipemat/pp/pipeline.h) each draw from (that seed, their key), whichever
// layers ran before them in the same forward. In a process that sees a GPU the current CUDA
// device's generator is saved, reseeded from its own seed the same way and restored too.
//
// Replay: a checkpoint unit records the generator at its entry and rewinds to it for a replay
// (Note [Replay RNG alignment]), and a unit whose forward entered a LayerStream counts as one
// that drew even though the scope left the generator as it found it; so a replay reseeds every
// layer from the same seed, whether the unit is one layer, part of one or several. Nesting: an
// inner scope keys from the outer scope's seed. Only the caller's reseed before each forward
// makes the streams differ from forward to forward: without one every forward draws the same.

#include <ATen/core/Generator.h>

#include <cstdint>
#include <memory>

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

// Note [Layer streams]: the seed of layer `key`'s stream under a generator seeded with `seed`
// (splitmix64 over both: nearby keys give unrelated seeds).
uint64_t layer_seed(uint64_t seed, int64_t key);

// Note [Layer streams]: the random ops of the scope draw from layer_seed(seed, key) of the
// current generator(s); the generators are as before the scope when it ends. On the thread that
// made it; non-copyable.
class LayerStream {
 public:
  explicit LayerStream(int64_t key);
  ~LayerStream();
  LayerStream(const LayerStream&) = delete;
  LayerStream& operator=(const LayerStream&) = delete;

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;
};

}  // namespace pipemat::remat

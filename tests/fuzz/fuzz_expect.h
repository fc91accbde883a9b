#pragma once
// What a fuzz target checks of what a library accepted (Note [Fuzz targets] in
// tests/fuzz/CMakeLists.txt): a broken promise aborts, so libFuzzer reports it as a crash and
// keeps the input.

#include <cstdio>
#include <cstdlib>

namespace pipemat::fuzz {

// Aborts naming `target` and the promise `what` unless `ok`.
inline void expect(bool ok, const char* target, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "%s fuzz: broken promise: %s\n", target, what);
    std::abort();
  }
}

}  // namespace pipemat::fuzz

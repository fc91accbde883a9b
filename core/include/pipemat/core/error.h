#pragma once
// Error policy of pipemat.
//
// User-facing failures (bad config, bad schedule, peer gone, misuse of a wrapper) throw a typed
// subclass of pipemat::Error through PIPEMAT_CHECK / PIPEMAT_THROW. Every message says what was
// expected, what was found, where (module path, invocation, rank, stage, micro-batch, peer, YAML
// key and line) and what to do next.
//
// Broken invariants of pipemat itself use PIPEMAT_INTERNAL_ASSERT, which throws InternalError with
// the source location and asks for a bug report. Nothing in pipemat throws from a destructor.

#include <sstream>
#include <stdexcept>
#include <string>

namespace pipemat {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A YAML config, a command-line flag or an options struct holds a value that is not allowed.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A schedule that cannot run: invalid action list, unmet generator constraint, deadlock.
class ScheduleError : public Error {
 public:
  using Error::Error;
};

// A transport failure: peer closed, MPI error, shape/dtype mismatch between ranks.
class CommError : public Error {
 public:
  using Error::Error;
};

// A wait that passed its deadline. A CommError, so code that handles comm failures handles it.
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

// Misuse or a detected inconsistency in activation checkpointing (remat).
class RematError : public Error {
 public:
  using Error::Error;
};

// A pipeline stage or the pipeline API used wrongly: a stage returning a different number of
// tensors or other dtypes than its boundary carried, inputs that do not fit a stage's forward, a
// loss that is not a scalar, a batch that does not split into the micro-batches.
class PipelineError : public Error {
 public:
  using Error::Error;
};

// A collective step failed on another rank, and this rank ends it the same way: its message
// names that rank, whose own error holds the cause (a rank that runs the ranks as threads
// reports that one, comm/rank_threads.h).
class PeerFailedError : public PipelineError {
 public:
  using PipelineError::PipelineError;
};

// A weight file or directory (safetensors, pipemat/weights) that is not what it claims: the
// message names the file, the tensor and what is wrong.
class WeightsError : public Error {
 public:
  using Error::Error;
};

// A pipemat invariant did not hold: a bug in pipemat, not in the caller.
class InternalError : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

[[noreturn]] void throw_internal(const char* file, int line, const char* cond,
                                 const std::string& msg);

}  // namespace detail
}  // namespace pipemat

// PIPEMAT_THROW(RematError, "what", value, "where") throws pipemat::RematError with the parts
// streamed together.
#define PIPEMAT_THROW(ErrorType, ...) \
  throw ::pipemat::ErrorType(::pipemat::detail::concat(__VA_ARGS__))

// PIPEMAT_CHECK(cond, ConfigError, "message parts", ...) throws when cond is false. The message
// parts are only evaluated on failure.
#define PIPEMAT_CHECK(cond, ErrorType, ...)  \
  do {                                       \
    if (!(cond)) {                           \
      PIPEMAT_THROW(ErrorType, __VA_ARGS__); \
    }                                        \
  } while (false)

#define PIPEMAT_INTERNAL_ASSERT(cond, ...)                                             \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      ::pipemat::detail::throw_internal(__FILE__, __LINE__, #cond,                     \
                                        ::pipemat::detail::concat("", ##__VA_ARGS__)); \
    }                                                                                  \
  } while (false)

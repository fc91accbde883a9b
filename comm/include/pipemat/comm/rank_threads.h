#pragma once
// Ranks as threads of this process: one thread per rank, all joined before returning, and of
// the ranks' failures one error for the caller, the root cause.
//
// The root cause is, by rank, the first error that is neither a CommError nor a
// PeerFailedError, else the first of those: a rank whose peer failed and closed its transport
// fails with a CommError, and a rank that ends a collective step because a peer's part failed
// with a PeerFailedError, each only repeating what happened elsewhere.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"

namespace pipemat::comm {

// What one rank runs.
using RankFunction = std::function<void(Transport&)>;

// The system could not start thread `thread` (1-based) of `count`: the threads that started were
// ended and joined, and their errors dropped.
class ThreadStartError : public ConfigError {
 public:
  ThreadStartError(int which, int of, const std::string& why);

  int thread;
  int count;
  std::string reason;  // the system's
};

// Runs fn(r) for r in [0, count) on one thread each and then, on the same thread whether fn threw
// or not, on_rank_end(r) (which must not throw); joins them all and rethrows the root cause of
// the failures. When a thread cannot start, on_rank_end runs for every rank that did not start,
// then the started ones are joined and ThreadStartError is thrown.
void run_rank_threads(int count, const std::function<void(int)>& fn,
                      const std::function<void(int)>& on_rank_end = {});

// The same with fn(*transports[r]) for each r.
void run_rank_threads(const std::vector<std::unique_ptr<Transport>>& transports,
                      const RankFunction& fn, const std::function<void(int)>& on_rank_end = {});

// Makes `world_size` local transports (make_local_transports; options.kind is ignored) and runs
// fn on each rank's thread. A rank's transport is destroyed as soon as its fn returns or throws,
// so that peers still waiting on it fail at once with a CommError instead of a timeout.
void run_local_ranks(int world_size, const TransportOptions& options, const RankFunction& fn);

}  // namespace pipemat::comm

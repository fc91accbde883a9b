#include "pipemat/comm/rank_threads.h"

#include <exception>
#include <system_error>
#include <thread>

namespace pipemat::comm {
namespace {

std::exception_ptr root_cause(const std::vector<std::exception_ptr>& errors) {
  std::exception_ptr first;
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const CommError&) {
      if (!first) first = e;
    } catch (const PeerFailedError&) {
      if (!first) first = e;
    } catch (...) {
      return e;
    }
  }
  return first;
}

}  // namespace

ThreadStartError::ThreadStartError(int which, int of, const std::string& why)
    : ConfigError(::pipemat::detail::concat(
          "transport local: could not start thread ", which, " of ", of, " (", why,
          "); run fewer ranks in one process or use transport.kind mpi / tcp")),
      thread(which),
      count(of),
      reason(why) {}

void run_rank_threads(int count, const std::function<void(int)>& fn,
                      const std::function<void(int)>& on_rank_end) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(count));
  std::vector<std::thread> threads;
  try {
    for (int r = 0; r < count; ++r) {
      threads.emplace_back([&, r] {
        try {
          fn(r);
        } catch (...) {
          errors[static_cast<size_t>(r)] = std::current_exception();
        }
        if (on_rank_end) on_rank_end(r);
      });
    }
  } catch (const std::system_error& e) {
    // The started ranks' peers are gone: end those that never started so the others return.
    const int started = static_cast<int>(threads.size());
    if (on_rank_end) {
      for (int r = started; r < count; ++r) on_rank_end(r);
    }
    for (auto& t : threads) t.join();
    throw ThreadStartError(started + 1, count, e.what());
  }
  for (auto& t : threads) t.join();
  if (std::exception_ptr root = root_cause(errors)) std::rethrow_exception(root);
}

void run_rank_threads(const std::vector<std::unique_ptr<Transport>>& transports,
                      const RankFunction& fn, const std::function<void(int)>& on_rank_end) {
  run_rank_threads(
      static_cast<int>(transports.size()), [&](int r) { fn(*transports[static_cast<size_t>(r)]); },
      on_rank_end);
}

void run_local_ranks(int world_size, const TransportOptions& options, const RankFunction& fn) {
  auto transports = make_local_transports(world_size, options);
  run_rank_threads(transports, fn, [&](int r) { transports[static_cast<size_t>(r)].reset(); });
}

}  // namespace pipemat::comm

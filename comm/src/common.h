#pragma once
// What the backends share (private): the wording of the comm error messages, so every backend
// says the same thing, and the span-carrying Work each backend builds from a Transport::Request.

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/comm/work.h"
#include "pipemat/core/error.h"

namespace pipemat::comm::detail {

using ::pipemat::detail::concat;

// "rank 1 sent 4160 bytes with tag 3, but rank 0 posted a recv of 4096 bytes (tcp); ..."
std::string size_mismatch_message(const WorkInfo& info, size_t sent_bytes);

// "<what happened> while rank 0 was waiting for <info.describe()>"
std::string peer_failure_message(const WorkInfo& info, const std::string& what_happened);

// Work finished because the transport was destroyed first.
std::string shutdown_message(const WorkInfo& info);

// What every backend's Work carries from its Transport::Request: the caller's buffers of a send
// or of an exact-size receive (a recv_any has none). The backends add their own state.
class SpanWork : public Work {
 public:
  using Work::Work;
  std::vector<ConstSpan> send_spans;
  std::vector<MutableSpan> recv_spans;
};

// What every backend's post_send / post_recv does first: BackendWork(request.info, timeout,
// args...) holding request.keep_alive and owning the request's spans (a send's or a receive's;
// the other list is empty). `Request` is Transport::Request.
template <typename BackendWork, typename Request, typename... Args>
std::shared_ptr<BackendWork> make_span_work(Request request, std::chrono::milliseconds timeout,
                                            Args&&... args) {
  auto work = std::make_shared<BackendWork>(request.info, timeout, std::forward<Args>(args)...);
  work->hold(std::move(request.keep_alive));
  work->send_spans = std::move(request.send_spans);
  work->recv_spans = std::move(request.recv_spans);
  return work;
}

}  // namespace pipemat::comm::detail

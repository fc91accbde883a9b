#pragma once
// What the single-tensor handle (tensor.cpp) and the tensor-list handle (tensor_list.cpp) share
// (private): the mode of a handle and the wait that turns its byte work into the result once.

#include <chrono>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"

namespace pipemat::comm {
namespace detail {
enum class Mode { kSend, kRecvAny, kRecvExpected };
}  // namespace detail

// The state of a tensor-list handle (tensor_list.cpp; device_lane.cpp makes it for a lane).
struct TensorListWork::State {
  detail::Mode mode = detail::Mode::kSend;
  WorkPtr work;
  std::vector<at::Tensor> tensors;  // send: the caller's tensors
  std::mutex mutex;
  bool finalized = false;
  std::vector<at::Tensor> result;
  std::string error;  // set when finalize failed
  bool timeout_error = false;
  // A device lane's receive: the list, once the work completed (Note [Device lanes]).
  std::function<std::vector<at::Tensor>()> take;
};

namespace detail {

// Turns the completed byte work into the result (once); called under the state's mutex.
void finalize(TensorWork::State& s);      // tensor.cpp
void finalize(TensorListWork::State& s);  // tensor_list.cpp

// Waits for the byte work (Work::wait(timeout), or Work::wait() without one), turns it into the
// result once (finalize) and returns it or throws the stored error. Shared by TensorWork and
// TensorListWork.
template <typename State>
const auto& wait_result(State& state, std::optional<std::chrono::milliseconds> timeout) {
  try {
    if (timeout) {
      state.work->wait(*timeout);
    } else {
      state.work->wait();
    }
  } catch (const CommError&) {
    // The status is stored; finalize() turns it into the right message (e.g. a size mismatch
    // into the tensor mismatch text).
  }
  std::lock_guard<std::mutex> lock(state.mutex);
  finalize(state);
  if (!state.error.empty()) {
    if (state.timeout_error) throw TimeoutError(state.error);
    throw CommError(state.error);
  }
  return state.result;
}

}  // namespace detail
}  // namespace pipemat::comm

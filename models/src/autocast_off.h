#pragma once
// Autocast off for one device type over a scope: the attention of gpt and llama runs in float32
// inside a bf16 region (Note [Mixed precision] in pp/precision.h).

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>

namespace pipemat::models {

// The thread's autocast state for `type` back at the end of the scope (also when a remat replay
// that stopped early unwinds through it).
class AutocastOff {
 public:
  explicit AutocastOff(c10::DeviceType type)
      : type_(type), was_(at::autocast::is_autocast_enabled(type)) {
    at::autocast::set_autocast_enabled(type_, false);
  }
  ~AutocastOff() { at::autocast::set_autocast_enabled(type_, was_); }
  AutocastOff(const AutocastOff&) = delete;
  AutocastOff& operator=(const AutocastOff&) = delete;

 private:
  c10::DeviceType type_;
  bool was_;
};

}  // namespace pipemat::models

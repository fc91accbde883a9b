#pragma once
// The per-thread clock behind host_overhead_ns() (stats.h): remat's own host time is measured by
// switching a thread-local clock between "remat" and "user code" at every boundary. Entry points
// (run_region, hooks, replay, pretrigger) open a RematCode; every call of a wrapped body or of
// user code inside remat opens a UserCode.

namespace pipemat::remat::detail {

// RAII markers of the two clock states; they nest in any order.
class RematCode {
 public:
  RematCode();
  ~RematCode();
  RematCode(const RematCode&) = delete;
  RematCode& operator=(const RematCode&) = delete;

 private:
  bool previous_;
};

class UserCode {
 public:
  UserCode();
  ~UserCode();
  UserCode(const UserCode&) = delete;
  UserCode& operator=(const UserCode&) = delete;

 private:
  bool previous_;
};

}  // namespace pipemat::remat::detail

#include "pipemat/core/error.h"

namespace pipemat::detail {

void throw_internal(const char* file, int line, const char* cond, const std::string& msg) {
  throw InternalError(concat("pipemat internal error: ", cond, " failed at ", file, ":", line,
                             msg.empty() ? "" : ": ", msg,
                             ". This is a bug in pipemat; please report it with this message."));
}

}  // namespace pipemat::detail

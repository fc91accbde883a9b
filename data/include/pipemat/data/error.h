#pragma once
// The one error type of pipemat::data.

#include "pipemat/core/error.h"

namespace pipemat::data {

// A tokenizer or a tokenized dataset that is not what it claims, or text or tokens it cannot
// take: the message names the file and what is wrong (the offset, the token, the document).
class DataError : public ::pipemat::Error {
 public:
  using ::pipemat::Error::Error;
};

}  // namespace pipemat::data

#pragma once
// The one error type of pipemat::data. It lives in namespace pipemat, beside core's error types,
// so that PIPEMAT_CHECK / PIPEMAT_THROW (which name ::pipemat::<type>) take it; pipemat::data
// names it too.

#include "pipemat/core/error.h"

namespace pipemat {

// A tokenizer or a tokenized dataset that is not what it claims, or text or tokens it cannot
// take: the message names the file and what is wrong (the offset, the token, the document).
class DataError : public Error {
 public:
  using Error::Error;
};

namespace data {
using ::pipemat::DataError;
}  // namespace data

}  // namespace pipemat

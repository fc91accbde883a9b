#pragma once
// Transport interface (filled in by the comm module).
namespace pipemat::comm {}

#pragma once
// Stage runtime (filled in by the pp module).
namespace pipemat::pp {}

#pragma once
// Action IR of pipeline schedules (filled in by the schedule module).
namespace pipemat::schedule {}

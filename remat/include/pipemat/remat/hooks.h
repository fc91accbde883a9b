#pragma once
namespace pipemat::remat {}

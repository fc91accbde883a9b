#pragma once
namespace pipemat::models {}

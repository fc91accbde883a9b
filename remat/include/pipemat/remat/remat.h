#pragma once
// Everything a model author needs from remat.
#include "pipemat/remat/any_module.h"
#include "pipemat/remat/containers.h"
#include "pipemat/remat/hooks.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/options.h"
#include "pipemat/remat/policy.h"
#include "pipemat/remat/region.h"
#include "pipemat/remat/rng.h"
#include "pipemat/remat/stats.h"
#include "pipemat/remat/values.h"
#include "pipemat/remat/wrappers.h"

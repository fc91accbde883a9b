#include "pipemat/remat/hooks.h"

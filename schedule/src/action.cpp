#include "pipemat/schedule/action.h"

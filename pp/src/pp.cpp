#include "pipemat/pp/pp.h"

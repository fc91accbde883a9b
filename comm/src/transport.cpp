#include "pipemat/comm/transport.h"

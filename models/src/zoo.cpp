#include "pipemat/models/zoo.h"

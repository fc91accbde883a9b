// Compiles cmake/torch_pch.h into the precompiled header the pipemat targets reuse.

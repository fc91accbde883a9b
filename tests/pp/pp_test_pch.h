#pragma once
// Precompiled for every pp test file: gtest and the torch headers the pipeline API pulls in.
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

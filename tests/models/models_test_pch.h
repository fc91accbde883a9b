#pragma once
// Precompiled for every models test file: gtest, yaml-cpp and the torch module header that
// pipemat/models/options.h pulls in through the remat policy.
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <yaml-cpp/yaml.h>

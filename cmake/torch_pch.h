#pragma once
// The precompiled header every pipemat target that uses LibTorch shares (Note [Shared precompiled
// header] in cmake/PipematHelpers.cmake): the LibTorch and standard headers most of its files
// include. Parsing them is half of such a file's compile time; sources still include what they
// use, so each also compiles without this header.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

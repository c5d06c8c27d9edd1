// Common includes and build macros of the samplec-native kernels.
#pragma once

#include <algorithm>
#include <exception>
#include <functional>
#include <type_traits>
#include <atomic>
#include <thread>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

// On x86-64 the vocabulary-wide loops are also compiled for AVX2 and AVX-512 and picked at load time (the build's
// baseline is SSE2).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SAMPLEC_VOCAB_LOOP __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SAMPLEC_VOCAB_LOOP
#endif

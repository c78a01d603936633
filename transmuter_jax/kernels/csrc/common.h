// Vector types (GCC/Clang vector extensions) and helpers shared by the kernels.
#pragma once

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace tj {

namespace ffi = xla::ffi;

constexpr int kLanes = 16;  // floats per vector
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));  // unaligned access
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint8_t vb16 __attribute__((vector_size(16)));
typedef uint8_t vb16u __attribute__((vector_size(16), aligned(1)));

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
inline vf splat(float s) { return s - vf{}; }  // x - 0 is x (x + 0 is not, for -0): a bare broadcast

inline float hsum(vf v) {
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(lanes));
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int i = 0; i < kLanes; i += 4) {
    s0 += lanes[i];
    s1 += lanes[i + 1];
    s2 += lanes[i + 2];
    s3 += lanes[i + 3];
  }
  return (s0 + s1) + (s2 + s3);
}

inline int64_t product(ffi::Span<const int64_t> dims, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= dims[i];
  return p;
}

}  // namespace tj

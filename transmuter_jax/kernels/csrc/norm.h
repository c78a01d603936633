// RMS norms with onnxruntime's CPU float steps, one row at a time (norm.cc has the two modes'
// steps): shared by the norm calls and the int4 product whose output a norm follows (nbits.cc).
#pragma once

#include <cmath>
#include <cstdint>

namespace tj {

inline float sum_of_squares(const float* x, int64_t k, int64_t mode) {
  if (mode == 1) {
    float sum = 0.0f;
    for (int64_t i = 0; i < k; ++i) {
      const float square = x[i] * x[i];  // rounded: no contraction (-std=c++17)
      sum = sum + square;
    }
    return sum;
  }
  float s[8] = {};
  for (int64_t i = 0; i < k; ++i) s[i % 8] = std::fma(x[i], x[i], s[i % 8]);
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

// o = the norm of `row` (K values) by `mode`'s steps (above), times gamma g.
inline void norm_row(const float* row, const float* g, int64_t k, float epsilon, int64_t mode,
                     float* o) {
  const float rms = std::sqrt(sum_of_squares(row, k, mode) / static_cast<float>(k) + epsilon);
  if (mode == 1) {
    for (int64_t i = 0; i < k; ++i) o[i] = (row[i] / rms) * g[i];
  } else {
    const float inv = 1.0f / rms;
    for (int64_t i = 0; i < k; ++i) o[i] = (row[i] * inv) * g[i];
  }
}

// s = a + b (each element one float add) and o = s's norm by mode 1 (SkipSimplifiedLayerNorm).
inline void skip_norm_row(const float* a, const float* b, const float* g, int64_t k,
                          float epsilon, float* s, float* o) {
  for (int64_t i = 0; i < k; ++i) s[i] = a[i] + b[i];
  norm_row(s, g, k, epsilon, 1, o);
}

// skip_norm_row over `rows` rows of k values each (s may be a: the sums in place).
inline void skip_norm_rows(const float* a, const float* b, const float* g, int64_t rows,
                           int64_t k, float epsilon, float* s, float* o) {
  for (int64_t r = 0; r < rows; ++r) {
    skip_norm_row(a + r * k, b + r * k, g, k, epsilon, s + r * k, o + r * k);
  }
}

}  // namespace tj

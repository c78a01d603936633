// MatMulNBits with int8 activations (accuracy_level 4), onnxruntime's CompInt8 scheme, computed
// strictly per row of X, so that a row's result never depends on the other rows:
//
//   per row r and block b of K:  s = max|x| / 127,  q = round_half_even(x * (127 / max|x|))
//   per column n:  d = sum(q * value) - zero_point * sum(q)     (exact, in integers)
//                  y[r, n] = fma(d_b, s_b * scale[n, b], ...)   in order b = 0, 1, ... from 0
//
// The integer sums are exact whatever their order, and the float steps are the same for every
// row and every code path (AVX2 or portable), so the pure-JAX path of quant.py (which does the
// same steps) gives the same numbers. Float zero points use d = fma(-zp, sum(q), sum(q * value)).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define TJ_HAVE_INT8_AVX2 1
#endif

namespace tj {

// X quantized per row and block; per block, the values at even positions, then the odd ones (the
// order of the low and high nibbles of B), zero past K.
struct Int8Rows {
  int64_t blocks = 0, block_size = 0;
  std::vector<int8_t> q;      // [rows, blocks, block_size]
  std::vector<float> scale;   // [rows, blocks]
  std::vector<int32_t> sums;  // [rows, blocks]: sum of q over the block
};

inline void int8_quantize(const float* x, int64_t m, int64_t k, int64_t block_size,
                          int64_t blocks, Int8Rows* out) {
  out->blocks = blocks;
  out->block_size = block_size;
  out->q.assign(static_cast<size_t>(m * blocks * block_size), 0);
  out->scale.assign(static_cast<size_t>(m * blocks), 0.0f);
  out->sums.assign(static_cast<size_t>(m * blocks), 0);
  const int64_t half = block_size / 2;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + r * k + b * block_size;
      const int64_t len = std::min(block_size, k - b * block_size);
      float amax = 0.0f;
      for (int64_t i = 0; i < len; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float s = amax / 127.0f;
      const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;  // as MLAS
      int8_t* q = out->q.data() + (r * blocks + b) * block_size;
      int32_t sum = 0;
      for (int64_t i = 0; i < len; ++i) {
        const float rounded = std::clamp(std::nearbyint(v[i] * inv), -127.0f, 127.0f);
        const int32_t value = static_cast<int32_t>(rounded);
        q[(i & 1) * half + i / 2] = static_cast<int8_t>(value);
        sum += value;
      }
      out->scale[r * blocks + b] = s;
      out->sums[r * blocks + b] = sum;
    }
  }
}

// One column's weights per block: the low nibbles (even K), then the high ones (odd K).
inline void int8_expand_column(const uint8_t* bytes, int64_t blocks, int64_t block_size,
                               uint8_t* out) {
  const int64_t half = block_size / 2;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = bytes + b * half;
    uint8_t* e = out + b * block_size;
    int64_t j = 0;
#if defined(__SSE2__)
    const __m128i low = _mm_set1_epi8(15);
    for (; j + 16 <= half; j += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(e + j), _mm_and_si128(v, low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(e + half + j),
                       _mm_and_si128(_mm_srli_epi16(v, 4), low));
    }
#endif
    for (; j < half; ++j) {
      e[j] = p[j] & 15;
      e[half + j] = p[j] >> 4;
    }
  }
}

// The zero point of each (column, block) in one of two forms: integers (packed nibbles or the
// default 8), or float.
struct Int8Column {
  const uint8_t* e;   // [blocks, block_size], expanded
  const float* s;     // [blocks] weight scales
  const int32_t* zi;  // [blocks] integer zero points, or null
  const float* zf;    // [blocks] float zero points, or null
};

// y = the product of one row of X with one column, the scheme above (the reference order).
inline float int8_dot(const Int8Rows& xs, int64_t r, const Int8Column& c) {
  const int64_t bs = xs.block_size;
  float acc = 0.0f;
  for (int64_t b = 0; b < xs.blocks; ++b) {
    const int8_t* q = xs.q.data() + (r * xs.blocks + b) * bs;
    const uint8_t* e = c.e + b * bs;
    int32_t dot = 0;
    for (int64_t i = 0; i < bs; ++i) dot += static_cast<int32_t>(q[i]) * e[i];
    const int32_t sq = xs.sums[r * xs.blocks + b];
    const float d = c.zi ? static_cast<float>(dot - c.zi[b] * sq)
                         : std::fma(-c.zf[b], static_cast<float>(sq), static_cast<float>(dot));
    acc = std::fma(d, xs.scale[r * xs.blocks + b] * c.s[b], acc);
  }
  return acc;
}

#ifdef TJ_HAVE_INT8_AVX2
// 8 lanes of int32 partial sums of 8 columns -> one vector with each column's total.
inline __m256i int8_column_totals(const __m256i v[8]) {
  const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

// Sums of q * e over one block, as 8 int32 lanes (maddubs: e unsigned, q signed; no saturation,
// as 2 * 15 * 127 < 2^15).
inline __m256i int8_block_lanes(const int8_t* q, const uint8_t* e, int64_t bs) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (bs == 16) {
    const __m128i p = _mm_madd_epi16(
        _mm_maddubs_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e)),
                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
        _mm_set1_epi16(1));
    return _mm256_zextsi128_si256(p);
  }
  __m256i acc = _mm256_setzero_si256();
  for (int64_t i = 0; i < bs; i += 32) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e + i));
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
  }
  return acc;
}

// y[r, n0 .. n0 + 8) for one row: the scheme above for 8 columns at once (the same steps per
// column as int8_dot). sw: the scales of the first column ([blocks] per column, columns
// consecutive); zero points per block for the 8 columns (zi8 or zf8), or zi8 null and zf8 null
// for the default 8.
inline void int8_dot8(const Int8Rows& xs, int64_t r, const uint8_t* e, int64_t len,
                      const float* sw, const int32_t* zi8, const float* zf8, float* y) {
  const int64_t bs = xs.block_size, blocks = xs.blocks;
  const __m256i column = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32(static_cast<int32_t>(blocks)));
  const __m256i eight = _mm256_set1_epi32(8);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* q = xs.q.data() + (r * blocks + b) * bs;
    __m256i lanes[8];
    for (int c = 0; c < 8; ++c) lanes[c] = int8_block_lanes(q, e + c * len + b * bs, bs);
    const __m256i dot = int8_column_totals(lanes);
    const int32_t sq = xs.sums[r * blocks + b];
    __m256 d;
    if (zf8 == nullptr) {
      const __m256i zp =
          zi8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(zi8 + b * 8)) : eight;
      d = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot, _mm256_mullo_epi32(zp, _mm256_set1_epi32(sq))));
    } else {
      const __m256 zp = _mm256_loadu_ps(zf8 + b * 8);
      d = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_setzero_ps(), zp),
                          _mm256_set1_ps(static_cast<float>(sq)), _mm256_cvtepi32_ps(dot));
    }
    const __m256 w = _mm256_i32gather_ps(sw + b, column, 4);
    const __m256 p = _mm256_mul_ps(_mm256_set1_ps(xs.scale[r * blocks + b]), w);
    acc = _mm256_fmadd_ps(d, p, acc);
  }
  _mm256_storeu_ps(y, acc);
}

// y[0:m, 0:8) (ldy apart) for 8 columns whose packed nibbles start at col[c] (block b at
// b * block_size / 2), for block sizes that are multiples of 32: blocks outer and rows inner, the
// nibbles unpacked in registers once per block for all rows. The float steps are those of
// int8_dot, in the same order. sw8 and zi8 / zf8: per block, the 8 columns side by side (zi8 and
// zf8 null: the default zero point 8). acc: scratch of m * 8 floats.
inline void int8_tile8(const Int8Rows& xs, int64_t m, const uint8_t* const col[8],
                       const float* sw8, const int32_t* zi8, const float* zf8, float* y,
                       int64_t ldy, float* acc) {
  const int64_t bs = xs.block_size, blocks = xs.blocks, half = bs / 2;
  const __m128i low = _mm_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1), eight = _mm256_set1_epi32(8);
  for (int64_t r = 0; r < m; ++r) _mm256_storeu_ps(acc + r * 8, _mm256_setzero_ps());
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i lanes_rows[8][8];  // unused rows beyond m are not touched
    for (int64_t r0 = 0; r0 < m; r0 += 8) {
      const int64_t rows = std::min<int64_t>(8, m - r0);
      for (int64_t r = 0; r < rows; ++r)
        for (int c = 0; c < 8; ++c) lanes_rows[r][c] = _mm256_setzero_si256();
      for (int64_t j = 0; j < half; j += 16) {
        __m256i e[8];
        for (int c = 0; c < 8; ++c) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(col[c] + b * half + j));
          e[c] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int8_t* q = xs.q.data() + ((r0 + r) * blocks + b) * bs;
          const __m256i x = _mm256_set_m128i(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + half + j)),
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j)));
          for (int c = 0; c < 8; ++c) {
            lanes_rows[r][c] = _mm256_add_epi32(
                lanes_rows[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(e[c], x), ones));
          }
        }
      }
      const __m256 w = _mm256_loadu_ps(sw8 + b * 8);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = r0 + r;
        const __m256i dot = int8_column_totals(lanes_rows[r]);
        const int32_t sq = xs.sums[row * blocks + b];
        __m256 d;
        if (zf8 == nullptr) {
          const __m256i zp =
              zi8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(zi8 + b * 8)) : eight;
          d = _mm256_cvtepi32_ps(
              _mm256_sub_epi32(dot, _mm256_mullo_epi32(zp, _mm256_set1_epi32(sq))));
        } else {
          const __m256 zp = _mm256_loadu_ps(zf8 + b * 8);
          d = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_setzero_ps(), zp),
                              _mm256_set1_ps(static_cast<float>(sq)), _mm256_cvtepi32_ps(dot));
        }
        const __m256 p = _mm256_mul_ps(_mm256_set1_ps(xs.scale[row * blocks + b]), w);
        _mm256_storeu_ps(acc + row * 8, _mm256_fmadd_ps(d, p, _mm256_loadu_ps(acc + row * 8)));
      }
    }
  }
  for (int64_t r = 0; r < m; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_loadu_ps(acc + r * 8));
}
#endif

}  // namespace tj

// MatMulNBits with int8 activations (accuracy_level 4) for block sizes that are multiples of 32
// and integer zero points (or the default 8): integer products per lane, one float scaling per
// block and lane, one reduction per output (MLAS's scheme), strictly per row of X.
//
// X is quantized as in nbits_int8.h (per row and block, even positions then odd). The products
// of one row and one column are kept in two vectors A and B of 8 float lanes:
//   block size 32: block b's 32 bytes of q, 4 bytes per lane, go to A for even b, to B for odd b;
//   block size 64 and more: the block's even positions (its first half of q) go to A, the odd
//   ones to B, lane l taking the bytes at offsets 4l .. 4l + 3 modulo 32 of its half.
// Per block and lane: d = sum(q * value) - zero_point * sum(q)   (int32, exact)
//                     lane = fma(float(d), s_x * s_w, lane)       (s_x * s_w rounded first)
// and y = the fixed tree over the 16 lanes: t = A + B, t[i] + t[i + 4], then [i] + [i + 2],
// then [0] + [1]. The SIMD code (AVX2, VNNI dot products where the CPU has them) and the
// portable code do exactly these float steps, so they agree bit for bit, and a row's result
// never depends on the other rows. With AVX512-VNNI, blocks of 32 go two at a time through
// 512-bit vectors whose halves are A and B (the same lanes and steps).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "nbits_int8.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TJ_HAVE_LANES_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TJ_LANES_VNNI 1  // 256-bit vpdpbusd (AVX512-VNNI with VL)
#if defined(__AVX512BW__) && defined(__AVX512DQ__)
#define TJ_LANES_512 1  // two blocks of 32 per 512-bit vector
#endif
#elif defined(__AVXVNNI__)
#define TJ_LANES_VNNI 1
#define TJ_LANES_AVXVNNI 1
#endif
#endif

namespace tj {

// Per row and block, the sums of q of each lane: 8 int32 for block size 32, else 8 for A then 8
// for B. units() of them per block.
struct LaneSums {
  int64_t units = 1;
  std::vector<int32_t> s;  // [rows, blocks, units, 8]
};

inline void lane_sums(const Int8Rows& xs, int64_t m, LaneSums* out) {
  const int64_t bs = xs.block_size, blocks = xs.blocks;
  out->units = bs == 32 ? 1 : 2;
  out->s.assign(static_cast<size_t>(m * blocks * out->units * 8), 0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* q = xs.q.data() + (r * blocks + b) * bs;
      int32_t* s = out->s.data() + (r * blocks + b) * out->units * 8;
      for (int64_t i = 0; i < bs; ++i) {
        const int64_t unit = bs == 32 ? 0 : i / (bs / 2);
        s[unit * 8 + (i % 32) / 4] += q[i];
      }
    }
  }
}

// The fixed reduction of the 16 lanes.
inline float lanes_total(const float* a, const float* b) {
  float t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i) t[i] = a[i] + b[i];
  for (int i = 0; i < 4; ++i) u[i] = t[i] + t[i + 4];
  for (int i = 0; i < 2; ++i) v[i] = u[i] + u[i + 2];
  return v[0] + v[1];
}

// Portable: y[r * ldy] for rows [r0, r0 + rows) and one column (packed nibbles `col`, scales
// sw [blocks], integer zero points zp [blocks] or null for 8).
inline void lanes_column_portable(const Int8Rows& xs, const LaneSums& ls, int64_t r0,
                                  int64_t rows, const uint8_t* col, const float* sw,
                                  const int32_t* zp, float* y, int64_t ldy) {
  const int64_t bs = xs.block_size, blocks = xs.blocks, half = bs / 2;
  for (int64_t r = r0; r < r0 + rows; ++r) {
    float acc[2][8] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* q = xs.q.data() + (r * blocks + b) * bs;
      const int32_t* s = ls.s.data() + (r * blocks + b) * ls.units * 8;
      const uint8_t* w = col + b * half;
      const int32_t z = zp ? zp[b] : 8;
      int32_t d[2][8] = {};
      for (int64_t i = 0; i < bs; ++i) {
        const int32_t value = i < half ? (w[i] & 15) : (w[i - half] >> 4);
        const int64_t unit = bs == 32 ? 0 : i / half;
        d[unit][(i % 32) / 4] += value * q[i];
      }
      const float p = xs.scale[r * blocks + b] * sw[b];
      for (int64_t unit = 0; unit < ls.units; ++unit) {
        float* a = acc[bs == 32 ? (b & 1) : unit];
        for (int i = 0; i < 8; ++i) {
          const int32_t lane = d[unit][i] - z * s[unit * 8 + i];
          a[i] = std::fma(static_cast<float>(lane), p, a[i]);
        }
      }
    }
    y[(r - r0) * ldy] = lanes_total(acc[0], acc[1]);
  }
}

#ifdef TJ_HAVE_LANES_AVX2
// acc + the products of 32 unsigned nibble values w and 32 signed bytes q, per 4-byte lane.
inline __m256i lanes_dot(__m256i acc, __m256i w, __m256i q) {
#if defined(TJ_LANES_AVXVNNI)
  return _mm256_dpbusd_avx_epi32(acc, w, q);
#elif defined(TJ_LANES_VNNI)
  return _mm256_dpbusd_epi32(acc, w, q);
#else
  // no saturation: 2 * 15 * 127 < 2^15
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, q),
                                                 _mm256_set1_epi16(1)));
#endif
}

inline float lanes_total(__m256 a, __m256 b) {
  const __m256 t = _mm256_add_ps(a, b);
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

// The AVX2 form of lanes_column_portable for R rows from r0 (registers hold R x 16 lanes).
template <int R>
inline void lanes_column(const Int8Rows& xs, const LaneSums& ls, int64_t r0, const uint8_t* col,
                         const float* sw, const int32_t* zp, float* y, int64_t ldy) {
  const int64_t bs = xs.block_size, blocks = xs.blocks, half = bs / 2;
  const __m128i low = _mm_set1_epi8(15);
  const __m256i low2 = _mm256_set1_epi8(15);
  const int8_t* q0 = xs.q.data() + r0 * blocks * bs;
  const int32_t* s0 = ls.s.data() + r0 * blocks * ls.units * 8;
  const float* sx0 = xs.scale.data() + r0 * blocks;
  __m256 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  if (bs == 32) {
    int64_t b = 0;
#ifdef TJ_LANES_512
    // Two blocks per 512-bit vector: lanes 0-7 are A (the even block), 8-15 B (the odd one).
    __m512 acc2[R];
    for (int r = 0; r < R; ++r) acc2[r] = _mm512_setzero_ps();
    const __m512i order = _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7);
    const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (; b + 2 <= blocks; b += 2) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + b * 16));
      const __m256i lo = _mm256_and_si256(v, low2);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low2);
      const __m512i w = _mm512_permutexvar_epi64(
          order, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
      __m512i z = _mm512_setzero_si512();
      if (zp) z = _mm512_permutexvar_epi32(pair, _mm512_castsi128_si512(_mm_loadl_epi64(
                                                      reinterpret_cast<const __m128i*>(zp + b))));
      const __m128 swp = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sw + b)));
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * blocks + b;
        const __m512i q = _mm512_loadu_si512(q0 + at * 32);
        const __m512i s = _mm512_loadu_si512(s0 + at * 8);
        const __m512i d =
            zp ? _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, q),
                                  _mm512_mullo_epi32(z, s))
               : _mm512_dpbusd_epi32(_mm512_sub_epi32(_mm512_setzero_si512(),
                                                      _mm512_slli_epi32(s, 3)),
                                     w, q);
        const __m128 sxp =
            _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sx0 + at)));
        const __m512 p = _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(_mm_mul_ps(sxp, swp)));
        acc2[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), p, acc2[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[0][r] = _mm512_castps512_ps256(acc2[r]);
      acc[1][r] = _mm512_extractf32x8_ps(acc2[r], 1);
    }
#endif
    for (; b < blocks; ++b) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(col + b * 16));
      const __m256i w =
          _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
      const __m256i z = _mm256_set1_epi32(zp ? zp[b] : 8);
      const int h = static_cast<int>(b & 1);
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * blocks + b;
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + at * 32));
        const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s0 + at * 8));
        const __m256i d = zp ? _mm256_sub_epi32(lanes_dot(_mm256_setzero_si256(), w, q),
                                                _mm256_mullo_epi32(z, s))
                             : lanes_dot(_mm256_sub_epi32(_mm256_setzero_si256(),
                                                          _mm256_slli_epi32(s, 3)),
                                         w, q);
        const __m256 p = _mm256_set1_ps(sx0[at] * sw[b]);
        acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), p, acc[h][r]);
      }
    }
  } else {
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i da[R], db[R];
      for (int r = 0; r < R; ++r) da[r] = db[r] = _mm256_setzero_si256();
      for (int64_t j = 0; j < half; j += 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + b * half + j));
        const __m256i lo = _mm256_and_si256(v, low2);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low2);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = q0 + (r * blocks + b) * bs;
          da[r] = lanes_dot(da[r], lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j)));
          db[r] = lanes_dot(
              db[r], hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + half + j)));
        }
      }
      const __m256i z = _mm256_set1_epi32(zp ? zp[b] : 8);
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * blocks + b;
        const int32_t* s = s0 + at * 16;
        const __m256i sa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
        const __m256i sb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 8));
        const __m256 p = _mm256_set1_ps(sx0[at] * sw[b]);
        acc[0][r] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_sub_epi32(da[r], _mm256_mullo_epi32(z, sa))), p, acc[0][r]);
        acc[1][r] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_sub_epi32(db[r], _mm256_mullo_epi32(z, sb))), p, acc[1][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = lanes_total(acc[0][r], acc[1][r]);
}
#endif

}  // namespace tj

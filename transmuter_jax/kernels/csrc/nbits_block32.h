// MatMulNBits with 4-bit weights in blocks of 32 and int8 activations (accuracy_level 4), with
// the float steps of onnxruntime's MLAS (its AVX512-VNNI CompInt8 kernel for blocks of 32), done
// alike on every CPU and strictly per row of X.
//
// X per row and block b:  s_b = max|x| / 127,  q = round_half_even(x * (127 / max|x|)) (int8),
//                         t_b = s_b * sum(q)
// Per column (raw weight values v in 0..15, scales w_b, zero points z_b, 8 when absent):
//   main: 16 float lanes. Each group of 4 blocks g = 4j .. 4j + 3 splits each block into the
//         parts P0 = positions 0-3 and 8-11, P1 = 4-7 and 12-15, P2 = 16-19 and 24-27,
//         P3 = 20-23 and 28-31; part p of block 4j + i goes to lane kLane[i][p] as
//         lane = fma(float(sum(q * v) over the part), w_b * s_b, lane). Then 8 lanes
//         a_i = lane_i + lane_{i + 8}; each block left over (fewer than 4) adds
//         a_i = fma(float(sum(q * v) over positions 4i .. 4i + 3), s_b * w_b, a_i).
//         main = (((a0 + a1) + a2) + a3) + (((a4 + a5) + a6) + a7), or for the last N % 4
//         columns ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
//   zero points: c = fma(t_b, -(w_b * z_b), c) over the blocks in order, from 0.
//   y = main + c.
// The integer sums are exact, so any SIMD width gives the same lanes; the SIMD code (AVX-512
// VNNI, AVX2 with or without VNNI) and the portable code do the same float steps and give the
// same bits.
//
// Weights come either as stored (ONNX: byte j of a block holds values 2j and 2j + 1) or
// prepacked at load (kernels.nbits_pack): per column, each whole group of 4 blocks as 64 bytes
// in the packed order (b32_first): byte 4o + i holds the i-th value of part o's first run of 4
// (low nibble) and of its second run (high nibble), so a mask and a shift give two vectors whose
// lane o, dotted with the row's values in the same order (B32Rows::qp) and chained, is part o's
// sum, with no pairing of lanes; each block left over as 16 bytes, byte t holding values t and
// 16 + t. The integer sums are the same in any order. With packed weights the scales (and zero
// points, one byte each) come in tiles of kB32Tile columns: [ceil(N / 16), blocks, 16], so the
// zero-point term of 16 columns is one vector operation per block.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define TJ_B32_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__)
#define TJ_B32_512 1  // two blocks per 512-bit vpdpbusd
#define TJ_B32_VNNI 1
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TJ_B32_VNNI 1
#elif defined(__AVXVNNI__)
#define TJ_B32_VNNI 1
#define TJ_B32_AVXVNNI 1
#endif
#endif

namespace tj {

constexpr int64_t kB32 = 32;
constexpr int64_t kB32Tile = 16;  // columns per tile of packed scales and zero points

// X quantized per row and block of 32, positions in order, zero past K.
struct B32Rows {
  int64_t blocks = 0;
  std::vector<int8_t> q;      // [rows, blocks, 32]
  std::vector<float> scale;   // [rows, blocks]
  std::vector<float> blksum;  // [rows, blocks]: scale * sum(q)
  std::vector<int8_t> qp;     // [rows, blocks / 4, 128]: each whole group in the packed order
  std::vector<float> sx16;    // [rows, blocks / 4, 16]: lane o the scale of part o's block
};

// The block (within its group of 4) whose scale lane o of main's accumulator takes.
constexpr int kB32LaneBlock[16] = {0, 0, 2, 2, 0, 0, 2, 2, 1, 1, 3, 3, 1, 1, 3, 3};

// The packed order of a group of 4 blocks (kernels._nbits_parts): byte 4o + i of its first 64
// holds value b32_first(4o + i), of its second 64 value b32_first(4o + i) + 8. Lane o of main's
// accumulator sums part o, the two runs of 4 (t = o % 4, j = o / 4: values 16j + 4(t % 2) + i of
// the group's first half for t < 2, of its second half otherwise, and 8 further).
constexpr int b32_first(int k) {
  return ((k / 4) % 4 >= 2 ? 64 : 0) + 16 * (k / 16) + 4 * ((k / 4) % 2) + k % 4;
}

inline void b32_quantize(const float* x, int64_t m, int64_t k, bool portable, B32Rows* out) {
  const int64_t blocks = (k + kB32 - 1) / kB32;
  out->blocks = blocks;
  out->q.assign(static_cast<size_t>(m * blocks * kB32), 0);
  out->scale.assign(static_cast<size_t>(m * blocks), 0.0f);
  out->blksum.assign(static_cast<size_t>(m * blocks), 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + r * k + b * kB32;
      const int64_t len = std::min(kB32, k - b * kB32);
#ifdef TJ_B32_512
      if (len == kB32 && !portable) {  // the same steps in lanes (NaN: out of the maximum)
        const __m512 sign = _mm512_set1_ps(-0.0f);
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
        const __m512 a0 = _mm512_andnot_ps(sign, v0), a1 = _mm512_andnot_ps(sign, v1);
        __m512 top = _mm512_max_ps(a0, _mm512_setzero_ps());  // NaN lanes: 0
        top = _mm512_max_ps(a1, top);
        const float amax = _mm512_reduce_max_ps(top);
        const float s = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        const __m512 lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f);
        auto quantize = [&](__m512 x) {
          const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(x, inv),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          return _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r)));
        };
        const __m512i q0 = quantize(v0), q1 = quantize(v1);
        int8_t* q = out->q.data() + (r * blocks + b) * kB32;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
        const __m512i wide = _mm512_add_epi32(_mm512_srai_epi32(_mm512_slli_epi32(q0, 24), 24),
                                              _mm512_srai_epi32(_mm512_slli_epi32(q1, 24), 24));
        out->scale[r * blocks + b] = s;
        out->blksum[r * blocks + b] = s * static_cast<float>(_mm512_reduce_add_epi32(wide));
        continue;
      }
#elif defined(TJ_B32_AVX2)
      if (len == kB32 && !portable) {  // as above, 8 lanes at a time
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 vs[4], top = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          vs[i] = _mm256_loadu_ps(v + 8 * i);
          top = _mm256_max_ps(_mm256_andnot_ps(sign, vs[i]), top);  // NaN lanes: kept out
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, top);
        float amax = 0.0f;
        for (float lane : lanes) amax = std::max(amax, lane);
        const float s = amax / 127.0f;
        const __m256 inv = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        const __m256 lo = _mm256_set1_ps(-128.0f), hi = _mm256_set1_ps(127.0f);
        int8_t* q = out->q.data() + (r * blocks + b) * kB32;
        alignas(32) int32_t ints[kB32];
        for (int i = 0; i < 4; ++i) {
          const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(vs[i], inv),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          _mm256_store_si256(reinterpret_cast<__m256i*>(ints + 8 * i),
                             _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, rounded))));
        }
        int32_t sum = 0;
        for (int i = 0; i < kB32; ++i) {
          q[i] = static_cast<int8_t>(ints[i]);  // the low byte, as the scalar cast
          sum += q[i];
        }
        out->scale[r * blocks + b] = s;
        out->blksum[r * blocks + b] = s * static_cast<float>(sum);
        continue;
      }
#endif
      float amax = 0.0f;
      for (int64_t i = 0; i < len; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float s = amax / 127.0f;
      const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
      int8_t* q = out->q.data() + (r * blocks + b) * kB32;
      int32_t sum = 0;
      for (int64_t i = 0; i < len; ++i) {
        const float rounded = std::clamp(std::nearbyint(v[i] * inv), -128.0f, 127.0f);
        q[i] = static_cast<int8_t>(rounded);
        sum += q[i];
      }
      out->scale[r * blocks + b] = s;
      out->blksum[r * blocks + b] = s * static_cast<float>(sum);
    }
  }
  const int64_t groups = blocks / 4;
  out->qp.resize(static_cast<size_t>(m * groups * 128));
  out->sx16.resize(static_cast<size_t>(m * groups * 16));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int o = 0; o < 16; ++o) {
        out->sx16[(r * groups + g) * 16 + o] = out->scale[r * blocks + 4 * g + kB32LaneBlock[o]];
      }
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* q = out->q.data() + r * blocks * kB32 + g * 128;
      int8_t* o = out->qp.data() + (r * groups + g) * 128;
      for (int k = 0; k < 64; k += 4) {  // runs of 4
        std::memcpy(o + k, q + b32_first(k), 4);
        std::memcpy(o + 64 + k, q + b32_first(k) + 8, 4);
      }
    }
  }
}

// The values of one column (32 bytes per block), from the stored layout in order, from the packed
// layout with each whole group in the packed order (b32_first; b32_values_ordered: in order).
inline void b32_values(const uint8_t* col, int64_t blocks, bool packed, uint8_t* w) {
  const int64_t groups = packed ? blocks / 4 : 0;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = col + g * 64;
    uint8_t* o = w + g * 128;  // the low nibbles, then the high ones: the packed order
    int64_t t = 0;
#if defined(__SSE2__)
    const __m128i low = _mm_set1_epi8(15);
    for (; t < 64; t += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + t));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + t), _mm_and_si128(v, low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 64 + t),
                       _mm_and_si128(_mm_srli_epi16(v, 4), low));
    }
#endif
    for (; t < 64; ++t) {
      o[t] = p[t] & 15;
      o[64 + t] = p[t] >> 4;
    }
  }
  for (int64_t b = groups * 4; b < blocks; ++b) {
    const uint8_t* p = col + b * 16;
    uint8_t* o = w + b * kB32;
#if defined(__SSE2__)
    const __m128i low = _mm_set1_epi8(15);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    if (packed) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), lo);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16), hi);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_unpacklo_epi8(lo, hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16), _mm_unpackhi_epi8(lo, hi));
    }
#else
    for (int t = 0; t < 16; ++t) {
      if (packed) {
        o[t] = p[t] & 15;
        o[16 + t] = p[t] >> 4;
      } else {
        o[2 * t] = p[t] & 15;
        o[2 * t + 1] = p[t] >> 4;
      }
    }
#endif
  }
}

// b32_values of packed weights with every value in order (the portable code reads them so).
inline void b32_values_ordered(const uint8_t* col, int64_t blocks, uint8_t* w) {
  b32_values(col, blocks, true, w);
  uint8_t group[128];
  for (int64_t g = 0; g < blocks / 4; ++g) {
    std::memcpy(group, w + g * 128, 128);
    for (int k = 0; k < 64; k += 4) {  // runs of 4 back in order
      std::memcpy(w + g * 128 + b32_first(k), group + k, 4);
      std::memcpy(w + g * 128 + b32_first(k) + 8, group + 64 + k, 4);
    }
  }
}

// The lane of part p of block i of a group of 4.
constexpr int kB32Lane[4][4] = {{0, 1, 4, 5}, {8, 9, 12, 13}, {2, 3, 6, 7}, {10, 11, 14, 15}};

inline float b32_fold(const float* a, bool tail) {
  if (tail) return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
  return (((a[0] + a[1]) + a[2]) + a[3]) + (((a[4] + a[5]) + a[6]) + a[7]);
}

// main (above) of one row and one column: q [blocks, 32], scales sx [blocks], values w in order,
// weight scales sw[b * ss] for block b.
inline float b32_main_portable(const int8_t* q, const float* sx, const uint8_t* w,
                               const float* sw, int64_t ss, int64_t blocks, bool tail) {
  float lanes[16] = {};
  const int64_t groups = blocks / 4;
  for (int64_t g = 0; g < groups; ++g) {
    for (int i = 0; i < 4; ++i) {
      const int64_t b = 4 * g + i;
      int32_t four[8] = {};
      for (int t = 0; t < 32; ++t) four[t / 4] += q[b * 32 + t] * w[b * 32 + t];
      const int32_t part[4] = {four[0] + four[2], four[1] + four[3], four[4] + four[6],
                               four[5] + four[7]};
      const float s = sw[b * ss] * sx[b];
      for (int p = 0; p < 4; ++p) {
        float& lane = lanes[kB32Lane[i][p]];
        lane = std::fma(static_cast<float>(part[p]), s, lane);
      }
    }
  }
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = lanes[i] + lanes[i + 8];
  for (int64_t b = groups * 4; b < blocks; ++b) {
    const float s = sx[b] * sw[b * ss];
    for (int i = 0; i < 8; ++i) {
      int32_t d = 0;
      for (int t = 0; t < 4; ++t) d += q[b * 32 + 4 * i + t] * w[b * 32 + 4 * i + t];
      a[i] = std::fma(static_cast<float>(d), s, a[i]);
    }
  }
  return b32_fold(a, tail);
}

#ifdef TJ_B32_AVX2
// acc + per 4-byte lane the products of unsigned bytes w (0..15) and signed bytes q.
inline __m256i b32_dot(__m256i acc, __m256i w, __m256i q) {
#if defined(TJ_B32_AVXVNNI)
  return _mm256_dpbusd_avx_epi32(acc, w, q);
#elif defined(TJ_B32_VNNI)
  return _mm256_dpbusd_epi32(acc, w, q);
#else
  // no saturation: 2 * 15 * 128 < 2^15
  return _mm256_add_epi32(acc,
                          _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), _mm256_set1_epi16(1)));
#endif
}

inline __m256i b32_load(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Where a column's weights come from: the packed layout, values in order (32 bytes a block), or
// the stored layout (byte j of a block holding values 2j and 2j + 1).
// kB32PackedValues: b32_values of packed weights (whole groups in the packed order).
enum B32Source { kB32Packed, kB32Values, kB32Stored, kB32PackedValues };

// Whether a source's whole groups come in the packed order (lane o of the dot products: part o).
constexpr bool b32_packed_order(B32Source source) {
  return source == kB32Packed || source == kB32PackedValues;
}

// Values 0-15 and 16-31 of the stored block at p, in order.
inline __m256i b32_stored_block(const uint8_t* p) {
  const __m128i low = _mm_set1_epi8(15);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
  return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

// The weights of group g (blocks 4g .. 4g + 3: in order, or for the packed order the low
// nibbles' two halves then the high nibbles') and of a block left over (in order).
template <B32Source Source>
struct B32Weights {
  const uint8_t* p;
  inline void group(int64_t g, __m256i wb[4]) const {
    if constexpr (Source == kB32Packed) {
      const __m256i low = _mm256_set1_epi8(15);
      const __m256i v0 = b32_load(p + g * 64), v1 = b32_load(p + g * 64 + 32);
      wb[0] = _mm256_and_si256(v0, low);
      wb[2] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
      wb[1] = _mm256_and_si256(v1, low);
      wb[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
    } else if constexpr (Source == kB32Stored) {
      for (int i = 0; i < 4; ++i) wb[i] = b32_stored_block(p + (4 * g + i) * 16);
    } else {
      for (int i = 0; i < 4; ++i) wb[i] = b32_load(p + (4 * g + i) * 32);
    }
  }
  inline __m256i block(int64_t b) const {
    if constexpr (Source == kB32Packed) {
      const __m128i low = _mm_set1_epi8(15);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b * 16));
      return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
    } else if constexpr (Source == kB32Stored) {
      return b32_stored_block(p + b * 16);
    } else {
      return b32_load(p + b * 32);
    }
  }
#ifdef TJ_B32_512
  inline void group512(int64_t g, __m512i* lo, __m512i* hi) const {
    if constexpr (Source == kB32Packed) {
      const __m512i low = _mm512_set1_epi8(15);
      const __m512i v = _mm512_loadu_si512(p + g * 64);
      *lo = _mm512_and_si512(v, low);
      *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    } else if constexpr (Source == kB32Stored) {
      const uint8_t* q = p + g * 64;
      *lo = _mm512_inserti64x4(_mm512_castsi256_si512(b32_stored_block(q)),
                               b32_stored_block(q + 16), 1);
      *hi = _mm512_inserti64x4(_mm512_castsi256_si512(b32_stored_block(q + 32)),
                               b32_stored_block(q + 48), 1);
    } else {
      *lo = _mm512_loadu_si512(p + g * 128);
      *hi = _mm512_loadu_si512(p + g * 128 + 64);
    }
  }
#endif
};

// The weight scales of blocks 4g .. 4g + 3 of one column, sw[b * SS] for block b.
template <int SS>
inline __m128 b32_scales(const float* sw, int64_t g) {
  if constexpr (SS == 1) {
    return _mm_loadu_ps(sw + 4 * g);
  } else {
    const float* p = sw + 4 * g * SS;
    return _mm_setr_ps(p[0], p[SS], p[2 * SS], p[3 * SS]);
  }
}

#ifdef TJ_B32_512
// The 16 parts' integer sums of row `row` and group g (lane o: part o), from the group's weights
// lo and hi (group512). Packed: two chained dot products with the row's values in the packed
// order; else two dot products and the runs of 4 paired.
// qa, qb: the row's two vectors of the group (b32_row_group512).
template <B32Source Source>
inline __m512i b32_parts512(__m512i lo, __m512i hi, __m512i qa, __m512i qb) {
  const __m512i zero = _mm512_setzero_si512();
  if constexpr (b32_packed_order(Source)) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, qa), hi, qb);
  } else {
    const __m512i d0 = _mm512_dpbusd_epi32(zero, lo, qa), d1 = _mm512_dpbusd_epi32(zero, hi, qb);
    return _mm512_add_epi32(_mm512_unpacklo_epi64(d0, d1), _mm512_unpackhi_epi64(d0, d1));
  }
}
#endif

// The same in two halves (parts 0-7 and 8-15) from group()'s 4 vectors, and q4 the row's 4
// vectors of the group: in the packed order for packed weights, else in order.
template <B32Source Source>
inline void b32_parts256(const __m256i wb[4], const __m256i q4[4], __m256i* p02, __m256i* p13) {
  if constexpr (b32_packed_order(Source)) {  // wb: lo's halves, then hi's; q4 likewise
#ifdef TJ_B32_VNNI
    const __m256i zero = _mm256_setzero_si256();
    *p02 = b32_dot(b32_dot(zero, wb[0], q4[0]), wb[2], q4[2]);
    *p13 = b32_dot(b32_dot(zero, wb[1], q4[1]), wb[3], q4[3]);
#else
    // the two products' 16-bit pair sums added before widening (|sum| <= 4 * 15 * 128 < 2^15)
    const __m256i ones = _mm256_set1_epi16(1);
    auto pairs = [](__m256i w, __m256i q) { return _mm256_maddubs_epi16(w, q); };
    *p02 = _mm256_madd_epi16(_mm256_add_epi16(pairs(wb[0], q4[0]), pairs(wb[2], q4[2])), ones);
    *p13 = _mm256_madd_epi16(_mm256_add_epi16(pairs(wb[1], q4[1]), pairs(wb[3], q4[3])), ones);
#endif
  } else {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i d0 = b32_dot(zero, wb[0], q4[0]), d1 = b32_dot(zero, wb[1], q4[1]);
    const __m256i d2 = b32_dot(zero, wb[2], q4[2]), d3 = b32_dot(zero, wb[3], q4[3]);
    *p02 = _mm256_add_epi32(_mm256_unpacklo_epi64(d0, d2), _mm256_unpackhi_epi64(d0, d2));
    *p13 = _mm256_add_epi32(_mm256_unpacklo_epi64(d1, d3), _mm256_unpackhi_epi64(d1, d3));
  }
}

// Row `row`'s 128 values of group g: in the packed order for such sources, else in order.
template <B32Source Source>
inline const int8_t* b32_row_values(const B32Rows& xs, int64_t row, int64_t g) {
  return b32_packed_order(Source) ? xs.qp.data() + (row * (xs.blocks / 4) + g) * 128
                                  : xs.q.data() + (row * xs.blocks + 4 * g) * kB32;
}

// Those values as b32_parts256 reads them.
template <B32Source Source>
inline void b32_row_group(const B32Rows& xs, int64_t row, int64_t g, __m256i q4[4]) {
  const int8_t* q = b32_row_values<Source>(xs, row, g);
  for (int i = 0; i < 4; ++i) q4[i] = b32_load(q + 32 * i);
}

// main (above) for R rows from r0 and one column (weight scales sw[b * SS]); y[r * ldy] = main.
template <int R, B32Source Source, int SS>
inline void b32_main(const B32Rows& xs, int64_t r0, B32Weights<Source> w, const float* sw,
                     bool tail, float* y, int64_t ldy) {
  const int64_t blocks = xs.blocks, groups = blocks / 4;
  const int8_t* q0 = xs.q.data() + r0 * blocks * kB32;
  const float* sx0 = xs.scale.data() + r0 * blocks;
  __m256 a[R];
#ifdef TJ_B32_512
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i pattern = _mm512_setr_epi32(0, 0, 2, 2, 0, 0, 2, 2, 1, 1, 3, 3, 1, 1, 3, 3);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i lo, hi;  // blocks 4g, 4g + 1 and 4g + 2, 4g + 3
    w.group512(g, &lo, &hi);
    const __m128 swg = b32_scales<SS>(sw, g);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = b32_row_values<Source>(xs, r0 + r, g);
      const __m512i parts =
          b32_parts512<Source>(lo, hi, _mm512_loadu_si512(q), _mm512_loadu_si512(q + 64));
      const __m128 s = _mm_mul_ps(swg, _mm_loadu_ps(sx0 + r * blocks + 4 * g));
      const __m512 scale = _mm512_permutexvar_ps(pattern, _mm512_castps128_ps512(s));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(parts), scale, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    a[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1));
  }
#else
  __m256 lo_acc[R], hi_acc[R];
  for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = _mm256_setzero_ps();
  const __m256i pattern_lo = _mm256_setr_epi32(0, 0, 2, 2, 0, 0, 2, 2);
  const __m256i pattern_hi = _mm256_setr_epi32(1, 1, 3, 3, 1, 1, 3, 3);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wb[4];
    w.group(g, wb);
    const __m128 swg = b32_scales<SS>(sw, g);
    for (int r = 0; r < R; ++r) {
      __m256i q4[4], p02, p13;
      b32_row_group<Source>(xs, r0 + r, g, q4);
      b32_parts256<Source>(wb, q4, &p02, &p13);
      const __m128 s4 = _mm_mul_ps(swg, _mm_loadu_ps(sx0 + r * blocks + 4 * g));
      const __m256 s = _mm256_castps128_ps256(s4);
      lo_acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p02),
                                  _mm256_permutevar8x32_ps(s, pattern_lo), lo_acc[r]);
      hi_acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p13),
                                  _mm256_permutevar8x32_ps(s, pattern_hi), hi_acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) a[r] = _mm256_add_ps(lo_acc[r], hi_acc[r]);
#endif
  for (int64_t b = groups * 4; b < blocks; ++b) {
    const __m256i wv = w.block(b);
    for (int r = 0; r < R; ++r) {
      const __m256i d =
          b32_dot(_mm256_setzero_si256(), wv, b32_load(q0 + (r * blocks + b) * kB32));
      a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sx0[r * blocks + b] * sw[b * SS]),
                             a[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float lanes[8];
    _mm256_storeu_ps(lanes, a[r]);
    y[r * ldy] = b32_fold(lanes, tail);
  }
}

// The 8 lanes of 4 columns folded as b32_fold (not tail): y[c] for c < 4.
inline void b32_fold4(const __m256 a[4], float* y) {
  const __m256 t01lo = _mm256_unpacklo_ps(a[0], a[1]), t01hi = _mm256_unpackhi_ps(a[0], a[1]);
  const __m256 t23lo = _mm256_unpacklo_ps(a[2], a[3]), t23hi = _mm256_unpackhi_ps(a[2], a[3]);
  auto pick = [](__m256 x, __m256 y, bool high) {
    const __m256d xd = _mm256_castps_pd(x), yd = _mm256_castps_pd(y);
    return _mm256_castpd_ps(high ? _mm256_unpackhi_pd(xd, yd) : _mm256_unpacklo_pd(xd, yd));
  };
  // lane c of the low half: value i of column c; of the high half: value 4 + i
  __m256 sum = _mm256_add_ps(pick(t01lo, t23lo, false), pick(t01lo, t23lo, true));
  sum = _mm256_add_ps(sum, pick(t01hi, t23hi, false));
  sum = _mm256_add_ps(sum, pick(t01hi, t23hi, true));
  _mm_storeu_ps(y, _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1)));
}

// The weight scales of blocks 4g .. 4g + 3 of 4 columns, out[c] for column c: as stored
// (sw[c] + 4g), or in a tile of 16 columns (Tiled: block b of column c at sw[0][b * 16 + c]).
template <bool Tiled>
inline void b32_scales4(const float* const sw[4], int64_t g, __m128 out[4]) {
  if constexpr (Tiled) {
    const float* p = sw[0] + 4 * g * kB32Tile;
    __m128 b0 = _mm_loadu_ps(p), b1 = _mm_loadu_ps(p + kB32Tile);
    __m128 b2 = _mm_loadu_ps(p + 2 * kB32Tile), b3 = _mm_loadu_ps(p + 3 * kB32Tile);
    _MM_TRANSPOSE4_PS(b0, b1, b2, b3);
    out[0] = b0, out[1] = b1, out[2] = b2, out[3] = b3;
  } else {
    for (int c = 0; c < 4; ++c) out[c] = _mm_loadu_ps(sw[c] + 4 * g);
  }
}

template <bool Tiled>
inline float b32_scale4(const float* const sw[4], int c, int64_t b) {
  return Tiled ? sw[0][b * kB32Tile + c] : sw[c][b];
}

// main (above) for one row r and 4 columns (weights w[c], scales as b32_scales4 reads them), none
// of them among the last N % 4 columns: y[c] = main of column c. The row's values are loaded
// once for the 4.
template <B32Source Source, bool Tiled>
inline void b32_row4(const B32Rows& xs, int64_t r, const B32Weights<Source> w[4],
                     const float* const sw[4], float* y) {
  const int64_t blocks = xs.blocks, groups = blocks / 4;
  const int8_t* q = xs.q.data() + r * blocks * kB32;
  const float* sx = xs.scale.data() + r * blocks;
  __m256 a[4];
#ifdef TJ_B32_512
  __m512 acc[4];
  for (int c = 0; c < 4; ++c) acc[c] = _mm512_setzero_ps();
  const __m512i pattern = _mm512_setr_epi32(0, 0, 2, 2, 0, 0, 2, 2, 1, 1, 3, 3, 1, 1, 3, 3);
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* qg = b32_row_values<Source>(xs, r, g);
    const __m512i qa = _mm512_loadu_si512(qg);
    const __m512i qb = _mm512_loadu_si512(qg + 64);
    const __m128 sxg = _mm_loadu_ps(sx + 4 * g);
    __m128 swg[4];
    b32_scales4<Tiled>(sw, g, swg);
    for (int c = 0; c < 4; ++c) {
      __m512i lo, hi;
      w[c].group512(g, &lo, &hi);
      const __m512i parts = b32_parts512<Source>(lo, hi, qa, qb);
      const __m128 s4 = _mm_mul_ps(swg[c], sxg);
      const __m512 scale = _mm512_permutexvar_ps(pattern, _mm512_castps128_ps512(s4));
      acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(parts), scale, acc[c]);
    }
  }
  for (int c = 0; c < 4; ++c) {
    a[c] = _mm256_add_ps(_mm512_castps512_ps256(acc[c]), _mm512_extractf32x8_ps(acc[c], 1));
  }
#else
  __m256 lo_acc[4], hi_acc[4];
  for (int c = 0; c < 4; ++c) lo_acc[c] = hi_acc[c] = _mm256_setzero_ps();
  const __m256i pattern_lo = _mm256_setr_epi32(0, 0, 2, 2, 0, 0, 2, 2);
  const __m256i pattern_hi = _mm256_setr_epi32(1, 1, 3, 3, 1, 1, 3, 3);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i q4[4];
    b32_row_group<Source>(xs, r, g, q4);
    const __m128 sxg = _mm_loadu_ps(sx + 4 * g);
    __m128 swg[4];
    b32_scales4<Tiled>(sw, g, swg);
    for (int c = 0; c < 4; ++c) {
      __m256i wb[4];
      w[c].group(g, wb);
      __m256i p02, p13;
      b32_parts256<Source>(wb, q4, &p02, &p13);
      const __m256 s = _mm256_castps128_ps256(_mm_mul_ps(swg[c], sxg));
      lo_acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p02),
                                  _mm256_permutevar8x32_ps(s, pattern_lo), lo_acc[c]);
      hi_acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p13),
                                  _mm256_permutevar8x32_ps(s, pattern_hi), hi_acc[c]);
    }
  }
  for (int c = 0; c < 4; ++c) a[c] = _mm256_add_ps(lo_acc[c], hi_acc[c]);
#endif
  for (int64_t b = groups * 4; b < blocks; ++b) {
    const __m256i qv = b32_load(q + b * kB32);
    for (int c = 0; c < 4; ++c) {
      const __m256i d = b32_dot(_mm256_setzero_si256(), w[c].block(b), qv);
      a[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sx[b] * b32_scale4<Tiled>(sw, c, b)), a[c]);
    }
  }
  b32_fold4(a, y);
}

#ifdef TJ_B32_512
// main (above) for R rows from r0 and 4 columns of packed weights (column c's bytes at
// bytes + c * row_bytes; scales in a tile, block b of column c at sw[b * kB32Tile + c]), none
// of them among the last N % 4 columns: y[r * ldy + c] = main. Each column's weights are
// unpacked, and its scales spread over the lanes, once for the R rows; each row's values once
// for the 4 columns.
template <int R>
inline void b32_tile4(const B32Rows& xs, int64_t r0, const uint8_t* bytes, int64_t row_bytes,
                      const float* sw, float* y, int64_t ldy) {
  const int64_t blocks = xs.blocks, groups = blocks / 4;
  const __m512i pattern = _mm512_setr_epi32(0, 0, 2, 2, 0, 0, 2, 2, 1, 1, 3, 3, 1, 1, 3, 3);
  const __m512i low = _mm512_set1_epi8(15);
  const float* const sws[4] = {sw, nullptr, nullptr, nullptr};
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m128 swg[4];
    b32_scales4<true>(sws, g, swg);
    __m512i lo[4], hi[4];
    __m512 swc[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(bytes + c * row_bytes + g * 64);
      lo[c] = _mm512_and_si512(v, low);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      swc[c] = _mm512_permutexvar_ps(pattern, _mm512_castps128_ps512(swg[c]));
    }
    for (int r = 0; r < R; ++r) {  // a row's values loaded once for the 4 columns
      const int64_t at = (r0 + r) * groups + g;
      const int8_t* q = xs.qp.data() + at * 128;
      const __m512i qa = _mm512_loadu_si512(q), qb = _mm512_loadu_si512(q + 64);
      const __m512 sx = _mm512_loadu_ps(xs.sx16.data() + at * 16);
      for (int c = 0; c < 4; ++c) {
        const __m512i parts = b32_parts512<kB32Packed>(lo[c], hi[c], qa, qb);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(parts), _mm512_mul_ps(swc[c], sx),
                                    acc[r][c]);
      }
    }
  }
  __m256 a[R][4];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 4; ++c) {
      a[r][c] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][c]),
                              _mm512_extractf32x8_ps(acc[r][c], 1));
    }
  }
  if (groups * 4 < blocks) {
    // The last blocks (fewer than a group): two columns to a 512-bit vector (lanes 0-7 the
    // first's, 8-15 the second's), each lane the 256-bit path's steps: its block's dot product,
    // converted, times the rows' scale times the column's, added to the column's accumulator.
    const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i second = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    __m512 pair[R][2];
    for (int r = 0; r < R; ++r) {
      pair[r][0] = _mm512_insertf32x8(_mm512_castps256_ps512(a[r][0]), a[r][1], 1);
      pair[r][1] = _mm512_insertf32x8(_mm512_castps256_ps512(a[r][2]), a[r][3], 1);
    }
    for (int64_t b = groups * 4; b < blocks; ++b) {  // each column's block unpacked once
      __m256i wv[4];
      for (int c = 0; c < 4; ++c) wv[c] = B32Weights<kB32Packed>{bytes + c * row_bytes}.block(b);
      const __m512i w01 = _mm512_inserti64x4(_mm512_castsi256_si512(wv[0]), wv[1], 1);
      const __m512i w23 = _mm512_inserti64x4(_mm512_castsi256_si512(wv[2]), wv[3], 1);
      const __m128 sw4 = _mm_loadu_ps(sw + b * kB32Tile);  // block b of the 4 columns
      for (int r = 0; r < R; ++r) {
        const __m256i qv = b32_load(xs.q.data() + ((r0 + r) * blocks + b) * kB32);
        const __m512i q2 = _mm512_inserti64x4(_mm512_castsi256_si512(qv), qv, 1);
        const __m128 s4 = _mm_mul_ps(_mm_set1_ps(xs.scale[(r0 + r) * blocks + b]), sw4);
        const __m512 s = _mm512_castps128_ps512(s4);
        const __m512i zero = _mm512_setzero_si512();
        pair[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, w01, q2)),
                                     _mm512_permutexvar_ps(first, s), pair[r][0]);
        pair[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, w23, q2)),
                                     _mm512_permutexvar_ps(second, s), pair[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm512_castps512_ps256(pair[r][0]);
      a[r][1] = _mm512_extractf32x8_ps(pair[r][0], 1);
      a[r][2] = _mm512_castps512_ps256(pair[r][1]);
      a[r][3] = _mm512_extractf32x8_ps(pair[r][1], 1);
    }
  }
  for (int r = 0; r < R; ++r) b32_fold4(a[r], y + r * ldy);
}
#endif
#endif

// y[r, c] += the zero-point term c (above) for rows [0, m) and columns [0, cols): t [m, blocks]
// the rows' t_b, z [blocks, cols] the columns' -(w_b * z_b).
inline void b32_zero_term(const float* t, int64_t m, int64_t blocks, const float* z,
                          int64_t cols, float* y, int64_t ldy, bool portable) {
  for (int64_t r = 0; r < m; ++r) {
    const float* tr = t + r * blocks;
    float* yr = y + r * ldy;
    int64_t c = 0;
#ifdef TJ_B32_AVX2
    if (!portable) {
      for (; c + 8 <= cols; c += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
          acc = _mm256_fmadd_ps(_mm256_set1_ps(tr[b]), _mm256_loadu_ps(z + b * cols + c), acc);
        }
        _mm256_storeu_ps(yr + c, _mm256_add_ps(_mm256_loadu_ps(yr + c), acc));
      }
    }
#endif
    for (; c < cols; ++c) {
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) acc = std::fma(tr[b], z[b * cols + c], acc);
      yr[c] = yr[c] + acc;
    }
  }
}

// y[r, c] += the zero-point term c (above) for rows [0, m) and columns [c0, c1), c0 a multiple
// of kB32Tile: t [m, blocks] the rows' t_b; scales [ceil(N / 16), blocks, 16] and zero points
// (one byte each, same layout; nullptr: 8) in tiles of 16 columns.
inline void b32_zero_tiles(const float* t, int64_t m, int64_t blocks, const float* scales,
                           const uint8_t* zp, int64_t c0, int64_t c1, float* y, int64_t ldy,
                           bool portable) {
  for (int64_t c = c0; c < c1; c += kB32Tile) {
    const int64_t cols = std::min(kB32Tile, c1 - c);
    const float* s = scales + (c / kB32Tile) * blocks * kB32Tile;
    const uint8_t* z = zp == nullptr ? nullptr : zp + (c / kB32Tile) * blocks * kB32Tile;
#ifdef TJ_B32_512
    if (!portable) {  // fnmadd(t, s * z, acc) is fma(t, -(s * z), acc): negation is exact
      constexpr int64_t kRows = 8;  // rows at a time: independent chains
      const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min(kRows, m - r0);
        __m512 acc[kRows];
        for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
          const __m512 zv =
              z == nullptr
                  ? _mm512_set1_ps(8.0f)
                  : _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(z + b * kB32Tile))));
          const __m512 sz = _mm512_mul_ps(_mm512_loadu_ps(s + b * kB32Tile), zv);
          for (int64_t r = 0; r < rows; ++r) {
            acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(t[(r0 + r) * blocks + b]), sz, acc[r]);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* yr = y + (r0 + r) * ldy + c;
          _mm512_mask_storeu_ps(yr, keep, _mm512_add_ps(_mm512_maskz_loadu_ps(keep, yr), acc[r]));
        }
      }
      continue;
    }
#endif
    for (int64_t r = 0; r < m; ++r) {
      const float* tr = t + r * blocks;
      float* yr = y + r * ldy + c;
#if defined(TJ_B32_AVX2) && !defined(TJ_B32_512)
      if (!portable) {
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < blocks; ++b) {
          const __m256 tb = _mm256_set1_ps(tr[b]);
          for (int h = 0; h < 2; ++h) {
            const int64_t at = b * kB32Tile + 8 * h;
            const __m256 zv =
                z == nullptr ? _mm256_set1_ps(8.0f)
                             : _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + at))));
            acc[h] = _mm256_fnmadd_ps(tb, _mm256_mul_ps(_mm256_loadu_ps(s + at), zv), acc[h]);
          }
        }
        float sums[kB32Tile];
        _mm256_storeu_ps(sums, acc[0]);
        _mm256_storeu_ps(sums + 8, acc[1]);
        for (int64_t i = 0; i < cols; ++i) yr[i] = yr[i] + sums[i];
        continue;
      }
#endif
      for (int64_t i = 0; i < cols; ++i) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const float zb = z == nullptr ? 8.0f : static_cast<float>(z[b * kB32Tile + i]);
          acc = std::fma(tr[b], -(s[b * kB32Tile + i] * zb), acc);
        }
        yr[i] = yr[i] + acc;
      }
    }
  }
}

}  // namespace tj

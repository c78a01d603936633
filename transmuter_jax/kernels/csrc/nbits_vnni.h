// MatMulNBits with 4-bit weights on CPUs with AVX512-VNNI: integer dot products of the 4-bit
// values with X quantized per block, vpdpbusd doing 4 products per 32-bit lane.
//
// X is held per block (the weights' blocks) as signed base-256 digits of round(x / scale):
// - 3 digits, scale = max|x| / 8355711 (exact mode): X is kept to 2^-24 of its block's largest
//   value, so the error is of the order of float32 rounding of the block's largest product;
// - 1 digit, scale = max|x| / 127 (unused: int8 activations run in nbits_int8.h, strictly per
//   row).
// Each 32-bit lane sums value * digit over 8 weights exactly; the default zero point (8) is
// subtracted exactly in the integers, other zero points as a per-block correction in float.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TJ_HAVE_VNNI 1
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tj {

constexpr int kVnniSpan = 128;  // values of K per 64 bytes of B
constexpr int kPrefetch = 1024;  // bytes of B to prefetch ahead

// X quantized for the kernel: per row and span, `digits` x 128 bytes (per digit: the 64 even
// positions, then the 64 odd ones), a per-lane start value (-8 * sum of the 8 values each lane
// sees) and a per-lane scale.
struct VnniRows {
  int digits = 0;
  int64_t spans = 0, blocks = 0;
  std::vector<int8_t> bytes;    // [rows, spans, digits, 128]
  std::vector<int32_t> start;   // [rows, spans, 16]
  std::vector<float> lane_scale;  // [rows, spans, 16]
  std::vector<float> block_sums;  // [rows, blocks]: scale * sum of the quantized values
};

inline void quantize_rows(const float* x, int64_t m, int64_t k, int64_t padded,
                          int64_t block_size, int digits, VnniRows* out) {
  const int64_t spans = (padded + kVnniSpan - 1) / kVnniSpan, blocks = padded / block_size;
  const double top = digits == 1 ? 127.0 : 8355711.0;
  out->digits = digits;
  out->spans = spans;
  out->blocks = blocks;
  out->bytes.assign(static_cast<size_t>(m * spans * digits * 128), 0);
  out->start.assign(static_cast<size_t>(m * spans * 16), 0);
  out->lane_scale.assign(static_cast<size_t>(m * spans * 16), 0.0f);
  out->block_sums.assign(static_cast<size_t>(m * blocks), 0.0f);
  std::vector<float> scale(static_cast<size_t>(blocks));
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * k;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * block_size, end = std::min(k, begin + block_size);
      float amax = 0.0f;
      for (int64_t i = begin; i < end; ++i) amax = std::max(amax, std::fabs(row[i]));
      // int8 mode: float32 arithmetic, as onnxruntime (multiplying by the inverse scale).
      const float s = digits == 1 ? amax / 127.0f : static_cast<float>(amax / top);
      const float inv = s != 0.0f ? 1.0f / s : 0.0f;
      const double exact_inv = amax != 0.0f ? top / amax : 0.0;
      scale[b] = s;
      int64_t sum = 0;
      for (int64_t i = begin; i < end; ++i) {
        int64_t v;
        if (digits == 1) {
          v = static_cast<int64_t>(std::nearbyint(row[i] * inv));
          v = std::clamp<int64_t>(v, -127, 127);
        } else {
          v = std::llround(static_cast<double>(row[i]) * exact_inv);
          v = std::clamp<int64_t>(v, -8355711, 8355711);
        }
        sum += v;
        const int64_t t = i / kVnniSpan, j = i % kVnniSpan;
        int8_t* dst = out->bytes.data() + (r * spans + t) * digits * 128 + (j & 1) * 64 + j / 2;
        int64_t rest = v;
        for (int d = digits - 1; d >= 0; --d) {  // least significant digit last in memory
          const int64_t digit = ((rest + 128) & 255) - 128;
          dst[d * 128] = static_cast<int8_t>(digit);
          rest = (rest - digit) / 256;
        }
        out->start[(r * spans + t) * 16 + (j / 8)] -= static_cast<int32_t>(8 * v);
      }
      out->block_sums[r * blocks + b] = static_cast<float>(static_cast<double>(sum) * s);
    }
    for (int64_t t = 0; t < spans; ++t) {
      for (int i = 0; i < 16; ++i) {
        const int64_t b = std::min(blocks - 1, (t * kVnniSpan + 8 * i) / block_size);
        out->lane_scale[(r * spans + t) * 16 + i] = scale[b];
      }
    }
  }
}

// y[r * ldy + row] for NB rows of B from `row` and R rows of X from m0, `correction(ctx, r, row)`
// subtracted when given (zero points other than 8). The NB rows share the loads of X.
template <int R, int D, int NB>
inline void vnni_block(const uint8_t* b, const float* scales, int64_t blocks, int shift,
                       const VnniRows& xs, int64_t m0, int64_t row, int64_t row_bytes,
                       __m512i lanes, float* y, int64_t ldy,
                       float (*correction)(const void*, int64_t, int64_t), const void* ctx) {
  const __m512i low = _mm512_set1_epi8(15);
  const int64_t spans = xs.spans;
  __m512 acc[NB][R];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t t = 0; t < spans; ++t) {
    const int64_t left = row_bytes - t * 64;
    const uint64_t mask = left >= 64 ? ~uint64_t{0} : (uint64_t{1} << left) - 1;
    const int64_t first = (t * kVnniSpan) >> shift;
    const __mmask16 count = static_cast<__mmask16>((1u << std::min<int64_t>(16, blocks - first)) - 1);
    __m512i lo[NB], hi[NB];
    __m512 sw[NB];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* bytes = b + (row + j) * row_bytes + t * 64;
      _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetch), _MM_HINT_T0);
      const __m512i raw = _mm512_maskz_loadu_epi8(mask, bytes);
      lo[j] = _mm512_and_si512(raw, low);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      sw[j] = _mm512_permutexvar_ps(
          lanes, _mm512_maskz_loadu_ps(count, scales + (row + j) * blocks + first));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * spans + t;
      const int8_t* digits = xs.bytes.data() + at * D * 128;
      const __m512i start = _mm512_loadu_si512(xs.start.data() + at * 16);
      const __m512 lane_scale = _mm512_loadu_ps(xs.lane_scale.data() + at * 16);
      __m512i sum[NB];
      for (int j = 0; j < NB; ++j) sum[j] = _mm512_setzero_si512();
      for (int d = 0; d < D; ++d) {
        const __m512i even = _mm512_loadu_si512(digits + d * 128);
        const __m512i odd = _mm512_loadu_si512(digits + d * 128 + 64);
        for (int j = 0; j < NB; ++j) {
          if (d > 0) sum[j] = _mm512_slli_epi32(sum[j], 8);
          sum[j] = _mm512_dpbusd_epi32(sum[j], lo[j], even);
          sum[j] = _mm512_dpbusd_epi32(sum[j], hi[j], odd);
        }
      }
      for (int j = 0; j < NB; ++j) {
        const __m512 total = _mm512_cvtepi32_ps(_mm512_add_epi32(sum[j], start));
        acc[j][r] = _mm512_fmadd_ps(total, _mm512_mul_ps(sw[j], lane_scale), acc[j][r]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    for (int r = 0; r < R; ++r) {
      const float c = correction ? correction(ctx, m0 + r, row + j) : 0.0f;
      y[(m0 + r) * ldy + row + j] = _mm512_reduce_add_ps(acc[j][r]) - c;
    }
  }
}

// Rows [n0, n1) of B against R rows of X from m0, four rows of B at a time.
template <int R, int D>
void vnni_rows(const uint8_t* b, const float* scales, int64_t blocks, int64_t block_size,
               const VnniRows& xs, int64_t m0, int64_t n0, int64_t n1, int64_t padded, float* y,
               int64_t ldy, float (*correction)(const void*, int64_t, int64_t),
               const void* ctx) {
  alignas(64) int32_t lane_block[16];
  for (int i = 0; i < 16; ++i) lane_block[i] = block_size <= 128 ? 8 * i / block_size : 0;
  const __m512i lanes = _mm512_load_si512(lane_block);
  const int64_t row_bytes = padded / 2;
  const int shift = __builtin_ctzll(static_cast<uint64_t>(block_size));  // a power of 2
  constexpr int kBlock = R <= 2 ? 4 : 2;
  int64_t row = n0;
  for (; row + kBlock <= n1; row += kBlock) {
    vnni_block<R, D, kBlock>(b, scales, blocks, shift, xs, m0, row, row_bytes, lanes, y, ldy,
                             correction, ctx);
  }
  for (; row < n1; ++row) {
    vnni_block<R, D, 1>(b, scales, blocks, shift, xs, m0, row, row_bytes, lanes, y, ldy,
                        correction, ctx);
  }
}

}  // namespace tj

#endif

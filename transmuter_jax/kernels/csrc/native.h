// The vector width of the ISA this library is built for (-march=native), for the float32
// kernels: GCC vector types of that width and their loads, stores and broadcast.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace tj {

#if defined(__AVX512F__)
constexpr int kVectorBytes = 64, kRegisters = 32;
#elif defined(__AVX__)
constexpr int kVectorBytes = 32, kRegisters = 16;
#elif defined(__aarch64__)
constexpr int kVectorBytes = 16, kRegisters = 32;
#else
constexpr int kVectorBytes = 16, kRegisters = 16;
#endif
typedef float gv __attribute__((vector_size(kVectorBytes)));
typedef float gvu __attribute__((vector_size(kVectorBytes), aligned(4)));  // unaligned access
typedef int32_t gvi __attribute__((vector_size(kVectorBytes)));
inline gv gload(const float* p) { return *reinterpret_cast<const gvu*>(p); }
inline void gstore(float* p, gv v) { *reinterpret_cast<gvu*>(p) = v; }
inline gv gsplat(float s) { return s - gv{}; }  // x - 0 is x (x + 0 is not, for -0): a bare broadcast
constexpr int kGemmLanes = kVectorBytes / 4;  // floats per vector

// The sum of the lanes of v, pairwise in a fixed order (half the lanes onto the others, again).
inline float glanes_sum(gv v) {
  float lanes[kGemmLanes];
  std::memcpy(lanes, &v, sizeof(lanes));
  for (int width = kGemmLanes / 2; width > 0; width /= 2) {
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  }
  return lanes[0];
}

// exp(x) for lanes x <= 0 (a softmax's shifted scores, a sigmoid's -|x|): Cody-Waite reduction
// by ln 2 and Cephes' degree-6 polynomial (within 2 ulp of exp); 0 below -87.3, where exp is
// subnormal.
inline gv gexp(gv x) {
  const gv low = gsplat(-87.33654f);
  const gvi under = x < low;
  x = under ? low : x;
  const gv n = (x * gsplat(1.44269504088896341f) + gsplat(12582912.0f)) - gsplat(12582912.0f);
  gv r = x - n * gsplat(0.693359375f);
  r = r - n * gsplat(-2.12194440e-4f);
  gv p = gsplat(1.9875691500e-4f);
  p = p * r + gsplat(1.3981999507e-3f);
  p = p * r + gsplat(8.3334519073e-3f);
  p = p * r + gsplat(4.1665795894e-2f);
  p = p * r + gsplat(1.6666665459e-1f);
  p = p * r + gsplat(5.0000001201e-1f);
  gv y = p * r * r + r + gsplat(1.0f);
  const gvi bits = (__builtin_convertvector(n, gvi) + 127) << 23;
  y = y * reinterpret_cast<gv>(bits);
  return under ? gv{} : y;
}

// Division of a row's values x in [0, 1] by their sum s (a softmax's last step), each quotient
// rounded as a division rounds it. With FMA, where 1 <= s < 2^24: y = x * r with r = 1 / s
// rounded, then y + r * (x - y * s), the remainder exact by FMA (Markstein's correction: the
// correctly rounded quotient; every x in [2^-100, 1] against 12 sums checked equal): three
// multiply-adds for a division's 10-16 cycles. A vector with a lane in (0, 2^-100), where the
// remainder could fall below float's normal range, divides.
struct SumDivisor {
  float s, r;
  bool fused;
};

inline SumDivisor sum_divisor(float s) {
#if defined(__AVX512F__) || (defined(__AVX__) && defined(__FMA__))
  return {s, 1.0f / s, s >= 1.0f && s < 0x1p24f};
#else
  return {s, 1.0f / s, false};
#endif
}

inline gv gdivide(gv x, const SumDivisor& d) {
#if defined(__AVX512F__)
  if (d.fused) {
    const __m512 xv = x, s = _mm512_set1_ps(d.s), r = _mm512_set1_ps(d.r);
    const __mmask16 tiny = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ) &
                           _mm512_cmp_ps_mask(xv, _mm512_setzero_ps(), _CMP_GT_OQ);
    if (tiny == 0) {
      const __m512 y = _mm512_mul_ps(xv, r);
      return _mm512_fmadd_ps(_mm512_fnmadd_ps(y, s, xv), r, y);
    }
  }
#elif defined(__AVX__) && defined(__FMA__)
  if (d.fused) {
    const __m256 xv = x, s = _mm256_set1_ps(d.s), r = _mm256_set1_ps(d.r);
    const __m256 tiny = _mm256_and_ps(_mm256_cmp_ps(xv, _mm256_set1_ps(0x1p-100f), _CMP_LT_OQ),
                                      _mm256_cmp_ps(xv, _mm256_setzero_ps(), _CMP_GT_OQ));
    if (_mm256_movemask_ps(tiny) == 0) {
      const __m256 y = _mm256_mul_ps(xv, r);
      return _mm256_fmadd_ps(_mm256_fnmadd_ps(y, s, xv), r, y);
    }
  }
#endif
  return x / gsplat(d.s);
}

}  // namespace tj

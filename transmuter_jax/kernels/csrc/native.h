// The vector width of the ISA this library is built for (-march=native), for the float32
// kernels: GCC vector types of that width and their loads, stores and broadcast.
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace tj

// The vector width of the ISA this library is built for (-march=native), for the float32
// kernels: GCC vector types of that width and their loads, stores and broadcast.
#pragma once

#include <cstdint>

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

}  // namespace tj

// The gated activation of a SwiGLU feed-forward, elementwise in float32:
// out = (g * sigmoid(g)) * u, sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, with
// e = exp(-|g|) (native.h's gexp: within 2 ulp). Every element takes the same vector steps (the
// last ones in a padded vector), so an element's result never depends on the others: any range
// of the elements gives the bits the whole array does (activation.cc, nbits.cc's gate and up).
#pragma once

#include <algorithm>
#include <cstdint>

#include "native.h"
#include "pool.h"

namespace tj {

constexpr int64_t kSiluChunk = 4096;        // elements of one pool chunk (a multiple of any lanes)
constexpr int64_t kSiluAlone = 2 * kSiluChunk;  // fewer elements: the calling thread alone

struct SiluMulJob {
  const float* gate;
  const float* up;
  float* out;
  int64_t size;
};

inline gv silu_mul(gv g, gv u) {
  const gv e = gexp(g < 0.0f ? g : -g);  // exp(-|g|)
  const gv s = (g >= 0.0f ? gsplat(1.0f) : e) / (gsplat(1.0f) + e);
  return (g * s) * u;
}

inline void silu_mul_range(const SiluMulJob& job, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + kGemmLanes <= end; i += kGemmLanes) {
    gstore(job.out + i, silu_mul(gload(job.gate + i), gload(job.up + i)));
  }
  if (i < end) {  // the last elements in one padded vector: the same steps as the others
    float g[kGemmLanes] = {}, u[kGemmLanes] = {}, o[kGemmLanes];
    std::copy(job.gate + i, job.gate + end, g);
    std::copy(job.up + i, job.up + end, u);
    gstore(o, silu_mul(gload(g), gload(u)));
    std::copy(o, o + (end - i), job.out + i);
  }
}

// A pool chunk (kSiluChunk elements) of a SiluMulJob (ctx).
inline void silu_mul_chunk(void* ctx, int64_t chunk) {
  const auto& job = *static_cast<const SiluMulJob*>(ctx);
  const int64_t begin = chunk * kSiluChunk;
  silu_mul_range(job, begin, std::min(begin + kSiluChunk, job.size));
}

// The whole job: on the calling thread below kSiluAlone elements, else in chunks on the pool.
inline void silu_mul_all(SiluMulJob job) {
  if (job.size < kSiluAlone) {
    silu_mul_range(job, 0, job.size);
  } else {
    Pool::get().run((job.size + kSiluChunk - 1) / kSiluChunk, silu_mul_chunk, &job);
  }
}

}  // namespace tj

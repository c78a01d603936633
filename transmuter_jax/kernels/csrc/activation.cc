// The gated activation of a SwiGLU feed-forward, elementwise in float32:
// out = (g * sigmoid(g)) * u, sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, with
// e = exp(-|g|) (native.h's gexp: within 2 ulp). Every element takes the same vector steps (the
// last ones in a padded vector), so a row's result never depends on the others; large arrays
// are cut into chunks for the pool.
#include <algorithm>
#include <cstdint>

#include "common.h"
#include "native.h"
#include "pool.h"

namespace tj {

constexpr int64_t kChunk = 4096;        // elements of one pool chunk (a multiple of any lanes)
constexpr int64_t kAlone = 2 * kChunk;  // fewer elements: the calling thread alone

struct SiluMulJob {
  const float* gate;
  const float* up;
  float* out;
  int64_t size;
};

static inline gv silu_mul(gv g, gv u) {
  const gv e = gexp(g < 0.0f ? g : -g);  // exp(-|g|)
  const gv s = (g >= 0.0f ? gsplat(1.0f) : e) / (gsplat(1.0f) + e);
  return (g * s) * u;
}

static void silu_mul_range(const SiluMulJob& job, int64_t begin, int64_t end) {
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

static void silu_mul_chunk(void* ctx, int64_t chunk) {
  const auto& job = *static_cast<const SiluMulJob*>(ctx);
  const int64_t begin = chunk * kChunk;
  silu_mul_range(job, begin, std::min(begin + kChunk, job.size));
}

static ffi::Error SiluMulImpl(ffi::Buffer<ffi::F32> gate, ffi::Buffer<ffi::F32> up,
                              ffi::ResultBuffer<ffi::F32> out) {
  const int64_t size = static_cast<int64_t>(gate.element_count());
  if (static_cast<int64_t>(up.element_count()) != size) {
    return ffi::Error::InvalidArgument("tj_silu_mul_f32: gate and up must have one shape");
  }
  SiluMulJob job{gate.typed_data(), up.typed_data(), out->typed_data(), size};
  if (size < kAlone) {
    silu_mul_range(job, 0, size);
  } else {
    Pool::get().run((size + kChunk - 1) / kChunk, silu_mul_chunk, &job);
  }
  return ffi::Error::Success();
}

}  // namespace tj

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjSiluMulF32, tj::SiluMulImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

// Float32 x [A, B, C, D] -> y [A, C, B, D] (attention's split into heads, [B, T, N, H] ->
// [B, N, T, H]): each run of D values copied whole. A chunk is one (a, c): it writes y[a, c]
// ([B, D], contiguous) from B runs of x D * C values apart. Chunks are spread over the pool.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "pool.h"

namespace tj {

struct SwapJob {
  const float* x;
  float* y;
  int64_t b, c, d;
};

static void swap_chunk(void* ctx, int64_t chunk) {
  const SwapJob& job = *static_cast<const SwapJob*>(ctx);
  const int64_t a = chunk / job.c, c = chunk % job.c, run = job.d;
  const float* from = job.x + (a * job.b * job.c + c) * run;
  float* to = job.y + chunk * job.b * run;
  for (int64_t i = 0; i < job.b; ++i) {
    std::memcpy(to + i * run, from + i * job.c * run, static_cast<size_t>(run) * sizeof(float));
  }
}

static ffi::Error SwapImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 4 || yd.size() != 4 || yd[0] != xd[0] || yd[1] != xd[2] || yd[2] != xd[1] ||
      yd[3] != xd[3]) {
    return ffi::Error::InvalidArgument("tj_swap_axes_f32: x [A, B, C, D] -> y [A, C, B, D]");
  }
  if (x.element_count() == 0) return ffi::Error::Success();
  SwapJob job{x.typed_data(), y->typed_data(), xd[1], xd[2], xd[3]};
  Pool::get().run(xd[0] * xd[2], swap_chunk, &job);
  return ffi::Error::Success();
}

}  // namespace tj

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjSwapAxesF32, tj::SwapImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

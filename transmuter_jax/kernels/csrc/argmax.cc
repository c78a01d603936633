// The index of the first largest value of each row of float32 x [R, V] (of its first NaN where
// the row has one), as jnp.argmax gives it -> out [R] int32. Two passes over a row: its largest
// value and whether it holds a NaN, a vector at a time; then the first index holding that value
// (or a NaN). Rows are spread over the pool.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "native.h"
#include "pool.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace tj {

// The first lane of `hit` that is set (all ones), or -1.
inline int first_lane(gvi hit) {
#if defined(__AVX512F__)
  const auto bits = _mm512_test_epi32_mask(reinterpret_cast<__m512i>(hit),
                                           reinterpret_cast<__m512i>(hit));
  return bits ? __builtin_ctz(bits) : -1;
#elif defined(__AVX__)
  const int bits = _mm256_movemask_ps(reinterpret_cast<__m256>(hit));
  return bits ? __builtin_ctz(bits) : -1;
#elif defined(__SSE2__)
  const int bits = _mm_movemask_ps(reinterpret_cast<__m128>(hit));
  return bits ? __builtin_ctz(bits) : -1;
#else
  int32_t lanes[kGemmLanes];
  std::memcpy(lanes, &hit, sizeof(lanes));
  for (int i = 0; i < kGemmLanes; ++i) {
    if (lanes[i]) return i;
  }
  return -1;
#endif
}

static int64_t row_argmax(const float* x, int64_t v) {
  gv top = gsplat(-INFINITY);
  gvi nan = {};
  int64_t j = 0;
  for (; j + kGemmLanes <= v; j += kGemmLanes) {
    const gv a = gload(x + j);
    nan |= a != a;
    top = a > top ? a : top;  // a NaN never replaces the top
  }
  float best = -INFINITY;
  float lanes[kGemmLanes];
  std::memcpy(lanes, &top, sizeof(lanes));
  for (float lane : lanes) best = std::max(best, lane);
  bool any_nan = first_lane(nan) >= 0;
  for (int64_t t = j; t < v; ++t) {
    if (std::isnan(x[t])) {
      any_nan = true;
    } else {
      best = std::max(best, x[t]);
    }
  }
  j = 0;
  for (; j + kGemmLanes <= v; j += kGemmLanes) {
    const gv a = gload(x + j);
    const int lane = first_lane(any_nan ? a != a : a == gsplat(best));
    if (lane >= 0) return j + lane;
  }
  for (; j < v; ++j) {
    if (any_nan ? std::isnan(x[j]) : x[j] == best) return j;
  }
  return 0;  // not reached: the row holds its largest value (or a NaN)
}

struct ArgmaxJob {
  const float* x;
  int32_t* out;
  int64_t v;
};

static void argmax_chunk(void* ctx, int64_t row) {
  const ArgmaxJob& job = *static_cast<const ArgmaxJob*>(ctx);
  job.out[row] = static_cast<int32_t>(row_argmax(job.x + row * job.v, job.v));
}

static ffi::Error ArgmaxImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  auto xd = x.dimensions();
  if (xd.size() < 1 || xd.back() < 1 || xd.back() > INT32_MAX ||
      static_cast<int64_t>(out->element_count()) * xd.back() !=
          static_cast<int64_t>(x.element_count())) {
    return ffi::Error::InvalidArgument("tj_argmax_f32: x [..., V] with V >= 1 -> out [...]");
  }
  ArgmaxJob job{x.typed_data(), out->typed_data(), xd.back()};
  Pool::get().run(static_cast<int64_t>(out->element_count()), argmax_chunk, &job);
  return ffi::Error::Success();
}

}  // namespace tj

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjArgmaxF32, tj::ArgmaxImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());

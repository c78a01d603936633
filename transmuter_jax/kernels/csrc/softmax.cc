// Float32 softmax over the last axis: y = e / sum(e), e = exp(x - max(x)) per row (ONNX Softmax's
// steps; exp by native.h's gexp, within 2 ulp). A row takes the same steps whatever the rows
// beside it: its maximum, then e a vector at a time (the last values in one vector padded with
// -inf, whose e is 0) summed lane by lane and the lanes in a fixed order, then e divided by the
// sum (native.h's gdivide: each quotient a division's). A row of -inf or NaN gives NaN, as the
// ops do. Rows are split over the pool.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common.h"
#include "native.h"
#include "pool.h"

namespace tj {

constexpr int64_t kChunkValues = 1 << 14;  // values of x per pool chunk, at least one row

struct SoftmaxJob {
  const float* x;
  float* y;
  int64_t rows, k, per_chunk;
};

// The largest lane, or NaN when a lane is NaN (as jax.numpy's max).
static inline float lanes_max(gv v) {
  float lanes[kGemmLanes];
  std::memcpy(lanes, &v, sizeof(lanes));
  float m = lanes[0];
  for (int i = 1; i < kGemmLanes; ++i) m = (lanes[i] > m || lanes[i] != lanes[i]) ? lanes[i] : m;
  return m;
}

static void softmax_row(const float* x, float* y, int64_t k) {
  const int64_t whole = k / kGemmLanes * kGemmLanes;
  constexpr float kLow = -std::numeric_limits<float>::infinity();
  float tail[kGemmLanes];
  std::fill(tail, tail + kGemmLanes, kLow);
  std::copy(x + whole, x + k, tail);
  gv top = gload(tail);
  for (int64_t i = 0; i < whole; i += kGemmLanes) {  // a NaN lane stays NaN
    const gv v = gload(x + i);
    top = ((v > top) | (v != v)) ? v : top;
  }
  const float m = lanes_max(top);
  const gv shift = gsplat(m);
  gv sum = gv{};
  for (int64_t i = 0; i < whole; i += kGemmLanes) {
    const gv e = gexp(gload(x + i) - shift);
    gstore(y + i, e);
    sum += e;
  }
  const gv e_tail = gexp(gload(tail) - shift);
  if (whole < k) sum += e_tail;
  const SumDivisor total = sum_divisor(glanes_sum(sum));
  for (int64_t i = 0; i < whole; i += kGemmLanes) gstore(y + i, gdivide(gload(y + i), total));
  if (whole < k) {
    float out[kGemmLanes];
    gstore(out, gdivide(e_tail, total));
    std::copy(out, out + (k - whole), y + whole);
  }
}

static void softmax_chunk(void* ctx, int64_t chunk) {
  const SoftmaxJob& job = *static_cast<const SoftmaxJob*>(ctx);
  const int64_t r0 = chunk * job.per_chunk, r1 = std::min(job.rows, r0 + job.per_chunk);
  for (int64_t r = r0; r < r1; ++r) softmax_row(job.x + r * job.k, job.y + r * job.k, job.k);
}

static ffi::Error SoftmaxImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("tj_softmax_f32: x must have an axis");
  const int64_t k = dims.back(), rows = product(dims, 0, dims.size() - 1);
  if (k == 0 || rows == 0) return ffi::Error::Success();
  const int64_t per_chunk = std::max<int64_t>(1, kChunkValues / k);
  SoftmaxJob job{x.typed_data(), y->typed_data(), rows, k, per_chunk};
  const int64_t chunks = (rows + per_chunk - 1) / per_chunk;
  Pool::get().run(chunks, softmax_chunk, &job);  // one chunk: on this thread
  return ffi::Error::Success();
}

}  // namespace tj

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjSoftmaxF32, tj::SoftmaxImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

// Float32 products against a transposed operand, for attention's scores over a cache:
// out[b, m, n] = sum_k a[b, m, k] * (x[b, n, k] * scale) for a [B, M, K] and x [B, N, K], both
// as stored (XLA:CPU's dot copies x transposed first: the whole cache, every decode step). With
// scale 1 the product is x's own value; otherwise x * scale is rounded first, as the graph's Mul
// would round it.
//
// Every output is computed alone in the same steps: per-lane sums over K a vector at a time (the
// last values in one zero-padded vector), then the lanes summed in a fixed order. A row's
// result never depends on M, N or the batch. Chunks of kKeys keys of one batch row, against all
// M rows, go to the pool.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "native.h"
#include "pool.h"

namespace tj {

constexpr int64_t kKeys = 64;      // keys (rows of x) of one chunk
constexpr int kKeysAtOnce = 4;     // keys against one row of a per pass
constexpr int64_t kAlone = 1 << 15;  // fewer multiply-adds in all: the calling thread alone

struct NtJob {
  const float* a;
  const float* x;
  float* out;
  int64_t batch, m, n, k, blocks;
  float scale;
  bool scaled;
};

// Keys [n0, n0 + count) of batch row b against row r of a; `tail` the last K % lanes values of
// a's row, zero-padded.
template <int C>
static void keys_pass(const NtJob& job, const float* arow, const float* tail, const float* keys,
                      float* out) {
  const int64_t k = job.k, whole = k / kGemmLanes * kGemmLanes;
  gv acc[C] = {};
  const gv scale = gsplat(job.scale);
  for (int64_t i = 0; i < whole; i += kGemmLanes) {
    const gv av = gload(arow + i);
    for (int c = 0; c < C; ++c) {
      gv xv = gload(keys + c * k + i);
      if (job.scaled) xv = xv * scale;
      acc[c] += av * xv;
    }
  }
  if (whole < k) {
    const gv av = gload(tail);
    for (int c = 0; c < C; ++c) {
      float padded[kGemmLanes] = {};
      std::copy(keys + c * k + whole, keys + c * k + k, padded);
      gv xv = gload(padded);
      if (job.scaled) xv = xv * scale;
      acc[c] += av * xv;
    }
  }
  for (int c = 0; c < C; ++c) out[c] = glanes_sum(acc[c]);
}

static void nt_chunk(void* ctx, int64_t chunk) {
  const NtJob& job = *static_cast<const NtJob*>(ctx);
  const int64_t b = chunk / job.blocks, n0 = (chunk % job.blocks) * kKeys;
  const int64_t n1 = std::min(job.n, n0 + kKeys), k = job.k;
  const int64_t whole = k / kGemmLanes * kGemmLanes;
  const float* x = job.x + b * job.n * k;
  for (int64_t r = 0; r < job.m; ++r) {
    const float* arow = job.a + (b * job.m + r) * k;
    float tail[kGemmLanes] = {};
    std::copy(arow + whole, arow + k, tail);
    float* out = job.out + (b * job.m + r) * job.n;
    int64_t n = n0;
    for (; n + kKeysAtOnce <= n1; n += kKeysAtOnce) {
      keys_pass<kKeysAtOnce>(job, arow, tail, x + n * k, out + n);
    }
    for (; n < n1; ++n) keys_pass<1>(job, arow, tail, x + n * k, out + n);
  }
}

static ffi::Error MatMulNtImpl(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> x,
                               ffi::ResultBuffer<ffi::F32> out, float scale, bool scaled) {
  auto ad = a.dimensions(), xd = x.dimensions(), od = out->dimensions();
  const size_t rank = ad.size();
  if (rank < 2 || xd.size() != rank || od.size() != rank) {
    return ffi::Error::InvalidArgument("tj_matmul_nt_f32: a, x and out must have one rank >= 2");
  }
  const int64_t batch = product(ad, 0, rank - 2);
  const int64_t m = ad[rank - 2], k = ad[rank - 1], n = xd[rank - 2];
  if (product(xd, 0, rank - 2) != batch || xd[rank - 1] != k || od[rank - 2] != m ||
      od[rank - 1] != n) {
    return ffi::Error::InvalidArgument("tj_matmul_nt_f32: shapes do not match");
  }
  if (batch * m * n == 0) return ffi::Error::Success();
  const int64_t blocks = (n + kKeys - 1) / kKeys;
  NtJob job{a.typed_data(), x.typed_data(), out->typed_data(), batch, m, n, k, blocks,
            scale, scaled};
  if (batch * m * n * k < kAlone) {
    for (int64_t c = 0; c < batch * blocks; ++c) nt_chunk(&job, c);
  } else {
    Pool::get().run(batch * blocks, nt_chunk, &job);
  }
  return ffi::Error::Success();
}

}  // namespace tj

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjMatMulNtF32, tj::MatMulNtImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("scaled"));

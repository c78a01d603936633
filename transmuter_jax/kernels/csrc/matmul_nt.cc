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

// acc[c] = the per-lane sums over K of a's row `arow` times key row(c) of `keys` (times the
// scale when scaled: rounded first), a vector at a time; `tail` the last K % lanes values of
// a's row, zero-padded, against each key's, zero-padded.
template <int C, typename Row>
static inline void key_sums(const NtJob& job, const float* arow, const float* tail,
                            const float* keys, Row row, gv (&acc)[C]) {
  const int64_t k = job.k, whole = k / kGemmLanes * kGemmLanes;
  const gv scale = gsplat(job.scale);
  for (int64_t i = 0; i < whole; i += kGemmLanes) {
    const gv av = gload(arow + i);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      gv xv = gload(keys + row(c) * k + i);
      if (job.scaled) xv = xv * scale;
      acc[c] += av * xv;
    }
  }
  if (whole < k) {
    const gv av = gload(tail);
    for (int c = 0; c < C; ++c) {
      float padded[kGemmLanes] = {};
      std::copy(keys + row(c) * k + whole, keys + row(c) * k + k, padded);
      gv xv = gload(padded);
      if (job.scaled) xv = xv * scale;
      acc[c] += av * xv;
    }
  }
}

// Keys [0, C) of `keys` (rows of K values) against row `arow` of a: C outputs.
template <int C>
static void keys_pass(const NtJob& job, const float* arow, const float* tail, const float* keys,
                      float* out) {
  gv acc[C] = {};
  key_sums<C>(job, arow, tail, keys, [](int c) { return c; }, acc);
  for (int c = 0; c < C; ++c) out[c] = glanes_sum(acc[c]);
}

#if defined(__AVX512F__) || defined(__AVX__)
// One lane of each of kGemmLanes accumulators: lane t of the result holds the lanes' sum of
// acc[t], added as glanes_sum adds them (half the lanes onto the others, again), but for all the
// accumulators at once: at each level, pairs of vectors whose blocks of 2h lanes hold one
// accumulator each become one vector whose blocks hold h lanes of each (the low halves and the
// high halves, side by side, added). Slot s of `acc` must hold the keys' accumulator br(s) (the
// bit reversal of s), so that the lanes come out in the keys' order.
template <int H>
static inline gv pair_level(gv x, gv y) {
  gvi lo, hi;
  for (int t = 0; t < kGemmLanes; ++t) {
    const int block = t / (2 * H) * (2 * H), u = t % (2 * H);
    lo[t] = u < H ? block + u : kGemmLanes + block + u - H;
    hi[t] = u < H ? block + H + u : kGemmLanes + block + u;
  }
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

static inline gv lanes_sums(gv (&acc)[kGemmLanes]) {
  gv level[kGemmLanes / 2];
  for (int i = 0; i < kGemmLanes / 2; ++i) {
    level[i] = pair_level<kGemmLanes / 2>(acc[2 * i], acc[2 * i + 1]);
  }
  for (int i = 0; i < kGemmLanes / 4; ++i) {
    level[i] = pair_level<kGemmLanes / 4>(level[2 * i], level[2 * i + 1]);
  }
  for (int i = 0; i < kGemmLanes / 8; ++i) {
    level[i] = pair_level<kGemmLanes / 8>(level[2 * i], level[2 * i + 1]);
  }
  if constexpr (kGemmLanes == 16) level[0] = pair_level<1>(level[0], level[1]);
  return level[0];
}

constexpr int bit_reversed(int s) {
  int r = 0;
  for (int bit = 1, top = kGemmLanes / 2; bit < kGemmLanes; bit <<= 1, top >>= 1) {
    if (s & bit) r |= top;
  }
  return r;
}

// Keys [0, kGemmLanes) of `keys` against row `arow` of a, each as keys_pass computes it.
static void keys_vector(const NtJob& job, const float* arow, const float* tail,
                        const float* keys, float* out) {
  gv acc[kGemmLanes] = {};
  key_sums<kGemmLanes>(job, arow, tail, keys, [](int s) { return bit_reversed(s); }, acc);
  gstore(out, lanes_sums(acc));
}
constexpr bool kKeysVector = true;
#else
static void keys_vector(const NtJob&, const float*, const float*, const float*, float*) {}
constexpr bool kKeysVector = false;
#endif

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
    if constexpr (kKeysVector) {
      for (; n + kGemmLanes <= n1; n += kGemmLanes) {
        keys_vector(job, arow, tail, x + n * k, out + n);
      }
    }
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

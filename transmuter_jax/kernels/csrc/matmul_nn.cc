// Float32 products of a few rows against an activation, for attention's weighted values:
// out[b, m, n] = sum_k a[b, m, k] * x[b, k, n] for a [B, M, K] and x [B, K, N] (XLA:CPU runs
// these batched products of one or a few rows at a fraction of the read bandwidth). x comes in
// two parts along K, x1 [B, K1, N] then x2 [B, K2, N] (a cache and a step's own rows, which the
// graph concatenates; x2 may be empty), read where they are.
//
// Every output is one multiply-add chain over k = 0, 1, ..., K - 1 in its lane: a row's result
// never depends on M, N or the batch. Each chunk is one batch row and a block of columns; the
// block's rows of x are read once for kRowsAtOnce rows of a, while they are in L1.
#include <algorithm>
#include <cstdint>

#include "common.h"
#include "native.h"
#include "pool.h"

namespace tj {

constexpr int kVectorsAtOnce = 4;  // column vectors of one pass
constexpr int64_t kColumns = kVectorsAtOnce * kGemmLanes;  // columns of a chunk
constexpr int kRowsAtOnce = 4;     // rows of a against one row of x per pass
constexpr int64_t kAlone = 1 << 15;  // fewer multiply-adds in all: the calling thread alone

struct NnJob {
  const float* a;
  const float* x1;
  const float* x2;
  float* out;
  int64_t m, n, k1, k2, blocks;
};

// Row i of x (of K1 + K2) of batch row b.
static inline const float* x_row(const NnJob& job, int64_t b, int64_t i) {
  return i < job.k1 ? job.x1 + (b * job.k1 + i) * job.n
                    : job.x2 + (b * job.k2 + i - job.k1) * job.n;
}

// Rows [r, r + R) of a against the V column vectors from n0 (whole vectors).
template <int R, int V>
static inline void rows_pass(const NnJob& job, const float* a, int64_t b, float* out, int64_t r,
                             int64_t n0) {
  gv acc[R][V] = {};
  const int64_t k = job.k1 + job.k2, n = job.n;
  for (int64_t i = 0; i < k; ++i) {
    const float* x = x_row(job, b, i) + n0;
    gv xv[V];
    for (int v = 0; v < V; ++v) xv[v] = gload(x + v * kGemmLanes);
    for (int q = 0; q < R; ++q) {
      const gv av = gsplat(a[(r + q) * k + i]);
      for (int v = 0; v < V; ++v) acc[q][v] += av * xv[v];
    }
  }
  for (int q = 0; q < R; ++q) {
    for (int v = 0; v < V; ++v) gstore(out + (r + q) * n + n0 + v * kGemmLanes, acc[q][v]);
  }
}

// Every row of a against the columns [n0, n1) that fill no whole vector: zero-padded to one,
// in the same steps as rows_pass (so a column's bits do not depend on N).
static void rows_tail(const NnJob& job, const float* a, int64_t b, float* out, int64_t n0,
                      int64_t n1) {
  const int64_t k = job.k1 + job.k2, n = job.n;
  for (int64_t r = 0; r < job.m; ++r) {
    gv acc = {};
    for (int64_t i = 0; i < k; ++i) {
      const float* x = x_row(job, b, i);
      float padded[kGemmLanes] = {};
      std::copy(x + n0, x + n1, padded);
      acc += gsplat(a[r * k + i]) * gload(padded);
    }
    float lanes[kGemmLanes];
    gstore(lanes, acc);
    std::copy(lanes, lanes + (n1 - n0), out + r * n + n0);
  }
}

template <int V>
static void block_rows(const NnJob& job, const float* a, int64_t b, float* out, int64_t n0) {
  int64_t r = 0;
  for (; r + kRowsAtOnce <= job.m; r += kRowsAtOnce) {
    rows_pass<kRowsAtOnce, V>(job, a, b, out, r, n0);
  }
  for (; r < job.m; ++r) rows_pass<1, V>(job, a, b, out, r, n0);
}

static void nn_chunk(void* ctx, int64_t chunk) {
  const NnJob& job = *static_cast<const NnJob*>(ctx);
  const int64_t b = chunk / job.blocks, n0 = (chunk % job.blocks) * kColumns;
  const int64_t n1 = std::min(job.n, n0 + kColumns);
  const float* a = job.a + b * job.m * (job.k1 + job.k2);
  float* out = job.out + b * job.m * job.n;
  const int64_t vectors = (n1 - n0) / kGemmLanes;
  switch (vectors) {
    case 4: block_rows<4>(job, a, b, out, n0); break;
    case 3: block_rows<3>(job, a, b, out, n0); break;
    case 2: block_rows<2>(job, a, b, out, n0); break;
    case 1: block_rows<1>(job, a, b, out, n0); break;
    default: break;
  }
  if (n0 + vectors * kGemmLanes < n1) rows_tail(job, a, b, out, n0 + vectors * kGemmLanes, n1);
}

static ffi::Error MatMulNnImpl(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> x1,
                               ffi::Buffer<ffi::F32> x2, ffi::ResultBuffer<ffi::F32> out) {
  auto ad = a.dimensions(), d1 = x1.dimensions(), d2 = x2.dimensions(), od = out->dimensions();
  const size_t rank = ad.size();
  if (rank < 2 || d1.size() != rank || d2.size() != rank || od.size() != rank) {
    return ffi::Error::InvalidArgument(
        "tj_matmul_nn_f32: a, x1, x2 and out must have one rank >= 2");
  }
  const int64_t batch = product(ad, 0, rank - 2);
  const int64_t m = ad[rank - 2], k1 = d1[rank - 2], k2 = d2[rank - 2], n = d1[rank - 1];
  if (product(d1, 0, rank - 2) != batch || product(d2, 0, rank - 2) != batch ||
      ad[rank - 1] != k1 + k2 || d2[rank - 1] != n || od[rank - 2] != m || od[rank - 1] != n) {
    return ffi::Error::InvalidArgument("tj_matmul_nn_f32: shapes do not match");
  }
  if (batch * m * n == 0) return ffi::Error::Success();
  float* o = out->typed_data();
  if (k1 + k2 == 0) {
    std::fill(o, o + batch * m * n, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t blocks = (n + kColumns - 1) / kColumns;
  NnJob job{a.typed_data(), x1.typed_data(), x2.typed_data(), o, m, n, k1, k2, blocks};
  if (batch * m * n * (k1 + k2) < kAlone) {
    for (int64_t c = 0; c < batch * blocks; ++c) nn_chunk(&job, c);
  } else {
    Pool::get().run(batch * blocks, nn_chunk, &job);
  }
  return ffi::Error::Success();
}

}  // namespace tj

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjMatMulNnF32, tj::MatMulNnImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

// Float32 X[M, K] @ W[K, N] with W packed in column strips P[S, K, kStrip] (S = ceil(N / kStrip),
// the last strip zero-padded): a strip is one contiguous stream, which the prefetcher follows.
// Up to kRows rows of X (decoding): a chunk of work is one strip against all rows, in one pass of
// a register-blocked micro-kernel. More rows: a chunk is a pair of strips against a group of up to
// kRowGroup rows, in passes of kPairRows rows, K in blocks of kDepth so that the blocks of the
// strips stay in L1 across passes. Chunks are spread over the thread pool.
#include <algorithm>
#include <cstdint>

#include "common.h"
#include "pool.h"

namespace tj {

constexpr int kVecs = 2;                 // vectors per strip row
constexpr int kStrip = kVecs * kLanes;   // strip width in floats
constexpr int kRows = 12;                // rows of X per micro-kernel pass
constexpr int64_t kRowGroup = 96;        // rows of X per chunk when M is large
constexpr int64_t kDepth = 256;          // values of K per block when M > kRows

// Y[0:R, 0:cols] (+)= X[0:R, 0:k] @ strip[0:k], R <= kRows; adds to Y when `add`.
template <int R>
static void micro(const float* x, int64_t ldx, const float* strip, int64_t k, float* y,
                  int64_t ldy, int64_t cols, bool add) {
  vf acc[R][kVecs] = {};
  for (int64_t i = 0; i < k; ++i) {
    const float* p = strip + i * kStrip;
    vf w[kVecs];
    for (int v = 0; v < kVecs; ++v) w[v] = load(p + v * kLanes);
    for (int r = 0; r < R; ++r) {
      vf a = splat(x[r * ldx + i]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] += a * w[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = y + r * ldy;
    if (cols == kStrip) {
      for (int v = 0; v < kVecs; ++v) {
        store(out + v * kLanes, add ? load(out + v * kLanes) + acc[r][v] : acc[r][v]);
      }
    } else {
      float tmp[kStrip];
      for (int v = 0; v < kVecs; ++v) store(tmp + v * kLanes, acc[r][v]);
      for (int64_t c = 0; c < cols; ++c) out[c] = add ? out[c] + tmp[c] : tmp[c];
    }
  }
}

using Micro = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                       bool);
using MicroPair = void (*)(const float*, int64_t, const float*, const float*, int64_t, float*,
                           int64_t, int64_t, bool);
static constexpr Micro kMicro[kRows + 1] = {
    nullptr,  micro<1>, micro<2>, micro<3>,  micro<4>,  micro<5>, micro<6>,
    micro<7>, micro<8>, micro<9>, micro<10>, micro<11>, micro<12>};

// Y[0:R, 0:cols] (+)= X[0:R, 0:k] @ [strip a | strip b] (cols <= 2 * kStrip): twice the columns
// per broadcast of X, for many rows of X.
template <int R>
static void micro_pair(const float* x, int64_t ldx, const float* a, const float* b, int64_t k,
                       float* y, int64_t ldy, int64_t cols, bool add) {
  vf acc[R][2 * kVecs] = {};
  for (int64_t i = 0; i < k; ++i) {
    vf w[2 * kVecs];
    for (int v = 0; v < kVecs; ++v) {
      w[v] = load(a + i * kStrip + v * kLanes);
      w[kVecs + v] = load(b + i * kStrip + v * kLanes);
    }
    for (int r = 0; r < R; ++r) {
      vf xv = splat(x[r * ldx + i]);
      for (int v = 0; v < 2 * kVecs; ++v) acc[r][v] += xv * w[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    float tmp[2 * kStrip];
    for (int v = 0; v < 2 * kVecs; ++v) store(tmp + v * kLanes, acc[r][v]);
    float* out = y + r * ldy;
    for (int64_t c = 0; c < cols; ++c) out[c] = add ? out[c] + tmp[c] : tmp[c];
  }
}

constexpr int kPairRows = 6;  // rows of X per pass of micro_pair
static constexpr MicroPair kMicroPair[kPairRows + 1] = {nullptr,       micro_pair<1>, micro_pair<2>,
                                                   micro_pair<3>, micro_pair<4>, micro_pair<5>,
                                                   micro_pair<6>};

struct GemmJob {
  const float* x;
  const float* packed;
  float* y;
  int64_t m, k, n, groups;
};

// Y[0:m, 0:cols] = X[0:m, 0:k] @ strip[0:k, :], on this thread.
static void gemm_strip(const float* x, int64_t ldx, const float* strip, int64_t k, float* y,
                       int64_t ldy, int64_t m, int64_t cols) {
  const int64_t passes = (m + kRows - 1) / kRows;
  // With several passes, K goes in blocks so that a block of the strip stays in L1 for all.
  const int64_t depth = passes > 1 ? kDepth : k;
  for (int64_t k0 = 0; k0 < k; k0 += depth) {
    const int64_t kc = std::min(depth, k - k0);
    int64_t r = 0;
    for (int64_t p = 0; p < passes; ++p) {  // balanced passes
      const int64_t take = (m - r) / (passes - p);
      kMicro[take](x + r * ldx + k0, ldx, strip + k0 * kStrip, kc, y + r * ldy, ldy, cols,
                   k0 > 0);
      r += take;
    }
  }
}

// Rows [r0, r1) of X against strip s.
static void gemm_rows(const GemmJob& job, int64_t s, int64_t r0, int64_t r1) {
  const int64_t cols = std::min<int64_t>(kStrip, job.n - s * kStrip);
  gemm_strip(job.x + r0 * job.k, job.k, job.packed + s * job.k * kStrip, job.k,
             job.y + r0 * job.n + s * kStrip, job.n, r1 - r0, cols);
}

static void gemm_chunk(void* ctx, int64_t chunk) {
  const GemmJob& job = *static_cast<const GemmJob*>(ctx);
  const int64_t s = chunk / job.groups, g = chunk % job.groups;
  const int64_t r0 = g * job.m / job.groups, r1 = (g + 1) * job.m / job.groups;
  gemm_rows(job, s, r0, r1);
}

// Many rows of X: strips 2p and 2p + 1 against a group of rows, K in blocks.
static void gemm_pair_chunk(void* ctx, int64_t chunk) {
  const GemmJob& job = *static_cast<const GemmJob*>(ctx);
  const int64_t pair = chunk / job.groups, g = chunk % job.groups;
  const int64_t r0 = g * job.m / job.groups, r1 = (g + 1) * job.m / job.groups;
  const int64_t s = 2 * pair;
  if ((s + 1) * kStrip >= job.n) {  // the last strip has no partner
    gemm_rows(job, s, r0, r1);
    return;
  }
  const int64_t cols = std::min<int64_t>(2 * kStrip, job.n - s * kStrip);
  const float* a = job.packed + s * job.k * kStrip;
  const float* b = a + job.k * kStrip;
  const int64_t passes = (r1 - r0 + kPairRows - 1) / kPairRows;
  for (int64_t k0 = 0; k0 < job.k; k0 += kDepth) {
    const int64_t kc = std::min(kDepth, job.k - k0);
    int64_t r = r0;
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t take = (r1 - r) / (passes - p);
      kMicroPair[take](job.x + r * job.k + k0, job.k, a + k0 * kStrip, b + k0 * kStrip, kc,
                       job.y + r * job.n + s * kStrip, job.n, cols, k0 > 0);
      r += take;
    }
  }
}

// Y[M, N] = X[M, K] @ W, W given as its strips.
void gemm(const float* x, const float* packed, float* y, int64_t m, int64_t k, int64_t n) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::fill(y, y + m * n, 0.0f);
    return;
  }
  const int64_t strips = (n + kStrip - 1) / kStrip;
  const int64_t groups = (m + kRowGroup - 1) / kRowGroup;
  GemmJob job{x, packed, y, m, k, n, groups};
  if (m > kRows) {
    Pool::get().run((strips + 1) / 2 * groups, gemm_pair_chunk, &job);
  } else {
    Pool::get().run(strips * groups, gemm_chunk, &job);
  }
}

// x [..., K] and packed [S, K, kStrip] (leading size-1 dims allowed) -> y [..., N].
static ffi::Error GemmImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                           ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto pd = packed.dimensions();
  auto yd = y->dimensions();
  if (xd.size() < 1 || pd.size() < 3 || yd.size() != xd.size()) {
    return ffi::Error::InvalidArgument("tj_gemm_f32: bad ranks");
  }
  const int64_t k = xd.back(), n = yd.back();
  const int64_t m = product(xd, 0, xd.size() - 1);
  const int64_t strips = pd[pd.size() - 3];
  if (pd.back() != kStrip || pd[pd.size() - 2] != k || strips * kStrip < n ||
      (strips - 1) * kStrip >= std::max<int64_t>(n, 1) ||
      product(pd, 0, pd.size() - 3) != 1 || product(yd, 0, yd.size() - 1) != m) {
    return ffi::Error::InvalidArgument("tj_gemm_f32: shapes do not match the packed layout");
  }
  gemm(x.typed_data(), packed.typed_data(), y->typed_data(), m, k, n);
  return ffi::Error::Success();
}

}  // namespace tj

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjGemmF32, tj::GemmImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

extern "C" int tj_strip_width() { return tj::kStrip; }

namespace tj {

struct PackJob {
  const float* w;  // element (i, j) at w[i * row + j * col]
  int64_t row, col, k, n;
  float* out;  // [strips, k, kStrip]
};

static void pack_chunk(void* ctx, int64_t s) {
  const PackJob& job = *static_cast<const PackJob*>(ctx);
  const int64_t cols = std::min<int64_t>(kStrip, job.n - s * kStrip);
  float* out = job.out + s * job.k * kStrip;
  for (int64_t i = 0; i < job.k; ++i) {
    const float* src = job.w + i * job.row + s * kStrip * job.col;
    float* dst = out + i * kStrip;
    int64_t j = 0;
    for (; j < cols; ++j) dst[j] = src[j * job.col];
    for (; j < kStrip; ++j) dst[j] = 0.0f;
  }
}

}  // namespace tj

// W [k, n] (strides in elements) into its strips out [ceil(n / kStrip), k, kStrip], zero-padded,
// over the thread pool.
extern "C" void tj_pack_f32(const float* w, int64_t row, int64_t col, int64_t k, int64_t n,
                            float* out) {
  tj::PackJob job{w, row, col, k, n, out};
  tj::Pool::get().run((n + tj::kStrip - 1) / tj::kStrip, tj::pack_chunk, &job);
}

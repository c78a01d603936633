// Float32 X[M, K] @ W[K, N] with W packed in column strips P[S, K, kStrip] (S = ceil(N / kStrip),
// the last strip zero-padded): a strip is one contiguous stream, which the prefetcher follows.
// The strip width is fixed (the layout does not depend on the CPU); the micro-kernels work on
// panels of kPanel columns of a strip, two vectors of the ISA wide, so that their accumulators
// stay in registers on AVX-512 (one panel a strip), AVX2 (two) and 128-bit vectors (four).
// Up to kRows rows of X (decoding): a chunk of work is a run of consecutive strips against all
// rows, each strip in one pass of a register-blocked micro-kernel per panel. More rows: a chunk is a pair of panels against a
// group of up to kRowGroup rows, in passes of kPairRows rows, K in blocks of kDepth so that the
// blocks of the panels stay in L1 across passes, each pass prefetching its share of the next
// block; where the panel kernel holds more accumulators (AVX2), the most rows go back to strips
// against row groups, in passes of kRows rows per panel, K in blocks. Chunks are spread over
// the thread pool.
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "activation.h"
#include "common.h"
#include "live.h"
#include "native.h"
#include "norm.h"
#include "pool.h"

namespace tj {

constexpr int kStrip = 32;                       // strip width in floats (the packed layout)
constexpr int kVecs = 2;                         // vectors per panel row
constexpr int kPanel = kVecs * kGemmLanes;       // panel width in floats
constexpr int kPanels = kStrip / kPanel;         // panels per strip
// Accumulators, one panel row and one broadcast value in registers:
constexpr int kRows = std::min(12, (kRegisters - kVecs - 1) / kVecs);  // rows per micro pass
constexpr int kWideRows = std::max(1, (kRegisters - kStrip / kGemmLanes - 1) / (kStrip / kGemmLanes));
constexpr int kPairRows = std::min(6, (kRegisters - 2 * kVecs - 1) / (2 * kVecs));
constexpr int64_t kRowGroup = 96;                // rows of X per chunk when M is large
constexpr int64_t kDepth = 256;                  // values of K per block when M > kRows
constexpr int64_t kPanelDepth = 192;             // the most values of K per block of a panel
constexpr int64_t kAhead = 64;                   // rows of a panel prefetched ahead in one pass
constexpr int64_t kRunsPerThread = 4;            // chunks of consecutive strips a thread (few rows)
// Where a pass of the pair kernel holds fewer accumulators than one of the panel kernel (AVX2:
// 8 against 12), a product of at least kManyRows rows (compute-bound) runs on single panels; the
// pair kernel, whose loads stream the weights faster, keeps the products of fewer rows (a
// decoding batch), which the weights' stream bounds. kManyRows: the crossover measured on AVX2.
constexpr bool kPanelsForMany = kPairRows * 2 * kVecs < kRows * kVecs;
constexpr int64_t kManyRows = 2 * kRows;
static_assert(kStrip % kPanel == 0, "a strip holds whole panels");

// Accumulators of R rows and V vectors from Y[0:R, 0:cols] (zeros past cols), and back. A
// product split into blocks of K resumes each block from the sum so far instead of adding the
// block's own sum to it: every path then computes an output as the same chain of multiply-adds
// over K in order, so a row's result never depends on how many rows run with it.
template <int R, int V>
static void load_acc(gv (&acc)[R][V], const float* y, int64_t ldy, int64_t cols) {
  constexpr int kWidth = V * kGemmLanes;
  for (int r = 0; r < R; ++r) {
    const float* in = y + r * ldy;
    if (cols == kWidth) {
      for (int v = 0; v < V; ++v) acc[r][v] = gload(in + v * kGemmLanes);
    } else {
      float tmp[kWidth] = {};
      for (int64_t c = 0; c < cols; ++c) tmp[c] = in[c];
      for (int v = 0; v < V; ++v) acc[r][v] = gload(tmp + v * kGemmLanes);
    }
  }
}

template <int R, int V>
static void store_acc(const gv (&acc)[R][V], float* y, int64_t ldy, int64_t cols) {
  constexpr int kWidth = V * kGemmLanes;
  for (int r = 0; r < R; ++r) {
    float* out = y + r * ldy;
    if (cols == kWidth) {
      for (int v = 0; v < V; ++v) gstore(out + v * kGemmLanes, acc[r][v]);
    } else {
      float tmp[kWidth];
      for (int v = 0; v < V; ++v) gstore(tmp + v * kGemmLanes, acc[r][v]);
      for (int64_t c = 0; c < cols; ++c) out[c] = tmp[c];
    }
  }
}

// Brings row i of a panel of `width` floats at `p` into L2 (not L1, which holds the block in
// use).
template <int width>
static inline void prefetch_row(const float* p, int64_t i) {
  const char* row = reinterpret_cast<const char*>(p + i * kStrip);
  for (int line = 0; line < width * 4; line += 64) __builtin_prefetch(row + line, 0, 2);
}

// Y[0:R, 0:cols] (+)= X[0:R, 0:k] @ panel[0:k] (V vectors wide, rows kStrip apart),
// cols <= V * kGemmLanes; resumes from Y when `add`. `fetch` rows of the panel's next block of
// K (from `next`) are prefetched, one every `every` values of K, as micro_pair does.
template <int R, int V>
static void micro(const float* x, int64_t ldx, const float* panel, int64_t k, float* y,
                  int64_t ldy, int64_t cols, bool add, const float* next, int64_t every,
                  int64_t fetch) {
  gv acc[R][V] = {};
  if (add) load_acc<R, V>(acc, y, ldy, cols);
  int64_t at = 0, fetched = 0;  // the value of K of the next prefetch, rows prefetched
  for (int64_t i = 0; i < k; ++i) {
    if (i == at && fetched < fetch) {  // a counter: no division in the loop
      prefetch_row<V * kGemmLanes>(next, fetched);
      ++fetched;
      at += every;
    }
    const float* p = panel + i * kStrip;
    gv w[V];
    for (int v = 0; v < V; ++v) w[v] = gload(p + v * kGemmLanes);
    for (int r = 0; r < R; ++r) {
      gv a = gsplat(x[r * ldx + i]);
      for (int v = 0; v < V; ++v) acc[r][v] += a * w[v];
    }
  }
  store_acc<R, V>(acc, y, ldy, cols);
}

// Y[0:R, 0:cols] (+)= X[0:R, 0:k] @ [panel a | panel b] (cols <= 2 * kPanel): twice the columns
// per broadcast of X, for many rows of X. `fetch` rows of the next block of K of the panels
// (starting at `next_a`, `next_b`) are prefetched, one every `every` values of K, so that the
// next block streams in from memory while this one is computed from L1 (the weights of a
// decode step are read once: cold).
template <int R>
static void micro_pair(const float* x, int64_t ldx, const float* a, const float* b, int64_t k,
                       float* y, int64_t ldy, int64_t cols, bool add, const float* next_a,
                       const float* next_b, int64_t every, int64_t fetch) {
  gv acc[R][2 * kVecs] = {};
  if (add) load_acc<R, 2 * kVecs>(acc, y, ldy, cols);
  int64_t at = 0, fetched = 0;  // the value of K of the next prefetch, rows prefetched
  for (int64_t i = 0; i < k; ++i) {
    if (i == at && fetched < fetch) {  // a counter: no division in the loop
      prefetch_row<kPanel>(next_a, fetched);
      prefetch_row<kPanel>(next_b, fetched);
      ++fetched;
      at += every;
    }
    gv w[2 * kVecs];
    for (int v = 0; v < kVecs; ++v) {
      w[v] = gload(a + i * kStrip + v * kGemmLanes);
      w[kVecs + v] = gload(b + i * kStrip + v * kGemmLanes);
    }
    for (int r = 0; r < R; ++r) {
      gv xv = gsplat(x[r * ldx + i]);
      for (int v = 0; v < 2 * kVecs; ++v) acc[r][v] += xv * w[v];
    }
  }
  store_acc<R, 2 * kVecs>(acc, y, ldy, cols);
}

using Micro = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                       bool, const float*, int64_t, int64_t);
using MicroPair = void (*)(const float*, int64_t, const float*, const float*, int64_t, float*,
                           int64_t, int64_t, bool, const float*, const float*, int64_t,
                           int64_t);

template <int V, int... I>
constexpr std::array<Micro, sizeof...(I) + 1> micro_table(std::integer_sequence<int, I...>) {
  return {nullptr, micro<I + 1, V>...};
}
template <int... I>
constexpr std::array<MicroPair, sizeof...(I) + 1> pair_table(std::integer_sequence<int, I...>) {
  return {nullptr, micro_pair<I + 1>...};
}
static constexpr auto kMicro = micro_table<kVecs>(std::make_integer_sequence<int, kRows>{});
// A whole strip a pass, for the fewest rows (decoding one or two rows): more independent
// accumulators and one contiguous stream of the strip.
static constexpr auto kWide =
    micro_table<kStrip / kGemmLanes>(std::make_integer_sequence<int, kWideRows>{});
static constexpr auto kMicroPair = pair_table(std::make_integer_sequence<int, kPairRows>{});

using Rows = std::pair<int64_t, int64_t>;  // rows [first, end) of X and Y

struct GemmJob {
  const float* x;
  const float* packed;
  float* y;
  int64_t m, k, n, groups;
  const Rows* rows;  // [groups] the rows of each group
  int64_t run;       // strips of a chunk of few rows (consecutive: one stream)
};

// The first value of panel q (panels counted over all strips, kPanels a strip).
static const float* panel_at(const GemmJob& job, int64_t q) {
  return job.packed + (q / kPanels) * job.k * kStrip + (q % kPanels) * kPanel;
}

// Rows [r0, r1) of X against panel q, on this thread.
static void gemm_panel(const GemmJob& job, int64_t q, int64_t r0, int64_t r1) {
  const int64_t cols = std::min<int64_t>(kPanel, job.n - q * kPanel);
  if (cols <= 0) return;
  const int64_t m = r1 - r0;
  const float* panel = panel_at(job, q);
  const float* x = job.x + r0 * job.k;
  float* y = job.y + r0 * job.n + q * kPanel;
  const int64_t passes = (m + kRows - 1) / kRows;
  // With several passes, K goes in blocks so that a block of the panel stays in L1 for all:
  // equal blocks of at most kPanelDepth values (a panel's rows are kStrip apart, so a block
  // of 256 fills the L1 sets its lines map to, with X's rows beside it).
  const int64_t blocks = (job.k + kPanelDepth - 1) / kPanelDepth;
  const int64_t depth = passes > 1 ? (job.k + blocks - 1) / blocks : job.k;
  if (passes == 1) {
    // One pass (a decode step's rows): the panel is read once, from memory; the hardware's
    // prefetch alone falls behind (at 8 rows the weights streamed at half the rate), so each
    // value of K prefetches the panel's row kAhead ahead (8 KB). 8 rows: 0.79x -> 1.22x
    // onnxruntime's MatMul over 30 layers of the default model's products; 1 row 0.9 -> 1.0x.
    // A whole strip (AVX-512: one panel a strip) prefetches on into the next strip's first
    // rows, which follow it in memory and which this thread reads next (gemm_chunk's runs); a
    // prefetch past the last strip is dropped by the CPU.
    const int64_t ahead = std::min<int64_t>(kAhead, job.k);
    const int64_t fetch = kPanels == 1 ? job.k : job.k - ahead;
    kMicro[m](x, job.k, panel, job.k, y, job.n, cols, false, panel + ahead * kStrip, 1, fetch);
    return;
  }
  for (int64_t k0 = 0; k0 < job.k; k0 += depth) {
    const int64_t kc = std::min(depth, job.k - k0);
    const int64_t next = std::min(depth, job.k - k0 - kc);  // rows of the next block
    int64_t r = 0, done = 0;
    for (int64_t p = 0; p < passes; ++p) {  // balanced passes, each prefetching its share
      const int64_t take = (m - r) / (passes - p);
      const int64_t share = (next - done) / (passes - p);
      const int64_t every = share > 0 ? std::max<int64_t>(1, kc / share) : 1;
      const int64_t at = share > 0 ? k0 + kc + done : k0;  // in the panel either way
      kMicro[take](x + r * job.k + k0, job.k, panel + k0 * kStrip, kc, y + r * job.n, job.n,
                   cols, k0 > 0, panel + at * kStrip, every, share);
      r += take;
      done += share;
    }
  }
}

// Few rows of X: a run of consecutive strips (their panels) against a group of rows.
static void gemm_chunk(void* ctx, int64_t chunk) {
  const GemmJob& job = *static_cast<const GemmJob*>(ctx);
  const int64_t strips = (job.n + kStrip - 1) / kStrip;
  const int64_t first = chunk / job.groups * job.run, end = std::min(strips, first + job.run);
  const auto [r0, r1] = job.rows[chunk % job.groups];
  for (int64_t s = first; s < end; ++s) {
    if (kPanels > 1 && r1 - r0 <= kWideRows) {
      const int64_t cols = std::min<int64_t>(kStrip, job.n - s * kStrip);
      kWide[r1 - r0](job.x + r0 * job.k, job.k, job.packed + s * job.k * kStrip, job.k,
                     job.y + r0 * job.n + s * kStrip, job.n, cols, false, nullptr, 1, 0);
      continue;
    }
    for (int64_t q = s * kPanels; q < (s + 1) * kPanels; ++q) gemm_panel(job, q, r0, r1);
  }
}

// Many rows of X: panels 2p and 2p + 1 against a group of rows, K in blocks.
static void gemm_pair_chunk(void* ctx, int64_t chunk) {
  const GemmJob& job = *static_cast<const GemmJob*>(ctx);
  const int64_t pair = chunk / job.groups;
  const auto [r0, r1] = job.rows[chunk % job.groups];
  const int64_t q = 2 * pair;
  if ((q + 1) * kPanel >= job.n) {  // the last panel has no partner
    gemm_panel(job, q, r0, r1);
    return;
  }
  const int64_t cols = std::min<int64_t>(2 * kPanel, job.n - q * kPanel);
  const float* a = panel_at(job, q);
  const float* b = panel_at(job, q + 1);
  const int64_t passes = (r1 - r0 + kPairRows - 1) / kPairRows;
  for (int64_t k0 = 0; k0 < job.k; k0 += kDepth) {
    const int64_t kc = std::min(kDepth, job.k - k0);
    const int64_t next = std::min(kDepth, job.k - k0 - kc);  // rows of the next block
    int64_t r = r0, done = 0;
    for (int64_t p = 0; p < passes; ++p) {  // each pass prefetches its share of the next block
      const int64_t take = (r1 - r) / (passes - p);
      const int64_t share = (next - done) / (passes - p);
      const int64_t every = share > 0 ? std::max<int64_t>(1, kc / share) : 1;
      const int64_t at = share > 0 ? k0 + kc + done : k0;  // in the panels either way
      kMicroPair[take](job.x + r * job.k + k0, job.k, a + k0 * kStrip, b + k0 * kStrip, kc,
                       job.y + r * job.n + q * kPanel, job.n, cols, k0 > 0, a + at * kStrip,
                       b + at * kStrip, every, share);
      r += take;
      done += share;
    }
  }
}

// Rows [first, end) of X added to `groups` in groups of at most kRowGroup rows, split evenly.
static void add_groups(std::vector<Rows>& groups, int64_t first, int64_t end) {
  const int64_t rows = end - first, parts = (rows + kRowGroup - 1) / kRowGroup;
  for (int64_t g = 0; g < parts; ++g) {
    groups.emplace_back(first + g * rows / parts, first + (g + 1) * rows / parts);
  }
}

// How a product runs on the pool: its job, the task and count of its chunks, and the weights it
// streams (few rows; none for the pair kernel's blocks, which prefetch their own).
struct GemmPlan {
  GemmJob job;
  Task task;
  int64_t chunks;
  int64_t bytes, runs;  // pool.stream's: the weights' bytes, in `runs` equal runs (0: none)
};

// The plan of Y[r] = X[r] @ W for the rows r of `groups` (m of them in all), k and n > 0.
static GemmPlan gemm_plan(const float* x, const float* packed, float* y, int64_t m, int64_t k,
                          int64_t n, const std::vector<Rows>& groups) {
  const int64_t strips = (n + kStrip - 1) / kStrip;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t count = static_cast<int64_t>(groups.size());
  // Few rows: each chunk a run of consecutive strips, kRunsPerThread runs a thread.
  const int64_t runs = std::min<int64_t>(strips, Pool::get().threads() * kRunsPerThread);
  const int64_t run = (strips + runs - 1) / runs;
  GemmJob job{x, packed, y, m, k, n, count, groups.data(), run};
  if (m > kRows && !(kPanelsForMany && m >= kManyRows)) {
    return {job, gemm_pair_chunk, (panels + 1) / 2 * count, 0, 0};
  }
  const int64_t chunks = (strips + run - 1) / run;
  return {job, gemm_chunk, chunks * count,
          strips * k * kStrip * static_cast<int64_t>(sizeof(float)), chunks};
}

// Y[r] = X[r] @ W for the rows r of `groups` (m of them in all); other rows of Y are left as they
// are. W given as its strips.
static void gemm_groups(const float* x, const float* packed, float* y, int64_t m, int64_t k,
                        int64_t n, const std::vector<Rows>& groups) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (const auto& [r0, r1] : groups) std::fill(y + r0 * n, y + r1 * n, 0.0f);
    return;
  }
  GemmPlan plan = gemm_plan(x, packed, y, m, k, n, groups);
  Pool& pool = Pool::get();
  if (plan.runs > 0) pool.stream(packed, plan.bytes, plan.runs);
  pool.run(plan.chunks, plan.task, &plan.job);
}

// Y[M, N] = X[M, K] @ W, W given as its strips.
void gemm(const float* x, const float* packed, float* y, int64_t m, int64_t k, int64_t n) {
  std::vector<Rows> groups;
  add_groups(groups, 0, m);
  gemm_groups(x, packed, y, m, k, n, groups);
}

// Two products of one X on one run of the pool: the first's chunks, then the second's (not
// gemm_pair_chunk's two panels of one product).
struct GemmBoth {
  GemmPlan a, b;
};

static void gemm_both_chunk(void* ctx, int64_t chunk) {
  GemmBoth& both = *static_cast<GemmBoth*>(ctx);
  if (chunk < both.a.chunks) {
    both.a.task(&both.a.job, chunk);
  } else {
    both.b.task(&both.b.job, chunk - both.a.chunks);
  }
}

// Y[M, N] = silu_mul(X @ G, X @ U) (activation.h), G and U given as strips: both products on one
// run of the pool, then the gated activation, each value as gemm() and silu_mul give it.
static void gemm_gate_up(const float* x, const float* gate, const float* up, float* y, int64_t m,
                         int64_t k, int64_t n) {
  if (m == 0 || n == 0) return;
  thread_local std::vector<float> products;
  products.resize(static_cast<size_t>(2 * m * n));
  float* g = products.data();
  float* u = g + m * n;
  std::vector<Rows> groups;
  add_groups(groups, 0, m);
  if (k == 0) {
    std::fill(g, g + 2 * m * n, 0.0f);
  } else {
    GemmBoth both{gemm_plan(x, gate, g, m, k, n, groups), gemm_plan(x, up, u, m, k, n, groups)};
    Pool& pool = Pool::get();
    if (both.a.runs > 0) pool.stream(gate, both.a.bytes, both.a.runs);
    pool.run(both.a.chunks + both.b.chunks, gemm_both_chunk, &both);
  }
  silu_mul_all(SiluMulJob{g, u, y, m * n});
}

// Whether x [..., K], packed [S, K, kStrip] (leading size-1 dims allowed) and y [..., N] fit.
static ffi::Error GemmImplShapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> pd,
                                 ffi::Span<const int64_t> yd, const char* name) {
  if (xd.size() < 1 || pd.size() < 3 || yd.size() != xd.size()) {
    return ffi::Error::InvalidArgument(std::string(name) + ": bad ranks");
  }
  const int64_t k = xd.back(), n = yd.back();
  const int64_t m = product(xd, 0, xd.size() - 1);
  const int64_t strips = pd[pd.size() - 3];
  if (pd.back() != kStrip || pd[pd.size() - 2] != k || strips * kStrip < n ||
      (strips - 1) * kStrip >= std::max<int64_t>(n, 1) ||
      product(pd, 0, pd.size() - 3) != 1 || product(yd, 0, yd.size() - 1) != m) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": shapes do not match the packed layout");
  }
  return ffi::Error::Success();
}

// x [..., K] and packed [S, K, kStrip] (leading size-1 dims allowed) -> y [..., N].
static ffi::Error GemmImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                           ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  auto error = GemmImplShapes(xd, packed.dimensions(), yd, "tj_gemm_f32");
  if (error.failure()) return error;
  const int64_t m = product(xd, 0, xd.size() - 1);
  gemm(x.typed_data(), packed.typed_data(), y->typed_data(), m, xd.back(), yd.back());
  return ffi::Error::Success();
}

// The same product over token rows: x [..., S, K] is blocks of S rows (a step's tokens), block
// j of batch row j % B; counts [B] the real tokens of each batch row. Only the first counts[b]
// rows of a block (at least one, at most S) are computed; each later row of the block is a copy
// of its last computed row (the padding after a row's tokens, which nothing reads: a copy keeps
// it finite where zeros could make an operation like x / |x| give NaN). A computed row has the
// bits it has in the whole product.
static ffi::Error GemmRowsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                               ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  auto error = GemmImplShapes(xd, packed.dimensions(), yd, "tj_gemm_rows_f32");
  if (error.failure()) return error;
  const int64_t batch = static_cast<int64_t>(counts.element_count());
  const int64_t k = xd.back(), n = yd.back(), m = product(xd, 0, xd.size() - 1);
  const int64_t steps = xd.size() < 2 ? 0 : xd[xd.size() - 2];
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (batch < 1 || steps < 1 || (m / steps) % batch != 0) {
    return ffi::Error::InvalidArgument("tj_gemm_rows_f32: the rows do not match the counts");
  }
  const int32_t* given = counts.typed_data();
  std::vector<Rows> groups;
  int64_t rows = 0;
  for (int64_t j = 0; j < m / steps; ++j) {
    const int64_t real = std::clamp<int64_t>(given[j % batch], 1, steps);
    add_groups(groups, j * steps, j * steps + real);
    rows += real;
  }
  float* out = y->typed_data();
  gemm_groups(x.typed_data(), packed.typed_data(), out, rows, k, n, groups);
  for (int64_t j = 0; j < m / steps; ++j) {
    const int64_t real = std::clamp<int64_t>(given[j % batch], 1, steps);
    const float* last = out + (j * steps + real - 1) * n;
    for (int64_t r = j * steps + real; r < (j + 1) * steps; ++r) {
      std::copy(last, last + n, out + r * n);
    }
  }
  return ffi::Error::Success();
}

// The same product over the live rows of a batch (live.h): x [..., K] is B blocks of rows, one
// per batch row; live [B] nonzero where a row is live. A computed row has the bits it has in the
// whole product.
static ffi::Error GemmLiveImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                               ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  auto error = GemmImplShapes(xd, packed.dimensions(), yd, "tj_gemm_live_f32");
  if (error.failure()) return error;
  const int64_t k = xd.back(), n = yd.back(), m = product(xd, 0, xd.size() - 1);
  if (m == 0 || n == 0) return ffi::Error::Success();
  const float* w = packed.typed_data();
  auto rows = [&](const float* a, float* b, int64_t r) { gemm(a, w, b, r, k, n); };
  const int64_t batch = static_cast<int64_t>(live.element_count());
  if (!live_product(x.typed_data(), y->typed_data(), m, k, n, live.typed_data(), batch, rows)) {
    return ffi::Error::InvalidArgument("tj_gemm_live_f32: the rows do not match the batch");
  }
  return ffi::Error::Success();
}

// Whether x, both weights and y fit (GemmImplShapes for each weight).
// SkipSimplifiedLayerNormalization of the product (nbits.cc's tj_matmul_nbits_skip_norm for a
// float32 weight in strips): total = x @ w + skip, y = its RMS norm by norm.h's steps, the
// product over every row or the live rows (`live` null: every row), then row by row on this
// thread: the values of the product's call and the norm's call.
static ffi::Error GemmSkipNormImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                                   ffi::Buffer<ffi::F32> skip, ffi::Buffer<ffi::F32> gamma,
                                   const ffi::Buffer<ffi::S32>* live,
                                   ffi::ResultBuffer<ffi::F32> y,
                                   ffi::ResultBuffer<ffi::F32> total, float epsilon) {
  auto xd = x.dimensions();
  auto td = total->dimensions();
  auto error = GemmImplShapes(xd, packed.dimensions(), td, "tj_gemm_skip_norm_f32");
  if (error.failure()) return error;
  const int64_t k = xd.back(), n = td.back(), m = product(xd, 0, xd.size() - 1);
  if (skip.element_count() != total->element_count() ||
      y->element_count() != total->element_count() ||
      static_cast<int64_t>(gamma.element_count()) != n) {
    return ffi::Error::InvalidArgument(
        "tj_gemm_skip_norm_f32: skip and the outputs must be [..., N], gamma [N]");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  float* sum = total->typed_data();
  const float* w = packed.typed_data();
  if (live == nullptr) {
    gemm(x.typed_data(), w, sum, m, k, n);
  } else {
    auto rows = [&](const float* a, float* b, int64_t r) { gemm(a, w, b, r, k, n); };
    const int64_t batch = static_cast<int64_t>(live->element_count());
    if (!live_product(x.typed_data(), sum, m, k, n, live->typed_data(), batch, rows)) {
      return ffi::Error::InvalidArgument("tj_gemm_skip_norm_live_f32: the rows do not match");
    }
  }
  // in place: each sum reads its own product first
  skip_norm_rows(sum, skip.typed_data(), gamma.typed_data(), m, n, epsilon, sum, y->typed_data());
  return ffi::Error::Success();
}

static ffi::Error GemmSkipNormFull(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                                   ffi::Buffer<ffi::F32> skip, ffi::Buffer<ffi::F32> gamma,
                                   ffi::ResultBuffer<ffi::F32> y,
                                   ffi::ResultBuffer<ffi::F32> total, float epsilon) {
  return GemmSkipNormImpl(x, packed, skip, gamma, nullptr, y, total, epsilon);
}

static ffi::Error GemmSkipNormLive(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                                   ffi::Buffer<ffi::F32> skip, ffi::Buffer<ffi::F32> gamma,
                                   ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y,
                                   ffi::ResultBuffer<ffi::F32> total, float epsilon) {
  return GemmSkipNormImpl(x, packed, skip, gamma, &live, y, total, epsilon);
}

static ffi::Error GateUpShapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> gate,
                               ffi::Span<const int64_t> up, ffi::Span<const int64_t> yd,
                               const char* name) {
  auto error = GemmImplShapes(xd, gate, yd, name);
  return error.failure() ? error : GemmImplShapes(xd, up, yd, name);
}

// x [..., K], gate and up [S, K, kStrip] -> y [..., N] = silu_mul(x @ gate, x @ up).
static ffi::Error GemmGateUpImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> gate,
                                 ffi::Buffer<ffi::F32> up, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  auto error = GateUpShapes(xd, gate.dimensions(), up.dimensions(), yd, "tj_gemm_gate_up_f32");
  if (error.failure()) return error;
  const int64_t m = product(xd, 0, xd.size() - 1);
  gemm_gate_up(x.typed_data(), gate.typed_data(), up.typed_data(), y->typed_data(), m, xd.back(),
               yd.back());
  return ffi::Error::Success();
}

// The same over the live rows of a batch (live.h, as tj_gemm_live_f32).
static ffi::Error GemmGateUpLiveImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> gate,
                                     ffi::Buffer<ffi::F32> up, ffi::Buffer<ffi::S32> live,
                                     ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  auto error =
      GateUpShapes(xd, gate.dimensions(), up.dimensions(), yd, "tj_gemm_gate_up_live_f32");
  if (error.failure()) return error;
  const int64_t k = xd.back(), n = yd.back(), m = product(xd, 0, xd.size() - 1);
  if (m == 0 || n == 0) return ffi::Error::Success();
  const float* g = gate.typed_data();
  const float* u = up.typed_data();
  auto rows = [&](const float* a, float* b, int64_t r) { gemm_gate_up(a, g, u, b, r, k, n); };
  const int64_t batch = static_cast<int64_t>(live.element_count());
  if (!live_product(x.typed_data(), y->typed_data(), m, k, n, live.typed_data(), batch, rows)) {
    return ffi::Error::InvalidArgument("tj_gemm_gate_up_live_f32: the rows do not match the batch");
  }
  return ffi::Error::Success();
}

}  // namespace tj

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjGemmGateUpF32, tj::GemmGateUpImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjGemmGateUpLiveF32, tj::GemmGateUpLiveImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjGemmLiveF32, tj::GemmLiveImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjGemmRowsF32, tj::GemmRowsImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjGemmSkipNormF32, tj::GemmSkipNormFull,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("epsilon"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjGemmSkipNormLiveF32, tj::GemmSkipNormLive,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("epsilon"));

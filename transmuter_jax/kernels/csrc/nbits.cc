// com.microsoft MatMulNBits with 4-bit weights: Y[M, N] = X[M, K] @ dequant(B)^T, reading the
// packed weights as they are stored: B[N, blocks, block_size / 2], two values per byte (low
// nibble first), weight = (value - zero point) * scale per block of K.
//
// int8 activations (accuracy_level 4): onnxruntime's CompInt8 scheme, strictly per row
// (nbits_int8.h), for any number of rows. Exact products: with AVX512-VNNI, integer dot products
// (nbits_vnni.h), for any number of rows of X: per row they cost about what a float32 product
// would. Otherwise X is rearranged to match the nibbles: for each group of 32 values of
// K, the 16 even positions (low nibbles) then the 16 odd ones (high nibbles), zero-padded past K.
// Few rows of X: each weight is dequantized in registers and used for every row. More rows: a
// chunk of weight rows is dequantized once into a buffer, then multiplied with all rows of X.
// Chunks of weight rows are spread over the thread pool.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "activation.h"
#include "common.h"
#include "live.h"
#include "nbits_block32.h"
#include "nbits_int8.h"
#include "nbits_lanes.h"
#include "nbits_vnni.h"
#include "norm.h"
#include "pool.h"

namespace tj {

constexpr int kGroup = 32;          // values of K per 16 bytes of B
constexpr int kDirectRows = 4;      // at most this many rows of X: dequantize in registers
constexpr int64_t kTileRows = 16;   // weight rows dequantized per chunk otherwise

enum ZeroPoints { kNone, kPacked, kFloat };

struct NbitsJob {
  const float* xr;      // [M, groups * 32], rearranged
  const uint8_t* b;     // [N, groups * 16]
  const float* scales;  // [N, blocks]
  const void* zp;       // per ZeroPoints
  ZeroPoints zp_kind;
  float* y;             // [M, N]
  int64_t m, n, groups, blocks, block_size, rows_per_chunk;
#ifdef TJ_HAVE_VNNI
  VnniRows vnni;  // X quantized, when the VNNI kernel runs
#endif
};

static inline float zero_point(const NbitsJob& job, int64_t row, int64_t block) {
  switch (job.zp_kind) {
    case kPacked: {
      const uint8_t* z = static_cast<const uint8_t*>(job.zp) + row * ((job.blocks + 1) / 2);
      return static_cast<float>((z[block / 2] >> ((block & 1) * 4)) & 15);
    }
    case kFloat:
      return static_cast<const float*>(job.zp)[row * job.blocks + block];
    default:
      return 8.0f;
  }
}

// The dequantized weights of group g of `row`, low nibbles (even K) then high (odd K).
struct Scale {
  vf s, zs;  // weight = value * s - zs, per lane
};

static inline Scale group_scale(const NbitsJob& job, int64_t row, int64_t g) {
  const float* s = job.scales + row * job.blocks;
  if (job.block_size >= kGroup) {
    const int64_t block = g * kGroup / job.block_size;
    const float scale = s[block];
    return {splat(scale), splat(zero_point(job, row, block) * scale)};
  }
  // block_size 16: lanes 0-7 are block 2g, lanes 8-15 block 2g + 1.
  const float s0 = s[2 * g], s1 = s[2 * g + 1];
  const float z0 = zero_point(job, row, 2 * g) * s0, z1 = zero_point(job, row, 2 * g + 1) * s1;
  vf sv, zv;
  for (int i = 0; i < kLanes; ++i) {
    sv[i] = i < 8 ? s0 : s1;
    zv[i] = i < 8 ? z0 : z1;
  }
  return {sv, zv};
}

static inline void dequant_group(const uint8_t* bytes, const Scale& sc, vf* lo, vf* hi) {
  vb16 q = *reinterpret_cast<const vb16u*>(bytes);
  vf l = __builtin_convertvector(__builtin_convertvector(q & 15, vi), vf);
  vf h = __builtin_convertvector(__builtin_convertvector(q >> 4, vi), vf);
  *lo = l * sc.s - sc.zs;
  *hi = h * sc.s - sc.zs;
}

// Rows of B in registers, used for all R rows of X.
template <int R>
static void direct_rows(const NbitsJob& job, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t len = job.groups * kGroup;
  for (int64_t row = n0; row < n1; ++row) {
    const uint8_t* bytes = job.b + row * job.groups * 16;
    vf acc[R] = {};
    for (int64_t g = 0; g < job.groups; ++g) {
      vf lo, hi;
      dequant_group(bytes + g * 16, group_scale(job, row, g), &lo, &hi);
      for (int r = 0; r < R; ++r) {
        const float* x = job.xr + (m0 + r) * len + g * kGroup;
        acc[r] += lo * load(x) + hi * load(x + kLanes);
      }
    }
    for (int r = 0; r < R; ++r) job.y[(m0 + r) * job.n + row] = hsum(acc[r]);
  }
}

using Direct = void (*)(const NbitsJob&, int64_t, int64_t, int64_t);
static constexpr Direct kDirect[kDirectRows + 1] = {nullptr, direct_rows<1>, direct_rows<2>,
                                                   direct_rows<3>, direct_rows<4>};

#ifdef TJ_HAVE_VNNI
// Sum over blocks of scale * (zero point - 8) * (sum of X over the block), for one row of B.
static float vnni_correction(const void* ctx, int64_t r, int64_t row) {
  const NbitsJob& job = *static_cast<const NbitsJob*>(ctx);
  const float* s = job.scales + row * job.blocks;
  const float* sums = job.vnni.block_sums.data() + r * job.blocks;
  float c = 0.0f;
  for (int64_t b = 0; b < job.blocks; ++b) c += s[b] * (zero_point(job, row, b) - 8.0f) * sums[b];
  return c;
}

template <int D>
static void vnni_pass(const NbitsJob& job, int64_t m0, int64_t rows, int64_t n0, int64_t n1) {
  auto fix = job.zp_kind == kNone ? nullptr : vnni_correction;
  using Fn = void (*)(const uint8_t*, const float*, int64_t, int64_t, const VnniRows&, int64_t,
                      int64_t, int64_t, int64_t, float*, int64_t,
                      float (*)(const void*, int64_t, int64_t), const void*);
  static constexpr Fn kRows[5] = {nullptr, vnni_rows<1, D>, vnni_rows<2, D>, vnni_rows<3, D>,
                                  vnni_rows<4, D>};
  kRows[rows](job.b, job.scales, job.blocks, job.block_size, job.vnni, m0, n0, n1,
              job.groups * kGroup, job.y, job.n, fix, &job);
}

static void vnni_chunk(void* ctx, int64_t chunk) {
  const NbitsJob& job = *static_cast<const NbitsJob*>(ctx);
  const int64_t n0 = chunk * job.rows_per_chunk;
  const int64_t n1 = std::min(job.n, n0 + job.rows_per_chunk);
  const int64_t passes = (job.m + 3) / 4;
  int64_t m0 = 0;
  for (int64_t p = 0; p < passes; ++p) {  // balanced passes of at most 4 rows
    const int64_t rows = (job.m - m0) / (passes - p);
    if (job.vnni.digits == 1) {
      vnni_pass<1>(job, m0, rows, n0, n1);
    } else {
      vnni_pass<3>(job, m0, rows, n0, n1);
    }
    m0 += rows;
  }
}
#endif

// int8 activations (nbits_int8.h): chunks of columns, 8 at a time where AVX2 runs.
struct Int8Job {
  const NbitsJob* job;
  Int8Rows xs;
  bool portable;
  int64_t cols_per_chunk;
};

// The expanded weights, scales and zero points of column `row` of B (a row of B is a column of
// the product).
static void int8_column(const NbitsJob& job, int64_t row, uint8_t* e, float* s, int32_t* zi,
                        float* zf) {
  const int64_t bs = job.block_size;
  int8_expand_column(job.b + row * job.groups * 16, job.blocks, bs, e);
  for (int64_t b = 0; b < job.blocks; ++b) {
    s[b] = job.scales[row * job.blocks + b];
    if (job.zp_kind == kFloat) {
      zf[b] = zero_point(job, row, b);
    } else {
      zi[b] = static_cast<int32_t>(zero_point(job, row, b));
    }
  }
}

static void int8_chunk(void* ctx, int64_t chunk) {
  const Int8Job& w = *static_cast<const Int8Job*>(ctx);
  const NbitsJob& job = *w.job;
  const int64_t bs = job.block_size, blocks = job.blocks, len = blocks * bs;
  const int64_t n0 = chunk * w.cols_per_chunk, n1 = std::min(job.n, n0 + w.cols_per_chunk);
  const bool zf = job.zp_kind == kFloat;
  thread_local std::vector<uint8_t> e;
  thread_local std::vector<float> s, z8f;
  thread_local std::vector<int32_t> z8i;
  e.resize(static_cast<size_t>(8 * len));
  s.resize(static_cast<size_t>(blocks));
  z8f.resize(static_cast<size_t>(8 * blocks));
  z8i.resize(static_cast<size_t>(8 * blocks));
  int64_t col = n0;
#ifdef TJ_HAVE_INT8_AVX2
  if (!w.portable && bs % 32 == 0) {
    thread_local std::vector<float> sw8, acc;
    sw8.resize(static_cast<size_t>(8 * blocks));
    acc.resize(static_cast<size_t>(8 * job.m));
    for (; col + 8 <= n1; col += 8) {
      const uint8_t* cols[8];
      for (int c = 0; c < 8; ++c) {
        cols[c] = job.b + (col + c) * job.groups * 16;
        for (int64_t b = 0; b < blocks; ++b) {  // per block, the 8 columns side by side
          sw8[b * 8 + c] = job.scales[(col + c) * blocks + b];
          if (job.zp_kind == kNone) continue;
          const float z = zero_point(job, col + c, b);
          z8f[b * 8 + c] = z;
          z8i[b * 8 + c] = static_cast<int32_t>(z);
        }
      }
      int8_tile8(w.xs, job.m, cols, sw8.data(), job.zp_kind == kPacked ? z8i.data() : nullptr,
                 zf ? z8f.data() : nullptr, job.y + col, job.n, acc.data());
    }
  }
  if (!w.portable) {
    for (; col + 8 <= n1; col += 8) {
      for (int c = 0; c < 8; ++c) {
        int8_expand_column(job.b + (col + c) * job.groups * 16, blocks, bs, e.data() + c * len);
        for (int64_t b = 0; job.zp_kind != kNone && b < blocks; ++b) {
          // per block, the 8 columns side by side
          const float z = zero_point(job, col + c, b);
          z8f[b * 8 + c] = z;
          z8i[b * 8 + c] = static_cast<int32_t>(z);
        }
      }
      const int32_t* zi8 = job.zp_kind == kPacked ? z8i.data() : nullptr;
      const float* zf8 = zf ? z8f.data() : nullptr;
      for (int64_t r = 0; r < job.m; ++r) {
        int8_dot8(w.xs, r, e.data(), len, job.scales + col * blocks, zi8, zf8,
                  job.y + r * job.n + col);
      }
    }
  }
#endif
  for (; col < n1; ++col) {
    int8_column(job, col, e.data(), s.data(), z8i.data(), z8f.data());
    const Int8Column c{e.data(), s.data(), zf ? nullptr : z8i.data(), zf ? z8f.data() : nullptr};
    for (int64_t r = 0; r < job.m; ++r) job.y[r * job.n + col] = int8_dot(w.xs, r, c);
  }
}

// int8 activations, block sizes that are multiples of 32, integer zero points (nbits_lanes.h):
// chunks of columns; per column, rows in groups of at most 4 held in registers.
struct LanesJob {
  const NbitsJob* job;
  Int8Rows xs;
  LaneSums sums;
  bool portable;
  int64_t cols_per_chunk;
};

static void lanes_chunk(void* ctx, int64_t chunk) {
  const LanesJob& w = *static_cast<const LanesJob*>(ctx);
  const NbitsJob& job = *w.job;
  const int64_t blocks = job.blocks, row_bytes = job.groups * 16;
  const int64_t n0 = chunk * w.cols_per_chunk, n1 = std::min(job.n, n0 + w.cols_per_chunk);
  thread_local std::vector<int32_t> zp;
  zp.resize(static_cast<size_t>(blocks));
  for (int64_t col = n0; col < n1; ++col) {
    const uint8_t* bytes = job.b + col * row_bytes;
    const float* sw = job.scales + col * blocks;
    const int32_t* z = nullptr;
    if (job.zp_kind == kPacked) {
      for (int64_t b = 0; b < blocks; ++b) zp[b] = static_cast<int32_t>(zero_point(job, col, b));
      z = zp.data();
    }
    float* y = job.y + col;
#ifdef TJ_HAVE_LANES_AVX2
    if (!w.portable) {
      using Fn = void (*)(const Int8Rows&, const LaneSums&, int64_t, const uint8_t*,
                          const float*, const int32_t*, float*, int64_t);
      static constexpr Fn kRows[5] = {nullptr, lanes_column<1>, lanes_column<2>,
                                      lanes_column<3>, lanes_column<4>};
      for (int64_t r0 = 0; r0 < job.m; r0 += 4) {
        const int64_t rows = std::min<int64_t>(4, job.m - r0);
        kRows[rows](w.xs, w.sums, r0, bytes, sw, z, y + r0 * job.n, job.n);
      }
      continue;
    }
#endif
    lanes_column_portable(w.xs, w.sums, 0, job.m, bytes, sw, z, y, job.n);
  }
}

// int8 activations, blocks of 32, integer zero points (nbits_block32.h): chunks of columns,
// in slices of kB32Slice columns: per column, the rows in groups of at most 4 (the weights
// unpacked once per block for all rows), then the zero-point term of the slice.
constexpr int64_t kB32Slice = 64;
// The packed weights of the columns this far ahead are asked for while 4 columns run (4 to 16
// tried on AVX-512: 8 was fastest).
constexpr int64_t kPrefetchColumns = 8;

struct B32Job {
  const NbitsJob* job;
  B32Rows xs;
  bool portable, packed;
  int64_t cols_per_chunk;  // a multiple of kB32Tile
};

// Weights as stored, scales [N, blocks], zero points packed two to a byte.
static void b32_stored_slice(const B32Job& w, int64_t s0, int64_t s1, uint8_t* values,
                             float* z) {
  const NbitsJob& job = *w.job;
  const int64_t blocks = job.blocks, row_bytes = job.groups * 16, m = job.m, cols = s1 - s0;
  const int64_t tail = job.n - job.n % 4;  // columns from here fold in the other order
  for (int64_t col = s0; col < s1; ++col) {
    const float* sw = job.scales + col * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const float zp = job.zp_kind == kPacked ? zero_point(job, col, b) : 8.0f;
      z[b * cols + (col - s0)] = -(sw[b] * zp);
    }
  }
  for (int64_t col = s0; col < s1; ++col) {
    const uint8_t* bytes = job.b + col * row_bytes;
    const float* sw = job.scales + col * blocks;
    float* y = job.y + col;
    const bool last = col >= tail;
#ifdef TJ_B32_AVX2
    if (!w.portable && m == 1 && col + 4 <= std::min(s1, tail)) {
      // one row: 4 columns at a time, unpacked in registers, the row's values loaded once
      const float* sws[4] = {sw, sw + blocks, sw + 2 * blocks, sw + 3 * blocks};
      const B32Weights<kB32Stored> ws[4] = {
          {bytes}, {bytes + row_bytes}, {bytes + 2 * row_bytes}, {bytes + 3 * row_bytes}};
      b32_row4<kB32Stored, false>(w.xs, 0, ws, sws, y);
      col += 3;
      continue;
    }
    if (!w.portable) {
      b32_values(bytes, blocks, false, values);
      using Fn = void (*)(const B32Rows&, int64_t, B32Weights<kB32Values>, const float*, bool,
                          float*, int64_t);
      static constexpr Fn kRows[5] = {nullptr, b32_main<1, kB32Values, 1>,
                                      b32_main<2, kB32Values, 1>, b32_main<3, kB32Values, 1>,
                                      b32_main<4, kB32Values, 1>};
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const int64_t rows = std::min<int64_t>(4, m - r0);
        kRows[rows](w.xs, r0, B32Weights<kB32Values>{values}, sw, last, y + r0 * job.n, job.n);
      }
      continue;
    }
#endif
    b32_values(bytes, blocks, false, values);
    for (int64_t r = 0; r < m; ++r) {
      y[r * job.n] = b32_main_portable(w.xs.q.data() + r * blocks * kB32,
                                       w.xs.scale.data() + r * blocks, values, sw, 1, blocks,
                                       last);
    }
  }
  b32_zero_term(w.xs.blksum.data(), m, blocks, z, cols, job.y + s0, job.n, w.portable);
}

// Asks for the packed weights of the 4 columns kPrefetchColumns past `col` (whose weights start
// at `bytes`), and for the next tile's scales once in a tile: the hardware's prefetchers alone
// left a one-row product at ~20 GB/s of a ~35 GB/s read rate.
static inline void b32_prefetch_ahead(const NbitsJob& job, int64_t col, const uint8_t* bytes) {
  if (col + kPrefetchColumns >= job.n) return;
  const int64_t row_bytes = job.groups * 16;
  const uint8_t* ahead = bytes + kPrefetchColumns * row_bytes;
  for (int64_t at = 0; at < 4 * row_bytes; at += 64) __builtin_prefetch(ahead + at);
  if (col % kB32Tile == kB32Tile - kPrefetchColumns) {
    const float* next = job.scales + (col / kB32Tile + 1) * job.blocks * kB32Tile;
    for (int64_t at = 0; at < job.blocks * kB32Tile; at += 16) __builtin_prefetch(next + at);
  }
}

// Weights packed (kernels.nbits_pack), scales and zero points in tiles of kB32Tile columns
// (kernels.nbits_pack_scales); s0 a multiple of kB32Tile.
static void b32_packed_slice(const B32Job& w, int64_t s0, int64_t s1, uint8_t* values) {
  const NbitsJob& job = *w.job;
  const int64_t blocks = job.blocks, row_bytes = job.groups * 16, m = job.m;
  const int64_t tail = job.n - job.n % 4;  // columns from here fold in the other order
  for (int64_t col = s0; col < s1; ++col) {
    const uint8_t* bytes = job.b + col * row_bytes;
    // block b of this column's scales at sw[b * kB32Tile]
    const float* sw = job.scales + (col / kB32Tile) * blocks * kB32Tile + col % kB32Tile;
    float* y = job.y + col;
    const bool last = col >= tail;
#ifdef TJ_B32_AVX2
    if (!w.portable && m == 1 && col % 4 == 0 && col + 4 <= std::min(s1, tail)) {
      // one row: 4 columns of a tile at a time, the row's values loaded once for the 4
      b32_prefetch_ahead(job, col, bytes);
      const float* sws[4] = {sw, nullptr, nullptr, nullptr};
      const B32Weights<kB32Packed> ws[4] = {
          {bytes}, {bytes + row_bytes}, {bytes + 2 * row_bytes}, {bytes + 3 * row_bytes}};
      b32_row4<kB32Packed, true>(w.xs, 0, ws, sws, y);
      col += 3;
      continue;
    }
#ifdef TJ_B32_512
    if (!w.portable && m >= 2 && col % 4 == 0 && col + 4 <= std::min(s1, tail)) {
      // more rows: 4 columns at a time, each unpacked once for a pass of at most 4 rows
      using Fn = void (*)(const B32Rows&, int64_t, const uint8_t*, int64_t, const float*,
                          float*, int64_t);
      static constexpr Fn kRows[5] = {nullptr, b32_tile4<1>, b32_tile4<2>, b32_tile4<3>,
                                      b32_tile4<4>};
      b32_prefetch_ahead(job, col, bytes);
      const int64_t passes = (m + 3) / 4;
      for (int64_t p = 0, r0 = 0; p < passes; ++p) {  // balanced passes
        const int64_t rows = (m - r0) / (passes - p);
        kRows[rows](w.xs, r0, bytes, row_bytes, sw, y + r0 * job.n, job.n);
        r0 += rows;
      }
      col += 3;
      continue;
    }
#endif
    if (!w.portable && m <= 4) {  // few rows: unpacked in registers
      using Fn = void (*)(const B32Rows&, int64_t, B32Weights<kB32Packed>, const float*, bool,
                          float*, int64_t);
      static constexpr Fn kRows[5] = {
          nullptr, b32_main<1, kB32Packed, kB32Tile>, b32_main<2, kB32Packed, kB32Tile>,
          b32_main<3, kB32Packed, kB32Tile>, b32_main<4, kB32Packed, kB32Tile>};
      kRows[m](w.xs, 0, B32Weights<kB32Packed>{bytes}, sw, last, y, job.n);
      continue;
    }
    if (!w.portable) {
      b32_values(bytes, blocks, true, values);
      using Fn = void (*)(const B32Rows&, int64_t, B32Weights<kB32PackedValues>, const float*,
                          bool, float*, int64_t);
      static constexpr Fn kRows[5] = {nullptr, b32_main<1, kB32PackedValues, kB32Tile>,
                                      b32_main<2, kB32PackedValues, kB32Tile>,
                                      b32_main<3, kB32PackedValues, kB32Tile>,
                                      b32_main<4, kB32PackedValues, kB32Tile>};
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const int64_t rows = std::min<int64_t>(4, m - r0);
        kRows[rows](w.xs, r0, B32Weights<kB32PackedValues>{values}, sw, last, y + r0 * job.n,
                    job.n);
      }
      continue;
    }
#endif
    b32_values_ordered(bytes, blocks, values);
    for (int64_t r = 0; r < m; ++r) {
      y[r * job.n] = b32_main_portable(w.xs.q.data() + r * blocks * kB32,
                                       w.xs.scale.data() + r * blocks, values, sw, kB32Tile,
                                       blocks, last);
    }
  }
  const uint8_t* zp = job.zp_kind == kPacked ? static_cast<const uint8_t*>(job.zp) : nullptr;
  b32_zero_tiles(w.xs.blksum.data(), m, blocks, job.scales, zp, s0, s1, job.y, job.n,
                 w.portable);
}

static void b32_chunk(void* ctx, int64_t chunk) {
  const B32Job& w = *static_cast<const B32Job*>(ctx);
  const NbitsJob& job = *w.job;
  const int64_t n0 = chunk * w.cols_per_chunk, n1 = std::min(job.n, n0 + w.cols_per_chunk);
  thread_local std::vector<uint8_t> values;
  thread_local std::vector<float> z;
  values.resize(static_cast<size_t>(job.blocks * kB32));
  if (!w.packed) z.resize(static_cast<size_t>(job.blocks * kB32Slice));
  for (int64_t s0 = n0; s0 < n1; s0 += kB32Slice) {
    const int64_t s1 = std::min(n1, s0 + kB32Slice);
    if (w.packed) {
      b32_packed_slice(w, s0, s1, values.data());
    } else {
      b32_stored_slice(w, s0, s1, values.data(), z.data());
    }
  }
}

static void direct_chunk(void* ctx, int64_t chunk) {
  const NbitsJob& job = *static_cast<const NbitsJob*>(ctx);
  const int64_t n0 = chunk * job.rows_per_chunk;
  const int64_t n1 = std::min(job.n, n0 + job.rows_per_chunk);
  for (int64_t m0 = 0; m0 < job.m; m0 += kDirectRows) {
    kDirect[std::min<int64_t>(kDirectRows, job.m - m0)](job, m0, n0, n1);
  }
}

// Y[m0:m0+R, n0:n0+C] = dot products of rows of xr and rows of the dequantized tile t.
template <int R, int C>
static void dot_micro(const float* xr, const float* t, int64_t len, float* y, int64_t ldy) {
  vf acc[R][C] = {};
  for (int64_t i = 0; i < len; i += kLanes) {
    vf a[R], w[C];
    for (int r = 0; r < R; ++r) a[r] = load(xr + r * len + i);
    for (int c = 0; c < C; ++c) w[c] = load(t + c * len + i);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] += a[r] * w[c];
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = hsum(acc[r][c]);
}

using DotMicro = void (*)(const float*, const float*, int64_t, float*, int64_t);
#define TJ_ROW(R) {dot_micro<R, 1>, dot_micro<R, 2>, dot_micro<R, 3>, dot_micro<R, 4>}
static constexpr DotMicro kDot[4][4] = {TJ_ROW(1), TJ_ROW(2), TJ_ROW(3), TJ_ROW(4)};
#undef TJ_ROW

static void tile_chunk(void* ctx, int64_t chunk) {
  const NbitsJob& job = *static_cast<const NbitsJob*>(ctx);
  const int64_t len = job.groups * kGroup;
  const int64_t n0 = chunk * kTileRows, n1 = std::min(job.n, n0 + kTileRows);
  thread_local std::vector<float> tile;
  tile.resize(static_cast<size_t>(kTileRows * len));
  for (int64_t row = n0; row < n1; ++row) {
    const uint8_t* bytes = job.b + row * job.groups * 16;
    float* t = tile.data() + (row - n0) * len;
    for (int64_t g = 0; g < job.groups; ++g) {
      vf lo, hi;
      dequant_group(bytes + g * 16, group_scale(job, row, g), &lo, &hi);
      store(t + g * kGroup, lo);
      store(t + g * kGroup + kLanes, hi);
    }
  }
  for (int64_t m0 = 0; m0 < job.m; m0 += 4) {
    const int64_t r = std::min<int64_t>(4, job.m - m0);
    for (int64_t c0 = n0; c0 < n1; c0 += 4) {
      const int64_t c = std::min<int64_t>(4, n1 - c0);
      kDot[r - 1][c - 1](job.xr + m0 * len, tile.data() + (c0 - n0) * len, len,
                         job.y + m0 * job.n + c0, job.n);
    }
  }
}

// x [M, K] -> xr [M, groups * 32]: per group of 32, even positions then odd, zero past K.
static void rearrange(const float* x, int64_t m, int64_t k, int64_t groups, float* xr) {
  const int64_t len = groups * kGroup;
  for (int64_t r = 0; r < m; ++r) {
    const float* in = x + r * k;
    float* out = xr + r * len;
    for (int64_t g = 0; g < groups; ++g) {
      for (int j = 0; j < kGroup; ++j) {
        const int64_t pos = g * kGroup + j;
        const float v = pos < k ? in[pos] : 0.0f;
        out[g * kGroup + (j & 1) * 16 + j / 2] = v;
      }
    }
  }
}

// The weights of a product and how to read them (checked by NbitsImpl).
struct NbitsWeights {
  const uint8_t* b;
  const float* scales;
  const void* zp;
  ZeroPoints kind;
  int64_t k, block_size;
  bool int8, portable, packed;
};

// y [m, n] = x [m, k] @ the weights.
static ffi::Error nbits_product(const NbitsWeights& weights, const float* xin, float* yout,
                                int64_t m, int64_t n) {
  const NbitsWeights& q = weights;
  const int64_t k = q.k, block_size = q.block_size;
  const bool int8 = q.int8, portable = q.portable, packed = q.packed;
  const ZeroPoints kind = q.kind;
  const int64_t blocks = (k + block_size - 1) / block_size;
  const int64_t padded = blocks * block_size;
  const int64_t groups = padded / kGroup;
  NbitsJob job{nullptr, q.b, q.scales, q.zp, kind, yout, m, n, groups, blocks, block_size, 0};
  Pool& pool = Pool::get();
  const int64_t target = 8 * static_cast<int64_t>(pool.threads());
  job.rows_per_chunk = std::max<int64_t>(4, (n + target - 1) / target);
  const int64_t chunks = (job.n + job.rows_per_chunk - 1) / job.rows_per_chunk;
  const bool block32 = int8 && kind != kFloat && block_size == 32;
  if (packed && !block32) {
    return ffi::Error::InvalidArgument(
        "tj_matmul_nbits: packed weights need int8, block_size 32 and integer zero points");
  }
  if (block32) {
    const int64_t cols =
        kB32Tile * std::max<int64_t>(1, (n + kB32Tile * target - 1) / (kB32Tile * target));
    B32Job w{&job, {}, portable, packed, cols};
    b32_quantize(xin, m, k, portable, &w.xs);
    const int64_t chunks32 = (n + cols - 1) / cols;
    if (packed) pool.stream(q.b, n * blocks * (block_size / 2), chunks32);  // columns in order
    pool.run(chunks32, b32_chunk, &w);
    return ffi::Error::Success();
  }
  if (int8 && kind != kFloat && block_size % 32 == 0) {
    LanesJob w{&job, {}, {}, portable, std::max<int64_t>(4, (n + target - 1) / target)};
    int8_quantize(xin, m, k, block_size, blocks, &w.xs);
    lane_sums(w.xs, m, &w.sums);
    pool.run((n + w.cols_per_chunk - 1) / w.cols_per_chunk, lanes_chunk, &w);
    return ffi::Error::Success();
  }
  if (int8) {
    Int8Job w{&job, {}, portable, 8 * ((job.rows_per_chunk + 7) / 8)};
    int8_quantize(xin, m, k, block_size, blocks, &w.xs);
    pool.run((n + w.cols_per_chunk - 1) / w.cols_per_chunk, int8_chunk, &w);
    return ffi::Error::Success();
  }
#ifdef TJ_HAVE_VNNI
  if (!portable) {
    quantize_rows(xin, m, k, padded, block_size, 3, &job.vnni);
    pool.run(chunks, vnni_chunk, &job);
    return ffi::Error::Success();
  }
#endif
  std::vector<float> xr(static_cast<size_t>(m * groups * kGroup));
  rearrange(xin, m, k, groups, xr.data());
  job.xr = xr.data();
  if (m <= kDirectRows) {
    pool.run(chunks, direct_chunk, &job);
  } else {
    pool.run((n + kTileRows - 1) / kTileRows, tile_chunk, &job);
  }
  return ffi::Error::Success();
}

// Chunks [0, split) of the first job's run, then the second's.
struct B32Pair {
  const B32Job* first;
  const B32Job* second;
  int64_t split;
};

static void b32_pair_chunk(void* ctx, int64_t chunk) {
  const B32Pair& p = *static_cast<const B32Pair*>(ctx);
  if (chunk < p.split) {
    b32_chunk(const_cast<B32Job*>(p.first), chunk);
  } else {
    b32_chunk(const_cast<B32Job*>(p.second), chunk - p.split);
  }
}

// y [m, n] = silu(x @ gate) * (x @ up) (SwiGLU's gate and up products and their gated
// activation, activation.h): the products' values are nbits_product's, the activation's
// silu_mul_range's. Packed block-32 weights share x's quantization and one run of the pool.
static ffi::Error gate_up_product(const NbitsWeights& gate, const NbitsWeights& up,
                                  const float* xin, float* yout, int64_t m, int64_t n) {
  thread_local std::vector<float> g, u;
  g.resize(static_cast<size_t>(m * n));
  u.resize(static_cast<size_t>(m * n));
  const bool shared = gate.packed && up.packed && gate.int8 && up.int8 &&
                      gate.block_size == 32 && up.block_size == 32 && gate.kind != kFloat &&
                      up.kind != kFloat && gate.k == up.k && gate.portable == up.portable;
  if (shared) {
    const int64_t blocks = (gate.k + 31) / 32, groups = blocks * 32 / kGroup;
    NbitsJob jg{nullptr, gate.b, gate.scales, gate.zp, gate.kind, g.data(), m, n, groups,
                blocks, 32, 0};
    NbitsJob ju{nullptr, up.b, up.scales, up.zp, up.kind, u.data(), m, n, groups, blocks, 32, 0};
    Pool& pool = Pool::get();
    const int64_t target = 8 * static_cast<int64_t>(pool.threads());
    const int64_t cols =
        kB32Tile * std::max<int64_t>(1, (n + kB32Tile * target - 1) / (kB32Tile * target));
    B32Job wg{&jg, {}, gate.portable, true, cols};
    b32_quantize(xin, m, gate.k, gate.portable, &wg.xs);
    B32Job wu{&ju, wg.xs, up.portable, true, cols};
    const int64_t chunks = (n + cols - 1) / cols;
    pool.stream(gate.b, n * blocks * 16, 2 * chunks);
    B32Pair pair{&wg, &wu, chunks};
    pool.run(2 * chunks, b32_pair_chunk, &pair);
  } else {
    auto error = nbits_product(gate, xin, g.data(), m, n);
    if (error.failure()) return error;
    error = nbits_product(up, xin, u.data(), m, n);
    if (error.failure()) return error;
  }
  silu_mul_range(SiluMulJob{g.data(), u.data(), yout, m * n}, 0, m * n);
  return ffi::Error::Success();
}

// The weights of a product of x [m, k] -> [m, n], checked against K, N and block_size.
static ffi::Error weights_of(int64_t k, int64_t n, ffi::Buffer<ffi::U8> b,
                             ffi::Buffer<ffi::F32> scales, ffi::AnyBuffer zp, int64_t block_size,
                             bool int8, bool portable, bool packed, NbitsWeights* out) {
  if (block_size < 16 || (block_size & (block_size - 1)) != 0) {
    return ffi::Error::InvalidArgument("tj_matmul_nbits: block_size must be a power of 2 >= 16");
  }
  const int64_t blocks = (k + block_size - 1) / block_size;
  const int64_t padded = blocks * block_size;
  ZeroPoints kind = kNone;
  if (zp.element_count() > 0) {
    kind = zp.element_type() == ffi::DataType::U8 ? kPacked : kFloat;
    // packed weights: one zero point a byte, in tiles of kB32Tile columns as the scales
    const int64_t tiled = (n + kB32Tile - 1) / kB32Tile * kB32Tile * blocks;
    const int64_t want = packed ? tiled : kind == kPacked ? n * ((blocks + 1) / 2) : n * blocks;
    if ((kind == kFloat && zp.element_type() != ffi::DataType::F32) ||
        static_cast<int64_t>(zp.element_count()) != want) {
      return ffi::Error::InvalidArgument("tj_matmul_nbits: bad zero points");
    }
  }
  if (padded % kGroup != 0 || static_cast<int64_t>(b.element_count()) != n * padded / 2 ||
      static_cast<int64_t>(scales.element_count()) !=
          (packed ? (n + kB32Tile - 1) / kB32Tile * kB32Tile : n) * blocks) {
    return ffi::Error::InvalidArgument("tj_matmul_nbits: shapes do not match K, N, block_size");
  }
  *out = NbitsWeights{b.typed_data(), scales.typed_data(), zp.untyped_data(), kind, k, block_size,
                      int8, portable, packed};
  return ffi::Error::Success();
}

// x [..., K] -> y [..., N]: m rows of K, checked.
static ffi::Error rows_of(const ffi::Buffer<ffi::F32>& x, ffi::Result<ffi::Buffer<ffi::F32>>& y,
                          int64_t* m, int64_t* k, int64_t* n) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() < 1 || yd.size() != xd.size()) {
    return ffi::Error::InvalidArgument("tj_matmul_nbits: bad ranks");
  }
  *k = xd.back(), *n = yd.back(), *m = product(xd, 0, xd.size() - 1);
  if (product(yd, 0, yd.size() - 1) != *m) {
    return ffi::Error::InvalidArgument("tj_matmul_nbits: shapes do not match K, N, block_size");
  }
  return ffi::Error::Success();
}

// `compute(a, c, r)` on the r rows of x at a into c, over the live rows where `live` is given.
template <typename Compute>
static ffi::Error over_rows(const float* x, float* y, int64_t m, int64_t k, int64_t n,
                            const ffi::Buffer<ffi::S32>* live, Compute compute) {
  if (live == nullptr) return compute(x, y, m);
  ffi::Error failed = ffi::Error::Success();
  auto rows = [&](const float* a, float* c, int64_t r) {
    auto error = compute(a, c, r);
    if (error.failure()) failed = error;
  };
  const int64_t batch = static_cast<int64_t>(live->element_count());
  if (!live_product(x, y, m, k, n, live->typed_data(), batch, rows)) {
    return ffi::Error::InvalidArgument("tj_matmul_nbits_live: the rows do not match the batch");
  }
  return failed;
}

// x [..., K] @ the weights -> y [..., N], over the live rows where `live` is given.
static ffi::Error NbitsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> b,
                            ffi::Buffer<ffi::F32> scales, ffi::AnyBuffer zp,
                            const ffi::Buffer<ffi::S32>* live, ffi::ResultBuffer<ffi::F32> y,
                            int64_t block_size, bool int8, bool portable, bool packed) {
  int64_t m, k, n;
  auto error = rows_of(x, y, &m, &k, &n);
  if (error.failure()) return error;
  NbitsWeights w;
  error = weights_of(k, n, b, scales, zp, block_size, int8, portable, packed, &w);
  if (error.failure()) return error;
  if (m == 0 || n == 0) return ffi::Error::Success();
  return over_rows(x.typed_data(), y->typed_data(), m, k, n, live,
                   [&](const float* a, float* c, int64_t r) { return nbits_product(w, a, c, r, n); });
}

// silu(x @ gate) * (x @ up) -> y [..., N] (gate_up_product), over the live rows where `live` is
// given.
static ffi::Error GateUpImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> gb,
                             ffi::Buffer<ffi::F32> gs, ffi::AnyBuffer gzp, ffi::Buffer<ffi::U8> ub,
                             ffi::Buffer<ffi::F32> us, ffi::AnyBuffer uzp,
                             const ffi::Buffer<ffi::S32>* live, ffi::ResultBuffer<ffi::F32> y,
                             int64_t block_size, bool int8, bool portable, bool packed) {
  int64_t m, k, n;
  auto error = rows_of(x, y, &m, &k, &n);
  if (error.failure()) return error;
  NbitsWeights gate, up;
  error = weights_of(k, n, gb, gs, gzp, block_size, int8, portable, packed, &gate);
  if (error.failure()) return error;
  error = weights_of(k, n, ub, us, uzp, block_size, int8, portable, packed, &up);
  if (error.failure()) return error;
  if (m == 0 || n == 0) return ffi::Error::Success();
  return over_rows(x.typed_data(), y->typed_data(), m, k, n, live,
                   [&](const float* a, float* c, int64_t r) {
                     return gate_up_product(gate, up, a, c, r, n);
                   });
}

static ffi::Error GateUpFull(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> gb,
                             ffi::Buffer<ffi::F32> gs, ffi::AnyBuffer gzp, ffi::Buffer<ffi::U8> ub,
                             ffi::Buffer<ffi::F32> us, ffi::AnyBuffer uzp,
                             ffi::ResultBuffer<ffi::F32> y, int64_t block_size, bool int8,
                             bool portable, bool packed) {
  return GateUpImpl(x, gb, gs, gzp, ub, us, uzp, nullptr, y, block_size, int8, portable, packed);
}

static ffi::Error GateUpLive(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> gb,
                             ffi::Buffer<ffi::F32> gs, ffi::AnyBuffer gzp, ffi::Buffer<ffi::U8> ub,
                             ffi::Buffer<ffi::F32> us, ffi::AnyBuffer uzp,
                             ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y,
                             int64_t block_size, bool int8, bool portable, bool packed) {
  return GateUpImpl(x, gb, gs, gzp, ub, us, uzp, &live, y, block_size, int8, portable, packed);
}

// x [..., K] @ the weights -> y [..., N].
static ffi::Error NbitsFull(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> b,
                            ffi::Buffer<ffi::F32> scales, ffi::AnyBuffer zp,
                            ffi::ResultBuffer<ffi::F32> y, int64_t block_size, bool int8,
                            bool portable, bool packed) {
  return NbitsImpl(x, b, scales, zp, nullptr, y, block_size, int8, portable, packed);
}

// The same product over the live rows of a batch (live.h): x [..., K] is B blocks of rows, one
// per batch row; live [B] nonzero where a row is live.
static ffi::Error NbitsLive(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> b,
                            ffi::Buffer<ffi::F32> scales, ffi::AnyBuffer zp,
                            ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y,
                            int64_t block_size, bool int8, bool portable, bool packed) {
  return NbitsImpl(x, b, scales, zp, &live, y, block_size, int8, portable, packed);
}

// SkipSimplifiedLayerNormalization of the product: total = x @ the weights + skip, y = its RMS
// norm (norm.h's steps: the values of the product's call and the norm's call), row by row on
// this thread once the product is done, over every row as the norm's call ran (a row the live
// product skips holds what the product's buffer held). One call where two were.
static ffi::Error SkipNormImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> b,
                               ffi::Buffer<ffi::F32> scales, ffi::AnyBuffer zp,
                               ffi::Buffer<ffi::F32> skip, ffi::Buffer<ffi::F32> gamma,
                               const ffi::Buffer<ffi::S32>* live, ffi::ResultBuffer<ffi::F32> y,
                               ffi::ResultBuffer<ffi::F32> total, int64_t block_size, bool int8,
                               bool portable, bool packed, float epsilon) {
  int64_t m, k, n;
  auto error = rows_of(x, total, &m, &k, &n);
  if (error.failure()) return error;
  if (skip.element_count() != total->element_count() ||
      y->element_count() != total->element_count() ||
      static_cast<int64_t>(gamma.element_count()) != n) {
    return ffi::Error::InvalidArgument(
        "tj_matmul_nbits_skip_norm: skip and the outputs must be [..., N], gamma [N]");
  }
  NbitsWeights w;
  error = weights_of(k, n, b, scales, zp, block_size, int8, portable, packed, &w);
  if (error.failure()) return error;
  if (m == 0 || n == 0) return ffi::Error::Success();
  float* sum = total->typed_data();
  error = over_rows(x.typed_data(), sum, m, k, n, live,
                    [&](const float* a, float* c, int64_t r) { return nbits_product(w, a, c, r, n); });
  if (error.failure()) return error;
  // in place: each sum reads its own product first
  skip_norm_rows(sum, skip.typed_data(), gamma.typed_data(), m, n, epsilon, sum, y->typed_data());
  return ffi::Error::Success();
}

static ffi::Error SkipNormFull(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> b,
                               ffi::Buffer<ffi::F32> scales, ffi::AnyBuffer zp,
                               ffi::Buffer<ffi::F32> skip, ffi::Buffer<ffi::F32> gamma,
                               ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> total,
                               int64_t block_size, bool int8, bool portable, bool packed,
                               float epsilon) {
  return SkipNormImpl(x, b, scales, zp, skip, gamma, nullptr, y, total, block_size, int8,
                      portable, packed, epsilon);
}

static ffi::Error SkipNormLive(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> b,
                               ffi::Buffer<ffi::F32> scales, ffi::AnyBuffer zp,
                               ffi::Buffer<ffi::F32> skip, ffi::Buffer<ffi::F32> gamma,
                               ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y,
                               ffi::ResultBuffer<ffi::F32> total, int64_t block_size, bool int8,
                               bool portable, bool packed, float epsilon) {
  return SkipNormImpl(x, b, scales, zp, skip, gamma, &live, y, total, block_size, int8, portable,
                      packed, epsilon);
}

}  // namespace tj

// x, then the weights: packed values, scales, zero points (or none).
#define TJ_NBITS_ARGS                        \
  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    \
      .Arg<xla::ffi::Buffer<xla::ffi::U8>>() \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>() \
      .Arg<xla::ffi::AnyBuffer>()
// The up product's weights after the gate's (TJ_NBITS_ARGS).
#define TJ_UP_ARGS                           \
  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()     \
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>() \
      .Arg<xla::ffi::AnyBuffer>()
#define TJ_NBITS_ATTRS             \
  .Attr<int64_t>("block_size")     \
      .Attr<bool>("int8")          \
      .Attr<bool>("portable")      \
      .Attr<bool>("packed")
#define TJ_LIVE_ARG .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
#define TJ_F32_RET .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
// skip and gamma; y and the sum out.
#define TJ_SKIP_NORM_ARGS \
  .Arg<xla::ffi::Buffer<xla::ffi::F32>>().Arg<xla::ffi::Buffer<xla::ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjMatMulNBits, tj::NbitsFull,
                              xla::ffi::Ffi::Bind() TJ_NBITS_ARGS TJ_F32_RET TJ_NBITS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjMatMulNBitsLive, tj::NbitsLive,
                              xla::ffi::Ffi::Bind() TJ_NBITS_ARGS TJ_LIVE_ARG TJ_F32_RET
                                  TJ_NBITS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjMatMulNBitsGateUp, tj::GateUpFull,
                              xla::ffi::Ffi::Bind() TJ_NBITS_ARGS TJ_UP_ARGS TJ_F32_RET
                                  TJ_NBITS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjMatMulNBitsGateUpLive, tj::GateUpLive,
                              xla::ffi::Ffi::Bind() TJ_NBITS_ARGS TJ_UP_ARGS TJ_LIVE_ARG
                                  TJ_F32_RET TJ_NBITS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjMatMulNBitsSkipNorm, tj::SkipNormFull,
                              xla::ffi::Ffi::Bind() TJ_NBITS_ARGS TJ_SKIP_NORM_ARGS TJ_F32_RET
                                  TJ_F32_RET TJ_NBITS_ATTRS.Attr<float>("epsilon"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjMatMulNBitsSkipNormLive, tj::SkipNormLive,
                              xla::ffi::Ffi::Bind() TJ_NBITS_ARGS TJ_SKIP_NORM_ARGS TJ_LIVE_ARG
                                  TJ_F32_RET TJ_F32_RET TJ_NBITS_ATTRS.Attr<float>("epsilon"));

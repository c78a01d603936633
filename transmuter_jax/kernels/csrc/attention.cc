// Float32 attention of a step over the valid rows of a cache and its own rows (onnxruntime's
// GroupQueryAttention): q [B, S, N, H]; k and v [B, Nk, S, H] the step's keys and values (or
// [B, S, Nk, H], tokens first: read where a projection wrote them, no transposed copy); old k
// and v [B, Nk, L, H] the cache before the step (L may be 0), past [B] its valid rows; total [B]
// the valid keys after the step -> out [B, S, N, H]. Query head n reads key head n / (N / Nk).
//
// Key u of batch row b is old row u for u < past, else the step's row u - past, at position u;
// query row i sits at position past + i. The query sees the keys u < total with u <= past + i
// when causal (and past + i - u < window with a window), every key u < total otherwise. Its
// output is sum_u p_u v_u with p = softmax(scale * q.k_u) over those keys (all zeros when there
// are none), each row computed alone in the same steps whatever the batch.
//
// Each key head of each batch row first puts its valid keys in transposed panels ([H, 16 or 32
// keys] each, contiguous: a vector of keys per load), eight keys at a time; the values are read
// where they are (the cache's rows, then the step's). A step of more than one block of query
// rows does this in a pass over the pool of its own; a shorter step (decoding) in its chunk.
// A chunk is one key head of one batch row and a block of query rows. For each head of the
// group (a step of one row: all the group's heads at once, as rows of one position): the
// scores of the block's rows against the keys they see, one panel of keys at a time for every
// group of kQ rows (the panel stays in L1 between them); the softmax of each row (exp below);
// the weighted sums of the values, kValueRows rows at once, over blocks of kValueKeys keys (a
// block's values stay in L1 across the rows; each row's sums go on from one block to the next
// in the order of the keys).
// Causal blocks late in the step see more keys: they are handed out first.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "native.h"
#include "pool.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace tj {

constexpr int64_t kQueryBlock = 16;  // query rows of a chunk
// Query rows against one pass over a panel of keys (kQ * kKeyVecs accumulators), and rows of a
// pass over a block of values (kValueRows * 4 accumulators): more with 32 registers.
constexpr int kQ = kRegisters >= 32 ? 8 : 4;
constexpr int kKeyVecs = 2;  // vectors of keys per pass
constexpr int kValueRows = kRegisters >= 32 ? 4 : 2;
constexpr int64_t kPanelKeys = kKeyVecs * kGemmLanes;  // keys of a transposed panel
constexpr int64_t kValueKeys = 64;   // keys of a block of values (64 x H floats)
constexpr int64_t kGroups = kQueryBlock / kQ;  // groups of kQ rows in a chunk

struct AttentionJob {
  const float* q;
  const float* k;
  const float* v;
  const float* old_k;  // [B, Nk, L, H], L = cached
  const float* old_v;
  const int32_t* past;
  const int32_t* total;
  float* out;
  int64_t batch, steps, heads, kv_heads, size, cached, blocks;
  float scale;
  int64_t window;
  bool causal;
  float* kt;  // [B, Nk, ldk / width, H, width] each key head's keys in transposed panels
  int64_t ldk;
  bool tokens_first;  // k and v [B, S, Nk, H], not [B, Nk, S, H]
};

// Where the step's rows of key head g of batch row b start in k and v, and the floats from one
// of them to the next.
static inline int64_t step_head(const AttentionJob& job, int64_t b, int64_t g) {
  return job.tokens_first ? (b * job.steps * job.kv_heads + g) * job.size
                          : (b * job.kv_heads + g) * job.steps * job.size;
}

static inline int64_t step_stride(const AttentionJob& job) {
  return job.tokens_first ? job.kv_heads * job.size : job.size;
}

// The valid cache rows of batch row b and its valid keys.
static inline void row_keys(const AttentionJob& job, int64_t b, int64_t* past, int64_t* total) {
  *past = job.past == nullptr ? 0 : std::clamp<int64_t>(job.past[b], 0, job.cached);
  *total = std::clamp<int64_t>(job.total[b], 0, *past + job.steps);
}

// dst[d * ldd + i] = src[i * lds + d] for i, d < 8: eight key rows into eight panel rows.
static inline void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
#if defined(__AVX__)
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // a0 b0 a1 b1 | a4 b4 a5 b5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // a2 b2 a3 b3 | a6 b6 a7 b7
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));      // column 0 | 4
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));  // 1 | 5
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));  // 2 | 6
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));  // 3 | 7
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * ldd, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * ldd, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
  }
#else
  for (int i = 0; i < 8; ++i) {
    for (int d = 0; d < 8; ++d) dst[d * ldd + i] = src[i * lds + d];
  }
#endif
}

#if defined(__AVX512F__)
// dst[d' * ldd + i] = rows[i][d + d'] for i, d' < 16: sixteen key rows (each from anywhere)
// into sixteen panel rows (half the instructions of four transpose8 calls).
static inline void transpose16(const float* const rows[16], int64_t d, float* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(rows[i] + d);
  for (int i = 0; i < 16; i += 2) {  // in each 128-bit lane L: rows i, i + 1 at 4L .. 4L + 3
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + c], lane L: rows i .. i + 3 at dimension 4L + c
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {  // dimension 4L + c: lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512 u0 = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 u1 = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 u2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 u3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
    _mm512_storeu_ps(dst + c * ldd, _mm512_shuffle_f32x4(u0, u2, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_ps(dst + (4 + c) * ldd, _mm512_shuffle_f32x4(u0, u2, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_ps(dst + (8 + c) * ldd, _mm512_shuffle_f32x4(u1, u3, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_ps(dst + (12 + c) * ldd, _mm512_shuffle_f32x4(u1, u3, _MM_SHUFFLE(3, 1, 3, 1)));
  }
}
#endif

// Key head g of batch row b (chunk b * Nk + g): its valid keys into transposed panels, zeros
// past them: on AVX-512 sixteen keys (from either source, or zeros) a block of as many
// dimensions at a time; else eight keys of one source (the cache or the step), or one.
static void gather_keys(const AttentionJob& job, int64_t chunk) {
  const int64_t b = chunk / job.kv_heads, h = job.size;
  int64_t past, total;
  row_keys(job, b, &past, &total);
  const int64_t width = kPanelKeys;
  const int64_t end = std::min(job.ldk, (total + width - 1) / width * width);
  float* kt = job.kt + chunk * h * job.ldk;
  const float* kb = job.k + step_head(job, b, chunk % job.kv_heads);  // the step's rows
  const int64_t ldb = step_stride(job);
  const float* ko = job.old_k + chunk * job.cached * h;
#if defined(__AVX512F__)
  if (h % 16 == 0 && width % 16 == 0) {
    // every 16 keys in one transpose, each row from the cache, the step or zeros past the keys
    // (a block across the two sources or past the last key took 8-key and single-key copies)
    thread_local std::vector<float> zeros;
    if (static_cast<int64_t>(zeros.size()) < h) zeros.assign(static_cast<size_t>(h), 0.0f);
    for (int64_t u = 0; u < end; u += 16) {
      const float* rows[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t v = u + i;
        rows[i] = v < past ? ko + v * h : v < total ? kb + (v - past) * ldb : zeros.data();
      }
      float* at = kt + (u / width) * h * width + u % width;
      for (int64_t d = 0; d < h; d += 16) transpose16(rows, d, at + d * width, width);
    }
    return;
  }
#endif
  if (end > total) {  // the last panel's keys past the valid ones: zeros
    float* panel = kt + (total / width) * h * width;
    for (int64_t d = 0; d < h; ++d) {
      std::fill(panel + d * width + total % width, panel + (d + 1) * width, 0.0f);
    }
  }
  const bool blocks = h % 8 == 0 && width % 8 == 0;
  for (int64_t u = 0; u < total;) {
    float* at = kt + (u / width) * h * width + u % width;
    if (blocks && u % 8 == 0 && u + 8 <= total && (u + 8 <= past || u >= past)) {
      const float* rows = u < past ? ko + u * h : kb + (u - past) * ldb;
      const int64_t lds = u < past ? h : ldb;
      for (int64_t d = 0; d < h; d += 8) transpose8(rows + d, lds, at + d * width, width);
      u += 8;
      continue;
    }
    const float* row = u < past ? ko + u * h : kb + (u - past) * ldb;
    for (int64_t d = 0; d < h; ++d) at[d * width] = row[d];
    ++u;
  }
}

static void gather_chunk(void* ctx, int64_t chunk) {
  gather_keys(*static_cast<const AttentionJob*>(ctx), chunk);
}

// The keys [lo, hi) a query at position `at` sees, of a batch row with `total` valid keys.
static inline void key_range(const AttentionJob& job, int64_t total, int64_t at, int64_t* lo,
                             int64_t* hi) {
  *hi = job.causal ? std::min(at + 1, total) : total;
  *lo = job.causal && job.window > 0 ? std::max<int64_t>(0, at - job.window + 1) : 0;
}

// scores[r][j] = scale * q_r . k_j for j in [j0, j1) (multiples of the pass's width), rows q[r]
// `ldq` apart; kt the keys in panels of kWidth keys transposed ([keys / kWidth, H, kWidth], one
// contiguous block a pass), zero past the keys.
template <int R>
static void scores_pass(const float* q, int64_t ldq, const float* kt, int64_t h, int64_t j0,
                        int64_t j1, float scale, float* scores, int64_t lds) {
  constexpr int64_t kWidth = kPanelKeys;
  for (int64_t j = j0; j < j1; j += kWidth) {
    gv acc[R][kKeyVecs] = {};
    const float* panel = kt + (j / kWidth) * h * kWidth;
    for (int64_t d = 0; d < h; ++d) {
      gv w[kKeyVecs];
      for (int c = 0; c < kKeyVecs; ++c) w[c] = gload(panel + d * kWidth + c * kGemmLanes);
      for (int r = 0; r < R; ++r) {
        const gv a = gsplat(q[r * ldq + d]);
        for (int c = 0; c < kKeyVecs; ++c) acc[r][c] += a * w[c];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < kKeyVecs; ++c) {
        gstore(scores + r * lds + j + c * kGemmLanes, acc[r][c] * gsplat(scale));
      }
    }
  }
}

// The scores of [lo, hi) of one row into their softmax (zeros elsewhere in [j0, j1)): the
// largest score, e_j = exp(s_j - top) a vector at a time, their sum (lane by lane, then the
// lanes in order), e_j / sum (each quotient rounded as onnxruntime's attention divides: gdivide).
static void softmax_row(float* row, int64_t j0, int64_t j1, int64_t lo, int64_t hi) {
  std::fill(row + j0, row + lo, 0.0f);
  std::fill(row + hi, row + j1, 0.0f);
  if (hi <= lo) return;
  float top = row[lo];
  int64_t m = lo;
  if (hi - lo >= kGemmLanes) {  // the largest a vector at a time (max is exact in any order)
    gv tops = gload(row + lo);
    for (m = lo + kGemmLanes; m + kGemmLanes <= hi; m += kGemmLanes) {
      const gv x = gload(row + m);
      tops = tops > x ? tops : x;
    }
    float lanes[kGemmLanes];
    gstore(lanes, tops);
    for (int t = 0; t < kGemmLanes; ++t) top = std::max(top, lanes[t]);
  }
  for (; m < hi; ++m) top = std::max(top, row[m]);
  const gv shift = gsplat(top);
  gv sums = {};
  int64_t j = lo;
  for (; j + kGemmLanes <= hi; j += kGemmLanes) {
    const gv e = gexp(gload(row + j) - shift);
    gstore(row + j, e);
    sums += e;
  }
  if (j < hi) {
    float tail[kGemmLanes] = {};
    std::copy(row + j, row + hi, tail);
    gv e = gexp(gload(tail) - shift);
    gstore(tail, e);
    for (int64_t t = hi - j; t < kGemmLanes; ++t) tail[t] = 0.0f;
    sums += gload(tail);
    std::copy(tail, tail + (hi - j), row + j);
  }
  float lanes[kGemmLanes];
  gstore(lanes, sums);
  float sum = 0.0f;
  for (int t = 0; t < kGemmLanes; ++t) sum += lanes[t];
  const SumDivisor total = sum_divisor(sum);
  for (j = lo; j + kGemmLanes <= hi; j += kGemmLanes) gstore(row + j, gdivide(gload(row + j), total));
  for (; j < hi; ++j) row[j] = row[j] / sum;
}

// out[r][c0 : c0 + V lanes] = sum_j p[r][j] v[j - j0][c0 : ...] over [j0, j1) (v: key j0's
// values), R rows at once, added on to out's sums unless `first`.
template <int R, int V>
static void values_pass(const float* p, int64_t lds, const float* v, int64_t ldv, int64_t j0,
                        int64_t j1, int64_t c0, float* out, int64_t ldo, bool first) {
  gv acc[R][V] = {};
  if (!first) {
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < V; ++c) acc[r][c] = gload(out + r * ldo + c0 + c * kGemmLanes);
    }
  }
  for (int64_t j = j0; j < j1; ++j) {
    gv w[V];
    for (int c = 0; c < V; ++c) w[c] = gload(v + (j - j0) * ldv + c0 + c * kGemmLanes);
    for (int r = 0; r < R; ++r) {
      const gv a = gsplat(p[r * lds + j]);
      for (int c = 0; c < V; ++c) acc[r][c] += a * w[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < V; ++c) gstore(out + r * ldo + c0 + c * kGemmLanes, acc[r][c]);
  }
}

template <int R>
static void values(const float* p, int64_t lds, const float* v, int64_t ldv, int64_t h,
                   int64_t j0, int64_t j1, float* out, int64_t ldo, bool first) {
  int64_t c0 = 0;
  for (; c0 + 4 * kGemmLanes <= h; c0 += 4 * kGemmLanes) {
    values_pass<R, 4>(p, lds, v, ldv, j0, j1, c0, out, ldo, first);
  }
  for (; c0 < h; c0 += kGemmLanes) values_pass<R, 1>(p, lds, v, ldv, j0, j1, c0, out, ldo, first);
}

// The scores of `rows` (1 to R) query rows against the keys [j0, j1) (whole panels).
template <int R>
static void scores_rows(int rows, const float* q, int64_t ldq, const float* kt, int64_t h,
                        int64_t j0, int64_t j1, float scale, float* scores, int64_t lds) {
  if constexpr (R > 1) {
    if (rows < R) return scores_rows<R - 1>(rows, q, ldq, kt, h, j0, j1, scale, scores, lds);
  }
  scores_pass<R>(q, ldq, kt, h, j0, j1, scale, scores, lds);
}

// The weighted sums of `rows` (1 to R) rows over the keys [j0, j1) (see values_pass).
template <int R>
static void values_rows(int rows, const float* p, int64_t lds, const float* v, int64_t ldv,
                        int64_t h, int64_t j0, int64_t j1, float* out, int64_t ldo, bool first) {
  if constexpr (R > 1) {
    if (rows < R) return values_rows<R - 1>(rows, p, lds, v, ldv, h, j0, j1, out, ldo, first);
  }
  values<R>(p, lds, v, ldv, h, j0, j1, out, ldo, first);
}

// A group of kQ query rows of a chunk: its rows, their keys [lo, hi), the keys any of them sees
// [j0, j1) and the panels over those [p0, p1).
struct RowGroup {
  int rows;
  int64_t lo[kQ], hi[kQ], j0, j1, p0, p1;
};

// One key head's keys (kt, in panels) and values (the cache's rows, then the step's from `past`).
struct KeyHead {
  const float* kt;
  const float* old_values;
  const float* new_values;
  int64_t new_ldv;  // floats from one of the step's values to the next
  int64_t past, total;
};

// `count` (at most kQueryBlock) query rows q[r * ld], row r at position at + r * step, against
// one key head: out[r * ld].
static void attend(const AttentionJob& job, const KeyHead& kh, const float* q, float* out,
                   int64_t ld, int64_t count, int64_t at, int64_t step) {
  const int64_t width = kPanelKeys, ldk = job.ldk, h = job.size;
  thread_local std::vector<float> scores;
  scores.resize(static_cast<size_t>(kQueryBlock * ldk));
  RowGroup groups[kGroups];
  int64_t n = 0, first = ldk, last = 0;  // groups; panels any of them reads
  for (int64_t i = 0; i < count; i += kQ, ++n) {
    RowGroup& rg = groups[n];
    rg.rows = static_cast<int>(std::min<int64_t>(kQ, count - i));
    rg.j0 = ldk, rg.j1 = 0;
    for (int r = 0; r < rg.rows; ++r) {
      key_range(job, kh.total, at + (i + r) * step, &rg.lo[r], &rg.hi[r]);
      if (rg.hi[r] > rg.lo[r]) rg.j0 = std::min(rg.j0, rg.lo[r]), rg.j1 = std::max(rg.j1, rg.hi[r]);
    }
    rg.p0 = rg.j0 / width * width, rg.p1 = (rg.j1 + width - 1) / width * width;
    if (rg.j1 > rg.j0) first = std::min(first, rg.p0), last = std::max(last, rg.p1);
  }
  for (int64_t j = first; j < last; j += width) {
    for (int64_t x = 0; x < n; ++x) {
      const RowGroup& rg = groups[x];
      if (rg.j1 <= rg.j0 || j < rg.p0 || j >= rg.p1) continue;
      scores_rows<kQ>(rg.rows, q + x * kQ * ld, ld, kh.kt, h, j, j + width, job.scale,
                      scores.data() + x * kQ * ldk, ldk);
    }
  }
  for (int64_t x = 0; x < n; ++x) {
    const RowGroup& rg = groups[x];
    float* sc = scores.data() + x * kQ * ldk;
    if (rg.j1 <= rg.j0) {
      for (int r = 0; r < rg.rows; ++r) {
        std::fill(out + (x * kQ + r) * ld, out + (x * kQ + r) * ld + h, 0.0f);
      }
      continue;
    }
    for (int r = 0; r < rg.rows; ++r) softmax_row(sc + r * ldk, rg.p0, rg.p1, rg.lo[r], rg.hi[r]);
  }
  for (int64_t k0 = first; k0 < last; k0 += kValueKeys) {
    for (int64_t x = 0; x < n; ++x) {
      const RowGroup& rg = groups[x];
      const int64_t lo = std::max(rg.j0, k0), hi = std::min(rg.j1, k0 + kValueKeys);
      if (hi <= lo) continue;
      const float* sc = scores.data() + x * kQ * ldk;
      float* o = out + x * kQ * ld;
      const bool starts = lo == rg.j0;
      const int64_t split = std::clamp(kh.past, lo, hi);  // [lo, split) cached, then the step's
      for (int r = 0; r < rg.rows; r += kValueRows) {
        const int rows = std::min(kValueRows, rg.rows - r);
        if (split > lo) {
          values_rows<kValueRows>(rows, sc + r * ldk, ldk, kh.old_values + lo * h, h, h, lo, split,
                                  o + r * ld, ld, starts);
        }
        if (hi > split) {
          values_rows<kValueRows>(rows, sc + r * ldk, ldk,
                                  kh.new_values + (split - kh.past) * kh.new_ldv, kh.new_ldv, h,
                                  split, hi, o + r * ld, ld, starts && split == lo);
        }
      }
    }
  }
}

static void attention_chunk(void* ctx, int64_t chunk) {
  const AttentionJob& job = *static_cast<const AttentionJob*>(ctx);
  const int64_t block = job.blocks - 1 - chunk % job.blocks;  // the costliest first
  const int64_t g = (chunk / job.blocks) % job.kv_heads, b = chunk / job.blocks / job.kv_heads;
  const int64_t s = job.steps, h = job.size, group = job.heads / job.kv_heads;
  const int64_t head = b * job.kv_heads + g;
  if (job.blocks == 1) gather_keys(job, head);  // its own key head's panels
  KeyHead kh{job.kt + head * h * job.ldk, job.old_v + head * job.cached * h,
             job.v + step_head(job, b, g), step_stride(job), 0, 0};
  row_keys(job, b, &kh.past, &kh.total);
  if (s == 1) {  // decoding: the group's heads are the rows (one position), each panel read once
    for (int64_t n0 = g * group; n0 < (g + 1) * group; n0 += kQueryBlock) {
      const int64_t at = (b * job.heads + n0) * h;
      attend(job, kh, job.q + at, job.out + at, h, std::min(kQueryBlock, (g + 1) * group - n0),
             kh.past, 0);
    }
    return;
  }
  const int64_t r0 = block * kQueryBlock, r1 = std::min(s, r0 + kQueryBlock);
  for (int64_t n = g * group; n < (g + 1) * group; ++n) {  // rows of one head, N * H apart
    const int64_t at = ((b * s + r0) * job.heads + n) * h;
    attend(job, kh, job.q + at, job.out + at, job.heads * h, r1 - r0, kh.past + r0, 1);
  }
}

// out = the attention of q over old and new keys and values (the layout of AttentionImpl's
// arguments; past null: no old row), on the pool.
static void run_attention(const float* q, const float* k, const float* v, const float* old_k,
                          const float* old_v, const int32_t* past, const int32_t* total,
                          float* out, int64_t b, int64_t s, int64_t n, int64_t nk, int64_t h,
                          int64_t cached, float scale, int64_t window, bool causal,
                          bool tokens_first) {
  const int64_t blocks = (s + kQueryBlock - 1) / kQueryBlock;
  AttentionJob job{q,     k,      v,      old_k, old_v,  past,    total, out,
                   b,     s,      n,      nk,    h,      cached,  blocks, scale,
                   window, causal, nullptr, 0,   tokens_first};
  int64_t most = 0;  // the most keys of a batch row
  for (int64_t i = 0; i < b; ++i) {
    int64_t rows, keys;
    row_keys(job, i, &rows, &keys);
    most = std::max(most, keys);
  }
  const int64_t width = kPanelKeys;
  job.ldk = std::max<int64_t>(width, (most + width - 1) / width * width);
  // This thread's calls' panels, kept between calls, given back when four times too large.
  thread_local std::vector<float> kt;
  const size_t need = static_cast<size_t>(b * nk * h * job.ldk);
  if (kt.capacity() > 4 * need && kt.capacity() > (size_t{1} << 22)) std::vector<float>().swap(kt);
  kt.resize(need);
  job.kt = kt.data();
  Pool& pool = Pool::get();
  if (blocks > 1) pool.run(b * nk, gather_chunk, &job);  // else each chunk gathers its own
  pool.run(b * nk * blocks, attention_chunk, &job);
}

static ffi::Error AttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> total,
                                ffi::Buffer<ffi::F32> old_k, ffi::Buffer<ffi::F32> old_v,
                                ffi::Buffer<ffi::S32> past, ffi::ResultBuffer<ffi::F32> out,
                                float scale, int64_t window, bool causal, bool tokens_first) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), od = out->dimensions();
  auto ok = old_k.dimensions(), ov = old_v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || od.size() != 4 || ok.size() != 4 ||
      ov.size() != 4) {
    return ffi::Error::InvalidArgument("tj_attention_f32: q, k, v, the cache and out: rank 4");
  }
  const int64_t b = qd[0], s = qd[1], n = qd[2], h = qd[3], cached = ok[2];
  const int64_t nk = kd[tokens_first ? 2 : 1], ks = kd[tokens_first ? 1 : 2];
  bool same = true;
  for (size_t i = 0; i < 4; ++i) same = same && kd[i] == vd[i] && qd[i] == od[i] && ok[i] == ov[i];
  if (!same || kd[0] != b || ks != s || kd[3] != h || nk < 1 || n % nk != 0 ||
      ok[0] != b || ok[1] != nk || ok[3] != h || h % kGemmLanes != 0 ||
      static_cast<int64_t>(total.element_count()) != b ||
      static_cast<int64_t>(past.element_count()) != b) {
    return ffi::Error::InvalidArgument("tj_attention_f32: shapes do not match");
  }
  if (b == 0 || s == 0 || n == 0 || h == 0) return ffi::Error::Success();
  run_attention(q.typed_data(), k.typed_data(), v.typed_data(), old_k.typed_data(),
                old_v.typed_data(), cached > 0 ? past.typed_data() : nullptr, total.typed_data(),
                out->typed_data(), b, s, n, nk, h, cached, scale, window, causal, tokens_first);
  return ffi::Error::Success();
}

// Features [0, 2 * half) of a head of h at one position rotated by its angles (c, s: `half`
// each; null: a position outside the tables, NaN as jnp.take gives there), the rest copied:
// pairs (i, i + half), or (2i, 2i + 1) when interleaved, a' = fma(a, c, -(b * s)) and
// b' = fma(b, c, a * s): the steps XLA's fusion of attention_core.rotate takes.
static void rotate_head(const float* x, float* y, int64_t h, int64_t half, const float* c,
                        const float* s, bool interleaved) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
    const float ci = c != nullptr ? c[i] : nan, si = s != nullptr ? s[i] : nan;
    const float a = x[ia], b = x[ib];
    y[ia] = std::fma(a, ci, -(b * si));
    y[ib] = std::fma(b, ci, a * si);
  }
  std::copy(x + 2 * half, x + h, y + 2 * half);
}

// One step of onnxruntime's GroupQueryAttention over a cache buffer, in one call: qkv
// [B, S, N + 2 Nk, H] the packed projections; the first N heads (queries) and the next Nk
// (keys) rotated at positions rot [B, S] by the tables cos, sin [P, half] (half = 0: none);
// out = the attention of AttentionImpl over the buffer's rows before the step (old k, v
// [B, Nk, L, H], past [B] valid) and the step's rows; then the step's keys and values are
// written into the buffer (present k, v: the same buffers, aliased) at rows
// clamp(past[b], 0, L - S), as dynamic_update_slice writes them.
static ffi::Error GqaStepImpl(ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> cos,
                              ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::S32> rot,
                              ffi::Buffer<ffi::S32> total, ffi::Buffer<ffi::F32> old_k,
                              ffi::Buffer<ffi::F32> old_v, ffi::Buffer<ffi::S32> past,
                              ffi::ResultBuffer<ffi::F32> out,
                              ffi::ResultBuffer<ffi::F32> present_k,
                              ffi::ResultBuffer<ffi::F32> present_v, float scale, int64_t window,
                              bool causal, bool interleaved, int64_t heads) {
  auto xd = qkv.dimensions(), cd = cos.dimensions(), od = out->dimensions();
  auto ok = old_k.dimensions();
  if (xd.size() != 4 || cd.size() != 2 || od.size() != 4 || ok.size() != 4 ||
      sin.dimensions().size() != 2 || old_v.dimensions().size() != 4 ||
      present_k->dimensions().size() != 4 || present_v->dimensions().size() != 4) {
    return ffi::Error::InvalidArgument("tj_gqa_step_f32: bad ranks");
  }
  const int64_t b = xd[0], s = xd[1], h = xd[3], n = heads, nk = ok[1], cached = ok[2];
  const int64_t positions = cd[0], half = cd[1];
  bool same = sin.dimensions()[0] == positions && sin.dimensions()[1] == half;
  for (size_t i = 0; i < 4; ++i) {
    same = same && old_v.dimensions()[i] == ok[i] && present_k->dimensions()[i] == ok[i] &&
           present_v->dimensions()[i] == ok[i];
  }
  if (!same || n < 1 || nk < 1 || n % nk != 0 || xd[2] != n + 2 * nk || ok[0] != b ||
      ok[3] != h || od[0] != b || od[1] != s || od[2] != n || od[3] != h || cached < s ||
      2 * half > h || h % kGemmLanes != 0 ||
      static_cast<int64_t>(rot.element_count()) != b * s ||
      static_cast<int64_t>(total.element_count()) != b ||
      static_cast<int64_t>(past.element_count()) != b) {
    return ffi::Error::InvalidArgument("tj_gqa_step_f32: shapes do not match");
  }
  const size_t buffer = static_cast<size_t>(b * nk * cached * h);
  if (present_k->typed_data() != old_k.typed_data()) {  // not aliased: start from the old rows
    std::copy(old_k.typed_data(), old_k.typed_data() + buffer, present_k->typed_data());
  }
  if (present_v->typed_data() != old_v.typed_data()) {
    std::copy(old_v.typed_data(), old_v.typed_data() + buffer, present_v->typed_data());
  }
  if (b == 0 || s == 0 || h == 0) return ffi::Error::Success();
  // The step's rows: queries [B, S, N, H], keys and values [B, Nk, S, H].
  thread_local std::vector<float> rows;
  const int64_t qn = b * s * n * h, kn = b * nk * s * h;
  rows.resize(static_cast<size_t>(qn + 2 * kn));
  float* q = rows.data();
  float* k = q + qn;
  float* v = k + kn;
  const float* x = qkv.typed_data();
  const float* cs = cos.typed_data();
  const float* sn = sin.typed_data();
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t t = 0; t < s; ++t) {
      int64_t p = rot.typed_data()[i * s + t];
      if (p < 0) p += positions;  // as jnp.take: negative positions count from the end
      const bool inside = p >= 0 && p < positions;
      const float* c = inside ? cs + p * half : nullptr;
      const float* si = inside ? sn + p * half : nullptr;
      const float* row = x + (i * s + t) * (n + 2 * nk) * h;
      for (int64_t j = 0; j < n; ++j) {
        rotate_head(row + j * h, q + ((i * s + t) * n + j) * h, h, half, c, si, interleaved);
      }
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t at = ((i * nk + j) * s + t) * h;
        rotate_head(row + (n + j) * h, k + at, h, half, c, si, interleaved);
        std::copy(row + (n + nk + j) * h, row + (n + nk + j + 1) * h, v + at);
      }
    }
  }
  // The attention reads the old rows where they were before the write (aliased: the same).
  run_attention(q, k, v, old_k.typed_data(), old_v.typed_data(), past.typed_data(),
                total.typed_data(), out->typed_data(), b, s, n, nk, h, cached, scale, window,
                causal, false);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t w = std::clamp<int64_t>(past.typed_data()[i], 0, cached - s);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t from = (i * nk + j) * s * h, to = ((i * nk + j) * cached + w) * h;
      std::copy(k + from, k + from + s * h, present_k->typed_data() + to);
      std::copy(v + from, v + from + s * h, present_v->typed_data() + to);
    }
  }
  return ffi::Error::Success();
}

}  // namespace tj

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjAttentionF32, tj::AttentionImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<bool>("causal")
                                  .Attr<bool>("tokens_first"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjGqaStepF32, tj::GqaStepImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<bool>("causal")
                                  .Attr<bool>("interleaved")
                                  .Attr<int64_t>("heads"));

extern "C" int tj_vector_lanes() { return tj::kGemmLanes; }

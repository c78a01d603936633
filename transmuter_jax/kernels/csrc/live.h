// A product over the live rows of a batch: the live blocks computed together, the others copies.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace tj {

// x [m, k] is `batch` blocks of m / batch rows (block b the rows of batch row b); live[b] nonzero
// where batch row b is live. Calls product(x', y', rows) once, over the live blocks' rows in
// order (x' [rows, k] -> y' [rows, n]: the weights read once for them all), and writes their
// rows of y [m, n]; each other block of y becomes a copy of the first live one (rows that nothing
// reads, kept finite), or, with none live, of block 0 computed. False when m is not a multiple
// of batch (nothing written).
template <typename Product>
bool live_product(const float* x, float* y, int64_t m, int64_t k, int64_t n, const int32_t* live,
                  int64_t batch, Product product) {
  if (batch < 1 || m % batch != 0) return false;
  const int64_t per = m / batch;  // rows of one block
  std::vector<int64_t> blocks;
  for (int64_t b = 0; b < batch; ++b) {
    if (live[b] != 0) blocks.push_back(b);
  }
  if (blocks.empty()) blocks.push_back(0);
  const int64_t count = static_cast<int64_t>(blocks.size());
  bool leading = true;  // the live blocks are the first ones: computed in place
  for (int64_t i = 0; i < count; ++i) leading = leading && blocks[i] == i;
  if (leading) {
    product(x, y, count * per);
  } else {
    thread_local std::vector<float> xs, ys;
    xs.resize(static_cast<size_t>(count * per * k));
    ys.resize(static_cast<size_t>(count * per * n));
    for (int64_t i = 0; i < count; ++i) {
      std::copy(x + blocks[i] * per * k, x + (blocks[i] + 1) * per * k, xs.data() + i * per * k);
    }
    product(xs.data(), ys.data(), count * per);
    for (int64_t i = 0; i < count; ++i) {
      std::copy(ys.data() + i * per * n, ys.data() + (i + 1) * per * n, y + blocks[i] * per * n);
    }
  }
  const float* first = y + blocks[0] * per * n;
  for (int64_t b = 0, i = 0; b < batch; ++b) {
    if (i < count && blocks[i] == b) {
      ++i;
    } else {
      std::copy(first, first + per * n, y + b * per * n);
    }
  }
  return true;
}

}  // namespace tj

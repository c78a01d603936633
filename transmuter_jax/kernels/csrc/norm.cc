// RMS norms with onnxruntime's CPU float steps, strictly per row (y = x / rms * gamma):
//
// mode 0 (SimplifiedLayerNormalization, rows of a multiple of 8; onnxruntime's tail differs):
//   8 partial sums, s[i % 8] = fma(x_i, x_i, s[i % 8]) over the row in order, then
//   ((s0 + s4) + (s2 + s6)) +
//   ((s1 + s5) + (s3 + s7)); rms = sqrt(sum / K + epsilon); y = (x * (1 / rms)) * gamma.
// mode 1 (SkipSimplifiedLayerNormalization): sum = ((x_0 * x_0) + x_1 * x_1) + ... in order,
//   each square rounded first; rms = sqrt(sum / K + epsilon); y = (x / rms) * gamma.
// tj_skip_rms_norm: mode 1 of x = input + skip (each element one float add), which it returns
//   too (the residual stream): one call where an add and the norm were two.
//
// Int8 products amplify one ulp of their input into a quantization step (see docs/kernels.md),
// so a norm that rounds as onnxruntime's keeps the int4 models' logits close to its own.
#include <cmath>
#include <cstdint>

#include "common.h"
#include "norm.h"

namespace tj {

static ffi::Error RmsNormImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> gamma,
                              ffi::ResultBuffer<ffi::F32> y, float epsilon, int64_t mode) {
  auto dims = x.dimensions();
  if (dims.size() < 1 || (mode != 0 && mode != 1)) {
    return ffi::Error::InvalidArgument("tj_rms_norm: bad rank or mode");
  }
  const int64_t k = dims.back(), rows = product(dims, 0, dims.size() - 1);
  if (static_cast<int64_t>(gamma.element_count()) != k) {
    return ffi::Error::InvalidArgument("tj_rms_norm: gamma must have K elements");
  }
  const float* in = x.typed_data();
  float* out = y->typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    norm_row(in + r * k, gamma.typed_data(), k, epsilon, mode, out + r * k);
  }
  return ffi::Error::Success();
}

static ffi::Error SkipRmsNormImpl(ffi::Buffer<ffi::F32> input, ffi::Buffer<ffi::F32> skip,
                                  ffi::Buffer<ffi::F32> gamma, ffi::ResultBuffer<ffi::F32> y,
                                  ffi::ResultBuffer<ffi::F32> total, float epsilon) {
  auto dims = input.dimensions();
  if (dims.size() < 1 || skip.element_count() != input.element_count()) {
    return ffi::Error::InvalidArgument("tj_skip_rms_norm: input and skip must match");
  }
  const int64_t k = dims.back(), rows = product(dims, 0, dims.size() - 1);
  if (static_cast<int64_t>(gamma.element_count()) != k) {
    return ffi::Error::InvalidArgument("tj_skip_rms_norm: gamma must have K elements");
  }
  const float* a = input.typed_data();
  const float* b = skip.typed_data();
  float* sum = total->typed_data();
  skip_norm_rows(a, b, gamma.typed_data(), rows, k, epsilon, sum, y->typed_data());
  return ffi::Error::Success();
}

}  // namespace tj

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjRmsNorm, tj::RmsNormImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("epsilon")
                                  .Attr<int64_t>("mode"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjSkipRmsNorm, tj::SkipRmsNormImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("epsilon"));

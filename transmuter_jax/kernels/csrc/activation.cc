// The gated activation of a SwiGLU feed-forward, elementwise in float32:
// out = (g * sigmoid(g)) * u, sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, with
// e = exp(-|g|) (native.h's gexp: within 2 ulp). Every element takes the same vector steps (the
// last ones in a padded vector), so a row's result never depends on the others; large arrays
// are cut into chunks for the pool.
#include <algorithm>
#include <cstdint>

#include "activation.h"
#include "common.h"

namespace tj {

static ffi::Error SiluMulImpl(ffi::Buffer<ffi::F32> gate, ffi::Buffer<ffi::F32> up,
                              ffi::ResultBuffer<ffi::F32> out) {
  const int64_t size = static_cast<int64_t>(gate.element_count());
  if (static_cast<int64_t>(up.element_count()) != size) {
    return ffi::Error::InvalidArgument("tj_silu_mul_f32: gate and up must have one shape");
  }
  silu_mul_all(SiluMulJob{gate.typed_data(), up.typed_data(), out->typed_data(), size});
  return ffi::Error::Success();
}

}  // namespace tj

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjSiluMulF32, tj::SiluMulImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

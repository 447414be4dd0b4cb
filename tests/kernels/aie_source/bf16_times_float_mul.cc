// Must be rejected by the AIE-path source check: aie::mul of a bf16 vector by an fp32 vector, the call gemv.cc's
// rmsnorm_bf16 made before it was fixed. aie_api's is_valid_mul_op allows bf16 x bf16 and fp32 x fp32, not the mix.
// With -DSCALE_IN_BF16=1 the factor is bf16 and the same kernel must be accepted: the mix alone is what fails.
#include <aie_api/aie.hpp>

#if SCALE_IN_BF16
using Scale = bfloat16;
#else
using Scale = float;
#endif

extern "C" void scale_bf16(const bfloat16 *x, Scale scale, bfloat16 *out) {
  const aie::vector<Scale, 16> factor = aie::broadcast<Scale, 16>(scale);
  const aie::accum<accfloat, 16> product = aie::mul(aie::load_v<16>(x), factor);
  aie::store_v(out, product.to_vector<bfloat16>());
}

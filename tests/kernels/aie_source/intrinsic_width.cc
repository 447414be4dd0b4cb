// An intrinsic the check declares precisely (kernels/aie_source_check.py PRECISE_INTRINSICS): to_v16bfloat16 takes a
// v16accfloat. With -DACC_LANES=16 this is accepted; with -DACC_LANES=32 it must be rejected.
#include <aie_api/aie.hpp>

extern "C" void round_to_bf16(const float *in, bfloat16 *out) {
  const aie::accum<accfloat, ACC_LANES> acc(aie::load_v<ACC_LANES>(in));
  const v16bfloat16 rounded = ::to_v16bfloat16(acc);
  aie::store_v(out, aie::vector<bfloat16, 16>(rounded));
}

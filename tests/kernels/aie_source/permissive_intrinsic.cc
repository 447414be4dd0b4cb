// What the check cannot see: an intrinsic declared permissively (kernels/aie2p_check/aie2p_permissive.h) accepts any
// arguments. mac_elem_32 multiplies two v32bfloat16 into a v32accfloat; this call passes it nonsense and is accepted.
#include <aie_api/aie.hpp>

extern "C" void nonsense(float *out) {
  const v32accfloat acc = ::mac_elem_32(1.5f, out, "not a vector");
  aie::store_v(out, aie::accum<accfloat, 32>(acc).to_vector<float>());
}

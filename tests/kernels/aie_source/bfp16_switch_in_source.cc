// bfp16_switch.cc with the switch defined in the source, before aie_api is included: the check must parse aie_api
// after it (not reuse one parsed without it).
#define AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16 1
#include "bfp16_switch.cc"

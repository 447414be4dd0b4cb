// Holds only if aie_api itself was parsed with AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16: with it, aie_api builds the
// bf16 4x8x8 mmul from BFP16 blocks (a C_block_larger_internal); without it, natively (a C_block). The check must
// hand aie_api the -D macros it reads (gemm.cc's precision switch is one).
#include <aie_api/aie.hpp>
#include <type_traits>

static_assert(std::is_base_of_v<aie::detail::C_block_larger_internal<bfloat16, bfloat16, 32, 32, 2>,
                                aie::detail::mmul_bf16_bf16<4, 8, 8, bfloat16, bfloat16, 32>>,
              "aie_api was parsed without AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16");

"""What runs on the NPU: Programs (declarative fused ops) and, for the NPU target, their MLIR and compile pipeline."""
from .program import Arg, Launch, Program, Role
from .programs import (DEFAULT_MATMUL_PRECISION, MATMUL_PRECISIONS, ModelDims, flash_attn, lm_head_gemv, o_ffn, o_gemv_ffn, programs_for_model, rms_gemms_rope,
                       rms_gemv_rope)

__all__ = ["Arg", "Launch", "Program", "Role", "ModelDims", "rms_gemms_rope", "flash_attn", "o_ffn", "rms_gemv_rope",
           "o_gemv_ffn", "lm_head_gemv", "programs_for_model", "MATMUL_PRECISIONS", "DEFAULT_MATMUL_PRECISION"]

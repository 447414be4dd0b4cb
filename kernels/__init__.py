"""What runs on the NPU: Programs (declarative fused ops) and, for the NPU target, their MLIR and compile pipeline.

``program.py`` holds the declaration types (Program, Arg, Launch, Role); ``catalog.py`` the factory of each
fused op's Program (``<op>_program``) and ``programs_for_model``.
"""
from .catalog import (DEFAULT_MATMUL_PRECISION, MATMUL_PRECISIONS, ModelDims, flash_attn_program, lm_head_gemv_program,
                      o_ffn_program, o_gemv_ffn_program, o_gemv_ffn_rms_gemv_rope_program, programs_for_model,
                      rms_gemms_rope_program, rms_gemv_rope_program)
from .program import Arg, Launch, Program, Role

__all__ = ["Arg", "Launch", "Program", "Role", "ModelDims", "rms_gemms_rope_program", "flash_attn_program",
           "o_ffn_program", "rms_gemv_rope_program", "o_gemv_ffn_program",
           "o_gemv_ffn_rms_gemv_rope_program", "lm_head_gemv_program",
           "programs_for_model", "MATMUL_PRECISIONS", "DEFAULT_MATMUL_PRECISION"]

"""The torch.library boundary: ``torch.ops.npu2.*`` fused ops (registered on import), the RoPE LUT they take,
and their plain-PyTorch references (``reference.<op>_reference``)."""
from . import reference
from .buffers import device_empty, device_only_empty, device_written
from .fused import (ALL_OPS, decode_attn, decode_attn_length, decode_attn_o_gemv_ffn, decode_attn_o_gemv_ffn_packed,
                    decode_attn_o_gemv_ffn_rms_gemv_rope, dequantize_rows,
                    decode_attn_o_gemv_ffn_rms_gemv_rope_packed, flash_attn,
                    lm_head_gemv, lm_head_gemv_packed, o_ffn, o_gemv_ffn, o_gemv_ffn_packed, o_gemv_ffn_rms_gemv_rope,
                    o_gemv_ffn_rms_gemv_rope_packed, o_ffn_w8x2, rms_gemms_rope, rms_gemms_rope_w8x2, rms_gemv_rope,
                    rms_gemv_rope_packed, INTO, QKV_BIASED)
from .rope import build_rope_lut

__all__ = ["reference", "device_empty", "device_only_empty", "device_written", "ALL_OPS", "rms_gemms_rope", "flash_attn", "o_ffn", "rms_gemv_rope",
           "o_gemv_ffn", "o_gemv_ffn_rms_gemv_rope", "decode_attn", "decode_attn_length", "decode_attn_o_gemv_ffn",
           "decode_attn_o_gemv_ffn_packed",
           "decode_attn_o_gemv_ffn_rms_gemv_rope", "decode_attn_o_gemv_ffn_rms_gemv_rope_packed", "lm_head_gemv", "rms_gemv_rope_packed", "o_gemv_ffn_packed",
           "o_gemv_ffn_rms_gemv_rope_packed", "lm_head_gemv_packed", "rms_gemms_rope_w8x2", "o_ffn_w8x2",
           "dequantize_rows", "build_rope_lut", "INTO", "QKV_BIASED"]

"""What each launch kind computes on the emulated NPU2, with the NPU's numerics.

Inputs arrive as tensors viewing device memory (bf16); arithmetic inside a launch is fp32 (matmuls
accumulate in fp32 and round once); the result is rounded to its buffer's dtype when written back —
bf16 for every buffer between launches, fp32 only for the LM head's logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm(p, x, weight):
    h = x.reshape(p["rows"], p["cols"]).float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + p["eps"])
    return h * weight.float()


def matmul(p, a, w):
    # torch's bf16 CPU matmul accumulates in fp32 and rounds once: the AIE2P bf16 GEMM contract.
    return F.linear(a.reshape(-1, p["K"]), w.reshape(p["N"], p["K"]))


def rope(p, x, lut):
    rows, heads, hd = p["rows"], p["heads"], p["head_dim"]
    half = hd // 2
    xh = x.reshape(rows, heads, hd).float()
    table = lut.reshape(rows, 1, hd).float()
    cos, sin = table[..., :half], table[..., half:]
    lo, hi = xh[..., :half], xh[..., half:]
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), -1)


def silu_mul(p, gate, up):
    return F.silu(gate.float()) * up.float()


def add(p, a, b):
    return a.float() + b.float()


def attention(p, q, k, v):
    seq, heads, kv_heads, hd = p["seq"], p["heads"], p["kv_heads"], p["head_dim"]
    qh = q.reshape(seq, heads, hd).transpose(0, 1).float()
    kh = k.reshape(seq, kv_heads, hd).transpose(0, 1).float()
    vh = v.reshape(seq, kv_heads, hd).transpose(0, 1).float()
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=p["causal"], enable_gqa=heads != kv_heads)
    return out.transpose(0, 1)


def partitioned_gemv(p, x, w):
    # Accumulate in fp32 and keep fp32: the LM head's output buffer is fp32 (see lm_head_gemv).
    rows = p["N"] // p["partitions"]
    weight = w.reshape(p["partitions"], rows, p["K"])
    return torch.cat([torch.mv(weight[i].float(), x.float()) for i in range(p["partitions"])])


LAUNCH_KINDS = {
    "rmsnorm": rmsnorm,
    "gemm": matmul,
    "gemv": matmul,
    "rope": rope,
    "silu_mul": silu_mul,
    "add": add,
    "attention": attention,
    "partitioned_gemv": partitioned_gemv,
}

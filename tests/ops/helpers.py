"""Random op arguments at given model dims, shared by the op tests."""
import torch

from torch_npu2.ops import build_rope_lut

# name: (hidden, heads, kv_heads, head_dim, intermediate, vocab, seq)
CONFIGS = {
    "smollm2_135m": (576, 9, 3, 64, 1536, 49152, 12),
    "llama32_1b": (2048, 32, 8, 64, 8192, 128256, 4),
    "odd": (96, 6, 2, 16, 200, 1000, 7),
}
EPS = 1e-5


def bf16(*shape, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


def rope_lut(rows, head_dim, gen=None):
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 6.0
    return build_rope_lut(torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)).bfloat16()


def qkv_args(hidden, heads, kv_heads, head_dim, seq, decode=False, gen=None):
    rows = () if decode else (seq,)
    w = hidden ** -0.5
    return [
        bf16(*rows, hidden, gen=gen),
        (1.0 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16(),
        bf16(heads * head_dim, hidden, scale=w, gen=gen),
        bf16(kv_heads * head_dim, hidden, scale=w, gen=gen),
        bf16(kv_heads * head_dim, hidden, scale=w, gen=gen),
        rope_lut(1, head_dim, gen=gen)[0] if decode else rope_lut(seq, head_dim, gen=gen),
    ]


def decode_qkv_args(hidden, heads, kv_heads, head_dim, gen=None):
    """A decode op's x, norm_w, wqk = [Wq; Wk], wv and LUT row: qkv_args' decode tensors, Q's and K's weights
    stacked."""
    x, norm_w, wq, wk, wv, lut = qkv_args(hidden, heads, kv_heads, head_dim, 1, decode=True, gen=gen)
    return [x, norm_w, torch.cat((wq, wk)), wv, lut]


def ffn_args(hidden, heads, head_dim, intermediate, seq, decode=False, gen=None):
    rows = () if decode else (seq,)
    q = heads * head_dim
    return [
        bf16(*rows, q, gen=gen),
        bf16(hidden, q, scale=q ** -0.5, gen=gen),
        bf16(*rows, hidden, gen=gen),
        (1.0 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16(),
        bf16(intermediate, 2 * hidden, scale=hidden ** -0.5, gen=gen),  # [w_gate | w_up]
        bf16(hidden, intermediate, scale=intermediate ** -0.5, gen=gen),
    ]


def attn_args(heads, kv_heads, head_dim, seq, gen=None):
    return [bf16(seq, heads * head_dim, gen=gen), bf16(seq, kv_heads * head_dim, gen=gen),
            bf16(seq, kv_heads * head_dim, gen=gen)]

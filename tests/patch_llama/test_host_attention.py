"""The host attention (decode, multi-chunk prefill, prefill over a cached context): blocks of queries give the
same result as one block and as a plain fp32 reference, for every mask form, and memory stays bounded."""
import json
import subprocess
import sys

import pytest
import torch

from torch_npu2.patch_llama import layer

MASKED = torch.finfo(torch.float32).min


def reference_attention(q, k, v, allowed, scale):
    """fp32 scores and softmax over every key, probabilities rounded to bf16, P·V in fp32, one bf16 rounding."""
    group = q.shape[1] // k.shape[1]
    keys, values = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.float() @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, MASKED)
    probs = torch.softmax(scores, dim=-1).to(torch.bfloat16).float()
    return (probs @ values).to(torch.bfloat16)


def inputs(batch, heads, kv_heads, q_len, kv_len, head_dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, n, length, head_dim, generator=generator).to(torch.bfloat16)
               for n, length in ((heads, q_len), (kv_heads, kv_len), (kv_heads, kv_len)))
    return q, k, v


def causal(q_len, kv_len):
    """Query i is position kv_len - q_len + i and sees the keys up to it."""
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)


def left_padded(batch_pads, q_len, kv_len):
    """(batch, 1, q_len, kv_len) bool: causal, with each row's first ``pad`` keys masked (its left padding)."""
    rows = []
    for pad in batch_pads:
        allowed = causal(q_len, kv_len).clone()
        allowed[:, :pad] = False
        rows.append(allowed)
    return torch.stack(rows)[:, None]


def attend(monkeypatch, block_bytes, *args):
    monkeypatch.setattr(layer, "HOST_ATTENTION_BLOCK_BYTES", block_bytes)
    return layer._host_attention(*args)


CASES = {
    # (batch, heads, kv_heads, q_len, kv_len, mask form)
    "causal prefill, no mask": (1, 6, 2, 70, 70, None),
    "decode, no mask": (2, 4, 2, 1, 37, None),
    "bool mask over a cached context": (1, 4, 4, 19, 50, "bool"),
    # row 1's first 5 queries are its padding and see no key: their softmax spreads over every key
    "float mask with left padding": (2, 6, 3, 33, 33, "float"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_blocks_of_queries_match_one_block_and_the_reference(monkeypatch, case):
    batch, heads, kv_heads, q_len, kv_len, form = CASES[case]
    q, k, v = inputs(batch, heads, kv_heads, q_len, kv_len)
    allowed = left_padded([0, 5][:batch], q_len, kv_len) if form else causal(q_len, kv_len).expand(batch, 1, -1, -1)
    mask = {None: None, "bool": allowed,
            "float": torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(
                ~allowed, torch.finfo(torch.bfloat16).min)}[form]
    scale = 16 ** -0.5
    # one query row of one batch entry's scores per block: every block boundary is exercised
    blocked = attend(monkeypatch, batch * heads * kv_len * 4, q, k, v, mask, scale)
    whole = attend(monkeypatch, 1 << 40, q, k, v, mask, scale)
    expected = reference_attention(q, k, v, allowed, scale)
    assert blocked.shape == whole.shape == q.shape and blocked.dtype == torch.bfloat16
    torch.testing.assert_close(blocked, whole, rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(blocked, expected, rtol=2 ** -7, atol=1e-3)


def test_continuing_a_cached_context_without_a_mask_is_refused():
    q, k, v = inputs(1, 2, 2, 4, 9)
    with pytest.raises(RuntimeError, match="a causal mask is needed"):
        layer._host_attention(q, k, v, None, 0.25)


PEAK_PROBE = """
import json, torch
BUDGET = {budget}
from torch_npu2.patch_llama import layer

def peak_growth(block_bytes):
    layer.HOST_ATTENTION_BLOCK_BYTES = block_bytes
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 4096, 16, generator=generator).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, 4096, 16, generator=generator).to(torch.bfloat16) for _ in range(2))
    rss = lambda field: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))
    before = rss("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    layer._host_attention(q, k, v, None, 0.25)
    return rss("VmHWM") - before

print(json.dumps([peak_growth(BUDGET), peak_growth(1 << 40)]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads peak RSS from /proc/self (Linux)")
def test_a_long_prompt_attends_in_bounded_memory():
    """4096 queries over 4096 keys, 4 heads: the whole fp32 score matrix is 256 MiB. In a fresh process (freed
    memory an earlier test left to the allocator would hide growth), with blocks of a sixteenth of that the
    attention's peak RSS grows by less than a third of the matrix: its memory follows the block budget, not the
    prompt. The same call as one block grows by more than the matrix, so the probe sees it."""
    matrix = 4 * 4096 * 4096 * 4
    done = subprocess.run([sys.executable, "-c", PEAK_PROBE.format(budget=matrix // 16)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    blocked, whole = json.loads(done.stdout.strip().splitlines()[-1])
    assert whole > matrix, (blocked, whole)
    assert blocked < matrix / 3, (blocked, whole)

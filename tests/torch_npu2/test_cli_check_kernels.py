"""``torch-npu2 check-kernels``: the AIR interpreter's comparison per Program, as a table."""
import re

import pytest
from transformers import LlamaConfig

import torch_npu2.kernels
from torch_npu2.cli import main
from torch_npu2.kernels import host_build, interpret, toolchain

pytestmark = pytest.mark.skipif(host_build.host_compiler() is None,
                                reason="no host C++ compiler (g++): the kernels' host builds are needed")


@pytest.fixture
def small_model(tmp_path, monkeypatch):
    """A Llama config at dims every builder accepts; its decode Programs and the default precision's integer Q/K/V
    Program (quantized rows, prepared weights), to keep the run short."""
    LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                vocab_size=1024, rms_norm_eps=1e-5).save_pretrained(tmp_path)
    real = torch_npu2.kernels.programs_for_model
    monkeypatch.setattr(torch_npu2.kernels, "programs_for_model",
                        lambda dims, buckets, precision: [p for p in real(dims, buckets, precision)
                                                          if p.name in ("rms_gemv_rope", "lm_head_gemv",
                                                                        "rms_gemms_rope_w8x2")])
    return tmp_path


def test_check_kernels_prints_one_row_per_program(air_tools, small_model, capsys):
    assert main(["check-kernels", "--model", str(small_model)]) == 0
    out = capsys.readouterr().out
    # an exact match prints 0.000e+00 (seen where the host build's and torch's bf16 rounding agreed everywhere)
    assert re.search(r"^rms_gemv_rope +\w+ +\d\.\d+e[-+]\d+ +(0\.99\d+|1\.0+) +\d+\.\ds  ok$", out, re.M), out
    assert re.search(r"^lm_head_gemv +logits .* ok$", out, re.M), out
    assert re.search(r"^rms_gemms_rope_w8x2_\d+ +\w+ .* ok$", out, re.M), out
    assert "3 of 3 Programs match the emulator" in out


def test_check_kernels_names_a_program_whose_ir_is_broken(air_tools, small_model, capsys, monkeypatch):
    real = interpret.canonical_text

    def without_last_dma(program, *args, **kwargs):
        text = real(program, *args, **kwargs)
        cut = text.rindex("air.dma_memcpy_nd")
        return text[:cut] + text[text.index("\n", cut):] if program.name == "lm_head_gemv" else text

    monkeypatch.setattr(interpret, "canonical_text", without_last_dma)
    assert main(["check-kernels", "--model", str(small_model)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^lm_head_gemv +FAILED TO RUN: UnwrittenOutput: .*'logits' were never written", out, re.M), out
    assert "2 of 3 Programs match the emulator" in out


def test_check_kernels_without_air_opt_says_what_is_missing(small_model, capsys, monkeypatch):
    monkeypatch.setenv(toolchain.AIR_TOOLS_VARIABLE, "/nonexistent")
    assert main(["check-kernels", "--model", str(small_model)]) == 2
    assert "cannot check kernels" in capsys.readouterr().err

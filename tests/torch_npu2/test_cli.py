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


@pytest.mark.filterwarnings("ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")
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


def test_compile_emit_mlir_needs_no_toolchain(tmp_path, capsys, smollm2_loaded):
    assert cli.main(["compile", "--emit-mlir", str(tmp_path), "--buckets", "16", "64"]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.mlir"))
    assert names == ["flash_attn_16.mlir", "flash_attn_64.mlir", "lm_head_gemv.mlir", "o_ffn_16.mlir", "o_ffn_64.mlir",
                     "o_gemv_ffn.mlir", "rms_gemms_rope_16.mlir", "rms_gemms_rope_64.mlir", "rms_gemv_rope.mlir"]
    assert "func.func @o_ffn(" in (tmp_path / "o_ffn_64.mlir").read_text()
    assert "wrote 9 modules" in capsys.readouterr().out


def test_matmul_precision_option_reaches_the_programs(tmp_path, monkeypatch, smollm2_loaded):
    import torch_npu2.kernels

    made = []
    real = torch_npu2.kernels.programs_for_model
    monkeypatch.setattr(torch_npu2.kernels, "programs_for_model",
                        lambda *a: made.append(real(*a)) or made[-1])
    assert cli.main(["compile", "--emit-mlir", str(tmp_path), "--buckets", "16", "--matmul-precision", "bfp16"]) == 0
    assert {l.p["precision"] for p in made[0] for l in p.launches if l.kind == "gemm"} == {"bfp16"}
    args = cli.build_parser().parse_args(["generate", "--matmul-precision", "bfp16"])
    assert args.matmul_precision == "bfp16"
    assert cli.build_parser().parse_args(["compile"]).matmul_precision == "bf16"
    with pytest.raises(SystemExit):
        cli.main(["compile", "--matmul-precision", "fp8"])


def test_compile_without_toolchain_lists_what_is_missing(capsys, monkeypatch, smollm2_loaded):
    from torch_npu2.kernels import compile as pipeline

    monkeypatch.setattr(pipeline, "missing_toolchain", lambda: ["aircc (mlir-air): not on PATH", "Peano: unset"])
    assert cli.main(["compile"]) == 2
    err = capsys.readouterr().err
    assert "the NPU toolchain is incomplete" in err and "aircc (mlir-air)" in err and "Peano: unset" in err


def test_compile_to_npu_instructions_prints_a_table_and_names_failures(air_tools, capsys, monkeypatch, smollm2_loaded):
    """The real AIR passes on one decode Program, plus one that cannot lower (a GEMM without broadcasts)."""
    import torch_npu2.kernels
    from torch_npu2.kernels import programs
    from torch_npu2.kernels.program import Arg, CompileOptions, Launch, Program, Role

    broken = Program("gemm_probe", (Arg("a", (64, 576), "bf16", Role.INPUT), Arg("w", (192, 576), "bf16", Role.INPUT),
                                    Arg("c", (64, 192), "bf16", Role.OUTPUT)),
                     (Launch("gemm", (("K", 576), ("M", 64), ("N", 192)), ("a", "w"), ("c",)),),
                     compile_options=CompileOptions(omit_auto_broadcast=True))
    decode = programs.rms_gemv_rope(576, 9, 3, 64, 1e-5)
    monkeypatch.setattr(torch_npu2.kernels, "programs_for_model", lambda dims, buckets, precision: [decode, broken])
    assert cli.main(["compile", "--target", "npu-insts"]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].split()[:3] == ["program", "result", "segments"]
    row = lines[1].split()
    assert row[:3] == ["rms_gemv_rope", "pass", "6"] and int(row[3]) == 8  # six launches, the GEMVs on 8 tiles
    assert lines[2].split()[:5] == ["gemm_probe", "FAIL", "at", "air-to-aie", "(air-to-aie)"]
    assert lines[3] == "1 of 2 Programs lowered to NPU instructions"
    assert "gemm_probe: air-to-aie (air-to-aie): <unknown>:0: error: 'aie.memtile_dma' op has more than 48 blocks" \
        in captured.err
    assert "AIR: mlir-air 0e3df89d" in captured.err


def test_compile_to_npu_instructions_without_the_air_tools_says_how_to_get_them(capsys, monkeypatch, smollm2_loaded):
    from torch_npu2.kernels import toolchain

    monkeypatch.setenv(toolchain.AIR_TOOLS_VARIABLE, "/nonexistent")
    assert cli.main(["compile", "--target", "npu-insts"]) == 2
    err = capsys.readouterr().err
    assert "cannot lower to NPU instructions" in err and "TORCH_NPU2_AIR_TOOLS=/nonexistent holds neither" in err

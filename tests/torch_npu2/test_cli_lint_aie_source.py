"""``torch-npu2 lint --aie-source``: every kernel variant of a model's Programs type-checked in its AIE path."""
import re
import shutil

import pytest
from transformers import LlamaConfig

from torch_npu2.cli import main
from torch_npu2.kernels import aie_source_check
from torch_npu2.kernels.toolchain import KERNEL_SOURCE_DIR

# gemv.cc's rmsnorm_bf16 as it was: x (bf16) times an fp32 broadcast of rstd, which aie_api refuses.
FIXED_SCALING = "aie::mul(v, rstd_high)"
BF16_TIMES_FLOAT = "aie::mul(v, aie::broadcast<float, kLanes>(rstd))"


@pytest.fixture
def small_model(tmp_path):
    LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                vocab_size=1024, rms_norm_eps=1e-5).save_pretrained(tmp_path / "model")
    return ["--model", str(tmp_path / "model"), "--buckets", "16"]


def test_every_variant_of_the_package_kernels_passes(aie_source_checker, small_model, capsys):
    assert main(["lint", "--aie-source", *small_model]) == 0
    out = capsys.readouterr().out
    for source in ("attention.cc", "gemm.cc", "gemv.cc", "rope_half_split.cc", "silu_mul.cc", "gemm_int8.cc",
                   "quantize_rows.cc",  # the integer GEMMs' kernels: matmul precision "w8x2a16"
                   "decode_attention.cc"):  # decode attention over an NpuKVCache, built per capacity bucket
        assert re.search(rf"^{source} -D\w+=\d+.*: ok$", out, re.M), out
    assert re.search(r"^gemm.cc -DAIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16=1 .*: ok$", out, re.M), out
    assert "bfp16_convert.cc: not built for this model's Programs, not checked" in out
    summary = re.search(r"^(\d+) of (\d+) variants of 8 kernels type-check in their AIE path", out, re.M)
    assert summary and summary[1] == summary[2], out


def test_a_rejected_kernel_is_named_with_its_variant_and_the_compiler_message(aie_source_checker, small_model,
                                                                              tmp_path, capsys):
    kernel_dir = tmp_path / "kernels"
    shutil.copytree(KERNEL_SOURCE_DIR, kernel_dir)
    gemv = kernel_dir / "gemv.cc"
    assert gemv.read_text().count(FIXED_SCALING) == 1
    gemv.write_text(gemv.read_text().replace(FIXED_SCALING, BF16_TIMES_FLOAT))
    assert main(["lint", "--aie-source", "--kernel-dir", str(kernel_dir), *small_model]) == 1
    out = capsys.readouterr().out
    rejected = re.findall(r"^(gemv\.cc -DGEMV_K=\d+(?: -DGEMV_QUANT=\d+)? -DGEMV_ROWS=\d+): REJECTED$", out, re.M)
    assert rejected, out
    assert f"{gemv}:" in out and "error: no matching function for call to 'mul'" in out
    assert "is_valid_mul_op_v" in out
    assert not re.search(r"^(?!gemv\.cc).*: REJECTED$", out, re.M)  # the other kernels still pass
    done, total = map(int, re.search(r"^(\d+) of (\d+) variants", out, re.M).groups())
    assert total - done == len(rejected)


def test_without_the_compiler_or_headers_it_says_what_is_missing(small_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(aie_source_check.HEADERS_VARIABLE, str(tmp_path))
    assert main(["lint", "--aie-source", *small_model]) == 2
    err = capsys.readouterr().err
    assert "cannot check the kernels' AIE path; missing:" in err and aie_source_check.HEADERS_VARIABLE in err


@pytest.mark.parametrize("argv, message", [
    (["--kernel-dir", "."], "argument --kernel-dir: only with --aie-source"),
    (["--aie-source", "--kernel-dir", "/nonexistent"], "argument --kernel-dir: /nonexistent is not a directory"),
    (["--aie-source", "--lowered"], "argument --lowered: not allowed with argument --aie-source"),
])
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["lint", *argv])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def _qwen2(tmp_path, intermediate: int) -> str:
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=intermediate,
                vocab_size=1024, max_position_embeddings=256).save_pretrained(tmp_path / "qwen2")
    return str(tmp_path / "qwen2")


def test_a_packed_down_projection_of_k_2080_is_checked_in_groups(aie_source_checker, tmp_path, capsys):
    """A Qwen2 whose down projection (K = 2080, not whole 1024-element groups, longer than one chunk) once could not
    be built in packed rows: its groups now split it (kernels/quant.py), so every packed Program is built and every
    variant, the q/k/v biases' Programs among them, checked (its integer o_ffn is not: quantize_rows takes K in
    multiples of 64, which is why "auto" does not pick the integer GEMMs for it)."""
    assert main(["lint", "--aie-source", "--model", _qwen2(tmp_path, 2080), "--buckets", "16"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^(\S+): cannot be built", out, re.M) == ["o_ffn_w8x2_16"], out
    assert "not made" not in out, out
    assert re.search(r"^gemv\.cc -D.*GEMV_K=416 .*GEMV_QUANT=80.*: ok$", out, re.M), out  # Q8_0: 5 groups of 13
    summary = re.search(r"^(\d+) of (\d+) variants of \d+ kernels type-check in their AIE path", out, re.M)
    assert summary and summary[1] == summary[2] and int(summary[2]) > 20, out


def test_a_model_whose_prefill_the_npu_cannot_build_is_refused_before_any_work(tmp_path, capsys):
    """A Qwen2 whose intermediate size (2064) is not whole 32-element runs: its prefill's SiLU·up chunks would not be
    whole 64-byte L1 buffers (nor its rows whole packed blocks, nor its down projection whole GEMV steps), so the
    lint refuses the bucket up front, naming the launch, before any Program is emitted or checked."""
    model = _qwen2(tmp_path, 2064)
    for argv in (["lint", "--aie-source", "--model", model, "--buckets", "16"],
                 ["lint", "--model", model, "--buckets", "16"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
            "argument --buckets: the model's prefill Programs at 16 cannot be built for NPU2 (o_ffn: silu_mul launch: "
            "cols=2064: must be a multiple of 32 (whole 16-lane vectors in chunk buffers of whole 64-byte runs))")

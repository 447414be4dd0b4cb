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


def test_programs_the_npu_cannot_build_are_named_and_the_rest_checked(aie_source_checker, tmp_path, capsys):
    """A Qwen2 whose down projection (K = 2080, not whole 1024-element groups) cannot be built in packed rows: those
    Programs are named with the builder's reason, every other variant (the q/k/v biases' Programs among them) is
    checked."""
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=2080,
                vocab_size=1024, max_position_embeddings=256).save_pretrained(tmp_path / "qwen2")
    assert main(["lint", "--aie-source", "--model", str(tmp_path / "qwen2"), "--buckets", "16"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^o_gemv_ffn_packed: cannot be built for NPU2 \(gemv_add launch: K=2080: no K chunk of "
                     r"whole groups fits one DMA dimension\); its kernels are not checked$", out, re.M), out
    summary = re.search(r"^(\d+) of (\d+) variants of \d+ kernels type-check in their AIE path", out, re.M)
    assert summary and summary[1] == summary[2] and int(summary[2]) > 20, out

"""The compile pipeline: toolchain discovery, fingerprint, and the Peano → aircc sequence.

Without the NPU toolchain, the sequence runs against stand-in ``clang++``/``aircc``/``aiecc`` scripts that
log their command lines and write their outputs: this checks our side of the contract (flags, -D renames,
private build directories, error reporting, artifact cache wiring), not the compilers. The real compile is
the ``npu``-marked test at the end.
"""
import json
import os
import shutil
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from torch_npu2.artifact_cache import ArtifactCache
from torch_npu2.kernels import ModelDims, compile as pipeline
from torch_npu2.kernels.programs import rms_gemv_rope
from torch_npu2.kernels.stitch import emit_mlir

SMOL = ModelDims(576, 9, 3, 64, 1536, 49152, 1e-5)
PROGRAM = rms_gemv_rope(SMOL.hidden, SMOL.heads, SMOL.kv_heads, SMOL.head_dim, SMOL.eps)

FAKE_CLANG = """
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_TOOL_LOG"], "a") as log:
    log.write(json.dumps({"tool": "clang++", "args": args}) + "\\n")
open(args[args.index("-o") + 1], "w").write("object")
"""
FAKE_AIRCC = """
import json, os, shutil, sys
args = sys.argv[1:]
cwd = os.getcwd()
with open(os.environ["FAKE_TOOL_LOG"], "a") as log:
    log.write(json.dumps({"tool": "aircc", "args": args, "cwd": cwd, "files": sorted(os.listdir(cwd)),
                          "project": sorted(os.listdir(os.path.join(cwd, "air_project"))),
                          "aiecc": shutil.which("aiecc"), "peano": os.environ.get("PEANO_INSTALL_DIR")}) + "\\n")
if os.environ.get("FAKE_AIRCC_FAIL"):
    sys.stderr.write("error: boom in air-to-aie\\n")
    sys.exit(1)
open(args[args.index("--elf-name") + 1], "wb").write(b"\\x7fELF fake")
"""


def write_tool(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def no_toolchain(tmp_path, monkeypatch):
    """An environment with nothing of the toolchain: empty PATH, no install variables, no wheels."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    for variable in ("PEANO_INSTALL_DIR", "MLIR_AIE_INSTALL_DIR", "MLIR_AIR_INSTALL_DIR"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(pipeline, "_dist_file", lambda dists, relative: None)
    monkeypatch.setattr(pipeline, "_package_root", lambda package: None)
    return tmp_path


@pytest.fixture
def fake_toolchain(no_toolchain, monkeypatch):
    root = no_toolchain / "toolchain"
    write_tool(root / "mlir_air" / "bin" / "aircc", FAKE_AIRCC)
    write_tool(root / "mlir_aie" / "bin" / "aiecc", "")
    (root / "mlir_aie" / "include" / "aie_api").mkdir(parents=True)
    (root / "mlir_aie" / "include" / "aie_api" / "aie.hpp").write_text("// stand-in")
    write_tool(root / "llvm-aie" / "bin" / "clang++", FAKE_CLANG)
    sources = root / "aie2p"
    sources.mkdir()
    for name in ("rope_half_split.cc", "silu_mul.cc", "gemv.cc", "attention.cc"):
        (sources / name).write_text(f"// {name}")
    monkeypatch.setenv("PATH", os.pathsep.join([str(root / "mlir_air" / "bin"), str(no_toolchain / "empty-bin")]))
    monkeypatch.setenv("MLIR_AIE_INSTALL_DIR", str(root / "mlir_aie"))
    monkeypatch.setenv("PEANO_INSTALL_DIR", str(root / "llvm-aie"))
    monkeypatch.setenv("FAKE_TOOL_LOG", str(no_toolchain / "tools.log"))
    monkeypatch.setattr(pipeline, "KERNEL_SOURCE_DIR", sources)
    return root


def tool_calls(tmp_path, tool):
    log = tmp_path / "tools.log"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [c for c in calls if c["tool"] == tool]


def test_missing_toolchain_names_each_piece_and_how_to_get_it(no_toolchain):
    missing = pipeline.missing_toolchain()
    assert [m.split(" ")[0] for m in missing] == ["aircc", "aiecc", "Peano", "aie_api"]
    assert all("pip install 'mlir_air[aie]'" in m or "PEANO_INSTALL_DIR" in m for m in missing)


def test_peano_dir_without_clang_is_reported(no_toolchain, monkeypatch):
    monkeypatch.setenv("PEANO_INSTALL_DIR", str(no_toolchain))
    assert any("has no bin/clang++" in m for m in pipeline.missing_toolchain())


def test_compile_without_toolchain_raises_naming_what_is_missing(no_toolchain):
    with pytest.raises(pipeline.ToolchainMissing, match="cannot compile rms_gemv_rope for the NPU; missing:"):
        pipeline.compile_program(PROGRAM, no_toolchain / "out")


def test_stand_in_toolchain_is_found(fake_toolchain):
    assert pipeline.missing_toolchain() == []
    tc = pipeline.find_toolchain()
    assert tc.aircc == fake_toolchain / "mlir_air" / "bin" / "aircc"
    assert tc.aiecc == fake_toolchain / "mlir_aie" / "bin" / "aiecc"  # via $MLIR_AIE_INSTALL_DIR


def test_tools_are_found_in_the_python_packages_install_trees(fake_toolchain, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_toolchain.parent / "empty-bin"))
    monkeypatch.delenv("MLIR_AIE_INSTALL_DIR")
    roots = {"air": fake_toolchain / "mlir_air", "aie": fake_toolchain / "mlir_aie"}  # <install>/python/<pkg>
    monkeypatch.setattr(pipeline, "_package_root", roots.get)
    tc = pipeline.find_toolchain()
    assert tc.aircc == roots["air"] / "bin" / "aircc" and tc.aiecc == roots["aie"] / "bin" / "aiecc"
    assert tc.aie_include == roots["aie"] / "include"


def test_compile_program_builds_kernels_then_runs_aircc_in_a_private_directory(fake_toolchain, tmp_path):
    out = tmp_path / "out"
    elf = pipeline.compile_program(PROGRAM, out)
    assert elf == out / "rms_gemv_rope.elf" and elf.read_bytes().startswith(b"\x7fELF")
    assert (out / "rms_gemv_rope.mlir").read_text() == emit_mlir(PROGRAM)

    clang = tool_calls(tmp_path, "clang++")
    built = {Path(c["args"][c["args"].index("-o") + 1]).name: c["args"] for c in clang}
    assert set(built) == {"gemv.o", "rope.o", "rope_v2.o"}  # Q, K and V projections share one gemv build
    for args in built.values():
        assert args[:4] == ["-O2", "-std=c++20", "--target=aie2p-none-unknown-elf", "-DNDEBUG"]
        assert f"-I{fake_toolchain / 'mlir_aie' / 'include'}" in args
    assert {"-DGEMV_K=576", "-DGEMV_ROWS=8"} <= set(built["gemv.o"])
    assert {"-DROPE_HEADS=9", "-DROPE_ROWS=1", "-DROPE_HEAD_DIM=64"} <= set(built["rope.o"])
    assert {"-DROPE_HEADS=3", "-Drope_half_split_bf16=rope_half_split_bf16_v2"} <= set(built["rope_v2.o"])
    assert not any(a.startswith("-Drope") for a in built["rope.o"])
    assert built["rope_v2.o"][built["rope_v2.o"].index("-c") + 1] == str(fake_toolchain / "aie2p" /
                                                                         "rope_half_split.cc")

    (aircc,) = tool_calls(tmp_path, "aircc")
    assert aircc["args"] == ["--device", "npu2", "air.mlir", "--elf-name", "rms_gemv_rope.elf", "--output-format",
                             "elf", "--xclbin-instance-name", "rms_gemv_rope", "--peano",
                             str(fake_toolchain / "llvm-aie"), "--no-xchesscc", "--no-xbridge", "--tmpdir=air_project"]
    assert {"air.mlir", "gemv.o", "rope_v2.o"} <= set(aircc["files"])
    assert set(aircc["project"]) == {"gemv.o", "rope.o", "rope_v2.o"}
    assert aircc["aiecc"] == str(fake_toolchain / "mlir_aie" / "bin" / "aiecc")  # aircc can run aiecc
    assert aircc["peano"] == str(fake_toolchain / "llvm-aie")
    assert Path(aircc["cwd"]) != out and not Path(aircc["cwd"]).exists()  # private, removed after success


def test_each_compile_gets_its_own_directory_and_extra_flags(fake_toolchain, tmp_path):
    pipeline.compile_program(PROGRAM, tmp_path / "a")
    pipeline.compile_program(PROGRAM, tmp_path / "b", aircc_flags=("--stack-size", "2048"))
    first, second = tool_calls(tmp_path, "aircc")
    assert first["cwd"] != second["cwd"]
    assert second["args"][-2:] == ["--stack-size", "2048"]


def test_aircc_failure_keeps_the_mlir_and_carries_stderr(fake_toolchain, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_AIRCC_FAIL", "1")
    with pytest.raises(pipeline.CompileError) as info:
        pipeline.compile_program(PROGRAM, tmp_path / "out")
    error = info.value
    assert error.stage == "aircc" and error.returncode == 1
    assert "boom in air-to-aie" in error.stderr and "boom in air-to-aie" in str(error)
    assert error.mlir_path.read_text() == emit_mlir(PROGRAM) and str(error.mlir_path) in str(error)
    assert not (tmp_path / "out" / "rms_gemv_rope.elf").exists()
    shutil.rmtree(error.build_dir)


def test_missing_kernel_source_is_a_compile_error(fake_toolchain, tmp_path):
    (fake_toolchain / "aie2p" / "gemv.cc").unlink()
    with pytest.raises(pipeline.CompileError, match=r"peano failed.*\n.*\n.*gemv\.cc not found") as info:
        pipeline.compile_program(PROGRAM, tmp_path / "out")
    shutil.rmtree(info.value.build_dir)


def test_fingerprint_tracks_dists_binaries_and_kernel_sources(fake_toolchain):
    first = pipeline.toolchain_fingerprint()
    assert first == pipeline.toolchain_fingerprint()
    fields = dict(part.split("=", 1) for part in first.split(";"))
    assert set(fields) == {"mlir_air", "mlir_aie", "mlir_aie_no_rtti", "llvm-aie", "aircc", "aiecc", "clang++",
                           "kernels"}
    assert fields["aircc"] != "missing" and fields["clang++"] != "missing"
    (fake_toolchain / "aie2p" / "rope_half_split.cc").write_text("// changed kernel")
    second = pipeline.toolchain_fingerprint()
    assert second != first
    aircc = fake_toolchain / "mlir_air" / "bin" / "aircc"
    aircc.write_text(aircc.read_text() + "\n# upgraded\n")
    assert pipeline.toolchain_fingerprint() != second


def test_fingerprint_without_toolchain_does_not_raise(no_toolchain):
    assert "aircc=missing" in pipeline.toolchain_fingerprint()


def test_artifact_cache_compiles_once_with_the_pipeline(fake_toolchain, tmp_path):
    cache = ArtifactCache(tmp_path / "cache", "npu2", pipeline.toolchain_fingerprint(), pipeline.compile_program)
    elf = cache.get(PROGRAM)
    assert elf.name == "rms_gemv_rope.elf" and elf.exists()
    assert (elf.parent / "rms_gemv_rope.mlir").exists()
    assert cache.get(PROGRAM) == elf and cache.builds == 1
    assert len(tool_calls(tmp_path, "aircc")) == 1


@pytest.mark.npu
def test_real_toolchain_compiles_a_decode_program(tmp_path):
    missing = pipeline.missing_toolchain()
    if missing:
        pytest.skip("NPU toolchain not installed: " + "; ".join(missing))
    sources = [pipeline.KERNEL_SOURCE_DIR / n for n in ("rope_half_split.cc", "gemv.cc")]
    if not all(s.exists() for s in sources):
        pytest.skip(f"AIE2P kernel sources not written yet: {[str(s) for s in sources if not s.exists()]}")
    elf = pipeline.compile_program(PROGRAM, tmp_path)
    assert elf.stat().st_size > 0

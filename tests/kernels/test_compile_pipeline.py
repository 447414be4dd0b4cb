"""The compile pipeline: toolchain discovery, fingerprint, and the Peano → aircc (or air-opt → aiecc) sequence.

Without Peano, the sequence runs against stand-in ``clang++``/``aircc``/``aiecc`` scripts that log their
command lines and write their outputs: this checks our side of the contract (flags, -D renames, private
build directories, error reporting, artifact cache wiring), not those compilers. The replay path runs the
real air-opt when the AIR tools are there, with a stand-in only for the final aiecc ELF step (it needs
Peano). The real compile is the ``npu``-marked test at the end.
"""
import dataclasses
import json
import os
import shutil
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from torch_npu2.artifact_cache import ArtifactCache
from torch_npu2.kernels import ModelDims, compile as pipeline, toolchain
from torch_npu2.kernels.budgets import L1BudgetError
from torch_npu2.kernels.catalog import o_ffn_program, rms_gemv_rope_program
from torch_npu2.kernels.stitch import emit_mlir

SMOL = ModelDims(576, 9, 3, 64, 1536, 49152, 1e-5)
PROGRAM = rms_gemv_rope_program(SMOL.hidden, SMOL.heads, SMOL.kv_heads, SMOL.head_dim, SMOL.eps)
# The stand-in tools are not the verified AIR: every compile says so (checked on its own below).
pytestmark = pytest.mark.filterwarnings("ignore:compiling rms_gemv_rope. the AIR in use is:UserWarning")

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
FAKE_AIECC = """
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_TOOL_LOG"], "a") as log:
    log.write(json.dumps({"tool": "aiecc", "args": args, "cwd": os.getcwd(), "files": sorted(os.listdir(os.getcwd())),
                          "npu_module": open(args[-1]).read()}) + "\\n")
name = next(a.split("=", 1)[1] for a in args if a.startswith("--full-elf-name="))
open(name, "wb").write(b"\\x7fELF fake")
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
    for variable in ("PEANO_INSTALL_DIR", "MLIR_AIE_INSTALL_DIR", "MLIR_AIR_INSTALL_DIR", toolchain.AIR_TOOLS_VARIABLE):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(toolchain, "_dist_file", lambda dists, relative: None)
    monkeypatch.setattr(toolchain, "_package_root", lambda package: None)
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
    monkeypatch.setattr(toolchain, "KERNEL_SOURCE_DIR", sources)
    return root


def tool_calls(tmp_path, tool):
    log = tmp_path / "tools.log"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [c for c in calls if c["tool"] == tool]


def test_missing_toolchain_names_each_piece_and_how_to_get_it(no_toolchain):
    missing = pipeline.missing_toolchain()
    assert [m.split(" ")[0] for m in missing] == ["aircc", "Peano", "aie_api"]
    assert "or the AIR tools" in missing[0] and toolchain.AIR_TOOLS_VARIABLE in missing[0]
    assert "build.sh" in missing[0] and "pip install 'mlir_air[aie]'" in missing[0]
    assert all("pip install 'mlir_air[aie]'" in m or "PEANO_INSTALL_DIR" in m for m in missing)
    assert toolchain.missing_lowering_tools()[0].startswith("AIR tools (air-opt and aiecc): not found")


def test_air_tools_variable_that_names_no_tools_is_reported_not_bypassed(no_toolchain, monkeypatch):
    monkeypatch.setenv(toolchain.AIR_TOOLS_VARIABLE, str(no_toolchain))
    write_tool(no_toolchain / "empty-bin" / "air-opt", "")  # on PATH, but the variable wins
    (problem,) = toolchain.missing_lowering_tools()
    assert f"{toolchain.AIR_TOOLS_VARIABLE}={no_toolchain} holds neither bin/air-opt" in problem


def test_air_tools_that_cannot_run_are_reported(no_toolchain, monkeypatch):
    tools = no_toolchain / "broken"
    write_tool(tools / "bin" / "air-opt", "import sys\nsys.stderr.write('error while loading shared libraries: "
                                          "libMLIR.so.22.1\\n'); sys.exit(127)")
    write_tool(tools / "bin" / "aiecc", "")
    monkeypatch.setenv(toolchain.AIR_TOOLS_VARIABLE, str(tools))
    (problem,) = toolchain.missing_lowering_tools()
    assert "--version failed (Debian/Ubuntu: apt-get install mlir-22-tools)" in problem


def test_peano_dir_without_clang_is_reported(no_toolchain, monkeypatch):
    monkeypatch.setenv("PEANO_INSTALL_DIR", str(no_toolchain))
    assert any("has no bin/clang++" in m for m in pipeline.missing_toolchain())


def test_compile_without_toolchain_raises_naming_what_is_missing(no_toolchain):
    with pytest.raises(pipeline.ToolchainMissing, match="cannot compile rms_gemv_rope for the NPU; missing:"):
        pipeline.compile_program(PROGRAM, no_toolchain / "out")


def test_stand_in_toolchain_is_found(fake_toolchain):
    assert pipeline.missing_toolchain() == []
    tc = toolchain.find_toolchain()
    assert tc.aircc == fake_toolchain / "mlir_air" / "bin" / "aircc"
    assert tc.aiecc == fake_toolchain / "mlir_aie" / "bin" / "aiecc"  # via $MLIR_AIE_INSTALL_DIR


def test_tools_are_found_in_the_python_packages_install_trees(fake_toolchain, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_toolchain.parent / "empty-bin"))
    monkeypatch.delenv("MLIR_AIE_INSTALL_DIR")
    roots = {"air": fake_toolchain / "mlir_air", "aie": fake_toolchain / "mlir_aie"}  # <install>/python/<pkg>
    monkeypatch.setattr(toolchain, "_package_root", roots.get)
    tc = toolchain.find_toolchain()
    assert tc.aircc == roots["air"] / "bin" / "aircc" and tc.aiecc == roots["aie"] / "bin" / "aiecc"
    assert tc.aie_include == roots["aie"] / "include"


def test_compile_program_builds_kernels_then_runs_aircc_in_a_private_directory(fake_toolchain, tmp_path):
    out = tmp_path / "out"
    elf = pipeline.compile_program(PROGRAM, out)
    assert elf == out / "rms_gemv_rope.elf" and elf.read_bytes().startswith(b"\x7fELF")
    assert (out / "rms_gemv_rope.mlir").read_text() == emit_mlir(PROGRAM)

    clang = tool_calls(tmp_path, "clang++")
    built = {Path(c["args"][c["args"].index("-o") + 1]).name: c["args"] for c in clang}
    # Q and K (768 rows) and V (192 rows), 2 rows a call both, with y buffers padded to whole 64-byte runs alike:
    # one build of the one configuration
    assert set(built) == {"gemv.o", "rope.o"}
    for args in built.values():
        assert args[:4] == ["-O2", "-std=c++20", "--target=aie2p-none-unknown-elf", "-DNDEBUG"]
        assert f"-I{fake_toolchain / 'mlir_aie' / 'include'}" in args
    assert {"-DGEMV_K=576", "-DGEMV_ROWS=2"} <= set(built["gemv.o"])
    assert not any(a.startswith("-Dgemv") for a in built["gemv.o"])
    assert built["gemv.o"][built["gemv.o"].index("-c") + 1] == str(fake_toolchain / "aie2p" / "gemv.cc")
    # one rope build: the token's 9 Q heads and 3 K heads in one call
    assert {"-DROPE_HEADS=12", "-DROPE_ROWS=1", "-DROPE_HEAD_DIM=64"} <= set(built["rope.o"])

    (aircc,) = tool_calls(tmp_path, "aircc")
    assert aircc["args"] == ["--device", "npu2", "air.mlir", "--elf-name", "rms_gemv_rope.elf", "--output-format",
                             "elf", "--xclbin-instance-name", "rms_gemv_rope", "--peano",
                             str(fake_toolchain / "llvm-aie"), "--no-xchesscc", "--no-xbridge", "--tmpdir=air_project",
                             # the Program's own compile options
                             "--air-runtime-loop-tiling-sizes", "16", "16", "--stack-size", "3072"]
    assert {"air.mlir", "gemv.o", "rope.o"} <= set(aircc["files"])
    assert set(aircc["project"]) == {"gemv.o", "rope.o"}
    assert aircc["aiecc"] == str(fake_toolchain / "mlir_aie" / "bin" / "aiecc")  # aircc can run aiecc
    assert aircc["peano"] == str(fake_toolchain / "llvm-aie")
    assert Path(aircc["cwd"]) != out and not Path(aircc["cwd"]).exists()  # private, removed after success


def test_an_air_other_than_the_verified_one_is_reported(fake_toolchain, tmp_path):
    with pytest.warns(UserWarning, match=r"compiling rms_gemv_rope: the AIR in use is aircc at .*, version unknown, "
                                         r"not the mlir-air 0e3df89d \+ mlir-aie c668d2cb .* was verified against"):
        pipeline.compile_program(PROGRAM, tmp_path / "out")
    assert toolchain.air_version_warning() is not None


def test_the_verified_air_is_recognised_by_the_archive_it_was_unpacked_from(air_tools, tmp_path, monkeypatch):
    tools = tmp_path / "tools"
    (tools / "bin").mkdir(parents=True)
    for tool in (air_tools.air_opt, air_tools.aiecc):
        try:
            os.link(tool, tools / "bin" / tool.name)  # a second name, not a symlink that resolves back
        except OSError:
            shutil.copy2(tool, tools / "bin" / tool.name)
    monkeypatch.setenv(toolchain.AIR_TOOLS_VARIABLE, str(tools))
    unknown = f"an unknown build at {tools / 'bin' / 'air-opt'} (Debian LLVM version 22"
    assert toolchain.air_version().startswith(unknown)
    (tools / toolchain.ARCHIVE_MARKER).write_text("0" * 64 + "\n")
    assert toolchain.air_version().startswith("an unknown build")
    assert "not the mlir-air 0e3df89d" in toolchain.air_version_warning()
    (tools / toolchain.ARCHIVE_MARKER).write_text(toolchain.VERIFIED_ARCHIVE_SHA256 + "\n")
    assert toolchain.air_version() == toolchain.VERIFIED_AIR and toolchain.air_version_warning() is None


def test_each_compile_gets_its_own_directory_and_extra_flags(fake_toolchain, tmp_path):
    pipeline.compile_program(PROGRAM, tmp_path / "a")
    pipeline.compile_program(PROGRAM, tmp_path / "b", aircc_flags=("--verbose",))
    first, second = tool_calls(tmp_path, "aircc")
    assert first["cwd"] != second["cwd"]
    assert second["args"][-1] == "--verbose"
    # the stack is the Program's (the L1 check counts it), never an extra flag
    with pytest.raises(ValueError, match="the stack size is CompileOptions.stack_size"):
        pipeline.compile_program(PROGRAM, tmp_path / "c", aircc_flags=("--stack-size", "2048"))


def test_a_program_over_a_cores_l1_is_refused_before_any_tool_runs(fake_toolchain, tmp_path):
    """A 1 KiB larger stack than the builders plan for puts the prefill GEMM's tile over 64 KiB (the emulator's
    refusal of the same Program: tests/kernels/test_budgets.py)."""
    program = o_ffn_program(576, 576, 1536, 1e-5, 512)
    overflowing = dataclasses.replace(program, compile_options=dataclasses.replace(
        program.compile_options, stack_size=program.compile_options.stack_size + 1024))
    with pytest.raises(L1BudgetError, match=r"^o_ffn does not fit a core's L1: o_ffn, launch 3 \(gemm_swiglu\), each "
                                            r"tile of herd @gemm_herd \(8x4\): buffers 61,440 B .* \+ stack 4,096 B "
                                            r"\+ headroom 1,024 B = 66,560 B of 65,536 B"):
        pipeline.compile_program(overflowing, tmp_path / "out")
    assert tool_calls(tmp_path, "clang++") == tool_calls(tmp_path, "aircc") == []
    assert not (tmp_path / "out").exists()


def test_aircc_failure_keeps_the_mlir_and_carries_stderr(fake_toolchain, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_AIRCC_FAIL", "1")
    with pytest.raises(pipeline.CompileError) as info:
        pipeline.compile_program(PROGRAM, tmp_path / "out")
    error = info.value
    assert error.stage == "aircc" and error.returncode == 1
    assert "boom in air-to-aie" in error.message and "boom in air-to-aie" in str(error)
    assert error.mlir_path.read_text() == emit_mlir(PROGRAM) and str(error.mlir_path) in str(error)
    assert not (tmp_path / "out" / "rms_gemv_rope.elf").exists()
    shutil.rmtree(error.build_dir)


def test_missing_kernel_source_is_a_compile_error(fake_toolchain, tmp_path):
    (fake_toolchain / "aie2p" / "gemv.cc").unlink()
    with pytest.raises(pipeline.CompileError, match=r"peano failed.*\n.*gemv\.cc not found") as info:
        pipeline.compile_program(PROGRAM, tmp_path / "out")
    shutil.rmtree(info.value.build_dir)


def test_fingerprint_tracks_dists_binaries_and_kernel_sources(fake_toolchain):
    first = pipeline.toolchain_fingerprint()
    assert first == pipeline.toolchain_fingerprint()
    fields = dict(part.split("=", 1) for part in first.split(";"))
    assert set(fields) == {"mlir_air", "mlir_aie", "mlir_aie_no_rtti", "llvm-aie", "air", "aircc", "air-opt", "aiecc",
                           "clang++", "kernels"}
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


def test_replay_path_builds_the_elf_with_aiecc_after_the_real_air_opt(fake_toolchain, air_tools, tmp_path,
                                                                      monkeypatch):
    """No aircc: the AIR binaries replay aircc's flow; only the ELF step (Peano) is a stand-in here."""
    (fake_toolchain / "mlir_air" / "bin" / "aircc").unlink()
    write_tool(fake_toolchain / "air" / "bin" / "aiecc", FAKE_AIECC)
    (fake_toolchain / "air" / "bin" / "air-opt").symlink_to(air_tools.air_opt)
    monkeypatch.setenv(toolchain.AIR_TOOLS_VARIABLE, str(fake_toolchain / "air"))
    elf = pipeline.compile_program(PROGRAM, tmp_path / "out")
    assert elf.read_bytes().startswith(b"\x7fELF")
    (aiecc,) = tool_calls(tmp_path, "aiecc")
    assert aiecc["args"][:-1] == ["--no-aiesim", "--no-xchesscc", "--no-xbridge", "--no-compile-host",
                                  "--tmpdir=air_project", "--peano", str(fake_toolchain / "llvm-aie"), "-O", "3",
                                  "--generate-full-elf", "--expand-load-pdis", "--full-elf-name=rms_gemv_rope.elf"]
    assert "aiex.configure" in aiecc["npu_module"] and "aie.runtime_sequence @rms_gemv_rope(" in aiecc["npu_module"]
    assert {"gemv.o", "rope.o", "air.mlir", "parsed.mlir", "npu.mlir"} <= set(aiecc["files"])


@pytest.mark.npu
def test_real_toolchain_compiles_a_decode_program(tmp_path):
    missing = pipeline.missing_toolchain()
    if missing:
        pytest.skip("NPU toolchain not installed: " + "; ".join(missing))
    elf = pipeline.compile_program(PROGRAM, tmp_path)  # a kernel source it cannot find is a CompileError
    assert elf.read_bytes().startswith(b"\x7fELF")

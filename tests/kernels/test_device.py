"""The device record (kernels/device.py): the one place kernels/ states the hardware, and what reads it."""
import ast
import dataclasses
import re
from pathlib import Path

from torch_npu2.kernels import air_pipeline, compile as pipeline, lint
from torch_npu2.kernels.builders import rope
from torch_npu2.kernels.builders.ir import L1, L2
from torch_npu2.kernels.catalog import rms_gemms_rope_program
from torch_npu2.kernels.device import DEVICE, NPU2
from torch_npu2.kernels.program import CompileOptions
from torch_npu2.kernels.toolchain import Toolchain

from .air_text import herd_headers
from .test_builders import build

KERNELS = Path(rope.__file__).resolve().parents[1]


def device_name_literals(source: str) -> list[int]:
    """Lines of ``source`` whose code (docstrings aside) holds the device name as a string."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    name = re.compile(rf"(?<![\w-]){re.escape(DEVICE.name)}\b")
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings and name.search(node.value)]


def test_only_the_device_record_names_the_device():
    found = {str(path.relative_to(KERNELS)): lines for path in sorted(KERNELS.rglob("*.py"))
             if (lines := device_name_literals(path.read_text()))}
    assert found == {"device.py": found.get("device.py")} and found["device.py"]


def test_a_device_name_in_code_is_found():
    source = '"""npu2 in a docstring is prose."""\nFLAGS = ["--device", "npu2"]\nPREFIX = "torch_npu2-lint"\n'
    assert device_name_literals(source) == [2]


def test_the_pass_pipelines_and_aircc_read_the_record(monkeypatch):
    other = dataclasses.replace(NPU2, name="npu9", placement_rows=5, placement_columns=4, row_offset=3,
                                column_offset=1)
    monkeypatch.setattr(air_pipeline, "DEVICE", other)
    monkeypatch.setattr(pipeline, "DEVICE", other)
    options = CompileOptions()
    placement = air_pipeline.placement_pipeline(options)
    assert "air-place-herds{num-rows=5 num-cols=4 row-anchor=3 col-anchor=1}" in placement
    assert "row-offset=3 col-offset=1 device=npu9 " in air_pipeline.air_to_aie_pipeline(options)
    assert "air-opt-memtile-dma-bds{device=npu9}" in placement
    program = rms_gemms_rope_program(256, 4, 2, 64, 1e-5, 16)
    command = pipeline.aircc_command(Toolchain(Path("aircc"), None, None, Path("peano"), None), program, "x.elf")
    assert command[1:3] == ["--device", "npu9"]


def test_a_builder_reads_the_record(monkeypatch):
    """rope's widest herd is the array's width: 8 columns on NPU2, 2 on a two-column device."""
    assert max(sizes[0] for _, sizes, _ in herd_headers(build("rope").text)) == 8
    monkeypatch.setattr(rope, "DEVICE", dataclasses.replace(NPU2, columns=2))
    assert max(sizes[0] for _, sizes, _ in herd_headers(build("rope").text)) == 2


def test_derived_limits():
    assert NPU2.herd_candidates == (8, 4, 2, 1)
    assert dataclasses.replace(NPU2, columns=4).herd_candidates == (4, 2, 1)
    assert NPU2.tile_channel_bytes_per_s == 4 * 1.8e9
    assert lint.BD_DIMS == {L1: NPU2.tile_bd_dims, L2: NPU2.memtile_bd_dims}

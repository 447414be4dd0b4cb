"""Stitching: one func.func per Program whose ABI is the Program's args, launches wired to the right args,
no SSA or symbol collisions, external kernel declarations merged and split into -D renamed variants."""
import re
from functools import lru_cache

import pytest

from torch_npu2.kernels import ModelDims, Program, programs_for_model
from torch_npu2.kernels.builders import KERNEL_OBJECTS
from torch_npu2.kernels.builders.ir import MemRef
from torch_npu2.kernels.program import Arg, Launch, Role
from torch_npu2.kernels.catalog import (decode_layers_program, o_gemv_ffn_program, rms_gemms_rope_program,
                                        rms_gemv_rope_program)
from torch_npu2.kernels.stitch import ObjectBuild, emit_mlir, stitch
from torch_npu2.kernels.mlir_text import index_constants

from .air_text import dma_endpoints, hierarchy

SMOL = ModelDims(576, 9, 3, 64, 1536, 49152, 1e-5)
LLAMA = ModelDims(2048, 32, 8, 64, 8192, 128256, 1e-5)
BUCKETS = [16, 32, 64, 128, 256, 512, 1024, 2048]


def all_programs():
    """Every Program of both models, and the integer-GEMM prefill Programs ("w8x2a16") at every bucket."""
    return [(f"{model}-{p.name}-{dict(p.params).get('rows', dict(p.params).get('seq', 1))}", p)
            for model, dims in (("smol", SMOL), ("llama", LLAMA))
            for p in [*programs_for_model(dims, BUCKETS),
                      *(p for p in programs_for_model(dims, BUCKETS, "w8x2a16") if p.name.endswith("_w8x2"))]]


PROGRAMS = all_programs()


@lru_cache(maxsize=None)
def stitched(index: int):
    return stitch(PROGRAMS[index][1])


def each_program():
    return pytest.mark.parametrize("index", range(len(PROGRAMS)), ids=[name for name, _ in PROGRAMS])


def func_signature(text, name):
    match = re.search(rf"func\.func @{name}\((.*)\) \{{", text)
    return re.findall(r"%(\w+): (memref<[^>]*>)", match.group(1))


def dataflow(text):
    """Per top-level air.launch, the func args its DMAs read from and write to, traced through the
    launch/segment/herd operand → block-argument bindings."""
    origin = {f"%{name}": name for name, _ in func_signature(text, r"\w+")}
    ops = hierarchy(text)
    for op in ops:  # text order: a binding's operand is resolved before the op's own block arguments
        for argument, operand in op.bindings:
            if operand in origin:
                origin[argument] = origin[operand]
    launches = []
    for launch in (op for op in ops if op.op == "launch"):
        reads, writes = set(), set()
        for dst, src in dma_endpoints(launch.body):
            if dst in origin:
                writes.add(origin[dst])
            if src in origin:
                reads.add(origin[src])
        launches.append((reads, writes, [operand.lstrip("%") for _, operand in launch.bindings]))
    return launches


def definitions(text):
    names = re.findall(r"^\s*(%[\w$.]+) = ", text, flags=re.M)
    names += re.findall(r"scf\.for (%[\w$.]+) =", text)
    for op in hierarchy(text):
        names += list(op.ids) + [argument for argument, _ in op.bindings]
    names += [f"%{n}" for n, _ in func_signature(text, r"\w+")]
    return names


def launch_sections(text):
    """The text of each launch, split at the stitcher's per-launch comments."""
    return re.split(r"\n    // launch \d+: ", text)[1:]


@each_program()
def test_func_signature_is_the_program_abi(index):
    name, program = PROGRAMS[index]
    text = stitched(index).text
    assert func_signature(text, program.name) == [(a.name, str(MemRef(a.shape, a.dtype))) for a in program.args]
    for i, a in enumerate(program.args):
        assert f"//   arg {i}: {a.name} ({a.role.value}) {MemRef(a.shape, a.dtype)}" in text


@each_program()
def test_each_launch_reads_and_writes_the_args_the_program_says(index):
    name, program = PROGRAMS[index]
    flows = dataflow(stitched(index).text)
    assert flows == [(set(launch.reads), set(launch.writes), list(launch.reads + launch.writes))
                     for launch in program.launches]


@each_program()
def test_no_ssa_or_symbol_collisions(index):
    name, program = PROGRAMS[index]
    text = stitched(index).text
    names = definitions(text)
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)
    owner = {}
    for i, section in enumerate(launch_sections(text)):
        for symbol in {op.name for op in hierarchy(section)}:
            assert symbol.startswith(f"l{i}_") and symbol not in owner, symbol
            owner[symbol] = i
    declared = re.findall(r"func\.func private @(\w+)\(", text)
    assert len(declared) == len(set(declared))
    called = set(re.findall(r"func\.call @(\w+)\(", text))
    assert called == set(declared)


@each_program()
def test_herds_link_the_objects_declaring_the_symbols_they_call(index):
    text = stitched(index).text
    object_of = dict(re.findall(r'func\.func private @(\w+)\([^)]*\) attributes \{link_with = "([^"]+)"', text))
    built = {b.object for b in stitched(index).objects}
    for herd in (op for op in hierarchy(text) if op.op == "herd"):
        calls = set(re.findall(r"func\.call @(\w+)\(", herd.body))
        assert {object_of[c] for c in calls} == ({herd.link_with} if herd.link_with else set())
        if herd.link_with:
            assert herd.link_with in built


@each_program()
def test_no_offset_uses_floordiv_or_mod(index):
    """AIR 0e3df89d folds loops into DMA access patterns as if every offset were linear in the loop indices
    (see rowwise.py): a floordiv or mod anywhere would be a miscompile waiting for a DMA to use it."""
    maps = re.findall(r"affine_map<[^>]*>", stitched(index).text)
    assert maps and not [m for m in maps if re.search(r"floordiv|ceildiv|\bmod\b", m)]


@each_program()
def test_every_loop_counts_trips_with_step_one(index):
    """AIR 0e3df89d folds a DMA's enclosing loop into its access pattern ignoring the loop's step (see
    LaunchBuilder.loop): a stepped scf.for anywhere would be a silent miscompile waiting for a DMA."""
    text = stitched(index).text
    steps = re.findall(r"scf\.for %[\w$.]+ = %[\w$.]+ to %[\w$.]+ step (%[\w$.]+)", text)
    constants = index_constants(text)
    assert steps and all(constants[step] == 1 for step in steps)


def test_rope_variants_get_suffixed_symbols_and_d_renamed_objects():
    program = rms_gemms_rope_program(576, 9, 3, 64, 1e-5, 64)
    result = stitch(program)
    declared = dict(re.findall(r'func\.func private @(\w+)\(([^)]*)\)', result.text))
    assert "memref<2304xbf16, 2 : i32>" in declared["rope_half_split_bf16"]      # 4 rows of 9 heads
    assert "memref<768xbf16, 2 : i32>" in declared["rope_half_split_bf16_v2"]    # 4 rows of 3 heads
    assert 'link_with = "rope_v2.o"' in launch_sections(result.text)[5]
    config = (("ROPE_HEAD_DIM", 64), ("ROPE_ROWS", 4))
    assert ObjectBuild("rope.o", "rope_half_split.cc", tuple(sorted(config + (("ROPE_HEADS", 9),)))) in result.objects
    assert ObjectBuild("rope_v2.o", "rope_half_split.cc", tuple(sorted(config + (("ROPE_HEADS", 3),))),
                       (("rope_half_split_bf16", "rope_half_split_bf16_v2"),)) in result.objects


def test_launches_with_one_configuration_share_one_build():
    """SmolLM2's decode projections of Q and K (N=768) and of V (N=192) are built alike (K=576, 2 rows a call), and
    their y buffers, padded to whole 64-byte L1 runs, give their calls one signature: one build (each once handed
    its own y size and took a second, renamed build). A second layer in the same dispatch calls the first layer's."""
    result = stitch(rms_gemv_rope_program(576, 9, 3, 64, 1e-5))
    sections = launch_sections(result.text)
    assert "@gemv_rows_bf16(" in sections[0] and "@gemv_rows_bf16(" in sections[1]
    gemv_builds = [b for b in result.objects if b.source == "gemv.cc"]
    assert [(b.object, dict(b.defines), b.renames) for b in gemv_builds] == [
        ("gemv.o", {"GEMV_K": 576, "GEMV_ROWS": 2}, ())]
    group = decode_layers_program(2, 576, 576, 1536, 1e-5, 9, 3, 64, 256, 1e-5)
    result = stitch(group)
    sections = launch_sections(result.text)
    per_layer = len(group.launches) // 2
    calls = [sorted(set(re.findall(r"func\.call @(\w+)\(", s))) for s in sections]
    assert calls[:per_layer] == calls[per_layer:]
    # one build per configuration of a layer's GEMV launches: 4 rows of K=576, 16 of 576, 4 of 1536, 2 of 576
    assert len([b for b in result.objects if b.source == "gemv.cc"]) == 4


def test_objects_cover_exactly_the_linked_kernels():
    result = stitch(o_gemv_ffn_program(2048, 2048, 8192, 1e-5))
    linked = set(re.findall(r'link_with = "([^"]+)"', result.text))
    assert {b.object for b in result.objects} == linked
    assert all(b.source == KERNEL_OBJECTS[re.sub(r"_v\d+\.o$", ".o", b.object)].source for b in result.objects)


def test_emit_mlir_is_the_stitched_text_and_deterministic():
    program = o_gemv_ffn_program(576, 576, 1536, 1e-5)
    assert emit_mlir(program) == stitch(program).text == emit_mlir(program)


def test_tuning_is_passed_to_the_indexed_launch():
    program = rms_gemms_rope_program(2048, 32, 8, 64, 1e-5, 2048)
    sections = launch_sections(stitch(program, tuning={1: {"herd_m": 4}}).text)
    assert "gemm M=2048 K=2048 N=2048: herd 4x4" in sections[1]
    assert "gemm M=2048 K=2048 N=512: herd 8x4" in sections[2]


def test_tuning_for_a_launch_the_program_lacks_is_refused():
    program = rms_gemms_rope_program(2048, 32, 8, 64, 1e-5, 2048)
    with pytest.raises(ValueError, match=r"rms_gemms_rope: tuning for launch index\(es\) \[6\], but it has launches 0..5"):
        stitch(program, tuning={1: {"herd_m": 4}, 6: {"herd_m": 4}})


def test_arg_names_that_would_clash_with_launch_prefixes_are_rejected():
    args = (Arg("l0_x", (16,), "bf16", Role.INPUT), Arg("o", (16,), "bf16", Role.OUTPUT))
    program = Program("clash", args, (Launch("add", (("cols", 16), ("rows", 1)), ("l0_x", "l0_x"), ("o",)),))
    with pytest.raises(ValueError, match="argument name 'l0_x' cannot be an SSA name"):
        stitch(program)


def test_a_groups_views_launches_move_their_arenas():
    """A decode group's scratches are views of one argument, and each layer's weights views of two: the function
    takes the arenas, each launch's DMAs read and write them where the Program names a view (a weight in the arena
    its layer's part is in: layer j's own, or layer j + 1's for the Q/K/V it chains into), the other arguments as
    before."""
    program = decode_layers_program(2, 256, 256, 512, 1e-5, 4, 2, 64, 128, 1e-5, first_qkv=True)
    text = stitch(program).text
    assert [n for n, _ in func_signature(text, program.name)] == [a.name for a in program.args]
    arena = {v.name: v.arena for v in program.views}
    assert len([n for n, a in arena.items() if a == "scratch_bf16"]) == 7
    assert [arena[n] for n in ("first_wqk", "wo_0", "next_wqk_0", "wo_1", "next_norm_w_1")] == [
        "weights_0", "weights_0", "weights_1", "weights_1", "norms_2"]
    as_args = lambda names: [arena.get(n, n) for n in names]  # noqa: E731
    assert dataflow(text) == [(set(as_args(l.reads)), set(as_args(l.writes)), as_args(l.reads + l.writes))
                              for l in program.launches]

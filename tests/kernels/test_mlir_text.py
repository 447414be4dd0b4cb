"""The one reader of printed MLIR: memref types, index constants, DMA operands and the op tree, on the forms the
builders emit and air-opt prints, and what it refuses."""
import pytest

from torch_npu2.kernels.mlir_text import (MemRefType, MlirTextError, dma_copies, index_constants, memref_types,
                                          parse_dma, parse_memref_type, parse_module, split_top)


def test_memref_types_read_shape_dtype_space_and_layouts():
    text = "(memref<64x32xbf16, 2 : i32>, memref<8x8xbf16, strided<[64, 1], offset: ?>, 1 : i32>, memref<128xi32>)"
    assert memref_types(text) == [MemRefType((64, 32), "bf16", 2), MemRefType((8, 8), "bf16", 1),
                                  MemRefType((128,), "i32", 0)]
    assert parse_memref_type("memref<f32, 2 : i32>") == MemRefType((), "f32", 2)
    with pytest.raises(MlirTextError, match="not a memref type"):
        parse_memref_type("vector<16xbf16>")
    with pytest.raises(MlirTextError, match="not a static memref type"):
        parse_memref_type("memref<?x64xbf16>")


def test_split_top_keeps_bracketed_commas():
    assert split_top("memref<4x4xbf16, 2 : i32>, %a[%c0, %c1], f(x, y)") == [
        "memref<4x4xbf16, 2 : i32>", "%a[%c0, %c1]", "f(x, y)"]
    assert split_top("") == []


def test_index_constants_and_conflicting_names():
    text = "%c0 = arith.constant 0 : index\n%c4 = arith.constant 4 : index\n%v = arith.constant 7 : i32\n"
    assert index_constants(text) == {"%c0": 0, "%c4": 4}
    clash = text + "%c4 = arith.constant 5 : index\n"
    assert index_constants(clash)["%c4"] == 5
    with pytest.raises(MlirTextError, match="%c4 names two different index constants"):
        index_constants(clash, distinct=True)


def test_dma_operands_in_the_builders_form_and_air_opts_async_form():
    ours = ("air.dma_memcpy_nd (%buf[%c0, %i] [%c8, %c8] [%c64, %c1], %arg2[] [] []) : "
            "(memref<8x8xbf16, 2 : i32>, memref<512xbf16>)")
    dma = parse_dma("    " + ours)
    assert (dma.dst.value, dma.dst.offsets, dma.dst.sizes, dma.dst.strides) == (
        "%buf", ("%c0", "%i"), ("%c8", "%c8"), ("%c64", "%c1"))
    assert (dma.src.value, dma.src.offsets) == ("%arg2", ())
    assert dma.types == (MemRefType((8, 8), "bf16", 2), MemRefType((512,), "bf16", 0))
    printed = ("%3 = air.dma_memcpy_nd async [%2] (%a[%c0] [%c8] [%c1], %b[%c8] [%c8] [%c1]) {id = 3 : i32} : "
               "(memref<8xbf16, 2 : i32>, memref<16xbf16, 1 : i32>)")
    assert [(d.dst.value, d.src.offsets) for d in dma_copies(f"{ours}\n{printed}\n")] == [
        ("%buf", ()), ("%a", ("%c8",))]
    assert parse_dma("air.dma_memcpy_nd (%a, %b) : (memref<8xbf16>, memref<8xbf16>)") is None


def test_the_op_tree_nests_regions_and_refuses_unbalanced_text():
    aliases, ops = parse_module("#map = affine_map<(d0)[] -> (d0 * 8)>\nmodule {\n  func.func @f() {\n"
                                "    %c0 = arith.constant 0 : index\n    return\n  }\n}\n")
    assert aliases == {"#map": "affine_map<(d0)[] -> (d0 * 8)>"}
    func = ops[0].regions[0][0]
    assert (ops[0].name, func.name, [op.name for op in func.regions[0]]) == (
        "module", "func.func", ["arith.constant", "return"])
    assert func.regions[0][0].results == ("%c0",)
    with pytest.raises(MlirTextError, match="unbalanced"):
        parse_module("module {\n  func.func @f() {\n}\n")

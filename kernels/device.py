"""The device the Programs are built for, as one record: array geometry, memories, DMA limits, the core's issue
width and clock, and the name the compilers know it by. The builders, lint, the pass pipelines, the L1 budgets
and the timing model read :data:`DEVICE`; nothing else in ``kernels/`` states a fact of the hardware.

A second device (AIE2, Phoenix's NPU1) would be a second record beside :data:`NPU2`, the kernels its cores
run (``kernels/aie2p/`` is AIE2P code) and :data:`DEVICE` set to it (ARCHITECTURE.md: "Adding a target").
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str                           # the compilers' device name: aircc --device, air-to-aie{device=}
    architecture: str                   # the cores': Peano's target, and kernels/<architecture>/ holds their kernels
    columns: int                        # compute-tile columns (each with a memtile and a shim tile below)
    rows: int                           # compute-tile rows
    # AIR's placement (aircc's defaults for the device): the rows and columns herds are placed over, the first
    # compute row (row 0 is the shim, row 1 the memtiles) and the first column
    placement_rows: int
    placement_columns: int
    row_offset: int
    column_offset: int
    l1_bytes: int                       # data memory per compute tile
    l2_bytes: int                       # one memtile
    # DMA: buffer descriptors per tile kind, channels per direction, and what one BD can express
    shim_bds: int
    tile_bds: int
    memtile_bds: int
    shim_channels_per_direction: int
    tile_channels_per_direction: int
    memtile_channels_per_direction: int
    tile_bd_dims: int                   # dimensions of a compute tile's BD
    memtile_bd_dims: int                # dimensions of a memtile's BD
    bd_dim_max_elements: int            # tile and memtile BDs: a dimension's size at most this
    bd_stride_limit_elements: int       # tile and memtile BDs: a stride below this
    shim_dims: int                      # a shim BD's dimensions, its iteration included
    shim_wrap_max: int                  # the shim BD's first two dimensions' wraps
    shim_iteration_max: int
    shim_stride_max_words: int
    dma_word_bytes: int                 # the unit of shim strides and of a DMA stream word
    # the core
    clock_hz: float
    vector_lanes: int                   # bf16 lanes whose f32 widening still fits one vector register
    mmul_granule: int                   # the bf16 matmul intrinsic's block side
    load_units: int                     # vector loads issued per cycle
    vector_align_bytes: int             # the widest vector load's alignment: an L1 buffer's start and size granule

    @property
    def herd_candidates(self) -> tuple[int, ...]:
        """Row-parallel herd widths, widest first: the powers of two up to the columns."""
        widths, width = [], 1
        while width <= self.columns:
            widths.insert(0, width)
            width *= 2
        return tuple(widths)

    @property
    def tile_channel_bytes_per_s(self) -> float:
        """A tile DMA channel moves one stream word per cycle (an assumption: the AIE-ML stream width)."""
        return self.dma_word_bytes * self.clock_hz


NPU2 = Device(
    name="npu2", architecture="aie2p", columns=8, rows=4,
    placement_rows=6, placement_columns=8, row_offset=2, column_offset=0,
    l1_bytes=64 * 1024,                 # mlir-aie's AIE2 target model, NPU2's base
    l2_bytes=512 * 1024,
    shim_bds=16, tile_bds=16, memtile_bds=48,
    shim_channels_per_direction=2, tile_channels_per_direction=2, memtile_channels_per_direction=6,
    tile_bd_dims=3, memtile_bd_dims=4,
    bd_dim_max_elements=512,            # aie.dma_bd: size >= 513 is rejected
    bd_stride_limit_elements=1 << 19,   # aie.dma_bd: the stride must stay below
    shim_dims=4,                        # three dimensions and the iteration
    shim_wrap_max=1023,                 # 10-bit wraps
    shim_iteration_max=64,              # 6-bit iteration count
    shim_stride_max_words=1 << 20,
    dma_word_bytes=4,
    # FACTS.md's 59 TFLOP/s peak for 32 tiles at one 8×8×8 BFP16 mmul (512 MACs) per cycle: 59e12 / (2·512·32) Hz
    clock_hz=1.8e9,
    vector_lanes=16, mmul_granule=8,
    load_units=2,                       # AIE-ML v2: two 512-bit load units, one 512-bit store unit (AMD UG1603)
    # A core drops the low bits of a vector load's address not aligned to the vector's size (aie_api detail/ld_st.hpp,
    # vector_ldst_align for __AIE_ARCH__ 21: 16/32/64 bytes for 128/256/512 bits).
    vector_align_bytes=64,
)

DEVICE = NPU2

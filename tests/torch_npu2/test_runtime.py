"""Runtime behaviour seen through the emulated driver's counters: syncs, hand-over, coherency, run states."""
import dataclasses
import gc
import types
import weakref
from pathlib import Path

import pytest
import torch

import torch_npu2
from torch_npu2 import NPURunError, create_runtime
from torch_npu2.targets import TargetUnavailable, resolve_target
from torch_npu2.emulator import EmulatedXrt
from torch_npu2.kernels.device import DEVICE
from torch_npu2.ops import ALL_OPS, reference

from ..ops.helpers import EPS, attn_args, decode_qkv_args, qkv_args

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ = 96, 6, 2, 16, 7


def pinned_qkv(runtime, seq=SEQ):
    x, norm_w, wq, wk, wv, lut = qkv_args(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, seq, gen=torch.Generator().manual_seed(1))
    return [x, *(runtime.pin(w) for w in (norm_w, wq, wk, wv)), lut]


def test_weights_sync_exactly_once_across_calls(runtime):
    args = pinned_qkv(runtime)
    weight_bytes = sum(t.numel() * 2 for t in args[1:5])
    for _ in range(3):
        x, lut = args[0].clone(), args[5].clone()  # new host tensors: copied in every call
        torch.ops.npu2.rms_gemms_rope(x, *args[1:5], lut, EPS)
    c = runtime.xrt.counters
    assert c["runs"] == 3
    assert c["syncs_to_device:weight"] == 4
    assert c["bytes_to_device:weight"] == weight_bytes
    assert c["syncs_to_device:input"] == 2 * 3  # x and the RoPE LUT, every call
    assert c["syncs_from_device:weight"] == 0 and c["syncs_to_device:scratch"] == 0
    assert runtime.stats["host_copy_bytes"] == 3 * (args[0].numel() + args[5].numel()) * 2


def test_a_weight_that_is_part_of_a_buffer_is_bound_in_place_and_its_whole_buffer_synced_once(runtime):
    """A patched layer's [Wq; Wk] is one buffer that prefill binds as two weights, Q's rows (the buffer's start) and
    K's (a part of it, as a sub-buffer): no host copy, the whole buffer synced once, so decode's op over the whole
    buffer reads every row as written (had only the rows of the first weight bound been synced, the strict
    emulator would serve K's rows as they were before)."""
    x, norm_w, wq, wk, wv, lut = qkv_args(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ, gen=torch.Generator().manual_seed(3))
    norm_w, wv = runtime.pin(norm_w), runtime.pin(wv)
    qk = runtime.pin(torch.cat((wq, wk)))
    q_rows, k_rows = qk[:wq.shape[0]], qk[wq.shape[0]:]
    copies, subs = runtime.stats["host_copies"], runtime.stats["sub_buffers"]
    for _ in range(2):
        out = torch.ops.npu2.rms_gemms_rope(x, norm_w, q_rows, k_rows, wv, lut, EPS)
    assert runtime.stats["host_copies"] == copies + 2 * 2  # x and the LUT only, every call
    assert runtime.stats["sub_buffers"] == subs + 1  # K's rows
    assert runtime.xrt.counters["syncs_to_device:weight"] == 3  # norm_w, wv, and [Wq; Wk] whole, once each
    assert runtime.xrt.counters["bytes_to_device:weight"] == norm_w.nbytes + wv.nbytes + qk.nbytes
    for got, want in zip(out, reference.rms_gemms_rope_reference(x, norm_w, wq, wk, wv, lut, EPS)):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
    decoded = torch.ops.npu2.rms_gemv_rope(x[0], norm_w, qk, wv, lut[0], EPS)
    for got, want in zip(decoded, reference.rms_gemv_rope_reference(x[0], norm_w, qk, wv, lut[0], EPS)):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


def test_a_host_input_is_copied_every_run_even_when_written_behind_torch(runtime):
    """A host tensor handed again to the same argument is copied into its staging buffer again: a write that
    leaves its version counter alone (NumPy, or inductor's kernels) must reach the device too."""
    args = pinned_qkv(runtime)
    x = args[0]
    for _ in range(3):
        torch.ops.npu2.rms_gemms_rope(*args, EPS)
    assert runtime.xrt.counters["syncs_to_device:input"] == 2 * 3
    version = x._version
    x.view(torch.int16).numpy()[:] = x.mul(0.5).view(torch.int16).numpy()
    assert x._version == version  # torch did not see the write
    out = torch.ops.npu2.rms_gemms_rope(*args, EPS)
    for got, want in zip(out, reference.rms_gemms_rope_reference(*args, EPS)):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


def test_programs_share_the_staging_buffer_of_a_host_weight(runtime):
    """Two prefill buckets given the same host (not BO-backed) weights, as packed weights' dequantized rows are: the
    second bucket's Program stages them into the first one's buffers, so memory does not grow with the buckets used;
    each run still copies them in."""
    gen = torch.Generator().manual_seed(2)
    weights = qkv_args(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ, gen=gen)[1:5]
    weight_bytes = sum(w.nbytes for w in weights)
    allocated = []
    for seq in (SEQ, SEQ + 9):
        x, _, _, _, _, lut = qkv_args(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, seq, gen=gen)
        before, copies = runtime.stats["bo_bytes"], runtime.stats["host_copy_bytes"]
        out = torch.ops.npu2.rms_gemms_rope(x, *weights, lut, EPS)
        allocated.append(runtime.stats["bo_bytes"] - before)
        assert runtime.stats["host_copy_bytes"] - copies == weight_bytes + x.nbytes + lut.nbytes
        for got, want in zip(out, reference.rms_gemms_rope_reference(x, *weights, lut, EPS)):
            torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
    assert allocated[0] >= weight_bytes > allocated[1]  # the second bucket allocated its inputs and outputs only


def test_output_handed_to_next_op_is_bound_as_its_bo_without_a_host_copy(runtime):
    v, q, k = torch.ops.npu2.rms_gemms_rope(*pinned_qkv(runtime), EPS)
    before_to_device = runtime.xrt.counters["bytes_to_device"]
    before_copies = runtime.stats["host_copies"]
    out = torch.ops.npu2.flash_attn(q, k, v, HEAD_DIM)
    assert runtime.stats["host_copies"] == before_copies
    # synced in place (a cache flush of their bytes), not copied
    assert runtime.xrt.counters["bytes_to_device"] - before_to_device == (q.numel() + k.numel() + v.numel()) * 2
    torch.testing.assert_close(out, reference.flash_attn_reference(q, k, v, HEAD_DIM), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("write", ["torch", "numpy"])
def test_host_write_to_an_output_is_synced_before_reuse(runtime, write):
    """Written in place through torch or behind torch's back (its version counter unchanged, as inductor's
    kernels write a reused buffer), an op output handed to the next op reaches the device as written."""
    v, q, k = torch.ops.npu2.rms_gemms_rope(*pinned_qkv(runtime), EPS)
    if write == "torch":
        q.mul_(0.5)
    else:
        version = q._version
        q.view(torch.int16).numpy()[:] = q.mul(0.5).view(torch.int16).numpy()
        assert q._version == version
    out = torch.ops.npu2.flash_attn(q, k, v, HEAD_DIM)
    torch.testing.assert_close(out, reference.flash_attn_reference(q, k, v, HEAD_DIM), atol=2e-2, rtol=2e-2)


def test_strict_emulator_catches_a_missing_sync(runtime):
    args = pinned_qkv(runtime)
    first = torch.ops.npu2.rms_gemms_rope(*args, EPS)[0].clone()
    args[4].mul_(2.0)  # wv written in place after it reached the device, without refresh()
    stale = torch.ops.npu2.rms_gemms_rope(*args, EPS)[0]
    assert torch.equal(stale, first), "strict coherency must serve the device's stale copy"
    runtime.refresh(args[4])
    fresh = torch.ops.npu2.rms_gemms_rope(*args, EPS)[0]
    torch.testing.assert_close(fresh, reference.rms_gemms_rope_reference(*args, EPS)[0], atol=3e-2, rtol=2e-2)
    assert not torch.equal(fresh, first)


def test_driver_level_missing_sync_reads_stale_data_only_in_strict_mode():
    for coherency, expect_stale in (("strict", True), ("fast", False)):
        xrt = EmulatedXrt(coherency=coherency)
        bo = xrt.ext.bo(xrt.device(0), 64)
        bo.map()[:] = b"\x01" * 64
        assert bool(bo.device_view(torch.uint8).eq(0).all()) == expect_stale
        bo.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
        assert bool(bo.device_view(torch.uint8).eq(1).all())


@pytest.mark.parametrize("state", ["ERT_CMD_STATE_TIMEOUT", "ERT_CMD_STATE_ERROR", "ERT_CMD_STATE_ABORT"])
def test_non_completed_run_state_raises_naming_program_and_state(runtime, state):
    runtime.xrt.injected_states.append(getattr(runtime.xrt.ert_cmd_state, state))
    with pytest.raises(NPURunError, match=rf"rms_gemms_rope finished in state .*{state}"):
        torch.ops.npu2.rms_gemms_rope(*pinned_qkv(runtime), EPS)


def test_output_buffers_are_reused_only_after_their_tensor_dies(runtime):
    args = attn_args(HEADS, KV_HEADS, HEAD_DIM, SEQ)
    kept = torch.ops.npu2.flash_attn(*args, HEAD_DIM)
    kept_view = kept[1:]
    del kept
    other = torch.ops.npu2.flash_attn(*args, HEAD_DIM)
    assert other.untyped_storage().data_ptr() != kept_view.untyped_storage().data_ptr()
    address = other.untyped_storage().data_ptr()
    del other
    again = torch.ops.npu2.flash_attn(*args, HEAD_DIM)
    assert again.untyped_storage().data_ptr() == address
    assert runtime.stats["pool_hits"] == 1


def test_one_loaded_context_per_program(runtime):
    args = attn_args(HEADS, KV_HEADS, HEAD_DIM, SEQ)
    for _ in range(3):
        torch.ops.npu2.flash_attn(*args, HEAD_DIM)
    assert runtime.stats["loads"] == 1 and runtime.cache.builds == 1


def test_pin_keeps_values_and_refresh_requires_bo_backing(runtime):
    t = torch.randn(5, 3).bfloat16()
    pinned = torch_npu2.pin(t)
    assert torch.equal(pinned, t) and runtime.is_bo_backed(pinned) and not runtime.is_bo_backed(t)
    runtime.refresh(pinned[1:])  # a view of a pinned weight at an offset: still its BO
    with pytest.raises(ValueError, match="not BO-backed"):
        runtime.refresh(t)


def test_backend_selection(monkeypatch):
    monkeypatch.setenv("TORCH_NPU2_BACKEND", "emulator")
    assert resolve_target().name == "emulator"
    monkeypatch.setenv("TORCH_NPU2_BACKEND", "gpu")
    with pytest.raises(ValueError, match=r"backend must be one of auto, npu2, emulator, got 'gpu' "
                                         r"\(from TORCH_NPU2_BACKEND\)"):
        resolve_target()
    monkeypatch.setenv("TORCH_NPU2_BACKEND", "auto")
    monkeypatch.setitem(__import__("sys").modules, "pyxrt", None)  # pyxrt absent, as on this machine
    assert resolve_target().name == "emulator"
    with pytest.raises(TargetUnavailable, match="the npu2 backend was requested but cannot run here:\n  pyxrt: "
                                                "cannot be imported"):
        resolve_target("npu2")


@pytest.mark.parametrize("call", [lambda: resolve_target("npu"), lambda: create_runtime(backend="npu"),
                                  lambda: torch_npu2.runtime.runtime_for("npu")])
def test_the_old_npu_spelling_is_refused_with_the_valid_names(call):
    with pytest.raises(ValueError, match=r"backend must be one of auto, npu2, emulator, got 'npu'"):
        call()


def test_strict_coherency_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_NPU2_BACKEND", "emulator")
    monkeypatch.setenv("TORCH_NPU2_EMULATOR_COHERENCY", "strict")
    assert create_runtime(cache_root=tmp_path).xrt.coherency == "strict"


def test_ops_reach_the_runtime_in_use(runtime):
    torch.ops.npu2.lm_head_gemv(torch.randn(8).bfloat16(), torch.randn(16, 8).bfloat16())
    assert runtime.xrt.counters["runs:lm_head_gemv"] == 1
    assert ALL_OPS["lm_head_gemv"] is torch.ops.npu2.lm_head_gemv.default


def test_emulator_artifact_carries_the_programs_mlir(runtime):
    import json

    from torch_npu2.kernels.catalog import flash_attn_program, lm_head_gemv_program

    torch.ops.npu2.lm_head_gemv(torch.randn(576).bfloat16(), torch.randn(49152, 576).bfloat16())
    torch.ops.npu2.flash_attn(*attn_args(HEADS, KV_HEADS, HEAD_DIM, SEQ), HEAD_DIM)

    def artifact(program):
        return json.loads((runtime.cache.entry_dir(program) / f"{program.name}.json").read_text())

    head = artifact(lm_head_gemv_program(576, 49152))
    assert head["mlir"].count("func.func @lm_head_gemv(") == 1 and head["mlir_problem"] is None
    attn = artifact(flash_attn_program(HEADS, KV_HEADS, HEAD_DIM, SEQ))  # 7 rows: no tiling of the NPU builder fits
    assert attn["mlir"] is None and "stack launch: rows=7: must be a multiple of 8" in attn["mlir_problem"]


@pytest.mark.parametrize("failure", [AssertionError("an emitter invariant"), KeyError("shape"),
                                     ValueError("unsupported tiling")])
def test_an_emitter_failure_cannot_stop_an_emulator_run(runtime, monkeypatch, failure):
    """The emulator never needs the MLIR its artifact carries for inspection: whatever the emitter raises is
    recorded in the artifact, and the run goes on."""
    import json

    from torch_npu2.kernels import stitch
    from torch_npu2.kernels.catalog import lm_head_gemv_program

    def broken_emitter(program):
        raise failure

    monkeypatch.setattr(stitch, "emit_mlir", broken_emitter)
    x, w = torch.randn(64).bfloat16(), torch.randn(32, 64).bfloat16()
    logits = torch.ops.npu2.lm_head_gemv(x, w)
    torch.testing.assert_close(logits.float(), (w.float() @ x.float()), rtol=2e-2, atol=2e-2)
    program = lm_head_gemv_program(64, 32)
    artifact = json.loads((runtime.cache.entry_dir(program) / f"{program.name}.json").read_text())
    assert artifact["mlir"] is None and artifact["mlir_problem"] == f"{type(failure).__name__}: {failure}"


def test_npu_target_without_toolchain_names_what_is_missing(tmp_path, monkeypatch):
    from torch_npu2.kernels import compile as pipeline

    monkeypatch.setattr(pipeline, "missing_toolchain", lambda: ["aircc (mlir-air): not on PATH"])
    rt = create_runtime(backend="npu2", driver=EmulatedXrt(), cache_root=tmp_path)
    with pytest.raises(pipeline.ToolchainMissing, match=r"cannot compile flash_attn for the NPU; missing:\n  aircc"):
        rt.load(__import__("torch_npu2").kernels.catalog.flash_attn_program(2, 1, 4, 8))


class _ReleaseRecordingDriver:
    """A pyxrt-shaped driver whose objects hold no references to one another (a C++ binding's handles need
    not), recording the order in which the runtime lets go of them."""

    class xclBOSyncDirection:
        XCL_BO_SYNC_BO_TO_DEVICE, XCL_BO_SYNC_BO_FROM_DEVICE = "to", "from"

    class ert_cmd_state:
        ERT_CMD_STATE_COMPLETED = "completed"

    class _Handle:
        def __init__(self, released, label):
            weakref.finalize(self, released.append, label)

    class _Bo(_Handle):
        def __init__(self, released, nbytes):
            super().__init__(released, "bo")
            self.data = bytearray(nbytes)

        def map(self):
            return memoryview(self.data)

        def sync(self, direction, nbytes, offset):
            pass

    class _Run(_Handle):
        def set_arg(self, index, bo):
            pass

        def start(self):
            pass

        def wait2(self):
            return "completed"

    def __init__(self):
        self.released = []
        self.ext = types.SimpleNamespace(bo=lambda device, nbytes: self._Bo(self.released, nbytes),
                                         kernel=lambda context, name: self._Handle(self.released, f"kernel {name}"))

    def device(self, index):
        return object()

    def elf(self, path):
        return self._Handle(self.released, f"elf {Path(path).stem}")

    def hw_context(self, device, elf):
        return self._Handle(self.released, "context")

    def run(self, kernel):
        return self._Run(self.released, "run")


def test_close_releases_driver_objects_in_reverse_order_of_creation(tmp_path):
    from torch_npu2.kernels.catalog import flash_attn_program, lm_head_gemv_program

    driver = _ReleaseRecordingDriver()
    rt = create_runtime(driver=driver, cache_root=tmp_path)
    attention, head = flash_attn_program(2, 1, 4, 8), lm_head_gemv_program(8, 16)
    outputs = rt.run(attention, [torch.zeros(8, 8).bfloat16(), torch.zeros(8, 4).bfloat16(),
                                 torch.zeros(8, 4).bfloat16()])
    outputs += rt.run(head, [torch.zeros(8).bfloat16(), torch.zeros(16, 8).bfloat16()])
    del outputs  # their BOs go back to the pool, which close empties
    assert driver.released == []
    rt.close()
    bos = driver.released.count("bo")
    assert bos == 5 + 1 + 2  # staging: q, k, v, x and w_lm; flash_attn's scratch kv; two pooled outputs
    assert driver.released == ["bo"] * bos + [
        "run", "kernel main:lm_head_gemv", "context", "elf lm_head_gemv",
        "run", "kernel main:flash_attn", "context", "elf flash_attn"]


def test_emulated_run_fails_while_an_argument_is_unbound_or_too_small(runtime):
    args = attn_args(HEADS, KV_HEADS, HEAD_DIM, SEQ)
    torch.ops.npu2.flash_attn(*args, HEAD_DIM)
    loaded = next(iter(runtime._loaded.values()))
    xrt, run = runtime.xrt, loaded.run
    completed, error = xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED, xrt.ert_cmd_state.ERT_CMD_STATE_ERROR
    fresh = xrt.run(loaded.kernel)  # nothing bound yet
    fresh.start()
    assert fresh.wait2() == error
    index, nbytes = loaded.output_plan[0][0], loaded.output_plan[0][3]
    fitting = run.bos[index]
    run.set_arg(index, xrt.ext.bo(runtime.device, nbytes - 1))
    run.start()
    assert run.wait2() == error
    run.set_arg(index, fitting)
    run.start()
    assert run.wait2() == completed


def test_a_view_into_an_op_output_at_an_offset_is_bound_as_a_sub_buffer_or_staged(runtime):
    """A tensor that starts inside a BO, at a whole shim DMA word, is bound as a sub-buffer of that BO from its
    offset (binding the BO itself would hand the kernel the rows before it) and its bytes are synced every run, as
    any input's (strict coherency: a host write reaches the device); a view at another offset is copied into a
    staging buffer."""
    q, k, v = attn_args(HEADS, KV_HEADS, HEAD_DIM, SEQ)
    wide = torch.ops.npu2.flash_attn(torch.cat([q, q * 2]), torch.cat([k, k]), torch.cat([v, v]), HEAD_DIM)
    tail = wide[SEQ:]  # rows SEQ.. of a BO-backed output: same storage, an offset of whole words
    assert runtime.is_bo_backed(tail) and tail.storage_offset() * 2 % 4 == 0 < tail.storage_offset()
    copies, subs = runtime.stats["host_copies"], runtime.stats["sub_buffers"]
    again = torch.ops.npu2.flash_attn(tail, k, v, HEAD_DIM)
    assert runtime.stats["host_copies"] == copies + 2  # k and v (host tensors); the view is bound in place
    assert runtime.stats["sub_buffers"] == subs + 1
    torch.testing.assert_close(again, reference.flash_attn_reference(tail, k, v, HEAD_DIM), atol=2e-2, rtol=2e-2)
    tail.mul_(-1)  # a host write: the next run syncs the sub-buffer's bytes
    negated = torch.ops.npu2.flash_attn(tail, k, v, HEAD_DIM)
    assert runtime.stats["sub_buffers"] == subs + 1  # the same place: the same sub-buffer
    torch.testing.assert_close(negated, reference.flash_attn_reference(tail, k, v, HEAD_DIM), atol=2e-2, rtol=2e-2)

    odd = wide.view(-1)[1:1 + tail.numel()].view(tail.shape)  # one element in: 2 bytes past a DMA word
    copies = runtime.stats["host_copies"]
    shifted = torch.ops.npu2.flash_attn(odd, k, v, HEAD_DIM)
    assert runtime.stats["host_copies"] == copies + 3 and runtime.stats["sub_buffers"] == subs + 1
    torch.testing.assert_close(shifted, reference.flash_attn_reference(odd, k, v, HEAD_DIM), atol=2e-2, rtol=2e-2)


def test_a_second_sequences_slab_is_read_in_place_and_never_synced_by_a_run(runtime):
    """Sequence 1's slab of a (2, capacity, kv_dim) state cache starts inside the BO: decode attention reads it
    through a sub-buffer without copying or syncing it, so only the rows the host synced with sync_written are on
    the strict emulator's device (a row written but not synced stays stale there, and the output is wrong)."""
    heads, kv_heads, head_dim, capacity = 2, 1, 64, 128
    gen = torch.Generator().manual_seed(5)
    k, v = (runtime.empty_state((2, capacity, kv_heads * head_dim), torch.bfloat16) for _ in range(2))
    q = torch.randn(heads * head_dim, generator=gen).bfloat16()
    length = torch_npu2.ops.decode_attn_length(11)
    for slab in (k, v):
        slab[1, :11] = torch.randn(11, kv_heads * head_dim, generator=gen).bfloat16()
        runtime.sync_written(slab[1, :11])
    copies, to_device = runtime.stats["host_copies"], runtime.xrt.counters["bytes_to_device"]
    out = torch.ops.npu2.decode_attn(q, k[1], v[1], length, head_dim)
    torch.testing.assert_close(out, reference.decode_attn_reference(q, k[1], v[1], length, head_dim),
                               atol=2e-2, rtol=2e-2)
    assert runtime.stats["host_copies"] == copies + 2  # q and the length (host tensors)
    assert runtime.xrt.counters["bytes_to_device"] - to_device == heads * head_dim * 2 + 4 * 2

    k[1, 10] = torch.randn(kv_heads * head_dim, generator=gen).bfloat16() * 4  # not synced
    stale = torch.ops.npu2.decode_attn(q, k[1], v[1], length, head_dim)
    assert not torch.allclose(stale, reference.decode_attn_reference(q, k[1], v[1], length, head_dim),
                              atol=2e-2, rtol=2e-2), "a run synced the state slab"


def _decode_attn_over_a_state_cache(runtime, sync_rows):
    """A 128-row empty_state cache whose first 10 rows the host writes; then row 10 (the new token's) is written
    and ``sync_rows(k, v)`` decides what reaches the device; returns decode_attn's output and its reference."""
    heads, kv_heads, head_dim, capacity = 2, 1, 64, 128
    gen = torch.Generator().manual_seed(3)
    k, v = (runtime.empty_state((capacity, kv_heads * head_dim), torch.bfloat16) for _ in range(2))
    q = torch.randn(heads * head_dim, generator=gen).bfloat16()
    for slab in (k, v):
        slab[:10] = torch.randn(10, kv_heads * head_dim, generator=gen).bfloat16()
        runtime.sync_written(slab[:10])
    for slab in (k, v):
        slab[10] = torch.randn(kv_heads * head_dim, generator=gen).bfloat16() * 4
    sync_rows(k, v)
    length = torch_npu2.ops.decode_attn_length(11)
    return (torch.ops.npu2.decode_attn(q, k, v, length, head_dim),
            reference.decode_attn_reference(q, k, v, length, head_dim))


def test_state_rows_reach_the_device_only_by_their_ranged_sync(runtime):
    """An empty_state tensor (a KV cache's slab) is never synced by a run: the row the host wrote reaches the strict
    emulator's device only through sync_written of that row, which moves its bytes and no others. Syncing the
    wrong row (a write outside the synced range) leaves the device's stale bytes, and the output is wrong."""
    before = runtime.xrt.counters["bytes_to_device"]
    out, want = _decode_attn_over_a_state_cache(runtime, lambda k, v: [runtime.sync_written(s[10]) for s in (k, v)])
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    row_bytes, q_and_length_bytes = 64 * 2, 2 * 64 * 2 + 4 * 2
    assert runtime.xrt.counters["bytes_to_device"] - before == 2 * 11 * row_bytes + q_and_length_bytes

    out, want = _decode_attn_over_a_state_cache(runtime, lambda k, v: [runtime.sync_written(s[11]) for s in (k, v)])
    assert not torch.allclose(out, want, atol=2e-2, rtol=2e-2), "a row outside the synced range reached the device"


def test_sync_written_refuses_what_is_not_state(runtime):
    with pytest.raises(ValueError, match="not a view of an empty_state tensor"):
        runtime.sync_written(runtime.pin(torch.zeros(4, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="not a view of an empty_state tensor"):
        runtime.sync_written(torch.zeros(4))


def test_device_only_data_is_written_by_one_run_and_read_by_another_and_never_synced(runtime):
    """An empty_device tensor (prefill's dequantized weights) an op's ``.into`` writes and another op binds as a weight:
    no byte of it crosses between host and device either way, and the second op reads what the first wrote on the
    device (on the strict emulator the host view stays as it was made: zeros). The host cannot sync it as state."""
    from torch_npu2.kernels import quant
    from torch_npu2.ops import INTO

    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 256, generator=gen) / 16).bfloat16()
    packed = runtime.pin(quant.quantize_q4_1(w).view(torch.int32))  # a weight's buffer: synced once
    weight = runtime.empty_device((64, 256), torch.bfloat16)
    x = torch.randn(256, generator=gen).bfloat16()
    exact = quant.dequantize(quant.Q4_1, packed, 256).bfloat16()
    INTO[ALL_OPS["dequantize_rows"]](packed, weight, 256, "q4_1")  # compiled and loaded before counting
    to_device, from_device = runtime.xrt.counters["bytes_to_device"], runtime.xrt.counters["bytes_from_device"]
    INTO[ALL_OPS["dequantize_rows"]](packed, weight, 256, "q4_1")
    assert runtime.xrt.counters["bytes_from_device"] == from_device  # nothing read back
    assert runtime.xrt.counters["bytes_to_device"] == to_device  # the packed weight was synced by the first run
    assert not weight.any()  # the host view was never written
    logits = torch.ops.npu2.lm_head_gemv(x, weight)
    torch.testing.assert_close(logits, reference.lm_head_gemv_reference(x, exact), rtol=1e-4, atol=1e-4)
    assert runtime.xrt.counters["bytes_to_device"] - to_device == x.nbytes  # x; the weight went nowhere
    with pytest.raises(ValueError, match="not a view of an empty_state tensor"):
        runtime.sync_written(weight)


def test_a_part_of_device_only_data_that_cannot_be_bound_in_place_is_refused(runtime):
    """Staging a view of an empty_device buffer would copy its host view, which holds nothing: as an output ``.into``
    writes (not contiguous) or as an argument (not at a whole DMA word), a view that cannot be bound in place is
    refused before the run, naming the argument."""
    from torch_npu2.kernels import quant
    from torch_npu2.ops import INTO

    packed = quant.quantize_q4_1(torch.ones(64, 256).bfloat16()).view(torch.int32)
    wide = runtime.empty_device((64, 512), torch.bfloat16)
    runs = runtime.stats["runs"]
    with pytest.raises(ValueError, match="dequantize_rows: argument 'out' is a view of an empty_device buffer that "
                                         "cannot be bound in place"):
        INTO[ALL_OPS["dequantize_rows"]](packed, wide[:, :256], 256, "q4_1")
    odd = runtime.empty_device((64 * 256 + 1,), torch.bfloat16)[1:].view(64, 256)  # 2 bytes into its buffer
    with pytest.raises(ValueError, match="lm_head_gemv: argument 'w_lm' is a view of an empty_device buffer"):
        torch.ops.npu2.lm_head_gemv(torch.ones(256).bfloat16(), odd)
    assert runtime.stats["runs"] == runs


def test_emulated_ranged_sync_stays_inside_its_bo():
    xrt = EmulatedXrt(coherency="strict")
    bo = xrt.ext.bo(xrt.device(0), 64)
    bo.map()[:] = b"\x01" * 64
    bo.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE, 8, 16)
    assert bo.device_view(torch.uint8).nonzero().flatten().tolist() == list(range(16, 24))
    with pytest.raises(RuntimeError, match="outside a 64-byte BO"):
        bo.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE, 8, 60)


def test_emulated_sub_buffer_shares_its_parents_bytes_and_stays_inside_it():
    """pyxrt's bo(parent, size, offset): a device write through the sub-buffer is the parent's device bytes at the
    offset, and a ranged sync of the parent brings just those to the host (strict coherency keeps them apart until
    then)."""
    xrt = EmulatedXrt(coherency="strict")
    parent = xrt.ext.bo(xrt.device(0), 64)
    sub = xrt.bo(parent, 8, 16)
    assert sub.size() == 8
    sub.device_view(torch.uint8)[:] = 7
    assert bytes(parent.map()) == bytes(64), "the host sees device writes only after a sync"
    parent.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE, 8, 16)
    assert [i for i, b in enumerate(parent.map().tobytes()) if b] == list(range(16, 24))
    assert parent.map().tobytes()[16] == 7 == sub.map().tobytes()[0]
    with pytest.raises(RuntimeError, match="does not fit its 64-byte parent"):
        xrt.bo(parent, 8, 60)
    with pytest.raises(RuntimeError, match="offset 18, not a multiple of the shim DMA's 4-byte word"):
        xrt.bo(parent, 8, 18)


def test_an_output_given_a_place_is_written_there_and_left_out_of_the_results(runtime):
    """run(..., into=): a part of a state tensor receives the output through a sub-buffer (no copy: the strict
    emulator shows it only after the read-back of its bytes); a plain tensor through a copy; a tensor of the wrong
    size is refused by name."""
    x, norm_w, wqk, wv, lut = decode_qkv_args(64, 2, 1, 32)
    v, q, k = ALL_OPS["rms_gemv_rope"](x, norm_w, wqk, wv, lut, EPS)
    program = next(iter(runtime._loaded.values())).program
    state = runtime.empty_state((4, 32), torch.bfloat16)
    state.zero_()
    runtime.sync_written(state)
    copies = runtime.stats["host_copies"]
    (q_only,) = runtime.run(program, [x, norm_w, wqk, wv, lut], into={0: state[2], 2: state[1]})
    assert torch.equal(q_only, q) and torch.equal(state[2], v) and torch.equal(state[1], k)
    assert not state[0].any() and not state[3].any()
    assert runtime.stats["host_copies"] == copies + 5  # the host-tensor arguments' staging only
    plain = torch.zeros(32, dtype=torch.bfloat16)
    runtime.run(program, [x, norm_w, wqk, wv, lut], into={0: plain})
    assert torch.equal(plain, v)
    subs, copies = runtime.stats["sub_buffers"], runtime.stats["host_copies"]
    odd = runtime.empty_state((80,), torch.bfloat16)  # a row at an odd element: 2 bytes past a DMA word
    runtime.run(program, [x, norm_w, wqk, wv, lut], into={0: odd[1:33]})
    assert torch.equal(odd[1:33], v) and runtime.stats["sub_buffers"] == subs
    assert runtime.stats["host_copies"] == copies + 6  # staged: the five host arguments and this output
    device = runtime._resident[odd.data_ptr()].bo.device_view(torch.bfloat16)
    assert torch.equal(device[1:33], v), "the copy into state reaches the device"
    with pytest.raises(ValueError, match="output v is 32 torch.bfloat16 elements, the tensor given for it 31"):
        runtime.run(program, [x, norm_w, wqk, wv, lut], into={0: state[0, :31]})


def _arena_qkv(runtime, scale=1.0):
    """pinned_qkv's arguments with the four weights parts of one BO (an arena, as a decode layer's), each at a whole
    shim DMA word."""
    x, norm_w, wq, wk, wv, lut = qkv_args(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ, gen=torch.Generator().manual_seed(1))
    weights = [norm_w, wq * scale, wk, wv]
    arena = runtime.empty((sum(w.numel() for w in weights),), torch.bfloat16)
    parts, start = [], 0
    for w in weights:
        assert start * 2 % DEVICE.dma_word_bytes == 0
        part = arena[start:start + w.numel()].view(w.shape)
        part.copy_(w)
        parts.append(part)
        start += w.numel()
    return [x, *parts, lut]


def test_weights_bound_as_parts_of_a_buffer_keep_their_binding(runtime, monkeypatch):
    """Weights that are parts of a BO (a decode layer's arena) are bound as sub-buffers once per set, like whole
    BOs: alternating sets re-bind nothing; a freed set's binding is dropped with its arena; a binding whose arena
    address now holds another buffer (a freed arena's memory reused) is bound again."""
    sets = [_arena_qkv(runtime), _arena_qkv(runtime, scale=-1.0)]
    parts_bound = []  # the weights bound as sub-buffers (inputs are bound on every run)
    bind_part = runtime._bind_part
    monkeypatch.setattr(runtime, "_bind_part", lambda loaded, index, nbytes, tensor, is_weight=False: (
        is_weight and parts_bound.append(index)) or bind_part(loaded, index, nbytes, tensor, is_weight))

    def run_and_check(args):
        for got, expected in zip(torch.ops.npu2.rms_gemms_rope(*args, EPS),
                                 reference.rms_gemms_rope_reference(*args, EPS)):
            torch.testing.assert_close(got, expected, atol=3e-2, rtol=2e-2)

    for _ in range(3):
        for args in sets:
            run_and_check(args)
    # each set's parts but the first (at the arena's start: bound as the BO itself), on its first run only
    assert len(parts_bound) == 2 * 3
    assert runtime.stats["bindings"] == 2 and runtime.xrt.counters["syncs_to_device:weight"] == 2
    [loaded] = runtime._loaded.values()
    freed = weakref.ref(runtime._resident[sets[1][1].untyped_storage().data_ptr()])
    del sets[1], args
    gc.collect()
    assert freed() is None and len(loaded.bindings) == 1  # its binding, which held its BO, went with it
    home = sets[0][1].untyped_storage().data_ptr()
    buffer = runtime._resident[home]
    monkeypatch.setitem(runtime._resident, home, dataclasses.replace(buffer, parts={}, weight_synced=False))
    run_and_check(sets[0])
    assert len(parts_bound) == 3 * 3 and runtime.xrt.counters["syncs_to_device:weight"] == 3


def test_each_weight_set_keeps_its_own_binding_and_freed_weights_are_rebound(runtime):
    """Layers share a Program: each set of pinned weights gets a run of its own, bound and synced once, so
    alternating sets neither re-bind nor re-sync them; a weight refreshed before its set's first run, and a set
    pinned after another was freed, are synced before they are used."""
    sets = [pinned_qkv(runtime), pinned_qkv(runtime)]
    sets[1][2].mul_(-1)
    runtime.refresh(sets[1][2])
    for _ in range(3):
        for args in sets:
            out = torch.ops.npu2.rms_gemms_rope(*args, EPS)
            want = reference.rms_gemms_rope_reference(*args, EPS)
            for got, expected in zip(out, want):
                torch.testing.assert_close(got, expected, atol=3e-2, rtol=2e-2)
    assert runtime.stats["bindings"] == 2
    assert runtime.xrt.counters["syncs_to_device:weight"] == 2 * 4
    del sets[1]
    fresh = pinned_qkv(runtime)
    fresh[3].mul_(3)
    runtime.refresh(fresh[3])
    out = torch.ops.npu2.rms_gemms_rope(*fresh, EPS)
    for got, expected in zip(out, reference.rms_gemms_rope_reference(*fresh, EPS)):
        torch.testing.assert_close(got, expected, atol=3e-2, rtol=2e-2)
    assert runtime.xrt.counters["syncs_to_device:weight"] == 3 * 4

"""How bytes move: loaded contexts, BO-backed tensors, the output allocator and the coherency discipline.

The runtime talks to a pyxrt-shaped driver only (real ``pyxrt`` or ``EmulatedXrt``) and knows Programs,
never models. A BO-backed tensor is an ordinary CPU tensor whose storage is a BO's host mapping; a
registry maps that storage back to its BO, so a tensor handed to ``run`` is bound as its BO with no copy (a weight
or input that is a contiguous part of one, from a whole DMA word, as a sub-buffer of it: ``_bind_part``).

Coherency has one owner, ``Runtime.run``: a weight's whole BO is synced to the device once (a weight may be a part
of one; ``refresh`` after writing one in place); every input is synced (its own bytes only, if it is part of a BO;
or copied into its staging buffer and synced) before every run, and
outputs are synced back after every run (an output the caller gives a place, ``run``'s ``into``, is written there
through a sub-buffer and only its bytes come back). The exception is state the host writes in pieces
(``empty_state``: a KV cache's slabs): a run never syncs it; each host write reaches the device by ``sync_written``,
a ranged sync of just the bytes written (XRT's ``bo.sync(direction, size, offset)``), so a prefill or a reordered
cache moves the rows written, not the whole cache (a decode token's K/V rows the NPU writes itself, through
``into``). Data only runs write and read (``empty_device``: prefill's dequantized weights) is never synced at all.
Inputs do not trust tensor version counters: torch.compile's
inductor reuses a dead op output's storage for its own kernels' results, written through raw pointers that
leave the version unchanged, so "the device already holds this version" would serve stale bytes. An
input's sync costs a cache flush of its bytes; the decode inputs are a few KB.
"""
from __future__ import annotations

import math
import weakref
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from .artifact_cache import ArtifactCache
from .kernels.device import DEVICE
from .kernels.program import TORCH_DTYPES, Program, Role
from .targets import AUTO, TARGETS, Target, check_backend, resolve_target
# XRT allocates BOs in whole pages; rounding pool sizes up lets nearby sizes share buffers.
PAGE = 4096
# Sub-buffers an input's BO keeps for reuse (``_Buffer.parts``): a KV cache's slabs are bound at one place per
# sequence and length bucket, token after token; past this many places all are dropped and made again as needed.
MAX_PARTS_PER_BUFFER = 64


class NPURunError(RuntimeError):
    """A run finished in a state other than COMPLETED."""


@dataclass(eq=False)
class _Buffer:
    bo: object
    mapping: np.ndarray  # uint8 view of bo.map(), taken once per BO
    weight_synced: bool = False  # a weight's bytes are on the device (weights are synced once)
    synced_by_writer: bool = False  # ``empty_state``'s: the host syncs what it writes (``sync_written``), runs never
    device_only: bool = False  # ``empty_device``'s: only runs write it and read it; nothing syncs it either way
    in_bindings: bool = False  # a kept binding holds it as a weight (``Runtime._forget``)
    # (byte offset, bytes) → a sub-buffer of ``bo`` that inputs at that place were bound as (``Runtime._bind_part``)
    parts: dict = field(default_factory=dict)

    def tensor(self, shape, dtype: torch.dtype):
        """A tensor over the mapping, and its ``lease``: the object whose lifetime is the tensor storage's."""
        numel = 1
        for d in shape:
            numel *= d
        return self.flat_tensor(numel, shape, dtype)

    def flat_tensor(self, numel: int, shape: tuple, dtype: torch.dtype):
        """``tensor`` with the element count known; a 1-D shape skips the view (the decode outputs' case)."""
        lease = self.mapping[: numel * dtype.itemsize]
        flat = torch.frombuffer(lease, dtype=dtype)
        return (flat if len(shape) == 1 else flat.view(shape)), lease


@dataclass(eq=False)
class _Staging:
    """A buffer for an argument given as a host tensor (not BO-backed), and a view over it."""

    buffer: _Buffer
    view: torch.Tensor


@dataclass(eq=False)
class _Binding:
    """A run object of a Program with one set of weights bound (and synced) for good: the decode layers share their
    Programs, so each layer's weights get a run of their own instead of being re-bound on every run."""

    run: object
    bound: list  # the BO bound to each argument
    # where each weight's BO mapping starts (the weight's own address, or its parent's for a part of one), and the
    # buffer the runtime found there when it was bound
    homes: list
    buffers: list
    epoch: int  # the runtime's weight epoch when its weights were bound and synced; -1: re-bind on every run


@dataclass(eq=False)
class LoadedProgram:
    """A loaded artifact plus per-argument plans computed once from its Program (the decode hot path
    runs these for every layer of every token)."""

    program: Program
    elf: object
    context: object
    kernel: object
    run: object  # the run of the binding in use (``bindings``)
    host_plan: tuple[tuple[int, bool, int], ...]  # (arg index, is weight, nbytes) per weight/input
    weight_plan: tuple[tuple[int, tuple[int, bool, int]], ...]  # (position among the tensors, its host_plan entry)
    input_plan: tuple[tuple[int, tuple[int, bool, int]], ...]
    output_plan: tuple[tuple[int, tuple, torch.dtype, int, int, int], ...]  # (arg index, shape, dtype, nbytes,
    #                                                                           numel, pool size)
    bound: list = field(default_factory=list)
    scratch: dict[int, object] = field(default_factory=dict)  # arg index → its BO
    bindings: dict[tuple, _Binding] = field(default_factory=dict)  # weights' host addresses → their binding


def _storage_died(runtime_ref, address: int) -> None:
    """The finalizer of an ``empty`` buffer's tensor storage (a weak reference: a live tensor does not keep its
    runtime alive)."""
    runtime = runtime_ref()
    if runtime is not None:
        runtime._forget(address)


class Runtime:
    def __init__(self, driver, backend: str, cache: ArtifactCache):
        """``backend``: the name of the target whose artifacts it runs (``--backend``, ``TORCH_NPU2_BACKEND``)."""
        self.xrt, self.backend, self.cache = driver, backend, cache
        self.device = driver.device(0)
        self._sync_to = driver.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE
        self._sync_from = driver.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE
        self._completed = driver.ert_cmd_state.ERT_CMD_STATE_COMPLETED
        self._loaded: dict[str, LoadedProgram] = {}
        self._resident: dict[int, _Buffer] = {}  # host address of a BO mapping → its buffer
        self._pool: dict[int, list[_Buffer]] = defaultdict(list)
        self._leases: dict[int, weakref.ref] = {}  # address → weakref to the lease of a pooled buffer in use
        # (arg index, shape, dtype) → the staging buffer of every Program with such an argument: a model's prefill
        # buckets share one per weight given as a host tensor (packed weights dequantized per call) instead of each
        # keeping a copy. Safe because runs are one at a time and each copies its host arguments in first.
        self._staging: dict[tuple, _Staging] = {}
        self._weight_epoch = 0  # moves when a weight is refreshed: every binding syncs its weights again
        self._in_run = self._dropping = False
        self._died: list[_Buffer] = []  # buffers whose tensors died during a run: their bindings go after it
        self.stats: Counter = Counter()

    # -- buffers ---------------------------------------------------------------------------------

    def _new_buffer(self, nbytes: int) -> _Buffer:
        bo = self.xrt.ext.bo(self.device, nbytes)
        self.stats["bo_allocs"] += 1
        self.stats["bo_bytes"] += nbytes
        return _Buffer(bo, np.frombuffer(bo.map(), np.uint8))

    def _lease(self, numel: int, shape: tuple, dtype: torch.dtype, size: int) -> tuple[torch.Tensor, _Buffer]:
        """A BO-backed tensor from the caching pool (``size``: ``_pool_size`` of its bytes); its BO returns to
        the pool when the storage dies."""
        free = self._pool[size]
        if free:
            buffer = free.pop()
            self.stats["pool_hits"] += 1
        else:
            buffer = self._new_buffer(size)
            self.stats["pool_misses"] += 1
        tensor, lease = buffer.flat_tensor(numel, shape, dtype)
        address = tensor.data_ptr()  # a fresh tensor over the mapping's start: its storage's address
        self._resident[address] = buffer
        # A weakref callback (cheaper than weakref.finalize on this hot path) returns the BO when the
        # tensor's storage, the lease's only owner, dies; the weakref lives in _leases until then.
        self._leases[address] = weakref.ref(lease, lambda _, a=address, b=buffer: self._return_to_pool(a, size, b))
        return tensor, buffer

    @staticmethod
    def _pool_size(nbytes: int) -> int:
        return -(-nbytes // PAGE) * PAGE

    def _return_to_pool(self, address: int, size: int, buffer: _Buffer) -> None:
        self._resident.pop(address, None)
        self._leases.pop(address, None)
        self._pool[size].append(buffer)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A BO-backed copy of ``tensor`` (for weights): synced to the device on first use, then never again."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise ValueError(f"pin: expected a CPU tensor, got {type(tensor).__name__} on "
                             f"{getattr(tensor, 'device', None)}")
        pinned = self.empty(tuple(tensor.shape), tensor.dtype)
        pinned.copy_(tensor)
        return pinned

    def empty(self, shape: tuple, dtype: torch.dtype, synced_by_writer: bool = False,
              device_only: bool = False) -> torch.Tensor:
        """An uninitialized BO-backed tensor of its own BO, resident until its storage dies (``pin``'s buffer);
        ``synced_by_writer``: ``empty_state``'s, ``device_only``: ``empty_device``'s."""
        buffer = self._new_buffer(max(math.prod(shape) * dtype.itemsize, 1))
        buffer.synced_by_writer = synced_by_writer or device_only
        buffer.device_only = device_only
        tensor, lease = buffer.tensor(shape, dtype)
        address = tensor.untyped_storage().data_ptr()
        self._resident[address] = buffer
        weakref.finalize(lease, _storage_died, weakref.ref(self), address).atexit = False  # nothing to free then
        return tensor

    def _forget(self, address: int) -> None:
        """The tensor over the buffer at ``address`` died: the buffer is no longer resident, and the runs that bound
        it as a weight (``_Binding``: they hold its BO) are dropped, so that its memory goes with it (a model's
        weights after unpatch_llama, or after the model is deleted). During a run, after it."""
        buffer = self._resident.pop(address, None)
        if buffer is None or not buffer.in_bindings:
            return
        self._died.append(buffer)
        if not (self._in_run or self._dropping):
            self._drop_bindings_of_dead()

    def _drop_bindings_of_dead(self) -> None:
        """Drop the kept runs that bound a buffer of ``_died``; buffers that die meanwhile (a collection the scan
        sets off) join the next pass, not a scan of their own."""
        self._dropping = True
        try:
            while self._died:
                died, self._died = self._died, []  # held through the pass: their ids stay theirs
                dead = {id(buffer) for buffer in died}
                for loaded in list(self._loaded.values()):
                    for key, binding in list(loaded.bindings.items()):
                        if not any(id(x) in dead for x in binding.buffers):
                            continue
                        del loaded.bindings[key]
                        if loaded.run is binding.run:  # the run in use: the next binding makes a fresh one (no
                            loaded.run, loaded.bound = None, []  # driver calls from a finalizer)
        finally:
            self._dropping = False

    def empty_state(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """``empty`` for state the host writes in pieces and ops read (a KV cache's slabs): runs never sync it; every
        host write must be followed by ``sync_written`` of the bytes written, or the device keeps its old bytes."""
        return self.empty(shape, dtype, synced_by_writer=True)

    def empty_device(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """``empty`` for data that only runs write and read (prefill's dequantized weights: one run writes them through
        ``run``'s ``into``, others bind them): never synced to or from the device, so its host view holds nothing
        meaningful (on an NPU, or the emulator with strict coherency) and the host must neither read nor write it."""
        return self.empty(shape, dtype, device_only=True)

    def sync_written(self, view: torch.Tensor) -> None:
        """Sync to the device just the bytes of ``view``, a view of an ``empty_state`` tensor the host has written:
        one ranged sync per contiguous piece (a view that is not contiguous is taken apart along its first dim)."""
        buffer = self._resident.get(view.untyped_storage().data_ptr())
        if buffer is None or not buffer.synced_by_writer or buffer.device_only:
            raise ValueError("sync_written: the tensor is not a view of an empty_state tensor")
        if view.numel() == 0:
            return
        if not view.is_contiguous():
            for piece in view.unbind(0):
                self.sync_written(piece)
            return
        nbytes = view.numel() * view.element_size()
        buffer.bo.sync(self._sync_to, nbytes, view.storage_offset() * view.element_size())
        self.stats["ranged_syncs"] += 1
        self.stats["ranged_sync_bytes"] += nbytes

    def is_bo_backed(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._resident

    def refresh(self, tensor: torch.Tensor) -> None:
        """Mark a BO-backed weight written by the host since its last sync, so the next run syncs it (inputs
        need no such call: they are synced before every run)."""
        buffer = self._resident.get(tensor.untyped_storage().data_ptr())
        if buffer is None:
            raise ValueError("refresh: the tensor is not BO-backed (pin it or pass it to an op first)")
        buffer.weight_synced = False
        self._weight_epoch += 1

    # -- programs --------------------------------------------------------------------------------

    def load(self, program: Program) -> LoadedProgram:
        """One loaded context per artifact per process."""
        loaded = self._loaded.get(program.key)
        if loaded is None:
            path = self.cache.get(program)
            elf = self.xrt.elf(str(path))
            context = self.xrt.hw_context(self.device, elf)
            kernel = self.xrt.ext.kernel(context, f"main:{program.name}")
            run = self.xrt.run(kernel)
            args = program.args
            host_plan = tuple((i, args[i].role is Role.WEIGHT, args[i].nbytes)
                              for i in program.indices(Role.WEIGHT, Role.INPUT))
            loaded = LoadedProgram(
                program, elf, context, kernel, run, host_plan=host_plan,
                weight_plan=tuple((p, entry) for p, entry in enumerate(host_plan) if entry[1]),
                input_plan=tuple((p, entry) for p, entry in enumerate(host_plan) if not entry[1]),
                output_plan=tuple((i, args[i].shape, TORCH_DTYPES[args[i].dtype], args[i].nbytes, args[i].numel,
                                   self._pool_size(args[i].nbytes)) for i in program.indices(Role.OUTPUT)),
                bound=[None] * len(args),
            )
            for i in program.indices(Role.SCRATCH):
                loaded.scratch[i] = self._new_buffer(program.args[i].nbytes).bo
                self._bind(loaded, i, loaded.scratch[i])
            self._loaded[program.key] = loaded
            self.stats["loads"] += 1
        return loaded

    def _bind(self, loaded: LoadedProgram, index: int, bo) -> None:
        if loaded.bound[index] is not bo:
            loaded.run.set_arg(index, bo)
            loaded.bound[index] = bo

    def _bind_host_arg(self, loaded: LoadedProgram, index: int, is_weight: bool, nbytes: int,
                       tensor: torch.Tensor) -> None:
        """Bind the BO for a weight or input argument, syncing it as its role requires: a weight's BO once, an
        input every run (its bytes may have changed without its version counter moving)."""
        # Bound as its BO only when it starts where a BO mapping starts: its storage is that mapping (no storage
        # can begin before one mapping and reach into another), at offset 0. One data_ptr() call tells both.
        buffer = self._resident.get(tensor.data_ptr())
        if buffer is None:
            if not self._bind_part(loaded, index, nbytes, tensor, is_weight):
                self._stage(loaded, index, nbytes, tensor)
            return
        bo = buffer.bo
        if loaded.bound[index] is not bo:  # _bind, inlined: this runs for every weight of every decode run
            loaded.run.set_arg(index, bo)
            loaded.bound[index] = bo
        if buffer.synced_by_writer:  # its writes were synced as they were made
            return
        if not is_weight:
            bo.sync(self._sync_to, nbytes, 0)
            self.stats["bo_inputs_synced"] += 1
        elif not buffer.weight_synced:
            self._sync_weight(buffer)

    def _sync_weight(self, buffer: _Buffer) -> None:
        """A weight's whole BO to the device, once: the weight bound may be only a part of it (a decode layer's
        [Wq; Wk], of which prefill binds Q's and K's rows as two weights), and ``weight_synced`` is the BO's."""
        buffer.bo.sync(self._sync_to, len(buffer.mapping), 0)
        buffer.weight_synced = True

    def _part(self, tensor: torch.Tensor) -> tuple[_Buffer, int] | None:
        """(its buffer, its byte offset) when ``tensor`` is a contiguous part of a BO-backed tensor that a sub-buffer
        can be bound to: one starting at a whole shim DMA word, since a sub-buffer is a DMA's base address."""
        buffer = self._resident.get(tensor.untyped_storage().data_ptr())
        offset = tensor.storage_offset() * tensor.element_size()
        if buffer is None or offset % DEVICE.dma_word_bytes or not tensor.is_contiguous():
            return None
        return buffer, offset

    def _bind_part(self, loaded: LoadedProgram, index: int, nbytes: int, tensor: torch.Tensor,
                   is_weight: bool = False) -> bool:
        """Bind a weight or input that is part of a BO-backed tensor (``_part``: K's rows of a layer's [Wq; Wk], a KV
        cache slab of a batch's second sequence, a row of a batch's output) as a sub-buffer of its BO, syncing a
        weight's whole BO once, an input's bytes every run unless the host syncs what it writes there; False if it
        is no such part (the caller stages a copy)."""
        part = self._part(tensor)
        if part is None:
            return False
        buffer, offset = part
        bo = buffer.parts.get((offset, nbytes))
        if bo is None:
            if len(buffer.parts) >= MAX_PARTS_PER_BUFFER:
                buffer.parts.clear()  # a run that still binds one holds it
            bo = buffer.parts[(offset, nbytes)] = self.xrt.bo(buffer.bo, nbytes, offset)
            self.stats["sub_buffers"] += 1
        if loaded.bound[index] is not bo:
            loaded.run.set_arg(index, bo)
            loaded.bound[index] = bo
        if buffer.synced_by_writer:
            return True
        if not is_weight:
            bo.sync(self._sync_to, nbytes, 0)
            self.stats["bo_inputs_synced"] += 1
        elif not buffer.weight_synced:
            self._sync_weight(buffer)
        return True

    def _refuse_device_only(self, loaded: LoadedProgram, index: int, tensor: torch.Tensor) -> None:
        """A part of an ``empty_device`` buffer that cannot be bound in place would be staged, i.e. copied through its
        host view, which holds nothing: refused, naming the argument."""
        buffer = self._resident.get(tensor.untyped_storage().data_ptr())
        if buffer is not None and buffer.device_only:
            raise ValueError(f"{loaded.program.name}: argument '{loaded.program.args[index].name}' is a view of an "
                             "empty_device buffer that cannot be bound in place (it must be contiguous and start at a "
                             f"multiple of {DEVICE.dma_word_bytes} bytes): its bytes exist only on the device")

    def _stage(self, loaded: LoadedProgram, index: int, nbytes: int, tensor: torch.Tensor) -> None:
        """Bind the staging buffer of a host tensor argument and copy the tensor in."""
        self._refuse_device_only(loaded, index, tensor)
        arg = loaded.program.args[index]
        key = (index, arg.shape, arg.dtype)
        staged = self._staging.get(key)
        if staged is None:
            buffer = self._new_buffer(nbytes)
            staged = self._staging[key] = _Staging(buffer, buffer.tensor(arg.shape, TORCH_DTYPES[arg.dtype])[0])
        self._bind(loaded, index, staged.buffer.bo)
        staged.view.copy_(tensor)
        staged.buffer.bo.sync(self._sync_to, nbytes, 0)
        self.stats["host_copies"] += 1
        self.stats["host_copy_bytes"] += nbytes

    def _use_binding(self, loaded: LoadedProgram, key: tuple, tensors) -> None:
        """Make the binding of these weights (``key``: their host addresses) the one ``loaded`` runs with: a run of
        its own, its weights bound and synced, as whole BOs or parts of one (sub-buffers). Weights staged (host
        tensors, copied in) are bound again on every run."""
        binding = loaded.bindings.get(key)
        if binding is None:
            self.stats["bindings"] += 1
        # the first takes the run ``load`` made (unless dropped with its weights: ``_drop_bindings_of_dead``)
        if binding is None and not loaded.bindings and loaded.run is not None:
            binding = loaded.bindings[key] = _Binding(loaded.run, loaded.bound, [], [], -1)
        elif binding is None:
            binding = _Binding(self.xrt.run(loaded.kernel), [None] * len(loaded.program.args), [], [], -1)
            if len(loaded.bindings) < 256:  # a model's layers, with room; past that, a binding is made per run
                loaded.bindings[key] = binding
            loaded.run, loaded.bound = binding.run, binding.bound
            for index, bo in loaded.scratch.items():
                self._bind(loaded, index, bo)
        loaded.run, loaded.bound = binding.run, binding.bound
        epoch = self._weight_epoch
        binding.homes, binding.buffers = [], []
        for position, (index, is_weight, nbytes) in loaded.weight_plan:
            self._bind_host_arg(loaded, index, is_weight, nbytes, tensors[position])
            bound = loaded.bound[index]
            home = tensors[position].untyped_storage().data_ptr()
            buffer = self._resident.get(home)
            # bound as its buffer's BO or a sub-buffer of it, not a staging buffer
            if buffer is None or not (bound is buffer.bo or bound in buffer.parts.values()):
                home = buffer = None
            binding.homes.append(home)
            binding.buffers.append(buffer)
        if loaded.bindings.get(key) is binding:  # kept: it holds these buffers' BOs until they die
            for buffer in binding.buffers:
                if buffer is not None:
                    buffer.in_bindings = True
        binding.epoch = epoch if None not in binding.buffers else -1

    def run(self, program: Program, tensors, into: dict | None = None) -> tuple[torch.Tensor, ...]:
        """Run ``program`` on ``tensors`` (its weights and inputs, in ELF order, each contiguous: the ops refuse
        others, and a strided view would be bound as the memory it starts at); returns its outputs.

        ``into``: {output position: tensor} for outputs the caller gives a place (a KV cache's row): the NPU writes
        them there and they are left out of the result. A contiguous part of a BO-backed tensor at a whole DMA word
        is bound as a sub-buffer of its BO (``xrt.bo(parent, size, offset)``), so the device writes it in place and
        only its bytes are synced back; any other tensor gets a pooled output BO, copied into it after the run."""
        self._in_run = True
        try:
            return self._run(program, tensors, into)
        finally:
            self._in_run = False
            if self._died:
                self._drop_bindings_of_dead()

    def _run(self, program: Program, tensors, into: dict | None) -> tuple[torch.Tensor, ...]:
        loaded = self._loaded.get(program.key) or self.load(program)
        key = tuple([tensors[position].data_ptr() for position, _ in loaded.weight_plan])
        binding = loaded.bindings.get(key)
        # valid while no weight was refreshed and each weight's BO is still the buffer it was (a freed weight's
        # address may come back as another buffer; a part's address lies in its parent's mapping while that lives)
        if (binding is None or binding.epoch != self._weight_epoch
                or list(map(self._resident.get, binding.homes)) != binding.buffers):
            self._use_binding(loaded, key, tensors)
        else:
            loaded.run, loaded.bound = binding.run, binding.bound
        for position, (index, is_weight, nbytes) in loaded.input_plan:
            self._bind_host_arg(loaded, index, is_weight, nbytes, tensors[position])
        outputs, buffers, placed = [], [], []
        for position, (index, shape, dtype, nbytes, numel, size) in enumerate(loaded.output_plan):
            target = into.get(position) if into else None
            if target is not None:
                returned = self._bind_into(loaded, index, nbytes, target, numel, shape, dtype, size)
                if returned is not None:
                    placed.append(returned)
                continue
            out, buffer = self._lease(numel, shape, dtype, size)
            outputs.append(out)
            buffers.append((buffer, nbytes))
            self._bind(loaded, index, buffer.bo)
        loaded.run.start()
        state = loaded.run.wait2()
        if state != self._completed:
            raise NPURunError(f"NPU run of {program.name} finished in state {state} (expected "
                              f"{self._completed}); its outputs are not valid")
        for buffer, nbytes in buffers:
            buffer.bo.sync(self._sync_from, nbytes, 0)
        for bo, nbytes, offset, target, staged in placed:
            bo.sync(self._sync_from, nbytes, offset)
            if staged is not None:
                target.copy_(staged)
                self.stats["host_copies"] += 1
                self.stats["host_copy_bytes"] += nbytes
                state = self._resident.get(target.untyped_storage().data_ptr())
                if state is not None and state.synced_by_writer:  # a host write to state: its bytes to the device
                    self.sync_written(target)
        self.stats["runs"] += 1
        return tuple(outputs)

    def _bind_into(self, loaded: LoadedProgram, index: int, nbytes: int, target: torch.Tensor, numel: int,
                   shape: tuple, dtype: torch.dtype, size: int) -> tuple:
        """Bind output ``index`` to ``target`` (``run``'s ``into``); returns what to sync (and copy) after the run
        (None for an ``empty_device`` target: nothing):
        (BO, bytes, offset, target, the staged output or None)."""
        if target.numel() != numel or target.dtype is not dtype:
            raise ValueError(f"{loaded.program.name}: output {loaded.program.args[index].name} is {numel} "
                             f"{dtype} elements, the tensor given for it {target.numel()} {target.dtype}")
        part = self._part(target)
        if part is None:
            self._refuse_device_only(loaded, index, target)
            staged, lease = self._lease(numel, shape, dtype, size)
            self._bind(loaded, index, lease.bo)
            return lease.bo, nbytes, 0, target, staged
        buffer, offset = part
        if offset == 0 and nbytes == buffer.bo.size():
            bo = buffer.bo
        else:
            bo = self.xrt.bo(buffer.bo, nbytes, offset)
            self.stats["sub_buffers"] += 1
        loaded.run.set_arg(index, bo)
        loaded.bound[index] = bo  # holds a sub-buffer while it is bound
        return None if buffer.device_only else (buffer.bo, nbytes, offset, target, None)

    def close(self) -> None:
        """Release the driver objects this runtime holds in reverse order of creation, as pyxrt asks: first the
        BOs (pooled outputs, staging buffers, each Program's scratch buffers), then, newest Program first, its run,
        kernel, hw_context and ELF. Each is dropped explicitly rather than left to the order in which Python
        happens to free them. BOs behind live tensors (pinned weights, outputs still held) go when those
        tensors die. The runtime stays usable: a later run loads its Program again."""
        self._pool.clear()
        self._staging.clear()
        newest_first = list(reversed(self._loaded.values()))
        self._loaded.clear()
        for loaded in newest_first:
            loaded.scratch.clear()
            for bound in [b.bound for b in loaded.bindings.values()]:
                bound[:] = [None] * len(bound)
            loaded.bound = [None] * len(loaded.bound)
        for loaded in newest_first:
            loaded.bindings.clear()  # their runs, with the Program's own
            for driver_object in ("run", "kernel", "context", "elf"):
                setattr(loaded, driver_object, None)


def create_runtime(backend: str | None = None, driver=None, cache_root=None) -> Runtime:
    """A runtime on the target ``backend`` names (see torch_npu2/targets), or, with an explicit pyxrt-shaped
    ``driver``, one that drives it but builds and caches artifacts for ``backend`` (default: the emulator)."""
    if driver is None:
        target: Target = resolve_target(backend)
        driver = target.open_driver()
    else:
        target = TARGETS[check_backend(backend) if backend not in (None, AUTO) else "emulator"]
    return Runtime(driver, target.name, target.cache(cache_root))


_current: Runtime | None = None


def get_runtime() -> Runtime:
    global _current
    if _current is None:
        _current = create_runtime()
    return _current


def runtime_for(backend: str = AUTO) -> Runtime:
    """The process-wide runtime, created for ``backend`` if none exists yet; an explicit backend must match it."""
    global _current
    check_backend(backend)
    if _current is None:
        _current = create_runtime(None if backend == AUTO else backend)
    if backend != AUTO and _current.backend != backend:
        raise ValueError(f"backend={backend!r} was requested but this process already runs on the "
                         f"{_current.backend} runtime")
    return _current


@contextmanager
def use_runtime(runtime: Runtime):
    """Make ``runtime`` the one ops run on, inside the ``with`` block (tests, benchmarks)."""
    global _current
    previous, _current = _current, runtime
    try:
        yield runtime
    finally:
        _current = previous


__all__ = ["Runtime", "NPURunError", "create_runtime", "get_runtime", "runtime_for", "use_runtime"]

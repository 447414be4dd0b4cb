"""patch_llama / unpatch_llama: route a HF Llama model's decoder layers and LM head through the npu2 ops."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import runtime as npu_runtime
from ..host_memory import release_free_heap
from ..kernels import MATMUL_PRECISIONS, int_gemm, programs_for_model, quant
from ..kernels.catalog import (AUTO_PRECISION, DECODE_GROUP_SIZES, DECODE_WEIGHTS, INTEGER_PRECISION,
                               RESCORED_LM_HEAD, integer_gemm_misfit, layer_arenas, lm_head_rows,
                               resolve_matmul_precision)
from ..kernels.stitch import npu2_build_problem
from .kv_cache import NpuKVCache
from .layer import (NpuDecoderLayer, NpuFinalNorm, NpuLmHead, PackedProjections, PrefillSettings, PreparedProjections,
                    SharedState, copy_error_bound)
from .gguf_file import PROJECTIONS, GgufFile
from .spill import WeightSpill
from .families import ModelFamily, family_of, supported
from .transformers_compat import check_transformers

DEFAULT_BUCKETS = tuple(2 ** i for i in range(4, 12))  # 16 … 2048
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
LM_HEADS = ("auto", "bf16", RESCORED_LM_HEAD)  # patch_llama's lm_head choices
STATE_ATTR = "_torch_npu2_patch"
# RoPE types whose frequencies are fixed at the module's creation: a position's cos/sin never change (_RotaryTable)
STATIC_ROPE_TYPES = ("default", "linear", "llama3")
ROPE_TABLE_CHUNK = 1024  # positions a _RotaryTable grows by, at least
ROPE_TABLE_POSITIONS = 1 << 17  # the most it holds (Llama-3.2's context; 32 MB in bf16): later positions go to HF
SLICE_MEMO_ATTR = "_torch_npu2_slice"  # model.model.layers' last slice while patched (_LayerListWithSliceMemo)
GGUF_PATH_ATTR = "_torch_npu2_gguf"  # set by models.load_model on a model loaded packed: the file its blocks are in
# set by models.load_model on a model loaded packed from a HF checkpoint: the CheckpointPacker its weights come from
CHECKPOINT_ATTR = "_torch_npu2_checkpoint"


@dataclass
class PatchState:
    shared: SharedState
    modules: list = field(default_factory=list)  # (module, attribute name, saved value or None)
    weights: tuple = ("bf16", "bf16")  # what decode reads: (projections' format, LM head's format)
    spill: WeightSpill | None = None  # bf16 weights decode reads packed copies of, mapped from a file until unpatch
    # Linears whose weight was never loaded in bf16 (meta, from load_model's packed GGUF path): (module, format, words)
    unloaded: list = field(default_factory=list)


def _fail(message: str) -> ValueError:
    return ValueError(f"patch_llama: {message}; the model was not modified")


def _validate(model, buckets, matmul_precision, weights="bf16", from_file=frozenset()) -> ModelFamily:
    config = model.config
    family = family_of(config)
    if family is None:
        raise _fail(f"model_type {getattr(config, 'model_type', None)!r} ({type(model).__name__}) is not supported; "
                    f"supported model types: {supported()}")
    if not isinstance(model, family.causal_lm_class()):
        raise _fail(f"expected a {family.causal_lm} for model_type {family.model_type!r}, got {type(model).__name__}")
    _check_biases(model, family)
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention"
                                                          for t in getattr(config, "layer_types", None) or ()):
        raise _fail("sliding-window attention (config.use_sliding_window, config.layer_types) is not supported: "
                    "flash_attn and decode_attn attend to every earlier position")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _fail(f"unknown rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    act = type(model.model.layers[0].mlp.act_fn) if len(model.model.layers) else nn.SiLU
    if not any(issubclass(act, silu) for silu in _silu_modules()):
        raise _fail(f"config.hidden_act={config.hidden_act!r} ({act.__name__}) is not supported: the fused FFN "
                    "computes SiLU(gate) * up (hidden_act 'silu')")
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    method = getattr(method, "value", method)
    if quant is not None and method != "gguf":  # GGUF checkpoints load dequantized to plain bf16
        raise _fail(f"quantized models are not supported (quantization method {method!r}); load it in bf16")
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
            raise _fail(f"{name} is a {type(module).__name__}, expected a plain nn.Linear (quantized layer?)")
    for name, param in model.named_parameters():
        if param.dtype != torch.bfloat16:
            raise _fail(f"parameter {name} has dtype {param.dtype}, expected torch.bfloat16 "
                        "(load with dtype=torch.bfloat16 or call model.to(torch.bfloat16))")
        if param.device.type == "meta" and id(param) not in from_file:
            raise _fail(f"parameter {name} was never loaded (it is on the meta device); only the projections and LM "
                        "head of a model load_model loaded packed may be (a GGUF file's: patched with gguf=that file)")
        if param.device.type not in ("cpu", "meta"):
            raise _fail(f"parameter {name} is on {param.device}, expected cpu (the NPU shares host memory)")
    if matmul_precision not in MATMUL_PRECISIONS:
        raise _fail(f"matmul_precision must be {AUTO_PRECISION!r} or one of {', '.join(map(repr, MATMUL_PRECISIONS))}, "
                    f"got {matmul_precision!r}")
    if weights not in DECODE_WEIGHTS:
        raise _fail(f"weights must be one of {', '.join(map(repr, DECODE_WEIGHTS))}, got {weights!r}")
    if matmul_precision == INTEGER_PRECISION:
        misfit = integer_gemm_misfit(family.dims(config))
        if misfit is not None:
            raise _fail(f"matmul_precision={misfit}")
    return family


def _check_biases(model, family: ModelFamily) -> None:
    """The biases the fused ops add are the family's: Q/K/V when it has them, never O or the MLP's."""
    for index, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name, module in (("q_proj", attn.q_proj), ("k_proj", attn.k_proj), ("v_proj", attn.v_proj)):
            if (module.bias is not None) != family.qkv_bias:
                raise _fail(f"layer {index} {name} {'has' if module.bias is not None else 'lacks'} a bias, but "
                            f"model_type {family.model_type!r} runs Q/K/V projections "
                            f"{'with' if family.qkv_bias else 'without'} one: attention or MLP bias other than the "
                            "family's is not supported by the fused ops (config.attention_bias/mlp_bias)")
        for name, module in (("o_proj", attn.o_proj), ("gate_proj", mlp.gate_proj), ("up_proj", mlp.up_proj),
                             ("down_proj", mlp.down_proj)):
            if module.bias is not None:
                raise _fail(f"layer {index} {name} has a bias: attention or MLP bias is not supported by the fused "
                            "ops here (config.attention_bias/mlp_bias)")


def _head_format(lm_head: str, weights: str, head_weights: str) -> tuple[str, bool]:
    """(the format the LM head's GEMV reads, whether its rows are a copy of the bf16 weight that rescoring reads) for
    patch_llama's ``lm_head``, given the projections' and the LM head's own formats; a ValueError naming it
    otherwise."""
    if lm_head not in LM_HEADS:
        raise _fail(f"lm_head must be one of {', '.join(map(repr, LM_HEADS))}, got {lm_head!r}")
    if weights != "bf16":
        if lm_head != "auto":
            raise _fail(f"lm_head={lm_head!r} chooses between copies of a bf16 LM head; with weights={weights!r} the "
                        f"LM head is packed as {head_weights!r} (lm_head='auto')")
        return head_weights, False
    return ("bf16", False) if lm_head == "bf16" else (RESCORED_LM_HEAD, True)


def _bucket_lengths(prefill_buckets) -> tuple[int, ...]:
    """``prefill_buckets`` as sorted unique lengths; a TypeError or ValueError naming it otherwise."""
    expected = "positive ints in a non-empty iterable such as (16, 32, 64)"
    try:
        lengths = list(prefill_buckets)
    except TypeError:
        raise TypeError(f"patch_llama: prefill_buckets must be {expected}, got {prefill_buckets!r}; "
                        "the model was not modified") from None
    if not lengths or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in lengths):
        raise _fail(f"prefill_buckets must be {expected}, got {prefill_buckets!r}")
    return tuple(sorted(set(lengths)))


def _silu_modules() -> tuple[type, ...]:
    """The activation modules HF builds for hidden_act 'silu'/'swish' (what the fused FFN computes)."""
    from transformers.activations import ACT2FN

    return (nn.SiLU, type(ACT2FN["silu"]), type(ACT2FN["swish"]))


def _check_npu2_builds(model, family: ModelFamily, buckets, matmul_precision, target: str, weights="bf16",
                       head_weights=None) -> None:
    """Every Program the model needs against the NPU2 builders' constraints: an error on the NPU, where
    nothing could run; a warning on the emulator, which runs them anyway."""
    programs = programs_for_model(family.dims(model.config), buckets, matmul_precision, weights, head_weights)
    problems = [(program, npu2_build_problem(program)) for program in programs]
    problems = [f"{program.name} ({', '.join(f'{k}={v}' for k, v in program.params)}): {problem}"
                for program, problem in problems if problem]
    if not problems:
        return
    listing = "\n  ".join(problems)
    if target == "npu2":
        raise _fail(f"{len(problems)} of the model's Programs cannot be compiled for NPU2:\n  {listing}")
    warnings.warn(f"patch_llama: {type(model).__name__} runs here on the emulated NPU2, but {len(problems)} of its "
                  f"Programs cannot be compiled for NPU2:\n  {listing}", stacklevel=3)


def _set_instance_attr(state: PatchState, module, attr: str, value) -> None:
    state.modules.append((module, attr, module.__dict__.get(attr)))
    setattr(module, attr, value)


def _replace_forward(state: PatchState, module, forward) -> None:
    """Instance-level patch; with accelerate hooks attached, the hook's saved forward is the one replaced."""
    attr = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
    _set_instance_attr(state, module, attr, forward)


def _join_final_norm(state: PatchState, norm, lm_head: NpuLmHead) -> None:
    """The model's final norm hands HF what the last decode group computed for it (layer.NpuFinalNorm), so that group
    runs the final norm and the LM head in its dispatch; HF's own forward (accelerate's saved one when hooked) does
    every other call."""
    hooked = hasattr(norm, "_hf_hook") and hasattr(norm, "_old_forward")
    final = NpuFinalNorm(norm, norm._old_forward if hooked else norm.forward, lm_head, state.shared)
    _replace_forward(state, norm, final)
    state.shared.head = final


class _LayerListWithSliceMemo(nn.ModuleList):
    """``model.model.layers`` while patched. HF's model forward loops over ``layers[:num_hidden_layers]`` on every
    call, and slicing a ModuleList builds a new one that registers every layer again (≈ 30 µs per decode token at 16
    layers): the last slice is handed out again while this list and that slice hold the same layers as then (a
    changed list, or a slice someone changed, gets a new slice)."""

    def __getitem__(self, idx):
        if not isinstance(idx, slice) or torch.compiler.is_compiling():
            return super().__getitem__(idx)
        layers = tuple(self._modules.values())
        memo = self.__dict__.get(SLICE_MEMO_ATTR)
        if memo is not None and memo[0] == idx and memo[1] == layers and tuple(memo[2]._modules.values()) == memo[3]:
            return memo[2]
        sliced = super().__getitem__(idx)
        # in __dict__ directly: a ModuleList set as an attribute would become a child module
        self.__dict__[SLICE_MEMO_ATTR] = (idx, layers, sliced, tuple(sliced._modules.values()))
        return sliced


def _memoize_layer_slices(state: PatchState, layers: nn.ModuleList) -> None:
    """Give ``layers`` (HF's ModuleList of decoder layers, not a subclass of it) the slice memo until unpatch_llama."""
    if type(layers) is not nn.ModuleList:  # a subclass may slice its own way
        return
    _set_instance_attr(state, layers, SLICE_MEMO_ATTR, None)
    state.modules.append((layers, "__class__", nn.ModuleList))
    layers.__class__ = _LayerListWithSliceMemo


class _RotaryTable:
    """The rotary embedding's forward while patched, for a RoPE whose frequencies are fixed (``STATIC_ROPE_TYPES``).
    HF computes a decode step's cos/sin anew on every forward (≈ 20 µs a token); here each position's come from a
    table that HF's own forward filled, for a chunk of positions, the first time a step reached past it: the same
    values bit for bit, since they are elementwise in the position. Calls of several positions per sequence
    (prefill), under torch.compile, past ROPE_TABLE_POSITIONS, or after the frequencies changed go to HF's forward."""

    def __init__(self, rotary, forward):
        self.rotary, self.forward = rotary, forward  # HF's module and its forward
        self.tables: dict = {}  # (dtype, device) → (its inv_freq, that tensor's version, cos, sin)

    def __call__(self, x, position_ids=None, **kwargs):
        if (kwargs or not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
                or position_ids.shape[1] != 1 or position_ids.dtype != torch.long or torch.compiler.is_compiling()):
            return self.forward(x, position_ids, **kwargs)
        positions = position_ids.view(-1).tolist()
        top = max(positions)
        if min(positions) < 0 or top >= ROPE_TABLE_POSITIONS:
            return self.forward(x, position_ids)
        key, inv_freq = (x.dtype, x.device), self.rotary.inv_freq
        table = self.tables.get(key)
        if table is not None and (table[0] is not inv_freq or table[1] != inv_freq._version):
            table = None  # the frequencies changed: the table is made again
        if table is None or top >= len(table[2]):
            table = self.tables[key] = self._grown(x, table, top + 1)
        return table[2][position_ids], table[3][position_ids]

    def _grown(self, x, table, needed: int) -> tuple:
        """``table`` (None: none yet) grown to hold at least ``needed`` positions: at least twice as many as before,
        in whole ROPE_TABLE_CHUNK, the new positions computed by HF's forward."""
        start = 0 if table is None else len(table[2])
        stop = min(max(2 * start, -(-needed // ROPE_TABLE_CHUNK) * ROPE_TABLE_CHUNK), ROPE_TABLE_POSITIONS)
        cos, sin = (t[0] for t in self.forward(x, torch.arange(start, stop, device=x.device)[None]))
        if table is not None:
            cos, sin = torch.cat([table[2], cos]), torch.cat([table[3], sin])
        inv_freq = self.rotary.inv_freq
        return inv_freq, inv_freq._version, cos, sin


def _tabulate_rotary(state: PatchState, rotary) -> None:
    """Put a _RotaryTable in front of the model's rotary embedding when its RoPE's frequencies are fixed."""
    if getattr(rotary, "rope_type", None) not in STATIC_ROPE_TYPES or not isinstance(
            getattr(rotary, "inv_freq", None), torch.Tensor):
        return
    hooked = hasattr(rotary, "_hf_hook") and hasattr(rotary, "_old_forward")  # accelerate: its saved forward
    _replace_forward(state, rotary, _RotaryTable(rotary, rotary._old_forward if hooked else rotary.forward))


def _refuse_conversions(state: PatchState, model) -> None:
    """Make ``.to(dtype/device)``, ``.half()``, ``.float()``… on the patched model (or any of its submodules)
    raise before anything changes: the ops need bf16 CPU weights that are views of NPU buffers. Every
    conversion goes through ``Module._apply``; its function, tried on an empty bf16 CPU tensor, tells
    whether it would change a dtype or device. Guarding every submodule means no conversion can start on
    one part (say the embedding) and then fail on a patched layer, leaving a half-converted model."""
    for module in model.modules():
        _set_instance_attr(state, module, "_apply", _conversion_guard(module._apply))


def _conversion_guard(apply):
    def guarded(fn, *args, **kwargs):
        probe = torch.empty(0, dtype=torch.bfloat16)
        try:
            converted = fn(probe)
        except Exception as exc:  # e.g. .cuda() without CUDA: still a conversion we refuse
            converted = exc
        if not isinstance(converted, torch.Tensor) or converted.dtype != probe.dtype or converted.device != probe.device:
            target = (f"{converted.dtype} on {converted.device}" if isinstance(converted, torch.Tensor)
                      else "another dtype or device")
            raise RuntimeError(f"torch_npu2: cannot convert a patched model to {target}: its weights must stay "
                               "bf16 on the CPU (they are views of NPU buffers); call torch_npu2.unpatch_llama(model) "
                               "first, convert, and patch again if the result is bf16 on the CPU")
        return apply(fn, *args, **kwargs)
    return guarded


def _npu_weights(model) -> list[nn.Parameter]:
    """The parameters the npu2 ops read (each once, though tied embeddings appear twice)."""
    modules = [model.lm_head, model.model.norm]
    for layer in model.model.layers:
        modules += [layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp]
    unique = {}
    for module in modules:
        for param in module.parameters():
            unique.setdefault(id(param), param)
    return list(unique.values())


def _pin_lm_head(runtime, weight: nn.Parameter) -> torch.Tensor:
    """The LM head's bf16 weight in an NPU buffer of ``lm_head_rows(vocab)`` rows, the rows past the vocabulary zero;
    the parameter (the embedding too, when tied) becomes a view of its first vocab rows. Returns the whole buffer."""
    vocab = weight.shape[0]
    if lm_head_rows(vocab) == vocab:
        weight.data = runtime.pin(weight.data)
        return weight.data
    rows = runtime.empty((lm_head_rows(vocab), weight.shape[1]), weight.dtype)
    rows[:vocab], rows[vocab:] = weight.data, 0
    weight.data = rows[:vocab]
    return rows


def _layer_arenas(runtime, layer, weights: str) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
    """A decoder layer's two arenas (catalog.layer_arenas: its projections in the weight format's dtype, its norms
    and any Q/K/V biases in bf16) as NPU buffers, their gaps zero, with its norms and biases in place (each parameter
    a view of its part; q_proj's and k_proj's biases the two parts of [bq | bk]): ((weights, norms), each part as a
    view)."""
    attn, mlp = layer.self_attn, layer.mlp
    biased = attn.q_proj.bias is not None
    layout = layer_arenas(attn.q_proj.in_features, attn.q_proj.out_features, attn.k_proj.out_features,
                          mlp.down_proj.in_features, weights, qkv_bias=biased)
    arenas = {a.name: runtime.empty(a.shape, torch.bfloat16 if a.dtype == "bf16" else torch.int32)
              for a in (layout.weights, layout.norms)}
    for arena in arenas.values():
        arena.zero_()
    parts = {v.name: v.of(arenas[v.arena]) for v in layout.parts}
    placed = [(parts["input_norm"], layer.input_layernorm.weight),
              (parts["post_attention_norm"], layer.post_attention_layernorm.weight)]
    if biased:
        q_rows = attn.q_proj.out_features
        placed += [(parts["qk_bias"][:q_rows], attn.q_proj.bias), (parts["qk_bias"][q_rows:], attn.k_proj.bias),
                   (parts["v_bias"], attn.v_proj.bias)]
    for part, param in placed:
        part.copy_(param.data)
        param.data = part
    return (arenas["weights"], arenas["norms"]), parts


def _pin_layer(runtime, layer) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
    """A decoder layer's bf16 weights in its arenas (``_layer_arenas``), each parameter a view of its part: [Wq; Wk]
    (q_proj and k_proj the rows), [gate | up] (gate_proj and up_proj the halves of each row), Wv, Wo, Wdown, and the
    norms. Returns the arenas and the parts."""
    arenas, parts = _layer_arenas(runtime, layer, "bf16")
    attn, mlp = layer.self_attn, layer.mlp
    q_rows, hidden = attn.q_proj.out_features, attn.q_proj.in_features
    placed = ((attn.q_proj, parts["wqk"][:q_rows]), (attn.k_proj, parts["wqk"][q_rows:]),
              (attn.v_proj, parts["wv"]), (attn.o_proj, parts["wo"]), (mlp.gate_proj, parts["w_gate_up"][:, :hidden]),
              (mlp.up_proj, parts["w_gate_up"][:, hidden:]), (mlp.down_proj, parts["w_down"]))
    for module, part in placed:
        part.copy_(module.weight.data)
        module.weight.data = part
    return arenas, parts


def _prepare_integer(runtime, layer, packed: PackedProjections | None = None) -> PreparedProjections:
    """A decoder layer's projections prepared for the integer prefill GEMMs (kernels/int_gemm.py), each into an NPU
    buffer of its own, from its bf16 weights, or from the exact weights of its ``packed`` rows (rounded to bf16)."""
    attn, mlp = layer.self_attn, layer.mlp
    hidden, q_dim, intermediate = attn.q_proj.in_features, attn.o_proj.in_features, mlp.down_proj.in_features

    def bf16(module, name: str, in_features: int) -> torch.Tensor:
        return module.weight.data if packed is None else packed.dequantized(name, in_features)

    def prepare(weight: torch.Tensor, halves: int = 1) -> torch.Tensor:
        out = runtime.empty(int_gemm.prepared_weight_shape(weight.shape[0] // halves, weight.shape[1], halves),
                            torch.int32)
        return int_gemm.prepare_weight(weight, halves, out)

    if packed is None:
        gate_up = torch.cat((mlp.gate_proj.weight.data, mlp.up_proj.weight.data))
        wq, wk = attn.q_proj.weight.data, attn.k_proj.weight.data
    else:  # each packed row holds a gate row, then an up row; wqk Q's rows, then K's
        pairs = packed.dequantized("gate_up", hidden)
        gate_up = torch.cat((pairs[:, :hidden], pairs[:, hidden:]))
        wq, wk = packed.dequantized("wqk", hidden).split((q_dim, attn.k_proj.out_features))
    return PreparedProjections(prepare(wq), prepare(wk),
                               prepare(bf16(attn.v_proj, "wv", hidden)), prepare(bf16(attn.o_proj, "wo", q_dim)),
                               prepare(gate_up, halves=2), prepare(bf16(mlp.down_proj, "down", intermediate)))


# ---- packed weights ---------------------------------------------------------------------------------------------
QUANTIZE_ROWS = 1024  # rows quantized at a time: a 128256-row LM head's fp32 temporaries would take GiBs (4096: 0.17 GiB)


def _quantize(weight: torch.Tensor, fmt: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF's round-to-nearest quantization of a bf16 weight, packed (into ``out`` if given), a few thousand rows at
    a time (each row's blocks are quantized on their own, so the result does not depend on the chunking)."""
    N, K = weight.shape
    out = torch.empty(N, quant.weight_format(fmt).row_bytes(K), dtype=torch.uint8) if out is None else out
    for start in range(0, N, QUANTIZE_ROWS):
        rows = weight[start:start + QUANTIZE_ROWS]
        if fmt == "q4_1":
            quant.quantize_q4_1(rows, out[start:start + rows.shape[0]])
            continue
        import gguf  # gguf-py's own quantizers for the other formats

        raw = gguf.quants.quantize(rows.float().numpy(), getattr(gguf.GGMLQuantizationType, fmt.upper()))
        quant.from_gguf_blocks(quant.weight_format(fmt), torch.from_numpy(raw), K, out[start:start + rows.shape[0]])
    return out


def _describe_linear(module, fmt: str):
    """The repr of a Linear whose NPU copy is packed: what the NPU holds, and where its bf16 weight went."""
    text = (f"in_features={module.in_features}, out_features={module.out_features}, bias={module.bias is not None}; "
            f"on the NPU: {quant.describe(quant.weight_format(fmt), (module.out_features, module.in_features))}"
            f"; {_bf16_whereabouts(module)}")
    return lambda: text


def _bf16_whereabouts(module) -> str:
    if module.weight.device.type == "meta":
        return "loaded packed, no bf16 weight (unpatch_llama dequantizes it)"
    return "the bf16 weight set aside in a mapped file for unpatch_llama"


def patch_llama(model, *, backend: str = "auto", prefill_buckets=DEFAULT_BUCKETS,
                matmul_precision: str = AUTO_PRECISION, weights: str = "bf16", gguf=None,
                decode_layers_per_dispatch: int = DECODE_GROUP_SIZES[-1], lm_head: str = "auto",
                progress: bool = False):
    """Run ``model`` (a HF ``LlamaForCausalLM``, patched in place and returned) through the npu2 ops.

    ``backend``: "auto" (NPU if present, else emulated), "npu2" or "emulator" — the process-wide runtime.
    ``prefill_buckets``: the sequence lengths prefill kernels are compiled for; prompts pad to the next
    bucket, and prompts longer than the largest are processed in chunks of it.
    ``matmul_precision``: how the prefill GEMMs multiply on the NPU: "w8x2a16" (integer GEMMs over weights prepared
    here as two int8 terms under per-channel scales, kernels/int_gemm.py: as accurate as bf16, several times faster
    than it, 2.25 bytes a projection weight more memory), "bf16" (the AIE API's exact bf16 mmul), "bfp16" (operands
    converted to bfp16ebs8, blocks of 8 along K: fast, less accurate) or "bfp16_gate_up" (BFP16 for the gate/up
    projection only); "auto", the default, is "w8x2a16" for bf16 weights whose projections the integer GEMMs take
    and "bf16" otherwise. The emulator follows the choice. Decode and the LM head use bf16 (or packed weights) in
    every mode. The default and why: README, "Matmul precision".
    ``weights``: how decode reads the projection weights (and the LM head): "bf16", or packed block-quantized
    rows, "q4_1" (GGUF's Q4_1, round to nearest per 32-element block, quantized here from the bf16 weights),
    "q4_0" or "q8_0"; the decode GEMVs dequantize each block as they go. Prefill's bf16 GEMMs multiply the rows
    npu2.dequantize_rows makes on the NPU, once per layer and prefill (the integer GEMMs read copies prepared from
    the packed rows here). The packed weights' bf16 originals leave memory for a mapped temporary file
    (``patch_llama/spill.py``), from which ``unpatch_llama`` gives them back bit for bit.
    ``gguf``: the GGUF file the model was loaded from: its quantized projections (and LM head) are packed from the
    file's own blocks, with no quantization of ours (``weights`` then defaults to the file's format). A model
    ``load_model(..., weights=...)`` loaded packed names its file itself, and its projections were never bf16 in
    memory (from a HF checkpoint they are quantized here as they are read, one tensor at a time).
    ``decode_layers_per_dispatch``: how many decoder layers one decode dispatch may run from their attention on
    (npu2.decode_layers<n>, up to 8: what 64 argument buffers per run hold, each layer's weights in two of them);
    1 runs each layer as a dispatch of its own. Fewer dispatches save NPU and host time per token; a group's ELF
    takes longer to build, once per decode attention capacity bucket (ARCHITECTURE.md, "Decode groups").
    ``lm_head``: what the LM head's NPU GEMV reads when ``weights`` is "bf16": "q8_0" (a Q8_0 copy of its weight,
    made here, about half the bytes a token streams for it; the tokens whose logit could be the largest are scored
    again on the host from the bf16 weight, so the best token and the logits near it are the bf16 head's, the
    others within a bound of theirs: layer.NpuLmHead; the bf16 weight, and a tied embedding, then live in the
    mapped file, resident where read) or "bf16" (every logit from the bf16 weight, the GEMV twice as long); "auto",
    the default, is "q8_0". With packed ``weights`` the LM head is packed too, and only "auto" goes.
    ``progress``: show a progress bar while weights move into NPU buffers.
    """
    if getattr(model, STATE_ATTR, None) is not None:
        warnings.warn("patch_llama: the model is already patched; leaving it as it is", stacklevel=2)
        return model
    buckets = _bucket_lengths(prefill_buckets)
    if type(decode_layers_per_dispatch) is not int or decode_layers_per_dispatch not in (1, *DECODE_GROUP_SIZES):
        raise ValueError(f"patch_llama: decode_layers_per_dispatch must be 1 to {DECODE_GROUP_SIZES[-1]}, got "
                         f"{decode_layers_per_dispatch!r}")
    gguf = gguf if gguf is not None else getattr(model, GGUF_PATH_ATTR, None)
    source = GgufFile(gguf, model.config) if gguf is not None else getattr(model, CHECKPOINT_ATTR, None)
    head_weights = weights
    if source is not None:
        weights, head_weights = _gguf_formats(model, source, weights)
    family = family_of(model.config)
    if matmul_precision == AUTO_PRECISION and family is not None:  # (an unknown family is refused by _validate)
        matmul_precision = resolve_matmul_precision(matmul_precision, family.dims(model.config), weights)
    packed = weights != "bf16"
    packed_weights = _packed_weights(model) if packed else []
    family = _validate(model, buckets, matmul_precision, weights,
                       frozenset(id(p) for p in packed_weights) if source is not None else frozenset())
    head_weights, rescored = _head_format(lm_head, weights, head_weights)
    signature = check_transformers(model)
    runtime = npu_runtime.runtime_for(backend)
    _check_npu2_builds(model, family, buckets, matmul_precision, runtime.backend, weights, head_weights)
    state = PatchState(SharedState(PrefillSettings(buckets, matmul_precision,
                                                   context=getattr(model.config, "max_position_embeddings", None)),
                                   decode_group=decode_layers_per_dispatch),
                       weights=(weights, head_weights))
    # a layer's projections, norms and Q/K/V biases go into its two arenas (_pin_layer, _pin_packed)
    paired = {id(p) for layer in model.model.layers for p in (
        *(m.weight for m in _projections(layer)), layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
        layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias, layer.self_attn.v_proj.bias) if p is not None}
    paired |= {id(p) for p in packed_weights}  # packed: the LM head is packed into its buffer, not pinned
    items = [p for p in _npu_weights(model) if id(p) not in paired] + list(model.model.layers)
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="moving weights to NPU buffers" + (f" ({weights})" if packed else ""),
                     unit="tensor")
    per_layer, head, bound = [], None, None
    if packed or rescored:
        state.spill = WeightSpill()
    try:
        for item in items:
            if item is model.lm_head.weight and rescored:  # the bf16 weight, bounded, then out of memory until read
                head = (head_weights, _pack_linear(state, runtime, model.lm_head, "lm_head", head_weights, None,
                                                   lm_head_rows(model.lm_head.out_features)))
                bound = copy_error_bound(item, head[1], head_weights)
                _set_aside(state, [item])
            elif item is model.lm_head.weight:
                head = (None, _pin_lm_head(runtime, item))
            elif isinstance(item, nn.Parameter):
                item.data = runtime.pin(item.data)
            elif packed:  # the projections packed (and prepared from the packed rows for integer prefill GEMMs)
                arenas, parts, rows = _pin_packed(state, runtime, item, weights, source)
                integer = _prepare_integer(runtime, item, rows) if matmul_precision == INTEGER_PRECISION else None
                per_layer.append(dict(packed=rows, arenas=arenas, prepared=integer, qk_bias=parts.get("qk_bias")))
                _set_aside(state, [m.weight for m in _projections(item)])
            else:  # a decoder layer: its weights in its two arenas, [gate | up] (F × 2H, side by side in each row)
                # and [Wq; Wk] among them, the layouts the decode ops read (and integer copies for prefill)
                arenas, parts = _pin_layer(runtime, item)
                prepared = _prepare_integer(runtime, item) if matmul_precision == INTEGER_PRECISION else None
                per_layer.append(dict(gate_up=parts["w_gate_up"], qk=parts["wqk"], arenas=arenas, prepared=prepared,
                                      qk_bias=parts.get("qk_bias")))
        if packed:
            head = (head_weights, _pack_linear(state, runtime, model.lm_head, "lm_head", head_weights, source,
                                               lm_head_rows(model.lm_head.out_features)))
            _set_aside(state, [model.lm_head.weight])
        if state.spill is not None:
            state.spill.map()
    except BaseException:
        if state.spill is not None:
            state.spill.abandon()
        raise
    patched = [NpuDecoderLayer(layer, state.shared, signature, **mine) for layer, mine in zip(model.model.layers,
                                                                                             per_layer)]
    for layer, forward, following in zip(model.model.layers, patched, patched[1:] + [None]):
        forward.next_layer = following
        _replace_forward(state, layer, forward)
    head_module = NpuLmHead(model.lm_head, head, state.shared, bound)
    _replace_forward(state, model.lm_head, head_module)
    _join_final_norm(state, model.model.norm, head_module)
    _memoize_layer_slices(state, model.model.layers)
    _tabulate_rotary(state, model.model.rotary_emb)
    _set_instance_attr(state, model, "_prepare_cache_for_generation",
                       _npu_cache_by_default(model._prepare_cache_for_generation, model.config, signature.cache))
    _refuse_conversions(state, model)
    setattr(model, STATE_ATTR, state)
    release_free_heap()  # the weights' original storages, freed as their copies went into NPU buffers
    return model


def _packed_weights(model) -> list[nn.Parameter]:
    """The weights that decode reads packed: every projection and the LM head (each once)."""
    params = [m.weight for layer in model.model.layers for m in _projections(layer)] + [model.lm_head.weight]
    return list({id(p): p for p in params}.values())


def _set_aside(state: PatchState, params) -> None:
    """The bf16 originals of weights just packed (or of the LM head a packed copy serves), out of memory: into the
    spill file (meta ones hold nothing)."""
    for param in params:
        if param.device.type != "meta":
            state.spill.add(param)


def _gguf_formats(model, source: GgufFile, weights: str) -> tuple[str, str]:
    """(projections' format, LM head's format) from the file: one packed format for every projection; an LM head
    of another type (llama.cpp often writes Q6_K) is quantized to the projections' format at patch time."""
    formats = source.projection_formats()
    if len(formats) != 1 or None in formats:
        raise _fail(f"the GGUF file's projections are not all of one packed format ({sorted(map(str, formats))}); "
                    f"the decode Programs take one of {', '.join(quant.FORMATS)} for all of them")
    (fmt,) = formats
    if weights not in ("bf16", fmt):
        raise _fail(f"weights={weights!r} asks for another format than the {fmt!r} the model was loaded packed in")
    return fmt, source.format_of(source.head_tensor()) or fmt


def _npu_cache_by_default(prepare, config, cache_keyword: str):
    """generate()'s cache preparation, with an NpuKVCache where HF would use its default DynamicCache: a call that
    passes its own cache, names a cache_implementation (static, offloaded, quantized, dynamic…) or sets
    use_cache=False keeps HF's behaviour. The hook is GenerationMixin._prepare_cache_for_generation, which every
    supported release calls once per generate() with the same arguments, after the user's cache is known and before
    the first forward: 5.23 and later create the default DynamicCache there (replaced), earlier releases leave it to
    the model's first forward (the NpuKVCache is put in first). ``cache_keyword``: generate()'s name for the cache
    (the decoder layer's: past_key_values, cache from 5.24)."""
    from transformers import DynamicCache

    def prepare_cache(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        given = model_kwargs.get(cache_keyword) is not None
        result = prepare(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        if given or generation_config.cache_implementation is not None or generation_config.use_cache is False:
            return result
        if model_kwargs.get(cache_keyword) is None or type(model_kwargs[cache_keyword]) is DynamicCache:
            model_kwargs[cache_keyword] = NpuKVCache(config, max_length=max_cache_length)
        return result
    return prepare_cache


def _projections(layer):
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)


def _packed_rows(module, hf_name: str, fmt: str, source, out: torch.Tensor | None = None) -> torch.Tensor:
    name = source.head_tensor() if source is not None and hf_name == "lm_head" else None
    if source is not None and name is None:
        layer, projection = hf_name.split(".", 1)
        name = f"blk.{layer}.{PROJECTIONS[projection]}.weight"
    if name is None or source.format_of(name) != fmt:  # no file, or a head tensor of another type: quantized here
        return _quantize(module.weight.data, fmt, out)
    return source.packed(name, out)


def _pack_linear(state, runtime, module, hf_name: str, fmt: str, source, rows: int | None = None) -> torch.Tensor:
    """``module``'s weight packed straight into its NPU buffer (a packed LM head, 157 MiB at Llama-3.2-1B's shape, is
    never held twice); ``rows``: the buffer's rows, zero rows (zero weights in every format) past the weight's."""
    out = module.out_features
    words = runtime.empty((rows or out, quant.weight_format(fmt).row_bytes(module.in_features) // 4), torch.int32)
    words[out:] = 0
    _packed_rows(module, hf_name, fmt, source, words[:out].view(torch.uint8))
    _set_instance_attr(state, module, "extra_repr", _describe_linear(module, fmt))
    _remember_unloaded(state, module, fmt, words[:out])
    return words


def _remember_unloaded(state, module, fmt: str, words: torch.Tensor) -> None:
    if module.weight.device.type == "meta":  # unpatch_llama gives it the packed rows' exact values, in bf16
        state.unloaded.append((module, fmt, words))


def _pin_packed(state, runtime, layer, fmt: str, source) -> tuple[tuple[torch.Tensor, torch.Tensor], dict,
                                                                    PackedProjections]:
    """A decoder layer's projections packed into its weight arena (``_layer_arenas``, its norms and biases into the
    other): [gate | up] each row a packed gate row then a packed up row, [Wq; Wk] Q's packed rows then K's, Wv, Wo
    and Wdown. Returns the arenas, their parts and the packed projections (views of their parts)."""
    index = layer.self_attn.layer_idx
    attn, mlp = layer.self_attn, layer.mlp
    arenas, parts = _layer_arenas(runtime, layer, fmt)
    gate_up = parts["w_gate_up"]
    gate_up.copy_(torch.cat([_packed_rows(m, f"{index}.mlp.{n}", fmt, source) for m, n in
                             ((mlp.gate_proj, "gate_proj"), (mlp.up_proj, "up_proj"))], dim=1).view(torch.int32))
    width = gate_up.shape[1] // 2
    qk = parts["wqk"]
    rows = (*qk.split((attn.q_proj.out_features, attn.k_proj.out_features)), parts["wv"], parts["wo"],
            parts["w_down"])
    packed = ((attn.q_proj, "self_attn.q_proj", rows[0]), (attn.k_proj, "self_attn.k_proj", rows[1]),
              (attn.v_proj, "self_attn.v_proj", rows[2]), (attn.o_proj, "self_attn.o_proj", rows[3]),
              (mlp.down_proj, "mlp.down_proj", rows[4]))
    for module, name, words in packed:  # straight into the arena: no packed copy beside it
        _packed_rows(module, f"{index}.{name}", fmt, source, words.view(torch.uint8))
    halves = ((mlp.gate_proj, gate_up[:, :width]), (mlp.up_proj, gate_up[:, width:]))
    for module, words in (*((m, w) for m, _, w in packed), *halves):
        _set_instance_attr(state, module, "extra_repr", _describe_linear(module, fmt))
        _remember_unloaded(state, module, fmt, words)
    return arenas, parts, PackedProjections(qk, parts["wv"], parts["wo"], gate_up, parts["w_down"], format=fmt)


def unpatch_llama(model):
    """Restore the original forwards and move the weights back to ordinary memory (bit-identical values). Weights the
    patch set aside (a packed patch's originals, a bf16 LM head whose Q8_0 copy decode read) come back from the spill
    file; those never loaded in bf16 (a model load_model loaded
    packed) are the packed rows dequantized exactly, as HF's GGUF loader dequantizes them, rounded to bf16, and a
    tied LM head is the embedding again."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("unpatch_llama: the model is not patched")
    for module, attr, saved in reversed(state.modules):  # instance attributes (and a class) set by the patch
        if saved is None:
            delattr(module, attr)
        else:
            setattr(module, attr, saved)
    for module, fmt, words in state.unloaded:  # a meta parameter cannot take CPU data: a new one replaces it
        if module is model.lm_head and model.config.tie_word_embeddings:  # the embedding holds its bf16 values
            module.weight = model.model.embed_tokens.weight
            continue
        module.weight = nn.Parameter(quant.dequantize(quant.weight_format(fmt), words, module.in_features)
                                     .to(torch.bfloat16))
    restored = {id(module.weight) for module, _, _ in state.unloaded}
    if state.spill is not None:
        restored |= {id(param) for param in state.spill.parameters()}
        state.spill.restore()
    for param in _npu_weights(model):
        if id(param) not in restored:
            param.data = param.data.clone()
    delattr(model, STATE_ATTR)
    return model


def is_patched(model) -> bool:
    return getattr(model, STATE_ATTR, None) is not None


def decode_weights(model) -> tuple[str, str]:
    """(projections' format, LM head's format) a patched model's decode reads: "bf16" or a packed format."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("decode_weights: the model is not patched")
    return state.weights


def prefill_precision(model) -> str:
    """The matmul precision a patched model's prefill GEMMs run at (``patch_llama``'s, "auto" resolved)."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("prefill_precision: the model is not patched")
    return state.shared.settings.matmul_precision


__all__ = ["patch_llama", "unpatch_llama", "is_patched", "decode_weights", "prefill_precision", "DEFAULT_BUCKETS"]

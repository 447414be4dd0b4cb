"""Every npu2 op on the strict emulated NPU2 against its plain-PyTorch reference, plus opcheck and argument checks."""
import functools
import zlib

import pytest
import torch

import torch_npu2  # noqa: F401  (registers torch.ops.npu2)
from torch_npu2.kernels import catalog, int_gemm, quant
from torch_npu2.kernels.catalog import DECODE_GROUP_SIZES
from torch_npu2.ops import ALL_OPS, INTO, decode_attn_length, device_empty, device_written, reference
from torch_npu2.ops.fused import FUSED_OPS
from torch_npu2.ops.registry import program_of

from .helpers import CONFIGS, EPS, attn_args, decode_qkv_args, ffn_args, qkv_args

# By output dtype. bf16: the NPU path rounds to bf16 between launches and accumulates in fp32 inside them,
# the reference rounds after every HF module op, so they differ by a few bf16 ulps of the output's scale.
# fp32 (LM-head logits): both sides accumulate the same bf16 products in fp32; only summation order differs.
TOLERANCE = {torch.bfloat16: dict(max_rel=2.5e-2, min_cosine=0.9995), torch.float32: dict(max_rel=1e-4, min_cosine=0.99999)}


def assert_close(out, ref):
    tol = TOLERANCE[out.dtype]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    o, r = out.float().flatten(), ref.float().flatten()
    rel = (o - r).abs().max().item() / r.abs().max().item()
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
    assert rel <= tol["max_rel"], f"max abs error {rel:.4f} of the output's range"
    assert cos >= tol["min_cosine"], f"cosine {cos:.6f}"


def op_cases(config):
    g = torch.Generator().manual_seed(zlib.crc32(config.encode()))  # hash() of a str changes every process
    cases = unbiased_cases(config, g)
    groups = group_cases(config, cases, g) if config != "llama32_1b" else {}
    return {**cases, **qkv_bias_cases(cases, g), **groups}


def group_layer(config, g, packed: bool) -> dict:
    """A decoder layer's weights as a decode group reads them (catalog.layer_arenas' parts, packed or bf16), random
    and of their own (a mix-up of layers changes the results), and its K and V caches (as decode_attn_args')."""
    hidden, heads, kv, hd, ffn, vocab, seq = CONFIGS[config]
    ffn = -(-ffn // quant.BLOCK) * quant.BLOCK if packed else ffn
    k, v = decode_attn_args(heads, kv, hd, gen=g)[1:3]
    _, wo, _, norm_w, w_gate_up, w_down = ffn_args(hidden, heads, hd, ffn, seq, decode=True, gen=g)
    _, input_norm, wqk, wv, _ = decode_qkv_args(hidden, heads, kv, hd, gen=g)
    if packed:
        w_gate_up = torch.cat((_packed(w_gate_up[:, :hidden]), _packed(w_gate_up[:, hidden:])), dim=1)
        wo, w_down, wqk, wv = map(_packed, (wo, w_down, wqk, wv))
    return dict(k_cache=k, v_cache=v, input_norm=input_norm, wqk=wqk, wv=wv, wo=wo, post_attention_norm=norm_w,
                w_gate_up=w_gate_up, w_down=w_down)


@functools.lru_cache(maxsize=None)
def group_layers(config, packed: bool) -> tuple[dict, ...]:
    """The layers of the decode group cases (``group_layer``, with their ``arenas``), built once per config and
    weight format: quantizing nine layers' weights for every test that asks for the cases would take most of the
    file's time. Never written by a test."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{config} group layers {packed}".encode()))
    layers = tuple(group_layer(config, g, packed) for _ in range(DECODE_GROUP_SIZES[-1] + 1))
    for layer in layers:
        layer["arenas"] = in_arenas(group_layout(config, packed), layer)
    return layers


def group_layout(config, packed: bool) -> catalog.LayerArenas:
    hidden, heads, kv, hd, ffn = CONFIGS[config][:5]
    ffn = -(-ffn // quant.BLOCK) * quant.BLOCK if packed else ffn
    return catalog.layer_arenas(hidden, heads * hd, kv * hd, ffn, _EX_FORMAT if packed else "bf16")


_EX_FORMAT = "q4_1"  # what _packed packs


def in_arenas(layout: catalog.LayerArenas, layer: dict) -> list[torch.Tensor]:
    """A layer's two arenas (weights, norms) holding its parts where ``layout`` puts them, the gaps zero."""
    arenas = {a.name: torch.zeros(a.shape, dtype=torch.bfloat16 if a.dtype == "bf16" else torch.int32)
              for a in (layout.weights, layout.norms)}
    for view in layout.parts:
        view.of(arenas[view.arena]).copy_(layer[view.name])
    return [arenas["weights"], arenas["norms"]]


def group_args(n: int, qkv: bool, final: str, q, x, length, lut, layers: list, head: list) -> list:
    """A decode group op's tensors (catalog.decode_layers_program's host order) over ``layers`` (caches and
    ``arenas``): one more layer than the group has unless it ends the model, that one's arenas only."""
    args = ([] if qkv else [q]) + [x, length, lut]
    for layer in layers[:n]:
        args += [layer["k_cache"], layer["v_cache"], *layer["arenas"]]
    return args + ([] if final else layers[n]["arenas"]) + (head if final.endswith("_lm") else [])


def group_cases(config, cases, g):
    """Each decode group: its first layer's query, input, caches, o/FFN weights and the next layer's norm and Q/K/V
    are decode_attn_o_gemv_ffn_rms_gemv_rope(_packed)'s case, every other weight and cache of a layer of its own
    (a _final group has no layer after its last; a _final_lm group's final norm and LM head follow, the final eps
    after the others, and a _final_packed_lm group's, its LM head packed, with the LM head's format last; a _qkv
    group's first layer has its own norm and Q/K/V in place of its q); the whole group at the small configs."""
    hidden, heads, _, _, ffn, vocab = CONFIGS[config][:6]
    out = {}
    for suffix in ("", "_packed"):
        packed = bool(suffix)
        tensors, scalars, _ = cases["decode_attn_o_gemv_ffn_rms_gemv_rope" + suffix]
        q, k, v, length, wo, x, norm_w, w_gate_up, w_down, next_norm_w, next_wqk, next_wv, lut = tensors
        final_norm_w = (1.0 + 0.1 * torch.randn(hidden, generator=g)).bfloat16()
        w_lm = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).bfloat16()
        heads_by_end = {"_final_lm": [final_norm_w, _packed(w_lm) if packed else w_lm],
                        "_final_packed_lm": [final_norm_w, _packed(w_lm)]}
        layout = group_layout(config, packed)
        own = group_layers(config, packed)
        first = dict(own[0], k_cache=k, v_cache=v, wo=wo, post_attention_norm=norm_w, w_gate_up=w_gate_up,
                     w_down=w_down)  # its norm and Q/K/V: the _qkv groups'
        second = dict(own[1], input_norm=next_norm_w, wqk=next_wqk, wv=next_wv)
        for layer in (first, second):
            layer["arenas"] = in_arenas(layout, layer)
        layers = [first, second, *own[2:]]
        intermediate = -(-ffn // quant.BLOCK) * quant.BLOCK if packed else ffn
        dims = (scalars[0], heads, intermediate)
        for n in DECODE_GROUP_SIZES:
            for final in ("", "_final", "_final_lm") + (() if packed else ("_final_packed_lm",)):
                group_scalars = dims + (scalars[1:3] + (3 * EPS,) + scalars[3:] + scalars[3:]
                                        if final == "_final_lm" else scalars[1:3] + (3 * EPS, "q4_1")
                                        if final == "_final_packed_lm" else scalars[1:])
                for qkv in ("", "_qkv"):
                    name = f"decode_layers{n}{qkv}{final}{suffix}"
                    out[name] = (group_args(n, bool(qkv), final, q, x, length, lut, layers, heads_by_end.get(final)),
                                 group_scalars, reference.DECODE_GROUP_REFERENCES[name])
    return out


def qkv_bias_cases(cases, g):
    """Each Q/K/V-projecting op's ``_qkv_bias`` twin on its case's tensors, random biases (of a bias's size in Qwen2)
    inserted where the twin takes them, against the biased reference."""
    out = {}
    for name in (name for name in FUSED_OPS if name + "_qkv_bias" in FUSED_OPS):
        tensors, scalars, ref_fn = cases[name]
        unbiased = FUSED_OPS[name]
        program = unbiased.program_for(tuple(tuple(t.shape) for t in tensors), *unbiased.with_defaults(scalars),
                                       qkv_bias=True)
        names = [a.name for a in program.host_args]
        at = next(i for i, n in enumerate(names) if n.endswith(("bq", "bqk")))  # bq, bk, bv; or bqk, bv (decode)
        count = len(names) - len(tensors)
        biases = [torch.randn(program.host_args[at + i].shape, generator=g).bfloat16() for i in range(count)]
        out[name + "_qkv_bias"] = (list(tensors[:at]) + biases + list(tensors[at:]), scalars,
                                   getattr(reference, ref_fn.__name__.replace("_reference", "_qkv_bias_reference")))
    return out


def unbiased_cases(config, g):
    hidden, heads, kv, hd, ffn, vocab, seq = CONFIGS[config]
    return {
        "rms_gemms_rope": (qkv_args(hidden, heads, kv, hd, seq, gen=g), (EPS,), reference.rms_gemms_rope_reference),
        "rms_gemv_rope": (decode_qkv_args(hidden, heads, kv, hd, gen=g), (EPS,), reference.rms_gemv_rope_reference),
        "flash_attn": (attn_args(heads, kv, hd, seq, gen=g), (hd,), reference.flash_attn_reference),
        "o_ffn": (ffn_args(hidden, heads, hd, ffn, seq, gen=g), (EPS,), reference.o_ffn_reference),
        "o_gemv_ffn": (ffn_args(hidden, heads, hd, ffn, seq, decode=True, gen=g), (EPS,), reference.o_ffn_reference),
        "o_gemv_ffn_rms_gemv_rope": (
            ffn_args(hidden, heads, hd, ffn, seq, decode=True, gen=g)
            + decode_qkv_args(hidden, heads, kv, hd, gen=g)[1:], (EPS, 2 * EPS),
            reference.o_gemv_ffn_rms_gemv_rope_reference),
        "lm_head_gemv": ([torch.randn(hidden).bfloat16(), (torch.randn(vocab, hidden) * hidden ** -0.5).bfloat16()],
                         (), reference.lm_head_gemv_reference),
        "decode_attn": (decode_attn_args(heads, kv, hd, gen=g), (hd,), reference.decode_attn_reference),
        "decode_attn_o_gemv_ffn_rms_gemv_rope": (
            decode_attn_args(heads, kv, hd, gen=g) + ffn_args(hidden, heads, hd, ffn, seq, decode=True, gen=g)[1:]
            + decode_qkv_args(hidden, heads, kv, hd, gen=g)[1:], (hd, EPS, 2 * EPS),
            reference.decode_attn_o_gemv_ffn_rms_gemv_rope_reference),
        "decode_attn_o_gemv_ffn": (
            decode_attn_args(heads, kv, hd, gen=g) + ffn_args(hidden, heads, hd, ffn, seq, decode=True, gen=g)[1:],
            (hd, EPS), reference.decode_attn_o_gemv_ffn_reference),
        **packed_cases(config, g),
        **w8x2_cases(config, g),
    }


def decode_attn_args(heads, kv_heads, head_dim, gen):
    """One query row against a cache of 256 rows (a capacity of whole pairs of tiles) holding 150 valid positions;
    the rows past them are NaN, which the kernel never reads."""
    q = torch.randn(heads * head_dim, generator=gen).bfloat16()
    k, v = (torch.randn(256, kv_heads * head_dim, generator=gen).bfloat16() for _ in range(2))
    k[150:], v[150:] = float("nan"), float("nan")
    return [q, k, v, decode_attn_length(150)]


def _packed(w: torch.Tensor) -> torch.Tensor:
    return quant.quantize_q4_1(w).view(torch.int32)


def packed_cases(config, g):
    """The decode ops over Q4_1 weights quantized from the bf16 cases' (the intermediate size rounded up to whole
    32-element blocks), against the packed references."""
    hidden, heads, kv, hd, ffn, vocab, seq = CONFIGS[config]
    ffn = -(-ffn // quant.BLOCK) * quant.BLOCK
    x, norm_w, wqk, wv, lut = decode_qkv_args(hidden, heads, kv, hd, gen=g)
    qkv = [x, norm_w, _packed(wqk), _packed(wv), lut]
    attn, wo, x2, norm2, w_gate_up, w_down = ffn_args(hidden, heads, hd, ffn, seq, decode=True, gen=g)
    gate_up = torch.cat((_packed(w_gate_up[:, :hidden]), _packed(w_gate_up[:, hidden:])), dim=1)
    ffn_tensors = [attn, _packed(wo), x2, norm2, gate_up, _packed(w_down)]
    w_lm = _packed((torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).bfloat16())
    return {
        "rms_gemv_rope_packed": (qkv, (EPS, "q4_1"), reference.rms_gemv_rope_packed_reference),
        "o_gemv_ffn_packed": (ffn_tensors, (EPS, "q4_1"), reference.o_gemv_ffn_packed_reference),
        "o_gemv_ffn_rms_gemv_rope_packed": (ffn_tensors + qkv[1:], (EPS, 2 * EPS, "q4_1"),
                                            reference.o_gemv_ffn_rms_gemv_rope_packed_reference),
        "lm_head_gemv_packed": ([torch.randn(hidden, generator=g).bfloat16(), w_lm], ("q4_1",),
                                reference.lm_head_gemv_packed_reference),
        "decode_attn_o_gemv_ffn_rms_gemv_rope_packed": (
            decode_attn_args(heads, kv, hd, gen=g) + ffn_tensors[1:] + qkv[1:], (hd, EPS, 2 * EPS, "q4_1"),
            reference.decode_attn_o_gemv_ffn_rms_gemv_rope_packed_reference),
        "decode_attn_o_gemv_ffn_packed": (decode_attn_args(heads, kv, hd, gen=g) + ffn_tensors[1:], (hd, EPS, "q4_1"),
                                          reference.decode_attn_o_gemv_ffn_packed_reference),
        # a [gate | up] weight as prefill reads it: 2·F rows, each half packed on its own
        "dequantize_rows": ([gate_up.view(2 * ffn, -1)], (hidden, "q4_1"), reference.dequantize_rows_reference),
    }


def w8x2_cases(config, g):
    """The prefill ops over weights prepared for the integer GEMMs (the intermediate size rounded up to a multiple
    of 32, the integer GEMMs' K granule), against their references."""
    hidden, heads, kv, hd, ffn, vocab, seq = CONFIGS[config]
    ffn = -(-ffn // int_gemm.CALL_K) * int_gemm.CALL_K
    x, norm_w, wq, wk, wv, lut = qkv_args(hidden, heads, kv, hd, seq, gen=g)
    attn, wo, x2, norm2, w_gate_up, w_down = ffn_args(hidden, heads, hd, ffn, seq, gen=g)
    pair = int_gemm.prepare_weight(torch.cat((w_gate_up[:, :hidden], w_gate_up[:, hidden:])), halves=2)
    return {
        "rms_gemms_rope_w8x2": ([x, norm_w, *map(int_gemm.prepare_weight, (wq, wk, wv)), lut], (EPS,),
                                reference.rms_gemms_rope_w8x2_reference),
        "o_ffn_w8x2": ([attn, int_gemm.prepare_weight(wo), x2, norm2, pair, int_gemm.prepare_weight(w_down)], (EPS,),
                       reference.o_ffn_w8x2_reference),
    }


# The _qkv_bias twins differ from their ops only by the biases: at the small configs (Llama-3.2-1B has none). The
# decode groups chain their layers' ops: at the small configs too.
CASES = [(name, config) for name in ALL_OPS for config in CONFIGS
         if not ((name.endswith("_qkv_bias") or name.startswith("decode_layers")) and config == "llama32_1b")]


@pytest.mark.parametrize("name,config", CASES)
def test_op_matches_reference(runtime, config, name):
    tensors, scalars, ref_fn = op_cases(config)[name]
    out = ALL_OPS[name](*tensors, *scalars)
    ref = ref_fn(*tensors, *scalars)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    assert len(outs) == len(refs)
    if "_lm" in name:
        # the logits at fp32 tolerance from the LM head's reference on the op's own final_normed (which is held to the
        # reference chain at bf16 tolerance above it): the chain's bf16 differences would swamp an fp32 comparison
        packed_head = "_packed" in name  # the LM head's format the op's last scalar
        head = reference.lm_head_gemv_packed_reference if packed_head else reference.lm_head_gemv_reference
        refs = (*refs[:-1], head(outs[-2], tensors[-1], *scalars[-1:] if packed_head else ()))
    for o, r in zip(outs, refs):
        assert_close(o, r)


def _biased_norms_arenas(config: str, name: str, tensors: list, g) -> list:
    """``name``'s case tensors with every layer's norms arena laid out with Q/K/V biases (catalog.layer_arenas'
    qkv_bias), its norms as before and random biases of a Qwen2's size beside them."""
    n, packed = int(name[len("decode_layers")]), name.endswith("_packed")
    hidden, heads, kv, hd, ffn = CONFIGS[config][:5]
    ffn = -(-ffn // quant.BLOCK) * quant.BLOCK if packed else ffn
    plain = group_layout(config, packed)
    biased = catalog.layer_arenas(hidden, heads * hd, kv * hd, ffn, _EX_FORMAT if packed else "bf16", qkv_bias=True)
    first = 3 if "_qkv" in name else 4  # x, length, LUT row (after q): then per layer k, v, weights, norms
    norms = [first + 4 * j + 3 for j in range(n)] + ([] if "_final" in name else [first + 4 * n + 1])
    out = list(tensors)
    for at in norms:
        arena = torch.zeros(biased.norms.shape, dtype=torch.bfloat16)
        for part in ("input_norm", "post_attention_norm"):
            biased.part(part).of(arena).copy_(plain.part(part).of(tensors[at]))
        for part in ("qk_bias", "v_bias"):
            view = biased.part(part).of(arena)
            view.copy_(0.5 * torch.randn(view.shape, generator=g))
        out[at] = arena
    return out


@pytest.mark.parametrize("name", ["decode_layers2", "decode_layers3_qkv_final_lm", "decode_layers2_qkv_final_packed_lm",
                                  "decode_layers2_qkv_packed", "decode_layers3_final_lm_packed"])
def test_decode_groups_add_the_qkv_biases_their_norms_arenas_hold(runtime, name):
    """A family with Q/K/V biases (Qwen2) keeps them in each layer's norms arena: the group op tells so from the
    arena's size and adds each layer's biases, as the reference of its layers' biased ops does; without them (the
    same op on the unbiased arenas) the results differ."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tensors, scalars, ref_fn = op_cases("odd")[name]
    biased = _biased_norms_arenas("odd", name, tensors, g)
    program = program_of(FUSED_OPS[name], biased, scalars)
    assert dict(program.params)["next_qkv_bias"] == 1
    outs, refs = ALL_OPS[name](*biased, *scalars), ref_fn(*biased, *scalars)
    assert len(outs) == len(refs)
    if "_lm" in name:  # the logits from the op's own final_normed, as test_op_matches_reference holds them
        packed_head = "_packed" in name
        head = reference.lm_head_gemv_packed_reference if packed_head else reference.lm_head_gemv_reference
        refs = (*refs[:-1], head(outs[-2], biased[-1], *scalars[-1:] if packed_head else ()))
    for o, r in zip(outs, refs):
        assert_close(o, r)
    plain = ALL_OPS[name](*tensors, *scalars)
    assert not torch.equal(outs[0], plain[0])


@pytest.mark.parametrize("name", list(ALL_OPS))
def test_opcheck(runtime, name):
    tensors, scalars, _ = op_cases("odd")[name]
    torch.library.opcheck(ALL_OPS[name], (*tensors, *scalars))


# the ops whose ``.into`` writes a decode token's K and V rows
INTO_OPS = [name for name in ALL_OPS if ALL_OPS[name] in INTO and name != "dequantize_rows"]


def _rows_in_state(shapes, position: int):
    """A row at ``position`` of sequence 1 of a (2, 8, n) NPU state tensor (as an NpuKVCache holds K and V) per shape,
    whose other rows are a known pattern the device also holds: (the state tensors, their rows, their patterns)."""
    states = [device_empty((2, 8, shape[-1]), torch.bfloat16) for shape in shapes]
    patterns = [torch.arange(2 * 8 * shape[-1], dtype=torch.float32).view(2, 8, -1).bfloat16() for shape in shapes]
    for state, pattern in zip(states, patterns):
        state.copy_(pattern)
        device_written(state)
    return states, [state[1, position] for state in states], patterns


@pytest.mark.parametrize("name", INTO_OPS)
def test_into_overload_writes_the_k_and_v_rows_where_it_is_told(runtime, name):
    """``.into`` writes the op's K and V rows into the tensors it is given, bit for bit what the op returns, and
    nothing else of them: parts of NPU state tensors (bound as sub-buffers, read back in place: strict coherency
    would show a missing read-back) and plain tensors (staged, then copied). (The state tensors here are not the
    caches a decode group reads, so it returns what it does without ``.into``.)"""
    tensors, scalars, _ = op_cases("odd")[name]
    op, into = ALL_OPS[name], INTO[ALL_OPS[name]]
    expected = op(*tensors, *scalars)
    placed = FUSED_OPS[name].into_positions
    rows_expected = [expected[i] for i in placed]
    rest = [o for i, o in enumerate(expected) if i not in placed]
    states, rows, patterns = _rows_in_state([r.shape for r in rows_expected], 5)
    subs = runtime.stats["sub_buffers"]
    got = into(*tensors, *rows, *scalars)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(rest) and all(torch.equal(g, r) for g, r in zip(got, rest))
    assert runtime.stats["sub_buffers"] == subs + len(rows)
    for state, row, pattern in zip(states, rows_expected, patterns):
        assert torch.equal(state[1, 5], row)
        untouched = torch.ones(2, 8, dtype=torch.bool)
        untouched[1, 5] = False
        assert torch.equal(state[untouched], pattern[untouched])
    plain = [torch.zeros_like(r) for r in rows_expected]
    into(*tensors, *plain, *scalars)
    assert all(torch.equal(p, r) for p, r in zip(plain, rows_expected))


@pytest.mark.parametrize("weights", ["q4_0", "q4_1", "q8_0"])
def test_dequantize_rows_is_ggufs_dequantization_bit_for_bit_into_a_buffer_the_caller_keeps(runtime, weights):
    """npu2.dequantize_rows on the emulator gives GGUF's exact weights rounded to bf16 once, in every format and both
    row layouts (whole 1024-element groups and rows of another length; the kernel's host build is held to the same in
    tests/kernels/test_packed_gemv.py); ``.into`` writes them into an NPU buffer (bound as it is, read back in place)
    or a plain tensor (staged, then copied), and returns nothing."""
    g = torch.Generator().manual_seed(7)
    fmt = quant.weight_format(weights)
    for in_features in (2048, 96):
        blocks = torch.randint(0, 256, (24, in_features // quant.BLOCK, fmt.block_bytes()), generator=g,
                               dtype=torch.uint8)
        scales = (torch.rand(24, in_features // quant.BLOCK, 2 if fmt.has_min else 1, generator=g) - 0.5) / 64
        blocks[..., :scales.shape[-1] * 2] = scales.half().view(torch.uint8).reshape(24, in_features // quant.BLOCK, -1)
        packed = quant.from_gguf_blocks(fmt, blocks.reshape(24, -1), in_features).view(torch.int32)
        expected = quant.dequantize(fmt, packed, in_features, out=torch.empty(24, in_features, dtype=torch.bfloat16))
        out = ALL_OPS["dequantize_rows"](packed, in_features, weights)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
        kept, plain = device_empty((24, in_features), torch.bfloat16), torch.zeros(24, in_features, dtype=torch.bfloat16)
        for target in (kept, plain):
            assert INTO[ALL_OPS["dequantize_rows"]](packed, target, in_features, weights) is None
            assert torch.equal(target.view(torch.int16), expected.view(torch.int16))


def test_into_overload_refuses_a_row_of_the_wrong_shape_by_name(runtime):
    tensors, scalars, _ = op_cases("odd")["rms_gemv_rope"]
    k_row = torch.zeros(tensors[3].shape[0], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"npu2.rms_gemv_rope: argument 'v_row' expected a torch.bfloat16 tensor of "
                                         r"shape \(\d+,\) \(the op's v\)"):
        INTO[ALL_OPS["rms_gemv_rope"]](*tensors, k_row, torch.zeros(3, dtype=torch.bfloat16), *scalars)


@pytest.mark.parametrize("name", ["rms_gemv_rope", "decode_attn_o_gemv_ffn_rms_gemv_rope"])
def test_opcheck_into(runtime, name):
    tensors, scalars, _ = op_cases("odd")[name]
    outputs = ALL_OPS[name](*tensors, *scalars)
    rows = [torch.zeros_like(outputs[i]) for i in FUSED_OPS[name].into_positions]
    torch.library.opcheck(INTO[ALL_OPS[name]], (*tensors, *rows, *scalars))


def test_chained_op_is_its_two_ops_bit_for_bit(runtime):
    """o_gemv_ffn_rms_gemv_rope is o_gemv_ffn, then rms_gemv_rope on its output, each with its own eps (one of
    them 1.0 so that mixing them up would change the results)."""
    tensors = op_cases("odd")["o_gemv_ffn_rms_gemv_rope"][0]
    ffn, qkv = tensors[:6], tensors[6:]
    for eps, next_eps in ((EPS, 1.0), (1.0, EPS)):
        chained = ALL_OPS["o_gemv_ffn_rms_gemv_rope"](*tensors, eps, next_eps)
        out = ALL_OPS["o_gemv_ffn"](*ffn, eps)
        expected = (out, *ALL_OPS["rms_gemv_rope"](out, *qkv, next_eps))
        assert len(chained) == len(expected) == 4
        for c, e in zip(chained, expected):
            assert torch.equal(c, e)
        assert not torch.equal(chained[2], ALL_OPS["rms_gemv_rope"](out, *qkv, eps)[1])


def test_the_layer_from_attention_on_is_its_two_ops_bit_for_bit(runtime):
    """decode_attn_o_gemv_ffn_rms_gemv_rope is decode_attn, then o_gemv_ffn_rms_gemv_rope on its output."""
    tensors, scalars, _ = op_cases("llama32_1b")["decode_attn_o_gemv_ffn_rms_gemv_rope"]
    head_dim, eps, next_eps = scalars
    chained = ALL_OPS["decode_attn_o_gemv_ffn_rms_gemv_rope"](*tensors, *scalars)
    attn = ALL_OPS["decode_attn"](*tensors[:4], head_dim)
    expected = ALL_OPS["o_gemv_ffn_rms_gemv_rope"](attn, *tensors[4:], eps, next_eps)
    assert len(chained) == len(expected) == 4
    for c, e in zip(chained, expected):
        assert torch.equal(c, e)


@pytest.mark.parametrize("packed", [(), ("q4_1",)])
def test_the_last_layer_from_attention_on_is_its_two_ops_bit_for_bit(runtime, packed):
    """decode_attn_o_gemv_ffn(_packed) is decode_attn, then o_gemv_ffn(_packed) on its output."""
    suffix = "_packed" if packed else ""
    tensors, scalars, _ = op_cases("llama32_1b")["decode_attn_o_gemv_ffn" + suffix]
    head_dim, eps = scalars[:2]
    fused = ALL_OPS["decode_attn_o_gemv_ffn" + suffix](*tensors, *scalars)
    attn = ALL_OPS["decode_attn"](*tensors[:4], head_dim)
    assert torch.equal(fused, ALL_OPS["o_gemv_ffn" + suffix](attn, *tensors[4:], eps, *packed))


def _in_state(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into an NPU state tensor the device holds too (as an NpuKVCache's slab)."""
    state = device_empty(tuple(tensor.shape), tensor.dtype)
    state.copy_(tensor)
    device_written(state)
    return state


def group_parts(name: str, tensors) -> tuple[list, list[dict]]:
    """A decode group case's (q or None, x, length, LUT row) and its layers: each one's caches (None for the layer
    after the group) and the weights its arenas hold (``group_layout``'s parts, sliced out)."""
    layers, qkv, final = int(name[len("decode_layers")]), "_qkv" in name, "_final" in name
    layout = group_layout("odd", name.endswith("_packed"))
    lead = [None] + list(tensors[:3]) if qkv else list(tensors[:4])
    rest = tensors[len(lead) - (1 if qkv else 0):]
    parts = []
    for j in range(layers + (0 if final else 1)):
        caches = rest[4 * j:4 * j + 2] if j < layers else (None, None)
        arenas = dict(zip(("weights", "norms"), rest[4 * j + 2:4 * j + 4] if j < layers else rest[4 * j:4 * j + 2]))
        layer = {v.name: v.of(arenas[v.arena]) for v in layout.parts}
        parts.append(dict(layer, k_cache=caches[0], v_cache=caches[1]))
    return lead, parts


@pytest.mark.parametrize("name", ["decode_layers3", "decode_layers2_packed", "decode_layers3_final",
                                  "decode_layers2_final_packed", "decode_layers3_qkv",
                                  "decode_layers2_qkv_final_packed"])
def test_a_group_into_the_caches_is_its_layers_one_run_each_bit_for_bit(runtime, name):
    """A decode group whose K/V rows go into the next layers' caches at the last position (``.into``) gives what
    its layers give as decode_attn_o_gemv_ffn_rms_gemv_rope(.into) one run each (a _final group's last layer as
    decode_attn_o_gemv_ffn; a _qkv group's first layer after rms_gemv_rope.into onto its own cache), over the
    weights its arenas hold: every layer attends over the row the run wrote before it. Rows bound elsewhere (plain
    tensors) leave the caches as given, and the results differ: the check can fail."""
    tensors, scalars, _ = op_cases("odd")[name]
    (q, x, length, lut), parts = group_parts(name, tensors)
    layers, first_qkv = int(name[len("decode_layers")]), "_qkv" in name
    final, packed = "_final" in name, name.endswith("_packed")
    rows = catalog.decode_attn_length_value(length.tolist())
    suffix = "_packed" if packed else ""
    single = INTO[ALL_OPS["decode_attn_o_gemv_ffn_rms_gemv_rope" + suffix]]
    last_alone = ALL_OPS["decode_attn_o_gemv_ffn" + suffix]
    head_dim, (eps, next_eps, *fmt) = scalars[0], scalars[3:]
    # each layer's K and V caches in NPU state, and (unless the group ends the model) the layer's after the group,
    # a copy of the first's
    followed = layers if final else layers + 1

    def caches():
        return [[_in_state(parts[j % layers][c]) for c in ("k_cache", "v_cache")] for j in range(followed)]

    def qkv(j):
        return [parts[j][n] for n in ("input_norm", "wqk", "wv")]

    def ffn(j):
        return [parts[j][n] for n in ("post_attention_norm", "w_gate_up", "w_down")]

    def group(states, targets):
        args = ([] if first_qkv else [q]) + [x, length, lut]
        args += [t for j in range(layers) for t in (*states[j], *tensors_of_arenas(j))]
        args += [] if final else tensors_of_arenas(layers)
        out = INTO[ALL_OPS[name]](*args, *targets, *scalars)
        return (out,) if final else out  # out, and unless the group ends the model the next layer's q

    def tensors_of_arenas(j):
        base = (0 if first_qkv else 1) + 3 + 4 * j
        return tensors[base + 2:base + 4] if j < layers else tensors[base:base + 2]

    def own_rows(states):
        """The rows a _qkv group's first rms_gemv_rope writes: the first layer's own, at the last position."""
        return [states[0][0][rows - 1], states[0][1][rows - 1]] if first_qkv else []

    chain = caches()
    x_chain, q_chain = x, q
    if first_qkv:
        q_chain = INTO[ALL_OPS["rms_gemv_rope" + suffix]](x, *qkv(0), lut, *own_rows(chain), next_eps, *fmt)
    for j in range(layers):
        if final and j == layers - 1:  # head_dim, eps (and the weight format): not next_eps
            x_chain = last_alone(q_chain, *chain[j], length, parts[j]["wo"], x_chain, *ffn(j), head_dim, eps, *fmt)
        else:
            x_chain, q_chain = single(q_chain, *chain[j], length, parts[j]["wo"], x_chain, *ffn(j), *qkv(j + 1), lut,
                                      chain[j + 1][0][rows - 1], chain[j + 1][1][rows - 1], head_dim, eps, next_eps,
                                      *fmt)

    grouped = caches()
    outs = group(grouped, own_rows(grouped) + [row for k, v in grouped[1:] for row in (k[rows - 1], v[rows - 1])])
    assert torch.equal(outs[0], x_chain) and (final or torch.equal(outs[1], q_chain))
    for (k, v), (k_expected, v_expected) in zip(grouped, chain):
        assert torch.equal(k[:rows], k_expected[:rows]) and torch.equal(v[:rows], v_expected[:rows])

    apart = caches()
    elsewhere = [torch.zeros_like(k[0]) for k, v in (apart if first_qkv else apart[1:]) for _ in (k, v)]
    assert not torch.equal(group(apart, elsewhere)[0], x_chain)


@pytest.mark.parametrize("name, index, arg", [
    ("decode_layers2", 4, "k_cache_0"), ("decode_layers2", 6, "weights_0"), ("decode_layers2", 11, "norms_1"),
    ("decode_layers2", 12, "weights_2"), ("decode_layers2_qkv", 0, "x"), ("decode_layers2_qkv", 2, "next_rope_lut"),
    ("decode_layers2_qkv", 5, "weights_0"), ("decode_layers2_qkv", 7, "k_cache_1"),
    ("decode_layers2_final_lm", 12, "final_norm_w")])
def test_a_group_names_the_layers_argument_at_fault(runtime, name, index, arg):
    tensors, scalars, _ = op_cases("odd")[name]
    bad = list(tensors)
    bad[index] = bad[index][:-1]
    with pytest.raises(ValueError, match=rf"npu2.{name}: argument '{arg}' expected"):
        ALL_OPS[name](*bad, *scalars)


def test_outputs_never_alias_inputs(runtime):
    tensors, scalars, _ = op_cases("odd")["rms_gemms_rope"]
    outs = ALL_OPS["rms_gemms_rope"](*tensors, *scalars)
    ins = {t.untyped_storage().data_ptr() for t in tensors}
    assert not ins & {o.untyped_storage().data_ptr() for o in outs}


def _call_with(name, index, value):
    tensors, scalars, _ = op_cases("odd")[name]
    tensors = list(tensors)
    tensors[index] = value(tensors[index])
    return ALL_OPS[name](*tensors, *scalars)


@pytest.mark.parametrize("name,index,arg,make,expected", [
    ("rms_gemms_rope", 2, "wq", lambda t: t.float(), "dtype torch.bfloat16"),
    ("o_ffn", 2, "x", lambda t: t[:-1], "shape (7, 96)"),
    ("rms_gemms_rope", 3, "wk", lambda t: t[:, :-1].contiguous(), "shape (32, 96)"),
    ("rms_gemv_rope", 0, "x", lambda t: t.unsqueeze(0), "a 1-D tensor"),
    ("flash_attn", 1, "k", lambda t: t.t().contiguous().t(), "a contiguous tensor"),
    ("lm_head_gemv", 0, "x", lambda t: t.float(), "dtype torch.bfloat16"),
    # A dimension comes from the size most arguments agree on, so a wrong activation is the one blamed.
    ("rms_gemms_rope", 0, "x", lambda t: t[:, :-2].contiguous(), "shape (7, 96)"),
    ("rms_gemv_rope", 0, "x", lambda t: t[:-2].contiguous(), "shape (96,)"),
    ("o_ffn", 2, "x", lambda t: t[:, :-2].contiguous(), "shape (7, 96)"),
    ("o_ffn", 0, "attn", lambda t: t[:, :-2].contiguous(), "shape (7, 96)"),
    ("o_ffn", 4, "w_gate_up", lambda t: t[:-2].contiguous(), "shape (200, 192)"),
    ("o_ffn", 4, "w_gate_up", lambda t: t[:, :-2].contiguous(), "shape (200, 192)"),
    ("lm_head_gemv", 0, "x", lambda t: t[:-2].contiguous(), "shape (96,)"),
    # The chained op names the next layer's arguments as such.
    ("o_gemv_ffn_rms_gemv_rope", 7, "next_wqk", lambda t: t[:-2].contiguous(), "[Wq; Wk]: the Q rows, then as many K "
                                                                                "rows as wv has (32)"),
    ("o_gemv_ffn_rms_gemv_rope", 6, "next_norm_w", lambda t: t[:-2].contiguous(), "shape (96,)"),
    ("o_gemv_ffn_rms_gemv_rope", 9, "next_rope_lut", lambda t: t[:-1].contiguous(), "an even width (head_dim)"),
    ("rms_gemms_rope", 5, "rope_lut", lambda t: t[:, :-1].contiguous(), "an even width (head_dim) dividing"),
    ("rms_gemms_rope", 5, "rope_lut", lambda t: t[:, :-2].contiguous(), "an even width (head_dim) dividing"),
    ("rms_gemms_rope", 2, "wq", lambda t: t[:-2].contiguous(), "rows that are a multiple of head_dim 16"),
    ("rms_gemv_rope", 2, "wqk", lambda t: t[:-2].contiguous(), "a multiple of head_dim 16 (rope_lut's width) in all"),
    ("rms_gemv_rope", 3, "wv", lambda t: t[:-2].contiguous(), "rows that are a multiple of head_dim 16"),
    ("rms_gemv_rope", 2, "wqk", lambda t: t[:, :-2].contiguous(), "shape (128, 96)"),
    ("rms_gemv_rope", 4, "rope_lut", lambda t: t[:-2].contiguous(), "an even width (head_dim) dividing the rows of "
                                                                    "wqk (128) and wv (32)"),
    ("rms_gemms_rope", 4, "wv", lambda t: t[:-16].contiguous(), "shape (32, 96)"),
    # Inference-only: with grad mode on, an argument requiring grad is refused (README, "Python API").
    ("rms_gemms_rope", 2, "wq", lambda t: t.requires_grad_(), "a tensor that does not require grad"),
    ("o_gemv_ffn", 0, "attn", lambda t: t.requires_grad_(), "a tensor that does not require grad"),
    # A meta tensor among CPU ones dispatches to the fake kernel, which names it.
    ("lm_head_gemv", 1, "w_lm", lambda t: t.to("meta"), "a CPU tensor like the other arguments"),
    # packed rows whose width is not in_features' row of words
    ("dequantize_rows", 0, "w", lambda t: t[:, :-4].contiguous(), "shape ("),
    ("rms_gemms_rope", 0, "x", lambda t: t.to("meta"), "a CPU tensor like the other arguments"),
])
def test_bad_arguments_raise_naming_op_and_argument(runtime, name, index, arg, make, expected):
    with pytest.raises(ValueError) as info:
        _call_with(name, index, make)
    message = str(info.value)
    assert f"npu2.{name}" in message and f"'{arg}'" in message and expected in message
    assert runtime.xrt.counters["runs"] == 0


@pytest.mark.parametrize("name,scalars,arg,expected", [
    ("rms_gemms_rope", (0.0,), "eps", "a finite float > 0, got 0.0"),
    ("o_ffn", (-1e-5,), "eps", "a finite float > 0, got -1e-05"),
    ("rms_gemv_rope", (float("nan"),), "eps", "a finite float > 0, got nan"),
    ("o_gemv_ffn", (float("inf"),), "eps", "a finite float > 0, got inf"),
    ("o_gemv_ffn_rms_gemv_rope", (EPS, -1.0), "next_eps", "a finite float > 0, got -1.0"),
    ("rms_gemms_rope", (EPS, "fp8"), "precision", "one of 'bf16', 'bfp16', 'bfp16_gate_up' (for 'w8x2a16': the "
                                                  "*_w8x2 ops, over prepared weights), got 'fp8'"),
    ("flash_attn", (0,), "head_dim", "a positive int, got 0"),
    ("decode_layers2", (16, 0, 200, EPS, EPS), "heads", "a positive int, got 0"),
    ("decode_layers2", (16, 6, -200, EPS, EPS), "intermediate", "a positive int, got -200"),
    ("decode_layers2", (16, 6, 224, EPS, EPS), "weights_0", "shape ("),
    ("dequantize_rows", (250, "q4_1"), "in_features", "a positive multiple of 32 (whole 32-element blocks), got 250"),
    ("dequantize_rows", (256, "q5_k"), "weights", "one of 'q4_0', 'q4_1', 'q8_0' (a packed weight format), got 'q5_k'"),
])
def test_bad_scalars_raise_naming_op_and_argument(runtime, name, scalars, arg, expected):
    tensors, _, _ = op_cases("odd")[name]
    with pytest.raises(ValueError) as info:
        ALL_OPS[name](*tensors, *scalars)
    assert f"npu2.{name}: argument '{arg}' expected {expected}" in str(info.value)
    assert runtime.xrt.counters["runs"] == 0


def test_arguments_requiring_grad_run_under_no_grad(runtime):
    tensors, scalars, _ = op_cases("odd")["rms_gemms_rope"]
    tensors = [t.requires_grad_() for t in tensors]
    with torch.no_grad():
        outs = ALL_OPS["rms_gemms_rope"](*tensors, *scalars)
    assert not any(o.requires_grad for o in outs)


def test_all_meta_arguments_infer_output_shapes(runtime):
    tensors, scalars, _ = op_cases("odd")["o_ffn"]
    out = ALL_OPS["o_ffn"](*[t.to("meta") for t in tensors], *scalars)
    assert out.device.type == "meta" and out.shape == (7, 96)
    assert runtime.xrt.counters["runs"] == 0


def test_inconsistent_head_dims_raise(runtime):
    tensors, _, _ = op_cases("odd")["flash_attn"]
    with pytest.raises(ValueError, match=r"npu2.flash_attn: inconsistent arguments: q rows \(96\) must be a "
                                         r"multiple of head_dim \(7\)"):
        ALL_OPS["flash_attn"](*tensors, 7)


def test_wrong_device_is_named():
    # Only CPU and meta exist here; meta tensors dispatch to the fake kernel, so check the real path's guard.
    x, w_lm = op_cases("odd")["lm_head_gemv"][0]
    with pytest.raises(ValueError, match=r"npu2.lm_head_gemv: argument 'w_lm' expected a CPU tensor .*device meta"):
        program_of(FUSED_OPS["lm_head_gemv"], [x, w_lm.to("meta")], ())


def test_op_runs_eagerly_inside_a_compiled_region(runtime):
    # A graph break inside a loop makes dynamo run the frame eagerly while still intercepting every Python
    # frame it calls: the op's NPU implementation must stay opaque to it (it used to be traced into,
    # failing on torch.frombuffer of a FakeTensor).
    tensors, _, _ = op_cases("odd")["lm_head_gemv"]

    def twice_with_breaks(x, w):
        logits = []
        for _ in range(2):
            torch._dynamo.graph_break()
            logits.append(ALL_OPS["lm_head_gemv"](x, w))
        return logits

    torch._dynamo.reset()
    try:
        compiled = torch.compile(twice_with_breaks, backend="eager")(*tensors)
    finally:
        torch._dynamo.reset()
    expected = ALL_OPS["lm_head_gemv"](*tensors)
    for logits in compiled:
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)

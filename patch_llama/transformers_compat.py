"""What a patched model relies on in the installed transformers, checked before anything is patched.

The patched decoder layer replaces ``LlamaDecoderLayer.forward``, so HF's ``LlamaModel`` calls it with the
keywords that transformers version passes, and it writes K/V through HF's Cache API. Both have changed
between releases: 5.4 stopped passing ``cache_position`` (which 5.0–5.3 caches need to place a token in a
``StaticCache``), and 5.24 renamed ``past_key_values`` to ``cache``. A renamed keyword that ends up in a
``**kwargs`` nobody reads does not fail: the layer sees no cache and decodes every token attending to itself.
So the layer binds its arguments by the names of the installed layer's signature (``LayerSignature``), a
keyword it does not handle is an error, and ``check_transformers`` refuses a transformers whose layer
signature, Cache API or layer calls it does not know, before the model is touched.
"""
from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

# The oldest and newest transformers the test suite passes on; CI runs its compatibility job on both ends.
TESTED_TRANSFORMERS = ("5.0.0", "5.24.0")

# Keywords HF may pass a decoder layer that do not change what the layer computes, so the patched layer
# accepts and ignores them (README, "Supported versions"): HF collects hidden states with forward hooks on
# the layer modules, which still run around the patched forward; generate(stop_strings=..., tokenizer=...)
# leaves the tokenizer among the model's keyword arguments, which HF's model hands on to every layer.
IGNORED_KEYWORDS = frozenset({"output_hidden_states", "tokenizer", "assistant_tokenizer"})
# Keywords a caller may still pass a model (they reach the layers through HF's **kwargs) after the layers of
# a release stopped using them: from 5.4 on, HF's own layers ignore cache_position, and so does the patch.
RETIRED_KEYWORDS = frozenset({"cache_position"})


@dataclass(frozen=True)
class LayerSignature:
    """A decoder layer's parameters after ``hidden_states``, as one transformers release names them."""

    params: tuple[str, ...]
    cache: str  # the parameter that carries the KV Cache
    releases: str  # the transformers releases with this signature (for error messages)

    @cached_property
    def cache_position(self) -> bool:
        """Whether the layer is handed ``cache_position``, which these releases' caches need in ``update``."""
        return "cache_position" in self.params

    @cached_property
    def accepted(self) -> frozenset[str]:
        """Every keyword a call may pass: the parameters, the handled ones, and the retired ones where retired."""
        return frozenset(self.params) | _HANDLED_KEYWORDS | (frozenset() if self.cache_position else RETIRED_KEYWORDS)

    def bind(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict]:
        """``(hidden_states, every other argument by name)`` of one call, as HF's own signature would bind it;
        a ``TypeError`` names any keyword the patched layer would otherwise drop."""
        if len(args) > 1 + len(self.params):
            raise TypeError(f"torch_npu2 decoder layer: takes at most {1 + len(self.params)} positional arguments "
                            f"({', '.join(('hidden_states',) + self.params)}), got {len(args)}")
        if args:
            hidden = args[0]
            for name, value in zip(self.params, args[1:]):
                if name in kwargs:
                    raise TypeError(f"torch_npu2 decoder layer: got multiple values for argument {name!r}")
                kwargs[name] = value
        elif "hidden_states" in kwargs:
            hidden = kwargs.pop("hidden_states")
        else:
            raise TypeError("torch_npu2 decoder layer: missing the argument 'hidden_states'")
        if not self.accepted.issuperset(kwargs):
            raise TypeError(_unknown_keyword_message([name for name in kwargs if name not in self.accepted], self))
        return hidden, kwargs


# output_attentions: the call runs HF's own layer (patch_llama/layer.py); the rest are ignored on purpose
_HANDLED_KEYWORDS = IGNORED_KEYWORDS | {"output_attentions"}

KNOWN_SIGNATURES = (
    LayerSignature(("attention_mask", "position_ids", "past_key_values", "use_cache", "cache_position",
                    "position_embeddings"), "past_key_values", "5.0–5.3"),
    LayerSignature(("attention_mask", "position_ids", "past_key_values", "use_cache", "position_embeddings"),
                   "past_key_values", "5.4–5.23"),
    LayerSignature(("attention_mask", "position_ids", "cache", "use_cache", "position_embeddings"), "cache", "5.24"),
)


def _unknown_keyword_message(unknown: list[str], signature: LayerSignature) -> str:
    import transformers

    names = ", ".join(map(repr, unknown))
    return (f"torch_npu2 decoder layer: got keyword argument(s) {names}, which it does not handle; transformers "
            f"{transformers.__version__}'s decoder layer takes {', '.join(signature.params)}, and the patched layer "
            f"also accepts {', '.join(sorted(_HANDLED_KEYWORDS))}. Rather than run without them, it stops here; "
            "call torch_npu2.unpatch_llama(model) to use HF's own layers")


class TransformersMismatch(ValueError):
    """The installed transformers differs from every release the patched layers were written for."""


def _mismatch(what: str) -> TransformersMismatch:
    import transformers

    low, high = TESTED_TRANSFORMERS
    return TransformersMismatch(
        f"patch_llama: transformers {transformers.__version__} is not supported: {what}. torch_npu2 supports "
        f"transformers {low} to {high} (the releases its tests pass on); install one of those, e.g. "
        f"pip install 'transformers=={high}'. The model was not modified")


def layer_signature(layer_class: type) -> LayerSignature:
    """The known signature of ``layer_class.forward``, or a ``TransformersMismatch`` saying what differs."""
    params = list(inspect.signature(layer_class.forward).parameters.values())  # follows HF's decorators
    names = tuple(p.name for p in params[1:] if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    if not names or names[0] != "hidden_states" or params[-1].kind is not params[-1].VAR_KEYWORD:
        raise _mismatch(f"{layer_class.__name__}.forward{inspect.signature(layer_class.forward)} is not a "
                        "decoder layer taking hidden_states and **kwargs")
    for signature in KNOWN_SIGNATURES:
        if names[1:] == signature.params:
            return signature
    closest = min(KNOWN_SIGNATURES, key=lambda s: len(set(s.params) ^ set(names[1:])))
    added = [n for n in names[1:] if n not in closest.params]
    missing = [n for n in closest.params if n not in names[1:]]
    differs = "; ".join(part for part in (f"new parameter(s) {', '.join(added)}" if added else "",
                                          f"no parameter(s) {', '.join(missing)}" if missing else "",
                                          "the same names in another order" if not added and not missing else "")
                        if part)
    raise _mismatch(f"its {layer_class.__name__}.forward takes ({', '.join(names)}), which differs from transformers "
                    f"{closest.releases}'s ({differs})")


def _check_cache_api(signature: LayerSignature) -> None:
    """The Cache methods the patched layer calls: update(key_states, value_states, layer_idx[, cache_kwargs])
    and get_seq_length(layer_idx)."""
    from transformers.cache_utils import Cache

    update = [p.name for p in inspect.signature(Cache.update).parameters.values()][1:]
    if update[:3] != ["key_states", "value_states", "layer_idx"]:
        raise _mismatch(f"Cache.update takes ({', '.join(update)}), expected key_states, value_states, layer_idx first")
    if signature.cache_position and "cache_kwargs" not in update:
        raise _mismatch("its decoder layer is handed cache_position, but Cache.update takes no cache_kwargs to "
                        f"pass it on (Cache.update({', '.join(update)}))")
    length = list(inspect.signature(Cache.get_seq_length).parameters)[1:]
    if length[:1] != ["layer_idx"]:
        raise _mismatch(f"Cache.get_seq_length takes ({', '.join(length)}), expected layer_idx")


class _Recorded(Exception):
    """Raised by the probe's stand-in layer to stop the forward once the first layer's call is seen."""

    def __init__(self, args, kwargs):
        super().__init__()
        self.args, self.kwargs = args, kwargs


@lru_cache(maxsize=None)
def _probe_layer_calls(model_class: type, config_class: type, attn_implementation: str,
                       signature: LayerSignature) -> None:
    """Run a tiny random model of ``model_class`` for one prefill and one decode step, and check what its
    first decoder layer is really handed: every keyword one the patched layer handles, the Cache under the
    signature's name, (cos, sin) position embeddings, and a mask the layer understands."""
    from transformers import DynamicCache

    config = config_class(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=1, vocab_size=32, max_position_embeddings=64)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = model_class(config).eval()
    layer = model.model.layers[0]

    def record(*args, **kwargs):
        raise _Recorded(args, kwargs)

    layer.forward = record
    cache = DynamicCache(config=config)
    steps = {"prefill (a left-padded batch of 2)": (torch.tensor([[1, 2, 3], [0, 4, 5]]), torch.tensor([[1, 1, 1], [0, 1, 1]])),
             "decode": (torch.tensor([[6], [7]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]))}
    for step, (ids, mask) in steps.items():
        try:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, **{signature.cache: cache}, use_cache=True)
        except _Recorded as call:
            _check_call(step, call.args, call.kwargs, cache, signature, config)
        else:
            raise _mismatch(f"its {model_class.__name__} did not call its decoder layer in a {step} step")
        # the next step needs the cache filled as the real layer would have filled it
        length = ids.shape[1]
        shape = (2, config.num_key_value_heads, length, config.hidden_size // config.num_attention_heads)
        cache.update(torch.zeros(shape), torch.zeros(shape), 0,
                     *([{"cache_position": torch.arange(cache.get_seq_length(), cache.get_seq_length() + length)}]
                       if signature.cache_position else []))


def _check_call(step, args, kwargs, cache, signature: LayerSignature, config) -> None:
    try:
        _, bound = signature.bind(tuple(args), dict(kwargs))
    except TypeError as exc:
        raise _mismatch(f"in a {step} step its model calls the decoder layer with arguments the patched layer does "
                        f"not take ({exc})") from None
    if bound.get(signature.cache) is not cache:
        raise _mismatch(f"in a {step} step its model does not hand the layer the Cache as {signature.cache!r}")
    position = bound.get("position_embeddings")
    if not (isinstance(position, tuple) and len(position) == 2 and all(torch.is_tensor(t) for t in position)):
        raise _mismatch(f"in a {step} step its model does not hand the layer position_embeddings as (cos, sin)")
    mask = bound.get("attention_mask")
    if mask is not None and not (torch.is_tensor(mask) and mask.dim() == 4 and mask.shape[:2] == (2, 1)):
        form = f"a {mask.dim()}-D tensor" if torch.is_tensor(mask) else type(mask).__name__
        raise _mismatch(f"with attention implementation {config._attn_implementation!r}, in a {step} step the "
                        f"decoder layer is handed a mask that is {form}, not a (batch, 1, queries, keys) tensor")
    if signature.cache_position and not torch.is_tensor(bound.get("cache_position")):
        raise _mismatch(f"in a {step} step its model does not hand the layer cache_position")


SUPPORTED_ATTENTION = ("eager", "sdpa")  # the masks these give layers: 4-D additive (eager) or boolean (sdpa)


def check_transformers(model) -> LayerSignature:
    """Everything the patch depends on in the installed transformers, checked for ``model`` (not modified):
    the decoder layer's signature, the Cache API and what the model really hands its layers. Returns the
    layer signature the patched layers bind by; raises ``TransformersMismatch`` naming what differs."""
    import transformers
    from packaging.version import Version

    attention = model.config._attn_implementation
    if attention not in SUPPORTED_ATTENTION:
        raise ValueError(f"patch_llama: attention implementation {attention!r} is not supported (its masks are not "
                         f"the 4-D tensors the patched layers read); load the model with attn_implementation='sdpa' "
                         "or 'eager'; the model was not modified")
    layer_class = type(model.model.layers[0]) if len(model.model.layers) else None
    if layer_class is None:
        raise ValueError("patch_llama: the model has no decoder layers; the model was not modified")
    signature = layer_signature(layer_class)
    _check_cache_api(signature)
    _probe_layer_calls(type(model), type(model.config), attention, signature)
    if Version(transformers.__version__) > Version(TESTED_TRANSFORMERS[1]):
        warnings.warn(f"patch_llama: transformers {transformers.__version__} is newer than the newest release "
                      f"torch_npu2 was tested on ({TESTED_TRANSFORMERS[1]}); its decoder layer, Cache API and layer "
                      "calls match what the patch expects, so it proceeds", stacklevel=3)
    return signature


__all__ = ["TESTED_TRANSFORMERS", "IGNORED_KEYWORDS", "RETIRED_KEYWORDS", "LayerSignature", "KNOWN_SIGNATURES", "TransformersMismatch",
           "check_transformers", "layer_signature"]


def sees_layer_outputs(module: torch.nn.Module, forward) -> bool:
    """Whether anything besides HF's layer loop could see what a call of ``module`` (whose patched forward is
    ``forward``) returns: a wrapper around that forward (transformers 5.0's output capture replaces it while it
    records; accelerate's hooks wrap it), a forward hook or pre-hook on the module or on every module. The
    output-capturing hook of later releases (installed once hidden states were asked for) counts only while a
    capture is active."""
    if module.__dict__.get("forward") is not forward or module._forward_pre_hooks:
        return True
    nn_module = torch.nn.modules.module  # where torch keeps the hooks registered for every module
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return not all(_idle_output_capture(hook) for hook in module._forward_hooks.values())


def _idle_output_capture(hook) -> bool:
    """Whether ``hook`` is transformers' output-capturing hook while no capture is active (it then returns at once)."""
    if getattr(hook, "__name__", None) != "output_capturing_hook":
        return False
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    return not _active_collector.get()  # None, or the empty dict of a forward that records nothing

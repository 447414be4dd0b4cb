"""The model families patch_llama runs: ``config.model_type`` → what the patched layers and the Programs must know.

One entry per family (as Liger-Kernel maps a model_type to its patch): the HF classes the patch expects, which
projections carry a bias, the activation, the norm and the rotary layout. A family's ``dims`` feed the catalogue
(``ModelDims``), so its Programs take the biases it has. Everything else about a decoder layer (module names,
the cache, RoPE's cos/sin handed in by the model) is what every family here shares with Llama; a family that
differs there needs more than an entry (ARCHITECTURE.md, "Adding a model family").
"""
from __future__ import annotations

from dataclasses import dataclass

from ..kernels import ModelDims


@dataclass(frozen=True)
class ModelFamily:
    model_type: str            # config.model_type
    causal_lm: str             # the transformers class patch_llama expects (its decoder layers are replaced)
    examples: str              # checkpoints of this family, for messages
    qkv_bias: bool = False     # q_proj, k_proj and v_proj carry a bias (o_proj and the MLP never do here)
    hidden_act: str = "silu"   # the fused FFN computes SiLU(gate) * up
    norm: str = "rms"          # RMSNorm before attention and before the MLP, weight only
    rope: str = "half_split"   # rotate_half RoPE on the whole head, cos/sin from the model's rotary embedding

    def dims(self, config) -> ModelDims:
        """The catalogue's dims of a config of this family."""
        return ModelDims.from_config(config, qkv_bias=self.qkv_bias)

    def causal_lm_class(self):
        import transformers

        return getattr(transformers, self.causal_lm)


FAMILIES = {family.model_type: family for family in (
    ModelFamily("llama", "LlamaForCausalLM", "Llama 2/3.x, SmolLM2, TinyLlama"),
    ModelFamily("qwen2", "Qwen2ForCausalLM", "Qwen2, Qwen2.5", qkv_bias=True),
)}


def family_of(config) -> ModelFamily | None:
    """The family of a HF config, or None when patch_llama does not run its model_type."""
    return FAMILIES.get(getattr(config, "model_type", None))


def model_dims(config) -> ModelDims:
    """The catalogue's dims of a HF config: its family's, or Llama's reading of it for a model_type not in the
    table (what the commands that only build Programs, such as ``torch-npu2 lint``, take it for)."""
    return (family_of(config) or FAMILIES["llama"]).dims(config)


def supported() -> str:
    return ", ".join(f"{f.model_type!r} ({f.examples})" for f in FAMILIES.values())

"""HF integration: ``patch_llama(model)`` runs a Llama model's decoder layers and LM head through the npu2 ops."""
from .compare import LayerDiff, LayerReport, compare_layers
from .layer import PromptTooLongError
from .patch import DEFAULT_BUCKETS, is_patched, patch_llama, unpatch_llama

__all__ = ["compare_layers", "LayerDiff", "LayerReport", "patch_llama", "unpatch_llama", "is_patched", "DEFAULT_BUCKETS",
           "PromptTooLongError"]

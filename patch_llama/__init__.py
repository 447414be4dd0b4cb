"""HF integration: ``patch_llama(model)`` runs a Llama model's decoder layers and LM head through the npu2 ops.

``torch_npu2.patch_llama`` is this package and can be called as the function: ``torch_npu2.patch_llama(model)``
patches, and ``import torch_npu2.patch_llama.models`` still finds the subpackage's modules (a plain function of
that name on ``torch_npu2`` would hide them).
"""
import inspect
import sys
import types

from .compare import LayerDiff, LayerReport, compare_layers
from .layer import PromptTooLongError
from .patch import DEFAULT_BUCKETS, is_patched, patch_llama, unpatch_llama


class _CallablePackage(types.ModuleType):
    __call__ = staticmethod(patch_llama)  # no wrapper frame: patch_llama's warnings still point at the caller


sys.modules[__name__].__class__ = _CallablePackage
__signature__ = inspect.signature(patch_llama)  # what help() and inspect show for the callable package

__all__ = ["compare_layers", "LayerDiff", "LayerReport", "patch_llama", "unpatch_llama", "is_patched", "DEFAULT_BUCKETS",
           "PromptTooLongError"]

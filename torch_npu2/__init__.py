"""torch_npu2: HuggingFace Llama models on the AMD Ryzen AI NPU (XDNA2) through fused ``torch.ops.npu2`` ops.

``import torch_npu2`` registers the ops. On a machine without an NPU everything runs on the emulated
NPU2 driver (see ``TORCH_NPU2_BACKEND``).
"""
from . import ops
from . import patch_llama  # the subpackage, callable as patch_llama(model)
from .patch_llama import PromptTooLongError, compare_layers, is_patched, unpatch_llama
from .runtime import NPURunError, create_runtime, get_runtime, use_runtime

__version__ = "0.1.0"


def pin(tensor):
    """A BO-backed copy of ``tensor``: resident on the NPU after its first use, one copy in RAM."""
    return get_runtime().pin(tensor)


def refresh(tensor):
    """Tell the runtime a pinned tensor was written in place, so the next op re-syncs it."""
    get_runtime().refresh(tensor)


__all__ = ["ops", "compare_layers", "patch_llama", "unpatch_llama", "is_patched", "PromptTooLongError", "NPURunError",
           "create_runtime", "get_runtime", "use_runtime", "pin", "refresh", "__version__"]

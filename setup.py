from setuptools import setup

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
        "test": ["pytest", "ml_dtypes", "safetensors", "gguf", "accelerate", "matplotlib", "fastapi", "uvicorn",
                 "openai"],
    },
    entry_points={"console_scripts": ["torch-npu2=torch_npu2.cli:main"]},
)

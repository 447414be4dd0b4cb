"""A normal (non-editable) install carries the whole package under the single import name torch_npu2."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_normal_install_has_one_top_level_name(tmp_path):
    source, target = tmp_path / "source", tmp_path / "site"  # a copy: the build writes build/ into its tree
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".air-tools*", "build", "*.egg-info",
                                                                "results", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, cwd=tmp_path)
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")) == ["bin", "torch_npu2"]
    probe = ("import torch, torch_npu2, torch_npu2.kernels.catalog, torch_npu2.emulator;"
             "from torch_npu2.kernels import core_ops, host_build;"
             "print(torch_npu2.__file__); print(len(list(host_build.KERNEL_DIR.glob('*.cc'))));"
             "print(torch.ops.npu2.rms_gemms_rope.default.name());"
             "print((core_ops.STAND_IN_DIR / 'aie_api' / 'aie.hpp').is_file())")
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, env=env,
                         cwd=tmp_path).stdout.split()
    assert out[0].startswith(str(target)) and int(out[1]) >= 4 and out[2] == "npu2::rms_gemms_rope"
    assert out[3] == "True"  # the timing model's counting stand-in of the AIE API

"""A normal (non-editable) install carries the whole package under the single import name torch_npu2; an editable
install works from the folder that holds the clone."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY_IGNORE = shutil.ignore_patterns(".git", ".air-tools*", ".compat", "build", "*.egg-info", "results", "__pycache__")


def test_normal_install_has_one_top_level_name(tmp_path):
    source, target = tmp_path / "source", tmp_path / "site"  # a copy: the build writes build/ into its tree
    shutil.copytree(ROOT, source, ignore=COPY_IGNORE)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, cwd=tmp_path)
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")) == ["bin", "torch_npu2"]
    probe = ("import torch, torch_npu2, torch_npu2.kernels.catalog, torch_npu2.emulator;"
             "from torch_npu2.kernels import core_ops, host_build;"
             "print(torch_npu2.__file__); print(len(list(host_build.KERNEL_DIR.glob('*.cc'))));"
             "print(torch.ops.npu2.rms_gemms_rope.default.name());"
             "print((core_ops.STAND_IN_DIR / 'aie_api' / 'aie.hpp').is_file())")
    # -S: site-packages by path only, without their .pth files, so an editable install of this checkout (whose
    # finder goes first, setup.py) cannot stand in for the installed copy
    dependencies = os.pathsep.join(p for p in sys.path if p.endswith("-packages"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), dependencies]))
    out = subprocess.run([sys.executable, "-S", "-c", probe], check=True, capture_output=True, text=True, env=env,
                         cwd=tmp_path).stdout.split()
    assert out[0].startswith(str(target)) and int(out[1]) >= 4 and out[2] == "npu2::rms_gemms_rope"
    assert out[3] == "True"  # the timing model's counting stand-in of the AIE API


def editable_install(tmp_path, setup_edit=None):
    """A copy of the checkout at <tmp_path>/home/torch_npu2 (the build writes into its tree), installed editable
    into a fresh venv; ``setup_edit`` rewrites the copy's setup.py first. Returns (home, venv python, env).

    The venv sees this interpreter's site-packages as plain path entries (torch, setuptools), without running their
    .pth files: another editable install of torch_npu2 there must not decide how this one imports."""
    home, venv = tmp_path / "home", tmp_path / "venv"
    shutil.copytree(ROOT, home / "torch_npu2", ignore=COPY_IGNORE)
    if setup_edit is not None:
        setup = home / "torch_npu2" / "setup.py"
        setup.write_text(setup_edit(setup.read_text()))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_dir = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True).stdout.strip()
    (Path(site_dir) / "outer_site_packages.pth").write_text(
        "\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-build-isolation", "--use-pep517", "-e", str(home / "torch_npu2")], check=True, cwd=tmp_path)
    return home, python, {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_an_editable_install_runs_from_the_folder_holding_the_clone(tmp_path):
    """`cd ~ && python -m torch_npu2` with the clone at ~/torch_npu2: Python's path search sees the clone (a folder
    without __init__.py) as a namespace package torch_npu2 before the editable install's finder is asked, unless
    the install's namespace guard hands it over; a real torch_npu2 on PYTHONPATH still comes first."""
    home, python, env = editable_install(tmp_path)
    cli = subprocess.run([str(python), "-m", "torch_npu2", "--help"], capture_output=True, text=True, env=env,
                         cwd=home)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith("usage: torch-npu2")
    (home / "script.py").write_text("import torch_npu2, torch_npu2.patch_llama.models as models\n"
                                    "print(torch_npu2.__file__); print(callable(torch_npu2.patch_llama));"
                                    "print(models.load_model.__module__)\n")
    script = subprocess.run([str(python), "script.py"], capture_output=True, text=True, env=env, cwd=home)
    assert script.returncode == 0, script.stderr
    assert script.stdout.split() == [str(home / "torch_npu2" / "torch_npu2" / "__init__.py"), "True",
                                     "torch_npu2.patch_llama.models"]
    (tmp_path / "elsewhere" / "torch_npu2").mkdir(parents=True)
    (tmp_path / "elsewhere" / "torch_npu2" / "__init__.py").write_text("")
    first = subprocess.run([str(python), "-c", "import torch_npu2; print(torch_npu2.__file__)"], capture_output=True,
                           text=True, env={**env, "PYTHONPATH": str(tmp_path / "elsewhere")}, cwd=home, check=True)
    assert first.stdout.strip() == str(tmp_path / "elsewhere" / "torch_npu2" / "__init__.py")


def test_without_the_namespace_guard_the_folder_holding_the_clone_shadows_the_install(tmp_path):
    """The negative control of the test above: the same editable install built without setup.py's namespace guard
    fails from the folder holding the clone as the issue saw it, so that test's checks can fail."""
    def without_guard(setup):
        assert setup.count("cmdclass=CMDCLASS,") == 1
        return setup.replace("cmdclass=CMDCLASS,", "cmdclass={},")

    home, python, env = editable_install(tmp_path, without_guard)
    cli = subprocess.run([str(python), "-m", "torch_npu2", "--help"], capture_output=True, text=True, env=env,
                         cwd=home)
    assert cli.returncode != 0
    assert "cannot import name '__version__' from 'torch_npu2' (unknown location)" in cli.stderr, cli.stderr


def test_torch_npu2_patch_llama_is_both_the_subpackage_and_the_function(runtime):
    """`import torch_npu2.patch_llama.models` reaches the subpackage's modules, and `torch_npu2.patch_llama(model)`
    patches: the package is callable as its function, with its signature, and its warnings name the caller."""
    import inspect
    import types
    import warnings

    import torch_npu2
    import torch_npu2.patch_llama.models
    from tests.patch_llama.tiny import tiny_llama

    assert isinstance(torch_npu2.patch_llama, types.ModuleType)
    assert torch_npu2.patch_llama.models.load_model.__module__ == "torch_npu2.patch_llama.models"
    assert inspect.signature(torch_npu2.patch_llama) == inspect.signature(torch_npu2.patch_llama.patch_llama)
    model = tiny_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch_npu2.patch_llama(model) is model and torch_npu2.is_patched(model)
        torch_npu2.patch_llama(model)
    already = [w for w in caught if "already patched" in str(w.message)]
    assert len(already) == 1 and already[0].filename == __file__

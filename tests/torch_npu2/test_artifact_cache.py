"""The on-disk artifact cache: persistence across processes, toolchain keys, corrupt entries, concurrency."""
import json
import subprocess
import sys
import textwrap

import pytest

from torch_npu2.artifact_cache import MANIFEST, ArtifactCache
from torch_npu2.kernels.programs import flash_attn

PROGRAM = flash_attn(4, 2, 8, 16)


def counting_builder(log_path):
    def build(program, directory):
        with open(log_path, "a") as log:
            log.write(program.name + "\n")
        path = directory / "artifact.bin"
        path.write_bytes(program.key.encode() * 64)
        return path
    return build


def builds_logged(log_path):
    return len(log_path.read_text().splitlines()) if log_path.exists() else 0


def cache(tmp_path, toolchain="tc-1"):
    return ArtifactCache(tmp_path / "cache", "emulator", toolchain, counting_builder(tmp_path / "builds.log"))


CHILD = textwrap.dedent("""
    import sys, pathlib
    sys.path.insert(0, {tests!r})
    from torch_npu2.artifact_cache import ArtifactCache
    from torch_npu2.kernels.programs import flash_attn
    from test_artifact_cache import counting_builder
    tmp = pathlib.Path({tmp!r})
    c = ArtifactCache(tmp / "cache", "emulator", "tc-1", counting_builder(tmp / "builds.log"))
    print(c.get(flash_attn(4, 2, 8, 16)))
""")


def run_child(tmp_path):
    code = CHILD.format(tests=str(__import__("pathlib").Path(__file__).parent), tmp=str(tmp_path))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_entry_survives_a_new_process(tmp_path):
    child = run_child(tmp_path)
    built_path = child.communicate()[0].strip()
    assert child.returncode == 0 and builds_logged(tmp_path / "builds.log") == 1
    c = cache(tmp_path)
    assert str(c.get(PROGRAM)) == built_path
    assert c.builds == 0 and builds_logged(tmp_path / "builds.log") == 1
    manifest = json.loads((c.entry_dir(PROGRAM) / MANIFEST).read_text())
    assert manifest["program"] == "flash_attn" and manifest["toolchain"] == "tc-1"


def test_concurrent_processes_build_once(tmp_path):
    children = [run_child(tmp_path) for _ in range(4)]
    paths = {child.communicate()[0].strip() for child in children}
    assert all(child.returncode == 0 for child in children)
    assert len(paths) == 1 and builds_logged(tmp_path / "builds.log") == 1


def test_toolchain_change_rebuilds(tmp_path):
    first = cache(tmp_path, "tc-1").get(PROGRAM)
    second_cache = cache(tmp_path, "tc-2")
    second = second_cache.get(PROGRAM)
    assert first != second and second_cache.builds == 1
    assert builds_logged(tmp_path / "builds.log") == 2


@pytest.mark.parametrize("damage", ["truncate_artifact", "delete_artifact", "truncate_manifest", "delete_manifest"])
def test_corrupt_or_partial_entry_is_rebuilt(tmp_path, damage):
    c = cache(tmp_path)
    artifact = c.get(PROGRAM)
    good = artifact.read_bytes()
    target = artifact if "artifact" in damage else c.entry_dir(PROGRAM) / MANIFEST
    if damage.startswith("truncate"):
        target.write_bytes(target.read_bytes()[:10])
    else:
        target.unlink()
    again = c.get(PROGRAM)
    assert again.read_bytes() == good and c.builds == 2


def test_default_root_honours_environment(monkeypatch, tmp_path):
    from torch_npu2.artifact_cache import default_cache_root

    monkeypatch.delenv("TORCH_NPU2_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "torch_npu2"
    monkeypatch.setenv("TORCH_NPU2_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_root() == tmp_path / "explicit"

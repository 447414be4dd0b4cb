"""The on-disk artifact cache: persistence across processes, toolchain keys, corrupt entries, concurrency."""
import hashlib
import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from torch_npu2.artifact_cache import MANIFEST, ArtifactCache, ArtifactCacheError, default_cache_root
from torch_npu2.kernels.catalog import flash_attn_program

PROGRAM = flash_attn_program(4, 2, 8, 16)


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
    from torch_npu2.kernels.catalog import flash_attn_program
    from test_artifact_cache import counting_builder
    tmp = pathlib.Path({tmp!r})
    c = ArtifactCache(tmp / "cache", "emulator", "tc-1", counting_builder(tmp / "builds.log"))
    print(c.get(flash_attn_program(4, 2, 8, 16)))
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
    monkeypatch.delenv("TORCH_NPU2_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "torch_npu2"
    monkeypatch.setenv("TORCH_NPU2_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_root() == tmp_path / "explicit"


def test_entry_replaced_by_a_file_is_rebuilt(tmp_path):
    c = cache(tmp_path)
    good = c.get(PROGRAM).read_bytes()
    entry = c.entry_dir(PROGRAM)
    shutil.rmtree(entry)
    entry.write_text("not a directory")
    assert c.get(PROGRAM).read_bytes() == good and c.builds == 2 and entry.is_dir()


def test_lock_path_that_is_a_directory_is_replaced(tmp_path):
    c = cache(tmp_path)
    entry = c.entry_dir(PROGRAM)
    lock = entry.parent / f".{entry.name}.lock"
    (lock / "debris").mkdir(parents=True)
    c.get(PROGRAM)
    assert c.builds == 1 and lock.is_file()


def test_foreign_artifact_with_its_own_valid_checksum_is_rebuilt(tmp_path):
    """Another entry's artifact copied in, manifest checksum and all: the checksum covers the key too."""
    c = cache(tmp_path)
    good = c.get(PROGRAM).read_bytes()
    other = c.get(flash_attn_program(4, 2, 8, 32))
    entry = c.entry_dir(PROGRAM)
    manifest = json.loads((entry / MANIFEST).read_text())
    manifest["checksum"] = json.loads((other.parent / MANIFEST).read_text())["checksum"]
    (entry / MANIFEST).write_text(json.dumps(manifest))
    shutil.copy(other, entry / manifest["artifact"])
    assert c.get(PROGRAM).read_bytes() == good and c.builds == 3


def test_foreign_artifact_with_a_plain_sha256_is_rebuilt(tmp_path):
    c = cache(tmp_path)
    artifact = c.get(PROGRAM)
    good = artifact.read_bytes()
    artifact.write_bytes(b"foreign")
    manifest = json.loads((artifact.parent / MANIFEST).read_text())
    manifest["checksum"] = hashlib.sha256(b"foreign").hexdigest()
    (artifact.parent / MANIFEST).write_text(json.dumps(manifest))
    assert c.get(PROGRAM).read_bytes() == good and c.builds == 2


@pytest.mark.parametrize("root", ["file", "below_a_file", "unwritable"])
def test_unusable_cache_dir_names_path_and_variable(tmp_path, monkeypatch, root):
    (tmp_path / "a_file").write_text("")
    path = {"file": tmp_path / "a_file", "below_a_file": tmp_path / "a_file" / "cache",
            # /sys refuses mkdir even to root (chmod cannot make a directory unwritable for root)
            "unwritable": "/sys/torch_npu2_cache"}[root]
    monkeypatch.setenv("TORCH_NPU2_CACHE_DIR", str(path))
    c = ArtifactCache(default_cache_root(), "emulator", "tc-1", counting_builder(tmp_path / "builds.log"))
    with pytest.raises(ArtifactCacheError) as info:
        c.get(PROGRAM)
    message = str(info.value)
    assert f"cannot use {path} (" in message and f"set TORCH_NPU2_CACHE_DIR to a writable directory (it is now {path})" \
        in message, message
    assert builds_logged(tmp_path / "builds.log") == 0

"""ARCHITECTURE.md stays true: every repository path it names in backticks exists, it names every launch
kind the builders know and every fused op (by its catalogue factory), and its claims about defaults hold."""
import inspect
import re
from pathlib import Path

from torch_npu2.emulator import EmulatedXrt
from torch_npu2.kernels.builders import BUILDERS
from torch_npu2.ops import ALL_OPS

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "ARCHITECTURE.md"
FENCED_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
# A repository path: no spaces or placeholders, and a folder separator or a source/document suffix.
PATH_LIKE = re.compile(r"^[\w.-]+(/[\w.-]*)*$")
PATH_SUFFIXES = (".py", ".md", ".cc", ".h")


def inline_code(text: str) -> set[str]:
    return set(INLINE_CODE.findall(FENCED_BLOCK.sub("", text)))


def named_paths(text: str) -> set[str]:
    return {c for c in inline_code(text) if PATH_LIKE.match(c) and ("/" in c or c.endswith(PATH_SUFFIXES))}


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    return sorted(p for p in named_paths(text) if not (root / p).exists())


def unnamed(text: str, names) -> list[str]:
    return sorted(set(names) - inline_code(text))


def test_every_path_named_in_architecture_md_exists():
    text = MAP.read_text()
    assert len(named_paths(text)) >= 20, "the path pattern no longer finds ARCHITECTURE.md's paths"
    missing = missing_paths(text)
    assert missing == [], f"ARCHITECTURE.md names paths that are not in the repository: {missing}"


def factory(op: str) -> str:
    """The catalog factory of ``op``'s Program: ``<op>_program``; one for an op and its ``_qkv_bias`` twin, and one,
    ``decode_layers_program(n, …, weights, ends_model, lm_head, first_qkv)``, for every decode group op
    (``decode_layers<n>``, ``_qkv``, ``_final``, ``_final_lm``, ``_final_packed_lm``, ``_packed``)."""
    op = op.removesuffix("_qkv_bias")
    group = re.fullmatch(r"decode_layers\d+(_qkv)?(_final(_lm|_packed_lm)?)?(_packed)?", op)
    return "decode_layers_program" if group else f"{op}_program"


def test_architecture_md_names_every_launch_kind_and_fused_op():
    """An op's ``_qkv_bias`` twin is its factory's Program with ``qkv_bias=True``: the map names the suffix once."""
    text = MAP.read_text()
    assert unnamed(text, BUILDERS) == []
    assert unnamed(text, map(factory, ALL_OPS)) == []
    assert "decode_layers_program" in map(factory, ALL_OPS)
    assert any(op.endswith("_qkv_bias") for op in ALL_OPS) and "<op>_qkv_bias" in inline_code(text)


def stated_coherency_default(text: str) -> str | None:
    found = re.search(r"coherency is `(\w+)` by default", text)
    return found and found.group(1)


def test_architecture_md_states_the_emulators_coherency_default(monkeypatch):
    from torch_npu2.targets import emulator

    monkeypatch.delenv(emulator.COHERENCY_VARIABLE, raising=False)
    stated = stated_coherency_default(MAP.read_text())
    assert stated == inspect.signature(EmulatedXrt).parameters["coherency"].default
    assert emulator.open_driver().coherency == stated
    assert stated_coherency_default("with strict coherency (a forgotten sync reads stale data)") is None


def test_the_checks_catch_a_wrong_map():
    wrong = ("The builders live in `kernels/builders/`, the stitcher in `kernels/stitcher.py`, the C++ in "
             "`kernels/aie2p/rope.cc`; `setup.py` installs it.\n```\n`kernels/nowhere.py` in a code block\n```\n"
             "Kinds: `rope`, `gemm`; `torch.ops.npu2.<op>` and `func.func @<program name>` are not paths.")
    assert missing_paths(wrong) == ["kernels/aie2p/rope.cc", "kernels/stitcher.py"]
    assert unnamed(wrong, BUILDERS) == sorted(set(BUILDERS) - {"rope", "gemm"})

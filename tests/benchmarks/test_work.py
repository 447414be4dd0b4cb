"""The prefill work ratio against hand-computed values."""
import pytest

from benchmarks import work

# The benchmarks' tiny models (head_dim 16) run on the emulated NPU2 only; patch_llama says so, as it should.
pytestmark = pytest.mark.filterwarnings(
    "ignore:patch_llama. LlamaForCausalLM runs here on the emulated NPU2:UserWarning")


@pytest.mark.parametrize("prompt, rows", [
    (1, 1),        # decode path: one GEMV row
    (2, 16),       # smallest bucket
    (16, 16),
    (17, 32),
    (30, 32),
    (100, 128),
    (1025, 2048),
    (2048, 2048),
    (2049, 2048 + 16),    # one full chunk + the 1-row remainder padded to 16
    (3000, 2048 + 1024),  # 952 remaining rows → bucket 1024
    (4096, 2 * 2048),
])
def test_our_rows_follow_the_default_buckets(prompt, rows):
    assert work.our_rows(prompt, work.prefill_settings()) == rows


@pytest.mark.parametrize("prompt, rows", [(1, 2048), (30, 2048), (2048, 2048), (2049, 4096), (4096, 4096)])
def test_reference_pads_everything_to_2048(prompt, rows):
    assert work.reference_rows(prompt) == rows


def test_ratios_hand_computed():
    data = work.ratios(max_prompt=3000)
    assert data["buckets"] == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert data["ours"][30 - 1] == pytest.approx(32 / 30)
    assert data["reference"][30 - 1] == pytest.approx(2048 / 30)  # the 68× of the issue
    assert data["ours"][8 - 1] == pytest.approx(2.0)
    assert max(r for n, r in zip(data["lengths"], data["ours"]) if n >= 16) == pytest.approx(2048 / 1025)


def test_custom_buckets_chunk_at_the_largest():
    state = work.prefill_settings((8, 32))
    assert work.our_rows(9, state) == 32
    assert work.our_rows(40, state) == 32 + 8


def test_cross_check_reads_the_rows_the_emulator_ran():
    rows = work.cross_check((5, 17, 40), log=lambda _: None)
    assert [r["rows_per_layer_measured"] for r in rows] == [16, 32, 64]
    assert all(r["rows_per_layer_measured"] == r["rows_per_layer_computed"] for r in rows)

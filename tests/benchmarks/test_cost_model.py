"""The cost model reproduces its calibration points within the stated residual and stays within FACTS' ranges."""
import pytest

from benchmarks import cost_model
from benchmarks.cost_model import CALIBRATION_TOLERANCE, CostModel


@pytest.fixture(scope="module")
def model():
    return CostModel.calibrated()


def test_calibration_points_within_stated_tolerance(model):
    residuals = model.residuals()
    assert [r["program"] for r in residuals] == [name for name, _, _ in cost_model.CALIBRATION]
    for r in residuals:
        assert abs(r["relative_residual"]) <= CALIBRATION_TOLERANCE, r


def test_constants_are_physical(model):
    c = model.constants()
    assert 50 <= c["dispatch_us"] <= 110 and 3 <= c["step_us"] <= 15
    assert 10 < c["ddr_gb_per_s"] < 120  # FACTS: 36–57 GB/s in practice, 14 GB/s per column
    assert 0.1 < c["gemm_tflop_per_s"] <= 59  # 59 TFLOP/s is the inferred peak


def test_features_hand_computed():
    dims = cost_model.llama_1b_dims()
    runs, launches, moved, gemm, attention = cost_model.features(cost_model.program("lm_head_gemv", dims))
    assert (runs, launches, attention) == (1, 1, 0)
    assert moved == 2048 * 2 + 128256 * 2048 * 2 + 128256 * 4  # x bf16, weight bf16, logits fp32
    assert gemm == 2 * 2048 * 128256
    *_, attention = cost_model.features(cost_model.program("flash_attn", dims, 2048))
    assert attention == 2 * 32 * 2048 ** 2 * 64


def test_bounded_fit_recovers_known_constants():
    import numpy as np

    truth = np.array([80e-6, 5e-6, 1 / 40e9, 1 / 5e12, 1 / 1e12])
    x = np.array([[1, 6, 5e7, 2e10, 0], [1, 1, 2e7, 0, 2e10], [1, 8, 3e8, 2e11, 0], [1, 6, 1.3e7, 1.3e7, 0],
                  [1, 8, 1.1e8, 1.1e8, 0], [1, 1, 5e8, 5e8, 0], [3, 20, 1e8, 1e9, 1e9]], dtype=float)
    fitted = cost_model._bounded_fit(x, x @ truth)
    assert fitted == pytest.approx(truth, rel=1e-6)


def test_bucketed_prefill_beats_fixed_2048_for_short_prompts(model):
    rows = cost_model.predictions(model, prompts=(32, 2048))["prefill"]
    assert rows[0]["ours_ms"] < rows[0]["reference_fixed_2048_ms"]
    assert rows[1]["ours_ms"] == pytest.approx(rows[1]["reference_fixed_2048_ms"])

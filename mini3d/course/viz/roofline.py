"""The roofline (Williams et al., 2009) of the GPUs mini3d's cost model knows, and where matmuls sit.

A kernel that does F FLOPs while moving B bytes to and from memory has arithmetic intensity I = F / B
(FLOP per byte). A GPU with peak P FLOP/s and memory bandwidth W bytes/s attains at most

    attainable(I) = min(P, W * I)

so below the ridge I* = P / W a kernel is memory-bound (the bandwidth roof), above it compute-bound
(the flat roof). `matmul_intensity(m, k, n)` is the intensity of one (m x k) @ (k x n) product that
reads both inputs and writes its output once: 2mkn FLOPs over e(mk + kn + mn) bytes. The peaks and
bandwidths come from `mini3d.cost.hardware.PRESETS`, the same numbers the cost model uses.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from mini3d.course.viz.theme import new_figure


def matmul_intensity(m: int, k: int, n: int, bytes_per_element: int = 2) -> float:
    """FLOP per byte of one (m x k) @ (k x n) matmul: 2mkn / (e * (mk + kn + mn))."""
    return 2 * m * k * n / (bytes_per_element * (m * k + k * n + m * n))


def attainable_flops(hw, intensity: float, dtype: str = "bf16") -> float:
    """min(peak, memory bandwidth x intensity) in FLOP/s for one GPU `hw` (a Hardware)."""
    return min(hw.flops(dtype), hw.memory_bw * intensity)


def roofline_rows(hardware: Mapping[str, object], dtype: str = "bf16") -> list[dict]:
    """Per GPU: peak TFLOP/s, memory TB/s and the ridge intensity (FLOP/byte) where the roofs meet."""
    return [dict(name=name, peak_tflops=hw.flops(dtype) / 1e12, memory_tbps=hw.memory_bw / 1e12,
                 ridge=hw.flops(dtype) / hw.memory_bw) for name, hw in hardware.items()]


def roofline_figure(hardware: Mapping[str, object], points: Mapping[str, float] | None = None,
                    dtype: str = "bf16", title: str = "Roofline: attainable FLOP/s per GPU"):
    """One roofline per GPU (log-log), and each of `points` {label: intensity} as a marker on every
    roof (labels in the legend, so nothing is written over the lines)."""
    fig = new_figure(title, "arithmetic intensity (FLOP/byte)", "attainable (TFLOP/s)")
    xs = np.logspace(0, 4, 200)
    for name, hw in hardware.items():
        fig.add_scatter(x=xs, y=[attainable_flops(hw, x, dtype) / 1e12 for x in xs], mode="lines",
                        name=f"{name} (ridge {hw.flops(dtype) / hw.memory_bw:.0f} FLOP/B)")
    for i, (label, intensity) in enumerate((points or {}).items()):
        fig.add_scatter(x=[intensity] * len(hardware), mode="markers", name=f"{label}: {intensity:.0f} FLOP/B",
                        y=[attainable_flops(hw, intensity, dtype) / 1e12 for hw in hardware.values()],
                        marker=dict(size=11, symbol=["circle", "diamond", "square", "x"][i % 4], color="#222"))
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return fig


__all__ = ["matmul_intensity", "attainable_flops", "roofline_rows", "roofline_figure"]

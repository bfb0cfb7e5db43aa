"""The matmul efficiency model of the step-time model (mini3d.cost.model): the fraction of peak
FLOP/s a GPU reaches, eff(w) = eff_max * w / (w + half_width), w the narrowest matmul dimension it
sees; the A100 constants fitted on two Korthikanti et al. rows (`calibration.fit_efficiency`), the
H100 presets' eff_max on one torchtitan row (`mini3d.cost.hardware`)."""

from __future__ import annotations

from dataclasses import dataclass

from mini3d.cost.hardware import Hardware


@dataclass(frozen=True)
class Efficiency:
    """Fraction of peak FLOP/s reached: eff_max * w / (w + half_width)."""

    eff_max: float
    half_width: float

    def at(self, width: float) -> float:
        return self.eff_max * width / (width + self.half_width)


# Fitted by `mini3d.cost.calibration.fit_efficiency()` on the two Korthikanti et al. 2022 rows
# (A100-80GB, Megatron-LM); tests check that refitting gives these values and both rows within 5%.
# The H100 presets carry their own eff_max (`mini3d.cost.hardware`), fitted on one torchtitan row.
CALIBRATED = Efficiency(eff_max=0.7400, half_width=243.8)


def efficiency_for(hw: Hardware, override: Efficiency | None = None) -> Efficiency:
    if override is not None:
        return override
    if hw.eff_max is not None:
        return Efficiency(hw.eff_max, hw.eff_half_width or 0.0)
    return CALIBRATED


__all__ = ["Efficiency", "CALIBRATED", "efficiency_for"]

"""mini3d: 3D-parallel training (data + tensor + pipeline, ZeRO, recomputation) you can read and use."""

from .config import PRESETS, ModelConfig, Plan, PlanError, model_from_preset
from .grid import Grid

__version__ = "0.1.0"
__all__ = ["ModelConfig", "Plan", "PlanError", "PRESETS", "model_from_preset", "Grid"]

"""mini3d: 3D-parallel training (data + tensor + pipeline, ZeRO, recomputation) you can read and use."""

# The names below are imported lazily (PEP 562): a worker process first imports mini3d.launch.boot,
# which must arm its die-with-parent signal before anything imports torch (seconds of start-up in
# which a killed launcher would otherwise leave it running).
_LAZY = {"PRESETS": "config", "ModelConfig": "config", "Plan": "config", "PlanError": "config",
         "model_from_preset": "config", "Grid": "grid"}

__version__ = "0.1.0"
__all__ = ["ModelConfig", "Plan", "PlanError", "PRESETS", "model_from_preset", "Grid"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'mini3d' has no attribute {name!r}")

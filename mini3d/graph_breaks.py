"""Functions that stay outside `torch.compile`d graphs (mini3d.run.compile), marked lazily.

`torch.compiler.disable` imports torch._dynamo, about 1.5 s of start-up per process, which every
worker of every launch would pay though only `--compile` needs dynamo. So the collectives' entry
points are marked with `outside_graphs` where they are defined, and `keep_outside()` wraps them in
`torch.compiler.disable` when the first model is compiled. Callers reach the marked functions
through their module's global name (as `copy_to_tp` reaches `_outside_graphs`), so the wrapped one
is what they call from then on; tests/test_compile.py checks the graph breaks are in place.
"""

from __future__ import annotations

import sys

_MARKED: list[tuple[str, str]] = []  # (module, function name)


def outside_graphs(fn):
    """Mark a module-level function to be run eagerly inside compiled code (see the module doc)."""
    _MARKED.append((fn.__module__, fn.__name__))
    return fn


def keep_outside() -> None:
    """Wrap every marked function in `torch.compiler.disable`, once per process."""
    import torch

    for module, name in _MARKED:
        fn = getattr(sys.modules[module], name)
        if not getattr(fn, "mini3d_outside_graphs", False):
            wrapped = torch.compiler.disable(fn)
            wrapped.mini3d_outside_graphs = True
            setattr(sys.modules[module], name, wrapped)


__all__ = ["keep_outside", "outside_graphs"]

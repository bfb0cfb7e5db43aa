"""Which layers each pipeline stage holds, and the stage modules built from them.

There are p * v stages (model chunks). Stage s lives on pipeline rank s % p as chunk s // p (for
v > 1, Megatron's round-robin: rank r holds stages r, r+p, ...), or, with placement "v" (the ZB-V
schedule), in a V: chunk c of rank r is stage c p + r for even c, (c + 1) p - 1 - r for odd c, so
rank 0 holds the first and the last stage and the hand-over p-1 -> p stays on rank p-1. Stage 0 also holds the embedding;
the last stage holds the final LayerNorm, the output head and the loss.

Default split: balanced by layer count. When n_layers does not divide evenly (v = 1 only), the
extra layers go to the earliest stages, because the last stage already carries the head and the
loss (a V x h matmul, the largest single layer for small models). Explicit `boundaries` give the
first layer id of every stage after the first, e.g. 8 layers, p = 2, boundaries [3]: [0-2], [3-7].

Example, 8 layers, p = 2, v = 2 (stages of 2 layers):

    stage 0 -> rank 0 chunk 0 layers [0, 1] (first)     stage 1 -> rank 1 chunk 0 layers [2, 3]
    stage 2 -> rank 0 chunk 1 layers [4, 5]             stage 3 -> rank 1 chunk 1 layers [6, 7] (last)

and with placement "v": stage 2 -> rank 1 chunk 1, stage 3 -> rank 0 chunk 1 (last).
"""

from __future__ import annotations

from dataclasses import dataclass

from mini3d.pp.placement import stage_rank


@dataclass(frozen=True)
class StageSpec:
    """One model chunk: its global stage id, where it lives, its layers, and its ends."""

    stage: int  # global stage id, 0 .. p*v-1
    pp_rank: int  # pipeline rank that holds it (stage % p)
    chunk: int  # which of that rank's v chunks (stage // p)
    layers: tuple  # global layer ids, in order
    first: bool  # holds the embedding (input: token ids)
    last: bool  # holds the head and the loss


def partition_problems(n_layers: int, p: int, v: int = 1, boundaries=None) -> list[str]:
    """Why the layers cannot be split as asked; each message names the values."""
    n = p * v
    if n > n_layers:
        return [f"pp={p} x virtual_stages={v} = {n} stages exceeds n_layers={n_layers}"]
    if boundaries is None:
        if v > 1 and n_layers % n:
            return [f"n_layers={n_layers} does not split evenly into pp*virtual_stages = {n} "
                    f"model chunks"]
        return []
    b = list(boundaries)
    if len(b) != n - 1:
        return [f"boundaries={b} must give {n - 1} cut points for {n} stages"]
    if any(not 0 < x < n_layers for x in b) or any(x >= y for x, y in zip(b, b[1:])):
        return [f"boundaries={b} must increase strictly within 1..{n_layers - 1} "
                f"(every stage needs at least one layer)"]
    return []


def partition_layers(n_layers: int, p: int, v: int = 1, boundaries=None) -> list[list[int]]:
    """Global layer ids of each stage 0 .. p*v-1 (see the module docstring)."""
    problems = partition_problems(n_layers, p, v, boundaries)
    if problems:
        raise ValueError("; ".join(problems))
    n = p * v
    if boundaries is None:
        base, extra = divmod(n_layers, n)
        sizes = [base + (1 if s < extra else 0) for s in range(n)]
        starts = [sum(sizes[:s]) for s in range(n)]
    else:
        starts = [0] + list(boundaries)
    ends = starts[1:] + [n_layers]
    return [list(range(a, b)) for a, b in zip(starts, ends)]


def stage_specs(n_layers: int, p: int, v: int = 1, boundaries=None,
                placement: str = "loop") -> list[StageSpec]:
    """Every stage's `StageSpec`, indexed by global stage id."""
    parts = partition_layers(n_layers, p, v, boundaries)
    n = p * v
    return [StageSpec(s, stage_rank(s, p, placement), s // p, tuple(parts[s]), s == 0, s == n - 1)
            for s in range(n)]


def local_specs(pp_rank: int, n_layers: int, p: int, v: int = 1, boundaries=None,
                placement: str = "loop") -> list[StageSpec]:
    """The v stages pipeline rank `pp_rank` holds, by chunk."""
    return [s for s in stage_specs(n_layers, p, v, boundaries, placement) if s.pp_rank == pp_rank]


def build_stages(cfg, seed: int, pp_rank: int, p: int, v: int = 1, boundaries=None,
                 device=None, placement: str = "loop") -> dict:
    """{stage id: GPT module holding that stage's layers}, with the reference initialisation;
    on device "meta": shapes only, no values (`mini3d.tp.materialize_reference` gives them).
    `device` None means the CPU (said explicitly: never torch's default device, see
    MINI3D_STRICT_DEVICE in mini3d/launch/launcher.py)."""
    import torch

    from mini3d.models.transformer import GPT

    device = torch.device(device if device is not None else "cpu")
    out = {}
    for spec in local_specs(pp_rank, cfg.n_layers, p, v, boundaries, placement):
        with device:  # modules' parameters are created here; init copies the CPU reference values
            out[spec.stage] = GPT(cfg, seed, layers=spec.layers, first=spec.first,
                                  last=spec.last, init=device.type != "meta")
    return out


__all__ = ["StageSpec", "partition_layers", "partition_problems", "stage_specs", "local_specs",
           "build_stages"]

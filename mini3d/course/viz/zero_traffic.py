"""Chapter 03 (ZeRO): several live runs in one launch, and measured dp traffic next to the formula.

Starting processes costs seconds (each one imports torch), so `train_many_worker(specs)` runs
`mini3d.run.train.train_worker` once per spec, one after the other, inside the same processes: every
spec must have the same world size. It is a launch() target, so it lives here, importable.

Communication (the ZeRO paper's accounting, Psi = the bytes of one full gradient; on the wire each
Psi is (dp-1)/dp of them under a ring), per step with M micro-batches, from the one formula
`mini3d.cost.comm_time.zero_traffic_psi`: ZeRO-0 all-reduces the accumulated gradients once, 2 Psi;
ZeRO-1 reduce-scatters them once (Psi) and all-gathers the updated parameters (Psi), 2 Psi; ZeRO-2
keeps only its 1/dp gradient shard, so it reduce-scatters every micro-batch's gradients, M + 1 Psi;
ZeRO-3 all-gathers the parameters for each micro-batch's forward and backward and reduce-scatters
its gradients, 3M Psi. At M = 1 that is 2, 2, 2, 3.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go

from mini3d.comm import ring_wire_bytes
from mini3d.cost.comm_time import zero_traffic_psi

from mini3d.course.viz.theme import AXIS_COLORS, new_figure

LOSS_MARKER_BYTES = 8  # train_worker's float64 loss all-reduce over dp, once per step


def train_many_worker(specs: Sequence[dict]) -> list[dict]:
    """Run `train_worker(spec)` for each spec in order in this process; return the results."""
    from mini3d.run.train import train_worker

    return [train_worker(spec) for spec in specs]


def zero_comm_rows(results_by_stage: Mapping[int, Mapping], grad_bytes: float, dp: int,
                   steps: int, micro_batches: int) -> list[dict]:
    """Measured dp wire bytes per step of one rank (`comm_wire_bytes["dp"]`, less the loss
    all-reduce of each step) in units of Psi = (dp-1)/dp * grad_bytes, next to the formula's
    `zero_traffic_psi(stage, micro_batches)` for runs of `micro_batches` micro-batches per step."""
    psi_wire = ring_wire_bytes("reduce_scatter", dp, float(grad_bytes))  # one Psi on the wire
    rows = []
    for stage in sorted(results_by_stage):
        wire = results_by_stage[stage]["comm_wire_bytes"].get("dp", 0) / steps - LOSS_MARKER_BYTES
        rows.append({"zero": stage, "micro_batches": micro_batches, "measured_bytes_per_step": wire,
                     "measured_psi": wire / psi_wire, "formula_psi": zero_traffic_psi(stage, micro_batches)})
    return rows


def zero_comm_figure(rows: Sequence[Mapping], grad_bytes: float, dp: int,
                     title: str = "Data-parallel traffic per step: measured vs the ZeRO paper") -> go.Figure:
    """Grouped bars per ZeRO stage: measured wire bytes per rank and step, and the formula (MiB);
    rows of several micro-batch counts get one bar each, labelled with M."""
    psi_wire = ring_wire_bytes("reduce_scatter", dp, float(grad_bytes))  # one Psi on the wire
    several = len({r["micro_batches"] for r in rows}) > 1
    labels = [(f"ZeRO-{r['zero']}" if r["zero"] else "no ZeRO") + (f" · M={r['micro_batches']}" if several else "")
              for r in rows]
    fig = new_figure(title, "ZeRO stage", "bytes sent per rank per step (MiB)")
    fig.add_bar(x=labels, y=[r["measured_bytes_per_step"] / 2**20 for r in rows], name="measured (comm log)",
                marker_color=AXIS_COLORS["dp"], text=[f"{r['measured_psi']:.2f} Ψ" for r in rows],
                textposition="outside")
    fig.add_bar(x=labels, y=[r["formula_psi"] * psi_wire / 2**20 for r in rows], name="formula",
                marker_color="#bbbbbb", text=[f"{r['formula_psi']} Ψ" for r in rows], textposition="outside")
    fig.update_layout(barmode="group")
    return fig


__all__ = ["train_many_worker", "zero_comm_rows", "zero_comm_figure"]

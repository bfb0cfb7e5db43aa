"""Chapter 04 (sequence parallelism): what splitting the sequence outside the tp matmuls changes,
measured on a real run.

Tensor parallelism alone leaves every rank holding the *whole* (s, b, h) activation wherever no
matmul is split: the LayerNorms, the residual adds, dropout. Sequence parallelism (Korthikanti et
al., 2022) cuts those regions along the sequence instead, s/tp tokens per rank, and replaces each
of the layer's tp all-reduces by a reduce-scatter (into the sequence shards, after the row-parallel
matmul) and an all-gather (of the full sequence, before the column-parallel one): the same bytes on
the wire (an all-reduce *is* a reduce-scatter then an all-gather), and the LayerNorm activations
divided by tp. Its LayerNorm weights see only s/tp tokens per rank, so their gradients are summed
over tp once per step.

`sp_runs(cfg, tp, ...)` trains the same model with and without sequence parallelism in one launch
(`train_many_worker`) and `sp_rows` reads from each rank 0: losses, tp collectives per step by op
and shape, tp wire bytes per step, and layer 0's saved activations by module.
"""

from __future__ import annotations

from collections import Counter

from mini3d.course.viz.theme import CATEGORY_COLORS, new_figure


def sp_runs(cfg, tp: int = 2, global_batch: int = 4, seq_len: int = 32, steps: int = 2) -> dict:
    """{False: rank-0 result without SP, True: with SP} of one launch of `tp` processes."""
    from mini3d.config import Plan
    from mini3d.launch.launcher import launch
    from mini3d.run.train import make_spec

    from mini3d.course.viz.zero_traffic import train_many_worker

    specs = [make_spec(cfg, Plan(tp=tp, global_batch=global_batch, seq_len=seq_len, sequence_parallel=sp),
                       steps=steps, collect=["events", "activations"]) for sp in (False, True)]
    rank0 = launch(train_many_worker, tp, specs)[0]
    return dict(zip((False, True), rank0))


def sp_rows(runs: dict, steps: int) -> list[dict]:
    """Per run: {'sequence_parallel', 'losses', 'tp_ops' {(op, shape): count per step},
    'tp_wire_bytes_per_step', 'layer0' {module: bytes}}."""
    rows = []
    for sp, r in runs.items():
        tp_events = [e for e in r["events"] if e["axis"] == "tp"]
        ops = Counter((e["op"], tuple(e["shape"])) for e in tp_events)
        rows.append(dict(sequence_parallel=sp, losses=[x["loss"] for x in r["records"]],
                         tp_ops={k: v / steps for k, v in ops.items()},
                         tp_wire_bytes_per_step=r["comm_wire_bytes"].get("tp", 0) / steps,
                         layer0={k.split(".", 1)[1]: v for k, v in r["activations"].items()
                                 if k.startswith("layer0.")}))
    return rows


def sp_activation_figure(rows: list[dict], title: str = "Layer 0's saved activations per rank, tp=2"):
    """Grouped bars: layer 0's saved bytes per module (KiB), without and with sequence parallelism."""
    fig = new_figure(title, "module of layer 0", "saved for backward per micro-batch (KiB)")
    for r, color in zip(rows, (CATEGORY_COLORS["activations"], "#9c4f12")):
        fig.add_bar(x=list(r["layer0"]), y=[v / 2**10 for v in r["layer0"].values()], marker_color=color,
                    name="with sequence parallelism" if r["sequence_parallel"] else "tensor parallelism only")
    fig.update_layout(barmode="group")
    return fig


__all__ = ["sp_runs", "sp_rows", "sp_activation_figure"]

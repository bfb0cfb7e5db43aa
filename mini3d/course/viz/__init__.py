"""Plotly figures and ipywidgets explorers for the course; every function takes plain data.

    theme     the `mini3d` template, category/axis colours, byte helpers
    memory    memory breakdown vs capacity, per-rank memory by ZeRO stage, recompute trade-off
    pipeline  Gantt of a per-rank timeline with the bubble annotated
    grid3d    the rank grid as a 3D cube coloured by group, nodes boxed
    comm      bytes per axis, ring all-reduce cost, scaling efficiency (the communication tax)
    tp        which block of each weight matrix lives on which tp rank
    widgets   explorers (controls + FigureWidget) around a function the chapter passes in
    adapters  mini3d.pp / mini3d.diagnose wrapped to the explorers' contracts
    long_sequences  the zig-zag, the ring's steps, memory against sequence length with cp (07b)
    experts   routing per step, dropped tokens against the capacity factor, all-to-all volume (10)
    story70b  the 70B scenario: per-GPU memory and step-time panels for any layouts (every chapter)
    oom_explorer  ch08: the --memory-budget check on the estimate, with the OOM report it prints
    predict   a multiple-choice predict-then-reveal whose answer the chapter's cell computes
"""

from mini3d.course.viz.comm import comm_volume_figure, ring_allreduce_figure, scaling_efficiency_figure
from mini3d.course.viz.grid3d import rank_cube_figure, rank_points
from mini3d.course.viz.memory import memory_breakdown_figure, recompute_figure, zero_memory_figure
from mini3d.course.viz.pipeline import bubble_formula_text, bubble_from_timeline, gantt_figure
from mini3d.course.viz.theme import TEMPLATE_NAME, new_figure
from mini3d.course.viz.tp import megatron_attention, megatron_mlp, tp_shard_figure
from mini3d.course.viz.widgets import memory_calculator, planner_explorer, schedule_explorer, zero_explorer

__all__ = ["comm_volume_figure", "ring_allreduce_figure", "scaling_efficiency_figure",
           "rank_cube_figure", "rank_points", "memory_breakdown_figure", "recompute_figure",
           "zero_memory_figure", "bubble_formula_text", "bubble_from_timeline", "gantt_figure",
           "TEMPLATE_NAME", "new_figure", "megatron_attention", "megatron_mlp",
           "tp_shard_figure", "memory_calculator", "planner_explorer", "schedule_explorer", "zero_explorer"]

"""Chapter 08's explorer: meet the OOM report before the job does, by moving the plan and the budget.

    budget_view(cfg, budget_mib, pp, micro_batches, recompute)  plain data: the estimator's bytes per
                        pipeline stage, and the report `mini3d.diagnose.oom.check_budget` raises for
                        the hungriest stage that does not fit (None when every stage fits)
    budget_figure(view)  one stacked bar per stage (MiB) against the budget
    oom_explorer(cfg)    budget / pp / micro-batches / recompute controls over both

Nothing here re-implements the diagnosis: the bytes are `diagnose.oom.estimated_bytes` (the
estimator), the verdict and its text are `diagnose.oom.check_budget` (the check `--memory-budget`
runs after the first step, here given the estimate where the trainer gives its measured ledgers;
they agree to within 1%, chapter 07), and the suggestions are its `plans_that_fit`.
"""

from __future__ import annotations

import html

import ipywidgets as W

from mini3d.course.viz.theme import CAPACITY_COLOR, CATEGORIES, CATEGORY_COLORS, CATEGORY_LABELS, new_figure

MIB = 2**20


def budget_view(cfg, budget_mib: float = 4, pp: int = 1, micro_batches: int = 1,
                recompute: str = "none", global_batch: int = 8, seq_len: int = 64) -> dict:
    """{'stages': [{category: bytes}] per pipeline stage, 'budget', 'oom' (None or the
    OutOfMemory of the first stage over budget, with its report)}. A plan the configuration
    refuses raises PlanError (a ValueError) naming every offending value."""
    from mini3d.config import Plan, PlanError
    from mini3d.diagnose.faults import OutOfMemory
    from mini3d.diagnose.oom import check_budget, estimated_bytes
    from mini3d.grid import Grid

    plan = Plan(pp=pp, micro_batches=micro_batches, recompute=recompute, global_batch=global_batch,
                seq_len=seq_len)
    problems = plan.problems(cfg)
    if problems:
        raise PlanError(problems)
    grid, budget = Grid(tp=1, pp=pp, dp=1), int(budget_mib * MIB)
    stages = [estimated_bytes(cfg, plan, s) for s in range(pp)]
    oom = None
    for rank in range(grid.world_size):
        coords = grid.coords(rank)
        try:
            check_budget(stages[coords["pp"]], budget, rank, coords, cfg, plan)
        except OutOfMemory as e:
            oom = oom or e
    return dict(stages=stages, budget=budget, oom=oom)


def budget_figure(view: dict, widget: bool = False):
    """Stacked MiB bars, one per stage, and the budget as a dashed line named in the legend (an
    annotation would collide with the bar totals)."""
    labels = [f"stage {s} (rank {s})" for s in range(len(view["stages"]))]
    fig = new_figure("Estimated memory per rank against the budget", "pipeline stage",
                     "memory of the rank (MiB)", widget=widget)
    for c in CATEGORIES:
        fig.add_bar(x=labels, y=[st.get(c, 0) / MIB for st in view["stages"]], name=CATEGORY_LABELS[c],
                    marker_color=CATEGORY_COLORS[c])
    totals = [sum(st.values()) / MIB for st in view["stages"]]
    fig.add_scatter(x=labels, y=totals, mode="text", text=[f"{t:.1f} MiB" for t in totals],
                    textposition="top center", showlegend=False, hoverinfo="skip")
    line = dict(color=CAPACITY_COLOR, dash="dash", width=2)
    fig.add_hline(y=view["budget"] / MIB, line=line)
    fig.add_scatter(x=[None], y=[None], mode="lines", line=line, name=f"budget {view['budget'] / MIB:g} MiB")
    fig.update_layout(barmode="stack", yaxis_range=[0, 1.2 * max(totals + [view["budget"] / MIB])])
    return fig


def oom_explorer(cfg, budget_mib: float = 4, pp: int = 1, micro_batches: int = 1, recompute: str = "none"):
    """The memory budget (MiB), pp, micro-batches and recomputation over `budget_figure`; the
    status line is the OOM report mini3d would print (rank, category, estimate, plans that fit)."""
    from mini3d.exits import EXIT_OK, EXIT_OOM

    from mini3d.course.viz.widgets import _explorer, _guard, _redraw_bars

    controls = dict(
        budget_mib=W.SelectionSlider(options=[1, 2, 4, 8, 16, 32], value=budget_mib, description="budget (MiB)"),
        pp=W.SelectionSlider(options=[1, 2, 4], value=pp, description="pp"),
        micro_batches=W.SelectionSlider(options=[1, 2, 4, 8], value=micro_batches, description="micro-batches"),
        recompute=W.Dropdown(options=["none", "selective", "full"], value=recompute, description="recompute"),
    )
    fig = budget_figure(dict(stages=[{}], budget=budget_mib * MIB), widget=True)
    status = W.HTML()

    def update():
        view = _guard(status, lambda: budget_view(cfg, **{k: c.value for k, c in controls.items()}))
        if view is None:
            return
        _redraw_bars(fig, budget_figure(view))
        if view["oom"] is None:
            worst = max(sum(st.values()) for st in view["stages"])
            status.value = (f"fits: the hungriest rank needs {worst / MIB:.1f} MiB of the "
                            f"{view['budget'] / MIB:g} MiB budget (exit status {EXIT_OK})")
        else:
            status.value = (f"<b>exit status {EXIT_OOM}</b>: the report `--memory-budget` prints when the rank "
                            f"measures what the estimator predicts:<pre style='line-height:1.2'>"
                            f"{html.escape(view['oom'].report)}</pre>")

    return _explorer(controls, fig, status, update)


__all__ = ["budget_view", "budget_figure", "oom_explorer"]

"""One look for every course figure: the `mini3d` Plotly template, category colours and unit helpers.

Every figure in `mini3d.course.viz` is built with `new_figure()`, so fonts, margins, colours and the hover
style agree from chapter to chapter, and every axis title carries its unit ("memory (GiB)",
"time (units of t_fwd)", "bandwidth (GB/s)"). Colours carry meaning across chapters: parameters are
always blue, activations always orange, the tp axis always green, and so on.
"""

from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio

from mini3d.cost.memory import gib as memory_gib
from mini3d.course.viz.figure_widget import FigureWidget

TEMPLATE_NAME = "mini3d"
GIB = 1024 ** 3

# Memory categories, in the order the estimator and the live ledger report them.
CATEGORIES = ("params", "grads", "optimizer", "activations", "comm_buffers")
CATEGORY_LABELS = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "comm_buffers": "comm buffers",
}
CATEGORY_COLORS = {
    "params": "#3b6fb6",
    "grads": "#7fa7db",
    "optimizer": "#8e6bbf",
    "activations": "#e8893a",
    "comm_buffers": "#9a9a9a",
}
# Rank-grid axes (and communication on them).
AXIS_COLORS = {"tp": "#2e9e5b", "pp": "#c8553d", "dp": "#3b6fb6", "mp": "#8e6bbf",
               "embedding": "#b59a2a"}
# Pipeline actions.
ACTION_COLORS = {"F": "#3b6fb6", "B": "#e8893a", "W": "#5a9e5f", "idle": "#e6e6e6"}
CAPACITY_COLOR = "#c0392b"


# The layout rules every figure keeps (tests/test_viz_layout.py checks them on the figure objects):
# - a legend sits right of the plot, one entry per line, top-aligned (LEGEND_RIGHT): never in the
#   title's band above the plot (a horizontal legend there wraps upwards over the title in a narrow
#   cell) nor under the x axis (over its tick labels and title);
# - each row of subplots (or of categories) gets a plot area of at least MIN_ROW_PX (`fit_height`);
# - every axis grows its margin for its title and tick labels (automargin, in the template), and an
#   axis title is short enough to fit along its axis (AXIS_TITLE_PX per character).
LEGEND_RIGHT = dict(orientation="v", x=1.02, xanchor="left", y=1.0, yanchor="top")
MIN_ROW_PX = 160
MARGIN_T, MARGIN_B = 60, 60
AXIS_TITLE_PX = 7.5  # width of one character of an axis title (13 px font), generous


def fit_height(rows: int = 1, per_row: float = MIN_ROW_PX, top: int = MARGIN_T,
               bottom: int = MARGIN_B) -> int:
    """The figure height that gives each of `rows` rows a plot area of max(per_row, MIN_ROW_PX)."""
    return int(top + bottom + max(1, rows) * max(per_row, MIN_ROW_PX))


def _build_template() -> go.layout.Template:
    t = go.layout.Template()
    t.layout = go.Layout(
        font=dict(family="Inter, Helvetica, Arial, sans-serif", size=13, color="#222"),
        title=dict(x=0.02, xanchor="left", font=dict(size=16)),
        paper_bgcolor="white",
        plot_bgcolor="white",
        margin=dict(l=70, r=30, t=MARGIN_T, b=MARGIN_B),
        colorway=["#3b6fb6", "#e8893a", "#2e9e5b", "#c8553d", "#8e6bbf", "#b59a2a", "#9a9a9a"],
        # automargin: margins grow to fit long tick labels and titles instead of clipping them
        xaxis=dict(showgrid=True, gridcolor="#eee", zeroline=False, linecolor="#888", ticks="outside",
                   automargin=True),
        yaxis=dict(showgrid=True, gridcolor="#eee", zeroline=False, linecolor="#888", ticks="outside",
                   automargin=True),
        legend=dict(bgcolor="rgba(255,255,255,0.8)", bordercolor="#ddd", borderwidth=1, **LEGEND_RIGHT),
        hoverlabel=dict(bgcolor="white", font_size=12),
        bargap=0.25,
    )
    return t


pio.templates[TEMPLATE_NAME] = _build_template()


def new_figure(title: str, x_title: str, y_title: str, widget: bool = False, **layout) -> go.Figure:
    """An empty figure in the mini3d template; axis titles must name their unit."""
    cls = FigureWidget if widget else go.Figure
    fig = cls()
    fig.update_layout(template=TEMPLATE_NAME, title=title, xaxis_title=x_title, yaxis_title=y_title,
                      **layout)
    return fig


def to_gib(nbytes: float) -> float:
    return float(nbytes) / GIB


def gib(nbytes: float, digits: int = 1) -> str:
    """THE memory formatter of the course: bytes as GiB (2**30), e.g. gib(85899345920) -> '80.0 GiB'.
    Every memory number a chapter prints, draws or quotes in its prose goes through it, so GB (1e9) and
    GiB never mix; bandwidths (GB/s) and FLOP/s keep their decimal units. The planner's own
    sentences use the same one (mini3d.cost.memory.gib)."""
    return memory_gib(nbytes, digits)


def human_bytes(nbytes: float) -> str:
    """1536 -> '1.5 KiB'; used in hover text and annotations."""
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def as_breakdown(x) -> dict[str, float]:
    """Bytes by category from a dict, or from any object with the category attributes
    (e.g. `mini3d.cost.memory.MemoryEstimate`). Missing categories count as 0."""
    if isinstance(x, dict):
        unknown = set(x) - set(CATEGORIES) - {"stage", "total", "n_params", "inflight", "detail"}
        if unknown:
            raise ValueError(f"unknown memory categories {sorted(unknown)} (choose from {CATEGORIES})")
        return {c: float(x.get(c, 0) or 0) for c in CATEGORIES}
    return {c: float(getattr(x, c, 0) or 0) for c in CATEGORIES}

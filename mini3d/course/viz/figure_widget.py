"""`FigureWidget`: plotly's FigureWidget whose browser module is compiled once per page, not once per figure.

Why (issue #32, blank explorer figures after Run All): plotly's FigureWidget is an anywidget whose
`_esm` is plotly's whole 5 MB widget bundle. anywidget imports every model's `_esm` from a fresh
blob URL, so the browser parses and evaluates plotly.js once per figure, on the page's one thread,
and gives each model 2 seconds from its creation to finish (`AbortSignal.timeout(2000)` in
anywidget's `Runtime`, which rejects the model's `ready` promise with "[anywidget] Failed to
initialize model"). A rejected `ready` is final: anywidget's `_handle_comm_msg` awaits it before
every message from the kernel, so every later update of that model is dropped, and its view,
drawn once the module finally loads, shows the state the model was created with: the empty axes
an explorer starts from. With a dozen figures created during Run All, or one figure on a busy
machine, the later ones miss the deadline; a browser reload (a fresh model, the module now warm)
sometimes cures it.

The fix: this class's `_esm` is a small loader that finishes `initialize` at once (so `ready`
resolves within the deadline however slow plotly.js is to load) and imports plotly's bundle, sent
as the `_plotly_esm` trait, once per page through one promise shared by every figure. Each
figure then runs plotly's own `initialize` and `render` on that module. Kernel messages that arrive
before plotly's model code listens are still applied to the model's synced state, and the
explorers store each figure's whole picture there after every redraw (`widgets.synced`), which is
what a view draws from when it is created.
"""

from __future__ import annotations

import functools
import pathlib
import uuid

import plotly
import plotly.graph_objects as go
import traitlets

LOADER_ESM = """
// One evaluation of plotly's widget bundle per page, shared by every mini3d figure.
const SHARED = "__mini3d_plotly_widget_module";
const FIGURES = (globalThis.__mini3d_plotly_figures ??= new Map());  // figure key -> plotly widget

function plotlyModule(model) {
  if (!globalThis[SHARED]) {
    const url = URL.createObjectURL(new Blob([model.get("_plotly_esm")], { type: "text/javascript" }));
    globalThis[SHARED] = import(url).finally(() => URL.revokeObjectURL(url));
  }
  return globalThis[SHARED];
}

export default {
  initialize({ model, experimental }) {
    // returns at once: anywidget gives initialize 2 s, plotly.js may need longer to load
    const widget = plotlyModule(model).then((mod) => {
      const w = mod.default();
      w.initialize({ model, experimental });
      return w;
    });
    FIGURES.set(model.get("_figure_key"), widget);
  },
  async render({ model, el, experimental }) {
    try {
      const w = await FIGURES.get(model.get("_figure_key"));
      return w.render({ model, el, experimental });
    } catch (err) {
      el.textContent = `plotly's widget module failed to load: ${err}`;
      throw err;
    }
  },
};
"""


@functools.cache
def plotly_widget_bundle() -> str:
    """The JavaScript module plotly's own FigureWidget ships (its `_esm` file)."""
    return (pathlib.Path(plotly.__file__).parent / "package_data" / "widgetbundle.js").read_text()


class FigureWidget(go.FigureWidget):
    """A `go.FigureWidget` that draws even when plotly.js loads slowly (see the module docstring)."""

    _esm = LOADER_ESM
    _plotly_esm = traitlets.Unicode().tag(sync=True)
    _figure_key = traitlets.Unicode().tag(sync=True)

    # trait defaults, not assignments after construction: the comm opens inside the constructor
    # with the state as it is then, and the loader's `initialize` reads both from that state
    @traitlets.default("_plotly_esm")
    def _default_plotly_esm(self):
        return plotly_widget_bundle()

    @traitlets.default("_figure_key")
    def _default_figure_key(self):
        return uuid.uuid4().hex


__all__ = ["FigureWidget", "LOADER_ESM", "plotly_widget_bundle"]

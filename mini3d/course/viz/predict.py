"""Predict-then-reveal: a multiple-choice question whose answer the chapter's cell computes.

    predict(question, options, answer, why="")   the question, the options as radio buttons, and a
                                                 Reveal button that shows the answer, says whether
                                                 the pick was right, and explains why

The chapter computes `answer` (and `why`) with mini3d in the same cell, so the revealed answer
follows the code, never a typed number. Stands before the figure it asks about.
"""

from __future__ import annotations

import ipywidgets as W


def verdict(pick, answer) -> str:
    """'right', 'not quite' or 'no guess' for a pick against the answer."""
    if pick is None:
        return "no guess"
    return "right" if pick == answer else "not quite"


def predict(question: str, options, answer, why: str = ""):
    """A VBox (CSS class `mini3d-predict`): question, options, Reveal button, answer line.
    `answer` must be one of `options`; `box.reveal()` does what the button does."""
    options = list(options)
    if answer not in options:
        raise ValueError(f"answer {answer!r} is not among the options {options}")
    pick = W.RadioButtons(options=options, value=None, layout=W.Layout(width="max-content"))
    button = W.Button(description="Reveal", button_style="info")
    shown = W.HTML()

    def reveal(_=None):
        shown.value = (f"Answer: <b>{answer}</b> ({verdict(pick.value, answer)}, you chose "
                       f"{pick.value if pick.value is not None else 'nothing'}). {why}")
    button.on_click(reveal)
    box = W.VBox([W.HTML(f"<b>Predict first.</b> {question}"), pick, button, shown])
    box.add_class("mini3d-predict")
    box.pick, box.reveal, box.shown = pick, reveal, shown
    return box


__all__ = ["predict", "verdict"]

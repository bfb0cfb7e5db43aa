"""Numbers in a chapter's prose, checked against the cells that compute them.

The marker convention: in a markdown cell, a number (or any short text) the chapter computes is
written between two HTML comments, which the rendered notebook does not show:

    tp=2 across nodes keeps <!--=tp2_kept-->84%<!--/--> of the gain

and a code cell publishes the value under that name, formatted as the prose should read it:

    told = Told("04_tensor_parallelism.ipynb")
    told("tp2_kept", f"{kept:.0%}")

`told(name, text)` reads the notebook file and fails (AssertionError naming every disagreement)
unless each `<!--=name-->` span in its markdown reads exactly `text`; a name with no span fails too,
so a value cannot be published for prose that no longer exists. The chapters run headless in the
suite (nbmake), so a sentence that drifts from its cell fails there; `tests/test_course_notebooks.py`
checks the other direction, that every span's name is published by a `told(...)` call of its chapter.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

SPAN = re.compile(r"<!--=(\w+)-->(.*?)<!--/-->", re.S)


def marked_spans(markdown: str) -> list[tuple[str, str]]:
    """(name, text) of every marked span, in order."""
    return [(m.group(1), m.group(2)) for m in SPAN.finditer(markdown)]


def notebook_spans(path) -> dict[str, list[str]]:
    """{name: [text of each span with that name]} over a notebook's markdown cells."""
    cells = json.loads(Path(path).read_text())["cells"]
    out: dict[str, list[str]] = {}
    for cell in cells:
        if cell["cell_type"] == "markdown":
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            for name, text in marked_spans(src):
                out.setdefault(name, []).append(text)
    return out


def _find(notebook: str) -> Path:
    """The notebook next to the kernel (Jupyter and nbmake start it in the notebook's folder), else
    the checkout's course/ folder."""
    here = Path(notebook)
    if here.exists():
        return here
    return Path(__file__).resolve().parents[3] / "course" / Path(notebook).name


class Told:
    """The values a chapter publishes for its prose; each call checks the spans of its name."""

    def __init__(self, notebook: str):
        self.path = _find(notebook)
        self.spans = notebook_spans(self.path)
        self.values: dict[str, str] = {}

    def __call__(self, name: str, text) -> str:
        text = str(text)
        self.values[name] = text
        found = self.spans.get(name)
        assert found, f"{self.path.name}: no <!--={name}--> span in the prose for the value {text!r}"
        wrong = [t for t in found if t != text]
        assert not wrong, (f"{self.path.name}: the prose says {wrong} where the cell computes "
                           f"{text!r} (span {name})")
        return text


FRACTIONS = ((1 / 5, "a fifth"), (1 / 4, "a quarter"), (1 / 3, "a third"), (1 / 2, "half"),
             (2 / 3, "two thirds"), (3 / 4, "three quarters"))


def about(fraction: float, within: float = 0.04) -> str:
    """A fraction as prose says it: 0.36 -> 'about a third' (the nearest of FRACTIONS, if within
    `within`), else a percentage ('about 45%'), so a marked "about a third" fails once the cell's
    number moves to another word."""
    value, word = min(FRACTIONS, key=lambda f: abs(f[0] - fraction))
    return f"about {word}" if abs(value - fraction) <= within else f"about {fraction:.0%}"


__all__ = ["SPAN", "Told", "about", "marked_spans", "notebook_spans"]

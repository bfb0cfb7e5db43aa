"""Course notebooks are stored without outputs (their execution is nbmake's job, see below)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "course").glob("*.ipynb")) + sorted((ROOT / "tests" / "notebooks").glob("*.ipynb"))
nbformat = pytest.importorskip("nbformat")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip outputs"


# Execution: `python -m pytest` collects every notebook under course/ and tests/notebooks/ with nbmake
# (pyproject: --nbmake, testpaths include course/), so each chapter runs headless in CI.


CHAPTERS = sorted((ROOT / "course").glob("[0-9][0-9]*_*.ipynb"))  # 07b too
_LINK = r"\]\(([^)\s]+)\)"


def _exercises_of(path):
    from mini3d.course import grading

    key = path.name.split("_")[0]  # "05", "07b"
    return [e for e in grading.all_exercises() if e.chapter.split()[0] == key]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_relative_link_opens_from_a_root_server(path):
    """Every relative link in a chapter's markdown resolves to a file in the repository, so a
    JupyterLab started at the repository root (course/README.md) opens it; none leaves the root."""
    import re

    nb = nbformat.read(path, as_version=4)
    links = [m for c in nb.cells if c.cell_type == "markdown" for m in re.findall(_LINK, c.source)]
    for link in links:
        if "://" in link or link.startswith("#"):
            continue
        target = (path.parent / link.split("#")[0]).resolve()
        assert target.exists() and ROOT in target.parents, f"{path.name}: dead link {link}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_chapter_ends_with_a_grade_cell_for_its_exercises(path):
    """The last cell grades exactly the chapter's exercises; the markdown before it links each one
    with its points (as the grader counts them)."""
    nb = nbformat.read(path, as_version=4)
    exs = _exercises_of(path)
    assert exs, f"{path.name}: no exercise names this chapter"
    last, before = nb.cells[-1], nb.cells[-2]
    assert last.cell_type == "code" and "grade_exercise(" in last.source
    assert last.source.split("grade_exercise(")[-1].rstrip().rstrip(")") == ", ".join(f'"{e.name}"' for e in exs)
    for e in exs:
        assert f"](../exercises/{e.name}.py) ({e.points} points)" in before.source, (path.name, e.name)


def _tagged(nb, tag):
    return [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_main_widget_builds_from_the_imports_cell_alone(path):
    """The browser test runs each chapter's `imports` + `main-widget` cells; they must stand alone
    and build an explorer."""
    nb = nbformat.read(path, as_version=4)
    (imports,), (widget,) = _tagged(nb, "imports"), _tagged(nb, "main-widget")
    ns: dict = {}
    exec(compile(imports.source, f"{path.name}[imports]", "exec"), ns)
    box = eval(compile(widget.source, f"{path.name}[main-widget]", "eval"), ns)
    assert "mini3d-explorer" in box._dom_classes and box.controls


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_predict_before_the_explorer_and_the_70b_story(path):
    """Predict-then-reveal: the cell right before the main explorer, and before the 70B scenario
    cell (every chapter but 08, which changes neither memory nor step time), asks the learner to
    predict first (markdown, or a `predict(...)` multiple choice)."""
    nb = nbformat.read(path, as_version=4)
    at = [i for i, c in enumerate(nb.cells) if "main-widget" in c.get("metadata", {}).get("tags", [])
          or (c.cell_type == "code" and "show_story(" in c.source)]
    assert len(at) == (1 if path.name.startswith("08") else 2), path.name
    for i in at:
        prev = nb.cells[i - 1]  # a question in markdown, or a multiple choice revealing a computed answer
        assert ("**Predict first.**" in prev.source if prev.cell_type == "markdown"
                else "predict(" in prev.source), (path.name, i)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_marked_number_is_computed_by_its_chapter(path):
    """Each `<!--=name-->text<!--/-->` span in a chapter's prose is published by a `told("name", ...)`
    call in one of its code cells (the call checks the text when the chapter runs under nbmake),
    and that call's `Told` reads this chapter's own file."""
    import re

    from mini3d.course.viz.prose import notebook_spans

    nb = nbformat.read(path, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    spans = notebook_spans(path)
    published = set(re.findall(r"""\btold\(\s*["'](\w+)["']""", code))
    assert not set(spans) - published, f"{path.name}: spans no cell publishes: {sorted(set(spans) - published)}"
    if spans:
        assert f'Told("{path.name}")' in code, f"{path.name}: Told(...) must name this notebook"


def test_told_fails_on_prose_that_disagrees(tmp_path):
    """The checker can fail: a span that reads otherwise, and a value with no span, are errors."""
    from mini3d.course.viz.prose import Told, marked_spans

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("keeps <!--=kept-->84%<!--/--> of it, **<!--=n-->1943<!--/-->** layouts"),
                nbformat.v4.new_markdown_cell("again <!--=kept-->84%<!--/-->")]
    nbformat.write(nb, tmp_path / "ch.ipynb")
    told = Told(str(tmp_path / "ch.ipynb"))
    assert told("kept", "84%") == "84%" and told("n", 1943) == "1943"
    with pytest.raises(AssertionError, match=r"says \['84%', '84%'\] where the cell computes '83%'"):
        told("kept", "83%")
    with pytest.raises(AssertionError, match="no <!--=gone--> span"):
        told("gone", "1")
    assert marked_spans("a <!--=x-->1\n2<!--/--> b <!--=y-->3<!--/-->") == [("x", "1\n2"), ("y", "3")]


def test_about_words_a_fraction_only_while_it_is_near():
    """Chapter 02's "about a third" (chapter 09's loss at 1,024 GPUs) is `about(1 - efficiency)`:
    a fraction that moves to another word, or to none, no longer reads "about a third"."""
    from mini3d.course.viz.prose import about

    assert about(0.36) == about(1 / 3) == "about a third" and about(0.27) == "about a quarter"
    assert about(0.52) == "about half" and about(0.42) == "about 42%" and about(0.05) == "about 5%"

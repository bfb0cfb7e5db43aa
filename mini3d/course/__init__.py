"""The course machinery: figures and explorers (`viz/`), the exercise grader (`grading/`), the
running example (`story`) and chapter 10's numbers (`experts`: live MoE runs, capacity, volume).

It depends on the engine (`mini3d.*`) and never the other way round: no engine module imports
`mini3d.course` (tests/test_layers.py checks it). The figures need the `course` extra
(plotly, ipywidgets); the grader needs only the engine.
"""

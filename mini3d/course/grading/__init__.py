"""The exercise grader: one list of named, weighted checks per exercise, used by pytest and `mini3d grade`.

    core             Check, Exercise, Context, expect: what a check is (imports nothing else here)
    scenario         the multi-process side of a distributed exercise (run on gloo)
    memory pipeline rank_grid recompute hangs data_parallel tensor_parallel plan_search grad_norm
    long_sequences experts
                     one module per exercise idea, each with its EXERCISES
    runner           run_check, all_exercises, find, grade, score_table
    cli              `mini3d grade`
"""

from mini3d.course.grading.core import (IMPLS, Check, CheckFailed, Context, Exercise, Outcome,
                                        ensure_importable, expect, load_impl)
from mini3d.course.grading.runner import (all_exercises, find, grade, run_check, scenario_results,
                                          score_table, untouched)

__all__ = ["IMPLS", "Check", "CheckFailed", "Context", "Exercise", "Outcome", "ensure_importable",
           "expect", "load_impl", "all_exercises", "find", "grade", "run_check", "scenario_results",
           "score_table", "untouched"]

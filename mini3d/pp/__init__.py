"""Pipeline parallelism: schedules as data, stage partition, point-to-point, runtime, simulator.

    from mini3d.pp import make_schedule, check, simulate, build_stages, PipelineRuntime

`make_schedule(kind, p, m, v)` returns a `Schedule` (per-rank ordered actions); `check` proves it
follows the rules and cannot deadlock; `simulate` times it; `PipelineRuntime` executes it.
"""

from mini3d.pp.generic import BlockStage, stages_from_blocks
from mini3d.pp.partition import StageSpec, build_stages, local_specs, partition_layers, stage_specs
from mini3d.pp.rules import CheckResult, check
from mini3d.pp.runtime import PipelineRuntime, StepResult
from mini3d.pp.schedules import (Action, Schedule, format_grid, gpipe, interleaved_1f1b, make_schedule,
                                 one_f_one_b, schedule_problems)
from mini3d.pp.simulator import SimResult, bubble_formula, simulate

__all__ = ["Action", "Schedule", "make_schedule", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "schedule_problems", "format_grid", "check", "CheckResult", "simulate", "SimResult",
           "bubble_formula", "StageSpec", "partition_layers", "stage_specs", "local_specs",
           "build_stages", "PipelineRuntime", "StepResult", "BlockStage", "stages_from_blocks"]

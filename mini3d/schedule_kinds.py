"""The schedule registry: each pipeline schedule kind is an object that answers every question
about itself (pure functions of p ranks, m micro-batches, v chunks per rank; no torch).

    kind = schedule_kind("interleaved")
    kind.chunks(v)                  model chunks per rank it runs with (the plan's v, or its own)
    kind.problems(p, m, v)          why (p, m, v) has no such schedule (Plan.problems reports them)
    kind.placement                  "loop" or "v": where a stage lives (mini3d.pp.placement)
    kind.in_flight(p, m, v, rank)   most micro-batch chunks rank holds between F and last B/W
    kind.head_in_flight(p, m)       most micro-batches whose last-stage (head) activations live at once
    kind.bubble(p, m, v, ...)       closed-form bubble fraction, or None (simulate it)
    kind.form                       that closed form at unit costs, as the course and the dry run
                                    print it
    kind.builder                    the function of mini3d.pp.schedules that builds its action lists

The configuration (`mini3d.config`, which validates plans) and the pipeline (`mini3d.pp`, which
builds, checks and times the action lists) both read it, so it sits in the foundations and
imports nothing. No other module compares a schedule's name (tests/test_schedule_kinds.py scans
the package): a question about a kind is a method here. Every bound and closed form is checked
against the schedule the builder really produces (`mini3d.pp.rules.check` measures the peaks, the
simulator the bubble; tests/test_formulas.py, tests/test_schedule_kinds.py).
"""

from __future__ import annotations

from fractions import Fraction


class ScheduleKind:
    """What every kind answers; the defaults are 1F1B's (`OneFOneB`), the others override."""

    name = ""
    builder = ""  # a function of mini3d.pp.schedules (its BUILDERS), taking (p, m) or (p, m, v)
    placement = "loop"  # stage s on rank s % p; "v": see mini3d.pp.placement.stage_rank
    fixed_chunks: int | None = 1  # chunks per rank; None: the plan's virtual_stages (at least 1)
    needs_full_pipe = True  # m >= p when p > 1: the warm-up fills every rank before the first B
    split = False  # backward split into B (input gradient) and W (weight gradients)
    form: str | None = "(p-1)/(m+p-1)"  # the closed form of `bubble`, None: no closed form

    def chunks(self, v: int) -> int:
        """Model chunks per rank it runs with, given the plan's (or the slider's) v."""
        return v if self.fixed_chunks is None else self.fixed_chunks

    @property
    def multi_chunk(self) -> bool:
        """Whether it can hold more than one model chunk per rank."""
        return self.fixed_chunks != 1

    @property
    def default_v(self) -> int:
        """The v `mini3d schedule` uses when none is given: 2 for the multi-chunk kinds."""
        return 2 if self.multi_chunk else 1

    def min_microbatches(self, p: int) -> int:
        """The fewest micro-batches it runs on p ranks: p for 1F1B and ZB-H1, else 1."""
        return p if self.needs_full_pipe and p > 1 else 1

    def problems(self, p: int, m: int, v: int) -> list[str]:
        """Why (p, m, v) has no schedule of this kind (positive integers assumed)."""
        out = []
        if m < self.min_microbatches(p):
            out.append(f"{self.name} needs micro_batches >= pp, got micro_batches={m} < pp={p} "
                       f"(use --micro-batches {p} or more)")
        return out + self._chunk_problems(v)

    def _chunk_problems(self, v: int) -> list[str]:
        if v == 1:
            return []
        multi = [k.name for k in KINDS.values() if k.multi_chunk]
        return [f"virtual_stages={v} needs schedule {', '.join(multi[:-1])} or {multi[-1]} "
                f"(got schedule={self.name!r})"]

    def model_problems(self, p: int, tie_embeddings: bool) -> list[str]:
        """What the model's shape forbids under this kind (beyond the layer split)."""
        return []

    def in_flight(self, p: int, m: int, v: int, rank: int) -> int:
        """Most micro-batch chunks (forward done, last backward action not yet) `rank` holds at
        once. 1F1B: min(m, p - rank), the warm-up forwards plus the one in flight."""
        return min(p - rank, m)

    def head_in_flight(self, p: int, m: int) -> int:
        """Most micro-batches whose last stage's activations (head and loss included) live at
        once: 1 when the last stage runs each micro-batch's backward right after its forward."""
        return 1

    def bubble(self, p: int, m: int, v: int = 1, t_fwd=1, t_bwd=2, t_w=None):
        """Closed-form bubble fraction (idle share of p x makespan) at uniform stage costs."""
        return Fraction(p - 1, m + p - 1)

    def __repr__(self) -> str:
        return f"<schedule kind {self.name}>"


class OneFOneB(ScheduleKind):
    """1F1B (PipeDream-Flush, Megatron's default): rank r runs p - r - 1 warm-up forwards, then
    one forward and one backward in turn."""

    name, builder = "1f1b", "one_f_one_b"


class GPipe(ScheduleKind):
    """All forwards, then all backwards (Huang et al. 2019): every rank holds m activations."""

    name, builder, needs_full_pipe = "gpipe", "gpipe", False

    def in_flight(self, p, m, v, rank):
        return m

    def head_in_flight(self, p, m):
        return m


class Interleaved(ScheduleKind):
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): v >= 2 chunks per rank, round robin."""

    name, builder, fixed_chunks, needs_full_pipe = "interleaved", "interleaved_1f1b", None, False
    form = "(p-1)/(v·m+p-1)"

    def problems(self, p, m, v):
        out = [] if v >= 2 else [f"interleaved needs virtual_stages >= 2, got {v}"]
        rounds = max(1, m // p)
        if m % rounds:
            fits = sorted({p * rounds, m - m % rounds, p})
            out.append(f"interleaved needs micro_batches={m} to be a multiple of its rounds "
                       f"max(1, micro_batches // pp={p}) = {rounds} (e.g. {fits})")
        return out

    def in_flight(self, p, m, v, rank):
        """Warm-up 2 (p - rank - 1) + (v - 1) g forwards plus the one in flight, at most m v
        (g = m // max(1, m // p): p when p divides m, Megatron's case)."""
        g = m // max(1, m // p)
        return min(2 * (p - rank - 1) + (v - 1) * g + 1, m * v)

    def bubble(self, p, m, v=1, t_fwd=1, t_bwd=2, t_w=None):
        return Fraction(p - 1, v * m + p - 1)


class LoopedBFS(Interleaved):
    """Breadth-first looping (Lamy-Poirier 2022): every micro-batch through chunk 0, then 1, ..."""

    name, builder = "looped-bfs", "looped_bfs"

    def problems(self, p, m, v):
        return []

    def in_flight(self, p, m, v, rank):
        return m * v

    def head_in_flight(self, p, m):
        return m


class ZBH1(ScheduleKind):
    """ZB-H1 (Qi et al. 2023): backward split into B (input gradient) and W (weight gradients),
    rank r running its W r micro-batches late, 1F1B's memory."""

    name, builder, split = "zb-h1", "zb_h1", True
    form = "(p-1)/(3m+p-1)"  # at t_F = t_B = t_W (the general form: `bubble`)

    def in_flight(self, p, m, v, rank):
        return min(p, m)

    def head_in_flight(self, p, m):
        """The last rank runs its W p - 1 micro-batches late; the graph, head included, stays."""
        return min(m, p)

    def bubble(self, p, m, v=1, t_fwd=1, t_bwd=2, t_w=None):
        """Each rank idles (p-1)(t_F + t_B - t_W), t_B = t_bwd - t_W the input-gradient part,
        against m (t_F + t_bwd) of work; it holds while t_W <= t_F + t_B (a deferred W never
        outlasts the gap it fills). t_W defaults to half the backward."""
        tw = t_bwd * Fraction(1, 2) if t_w is None else t_w
        idle = (p - 1) * (t_fwd + (t_bwd - tw) - tw)
        idle = Fraction(idle) if isinstance(idle, int) else idle  # exact for int costs
        return idle / (m * (t_fwd + t_bwd) + idle)


class ZBV(ZBH1):
    """ZB-V (Qi et al. 2023, section 6): two chunks per rank in a V (stages r and 2p-1-r)."""

    name, builder, placement, fixed_chunks, needs_full_pipe = "zbv", "zbv", "v", 2, False
    form = None

    def _chunk_problems(self, v):
        if v == 2:
            return []
        return [f"zbv needs exactly virtual_stages=2 (two chunks per rank in a V), got {v}"]

    def model_problems(self, p, tie_embeddings):
        if p > 1 and tie_embeddings:
            return ["schedule='zbv' puts the first and the last stage on pipeline rank 0, but "
                    "tied embeddings are summed between pipeline ranks 0 and pp-1 "
                    "(mini3d.pp.tied): use --schedule zb-h1, or a model with untied embeddings"]
        return []

    def in_flight(self, p, m, v, rank):
        """The peak of its handcrafted order: min(2p, 2m, m + rank + 1) half-stage chunks (2p,
        1F1B's peak in layers, once m >= 2p - rank - 1; checked on every order up to p = 8)."""
        return min(2 * p, 2 * m, m + rank + 1)

    def head_in_flight(self, p, m):
        """Rank 0 runs the last chunk's F, B and W back to back."""
        return 1

    def bubble(self, p, m, v=1, t_fwd=1, t_bwd=2, t_w=None):
        return None


KINDS = {k.name: k for k in (GPipe(), OneFOneB(), Interleaved(), LoopedBFS(), ZBH1(), ZBV())}
SCHEDULES = tuple(KINDS)  # the names, in the order the CLI and the course list them
MULTI_CHUNK = tuple(k.name for k in KINDS.values() if k.multi_chunk)


def schedule_kind(name: str) -> ScheduleKind:
    """The kind called `name`; a ValueError naming the known ones otherwise."""
    try:
        return KINDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"schedule={name!r} is unknown (choose {', '.join(SCHEDULES)})") from None


def schedule_problems(kind: str, p: int, m: int, v: int = 1) -> list[str]:
    """Why (kind, p, m, v) has no pipeline schedule (`mini3d.pp.make_schedule` refuses it with
    these messages, `Plan.problems` reports them)."""
    out = [f"{n}={x} must be a positive integer" for n, x in (("pp", p), ("micro_batches", m),
           ("virtual_stages", v)) if not isinstance(x, int) or x < 1]
    if not isinstance(kind, str) or kind not in KINDS:
        out.append(f"schedule={kind!r} is unknown (choose {', '.join(SCHEDULES)})")
    return out or KINDS[kind].problems(p, m, v)


__all__ = ["ScheduleKind", "OneFOneB", "GPipe", "Interleaved", "LoopedBFS", "ZBH1", "ZBV", "KINDS",
           "SCHEDULES", "MULTI_CHUNK", "schedule_kind", "schedule_problems"]

"""The launcher's p2p check, completed: each job's recorded point-to-point programs
(`mini3d.launch.p2p_record`) run by the rendezvous simulator under NCCL's rules, which also sees waits and
the pair communicators' joins: a rank that blocks on a receive before posting the send its peer
waits for, or a ring of first sends (each joining a pair communicator) at cp >= 3.

`register()` adds `program_deadlock` to the judges of every checked job
(`mini3d.launch.p2p_record.add_judge`). tests/conftest.py calls it, so every multi-process test gets
both checks, and so does `mini3d.diagnose.cli` when imported (the CLI's `mini3d train`). The strict reading is
used (`device_id=False`: pair communicators joined on first use).
"""

from __future__ import annotations

from mini3d.launch.p2p_record import add_judge
from mini3d.diagnose.rendezvous import simulate

def program_deadlock(records: list, device_id: bool = False) -> str | None:
    """The records run by the rendezvous simulator under NCCL's rules; None if every program ends.
    An op never waited for in the record (its Work followed to the end) is waited for at the end."""
    progs = []
    for record in records:
        prog = [(what, key, op[:4]) for what, key, op in record]
        waited = {key for what, key, _ in record if what == "wait"}
        prog += [("wait", key, op) for what, key, op in prog if what == "issue" and key not in waited]
        progs.append(prog)
    return simulate(progs, None, "nccl", device_id)


def register() -> None:
    """Judge every checked job with `program_deadlock` too (once: a repeat is ignored)."""
    add_judge(program_deadlock)

__all__ = ["program_deadlock", "register"]

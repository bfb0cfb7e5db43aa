"""One step of one pipeline rank: `Action` (F, B, W and the transfers), as `mini3d.pp.schedules`
lists them (see its docstring for what each op means and how it prints)."""

from __future__ import annotations

from typing import NamedTuple

COMPUTE = ("F", "B", "W")
TRANSFERS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_SHORT = {"SEND_F": "sF", "RECV_F": "rF", "SEND_B": "sB", "RECV_B": "rB"}


class Action(NamedTuple):
    """One step of one pipeline rank; `peer` is the other pipeline rank of a transfer."""

    op: str  # F, B, W, SEND_F, RECV_F, SEND_B or RECV_B
    stage: int  # global stage (model chunk) id
    mb: int  # micro-batch index
    peer: int | None = None  # pipeline rank at the other end (transfers only)

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.op}{self.stage}.{self.mb}"
        arrow = ">" if self.op.startswith("SEND") else "<"
        return f"{_SHORT[self.op]}{self.stage}.{self.mb}{arrow}{self.peer}"


def F(stage: int, mb: int) -> Action:
    return Action("F", stage, mb)


def B(stage: int, mb: int) -> Action:
    return Action("B", stage, mb)


def W(stage: int, mb: int) -> Action:
    return Action("W", stage, mb)


__all__ = ["Action", "F", "B", "W", "COMPUTE", "TRANSFERS"]

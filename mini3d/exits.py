"""Exit codes of every mini3d command, and the one-paragraph bad-input message (exit 2, printed
before any process starts). Each subcommand module reads them here, so none imports `mini3d.cli`."""

from __future__ import annotations

import sys

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_HUNG, EXIT_OOM = 0, 1, 2, 3, 4


def bad_input(problems: list[str], command: str = "train") -> int:
    print(f"mini3d {command}: bad input: " + "; ".join(problems) + ". Nothing was started.",
          file=sys.stderr)
    return EXIT_BAD_INPUT

"""Exit codes of every mini3d command, the errors that carry them, the one-paragraph bad-input
message (exit 2, printed before any process starts), and the checks that an output path can be
written where it points. Each subcommand module reads them here, so none imports `mini3d.cli`.

An error class says its own exit code (`Mini3dError.exit_code`: `BadInput` 2, `PlanError` 2,
`mini3d.run.records.NonFiniteLoss` 5, `mini3d.diagnose.faults.OutOfMemory` 4); `exit_code_of`
reads it, in the process that raised it or, through the launcher, in the one that launched it.
Any other exception is a failed rank (1)."""

from __future__ import annotations

import os
import sys

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_HUNG, EXIT_OOM = 0, 1, 2, 3, 4
EXIT_NONFINITE = 5  # the loss became nan or inf (the message names the step and the rank)
# 130 / 143: stopped by SIGINT / SIGTERM at a step boundary (mini3d.run.stop.exit_code)


class Mini3dError(Exception):
    """An error that ends a mini3d command with its own exit code; its message is the whole
    story (a command prints it without a traceback)."""

    exit_code = EXIT_FAILED


class BadInput(Mini3dError, ValueError):
    """Input refused before anything starts; the message names every offending value."""

    exit_code = EXIT_BAD_INPUT


def exit_code_of(exc: BaseException) -> int:
    """The exit code an exception ends a command with: its class's, else 1 (a rank failed)."""
    return exc.exit_code if isinstance(exc, Mini3dError) else EXIT_FAILED


def bad_input(problems: list[str], command: str = "train", after: str = " Nothing was started.") -> int:
    """Print the one-paragraph bad-input message of `command`; its exit code (2)."""
    print(f"mini3d {command}: bad input: " + "; ".join(problems) + "." + after, file=sys.stderr)
    return EXIT_BAD_INPUT


def file_target(flag: str, path: str | None) -> list[str]:
    """A file mini3d will create or append to: not a directory, in a directory that exists."""
    if not path:
        return []
    if os.path.isdir(path):
        return [f"{flag} {path!r} is a directory (give a file name)"]
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return [f"{flag} {path!r}: its directory {parent!r} does not exist"]
    if not os.access(parent, os.W_OK):
        return [f"{flag} {path!r}: its directory {parent!r} is not writable"]
    return []


def dir_target(flag: str, path: str | None) -> list[str]:
    """A directory mini3d will create or fill: not an existing file, not below one, and the
    directory itself or its nearest existing ancestor writable (os.access: a read-only file system
    is refused even for root, which a mode bit is not)."""
    if not path:
        return []
    if os.path.exists(path) and not os.path.isdir(path):
        return [f"{flag} {path!r} is an existing file, not a directory"]
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        return [f"{flag} {path!r} lies below {parent!r}, which is a file"]
    where = path if os.path.isdir(path) else parent
    if where and not os.access(where, os.W_OK | os.X_OK):
        return [f"{flag} {path!r}: {where!r} is not writable"]
    return []

"""Helpers shared by the subcommands."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import TypeVar

from fp4kit.progress import Reporter

T = TypeVar("T")


def human_bytes(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000:
            return f"{int(nbytes)} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


def with_progress(fn: Callable[[Reporter], T], quiet: bool, label: str, phase: str, warnings: bool = True) -> T:
    """Run ``fn(progress)`` with a Reporter for command ``label`` (fp4kit.progress): a bar per phase on a terminal, a
    line per phase otherwise; ``phase`` names the work of a function that reports bytes without naming phases."""
    with Reporter(label, quiet, warnings=warnings, default_phase=phase) as reporter:
        return fn(reporter)

# the command line (without the program name) that fp4kit.cli.run is running: what a command records of itself,
# which is not sys.argv when a runner or a pipeline calls run()
INVOKED_ARGS: ContextVar[list[str] | None] = ContextVar("fp4kit_invoked_args", default=None)

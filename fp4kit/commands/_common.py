"""Helpers shared by the subcommands."""

from __future__ import annotations

from collections.abc import Callable
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

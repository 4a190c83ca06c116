"""Helpers shared by the subcommands."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def human_bytes(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000:
            return f"{int(nbytes)} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


def with_progress(fn: Callable[[Callable[[int, int], None] | None], T], quiet: bool, label: str) -> T:
    """Run ``fn(progress)`` with a rich byte-progress bar on an interactive terminal."""
    if quiet or not sys.stderr.isatty():
        return fn(None)
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task(label, total=None)
        return fn(lambda done, total: bar.update(task, completed=done, total=total))

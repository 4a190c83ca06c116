"""What a long command shows while it works, phase by phase (calibrating, quantizing, verifying, ...).

On a terminal: a determinate bar per phase on stderr (rich), with done/total in the phase's unit, within the
terminal's width. Otherwise: one plain line per phase on stderr, as it starts, and one per step of a long phase (a
decoder layer calibrated or quantized) with the time since the phase started. With ``quiet``: nothing but warnings.
Warnings are lines in every case.

Library functions take a ``progress`` argument: called as ``progress(done, total)`` it advances the current phase, so
a plain callable still works (it sees the function's main phase only); ``start_phase`` and ``warn`` below open a
phase, log a step or print a warning when ``progress`` is a ``Reporter`` and do nothing otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.filesize import decimal
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

ProgressFn = Callable[[int, int], None]
BYTES = "bytes"


class _Amount(ProgressColumn):
    """done/total in the task's unit: bytes in decimal units, anything else counted (``3/16 batches``)."""

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit", BYTES)
        total = "?" if task.total is None else (decimal(int(task.total)) if unit == BYTES else str(int(task.total)))
        done = decimal(int(task.completed)) if unit == BYTES else str(int(task.completed))
        return Text(f"{done}/{total}" + ("" if unit == BYTES else f" {unit}"), style="progress.download")


class Reporter:
    """Progress of one command (see the module docstring). Use as a context manager around the work."""

    def __init__(self, label: str, quiet: bool = False, console: Console | None = None, warnings: bool = True,
                 default_phase: str = "", default_unit: str = BYTES, lines: bool = True):
        """``label``: the command ('quantize'); ``default_phase`` / ``default_unit``: the phase a caller that reports
        without opening a phase is in ('sharding', bytes); ``warnings`` False silences warnings too (torchrun's
        ranks but 0); ``lines`` False: no phase lines without a terminal (a command whose output is its report)."""
        self.label, self.quiet, self.warnings = label, quiet or console is not None and console.quiet, warnings
        self.default_phase, self.default_unit, self.lines = default_phase, default_unit, lines
        self._in_phase = False
        self._phase_name, self._phase_start = "", time.monotonic()
        self.console = console or Console(stderr=True)
        self.terminal = self.console.is_terminal and not quiet
        self._bar: Progress | None = None
        self._task = None

    def __enter__(self) -> Reporter:
        if self.terminal:
            # the bar takes the width the other columns leave, so that a row never wraps (80 columns and up)
            self._bar = Progress(TextColumn("[progress.description]{task.description}",
                                            table_column=Column(no_wrap=True, overflow="ellipsis")),
                                 BarColumn(bar_width=None), _Amount(table_column=Column(no_wrap=True)),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=True,
                                 expand=True)
            self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)  # type: ignore[arg-type]
            self._bar = None

    def phase(self, name: str, total: int | None, unit: str = BYTES, detail: str = "") -> None:
        """Start phase ``name`` of ``total`` ``unit`` (``detail``: what the line says about it, e.g. '2 layers x 4
        batches'); the previous phase ends."""
        self._in_phase = True
        self._phase_name, self._phase_start = name, time.monotonic()
        if self.quiet:
            return
        if self._bar is None:
            if not self.lines:
                return
            amount = detail or (decimal(total) if unit == BYTES and total is not None else f"{total} {unit}")
            self._print(f"{self.label}: {name} ({amount})" if amount else f"{self.label}: {name}")
            return
        if self._task is not None:
            self._bar.refresh()  # the finished phase's last count is drawn before it goes
            self._bar.remove_task(self._task)
        self._task = self._bar.add_task(f"{self.label}: {name}", total=total, unit=unit)

    def __call__(self, done: int, total: int) -> None:
        if not self._in_phase:  # a function that reports its bytes without opening a phase
            self.phase(self.default_phase or "working", total, self.default_unit)
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=done, total=total)

    def describe(self, text: str) -> None:
        """Name what the current phase does now (the bar's label; nothing without a terminal)."""
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=f"{self.label} {text}")

    def step(self, text: str) -> None:
        """Without a terminal, a line saying how far the current phase has come (``text``: 'layer 3/48') and how long
        it has taken so far; on a terminal the bar says it."""
        if self.quiet or self._bar is not None or not self.lines:
            return
        elapsed = int(time.monotonic() - self._phase_start)
        clock = f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}"
        self._print(f"{self.label}: {self._phase_name}: {text}, {clock} elapsed")

    def warn(self, text: str) -> None:
        if self.warnings:
            self._print(f"warning: {text}")

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        elif not self.console.quiet:
            print(line, file=self.console.file, flush=True)


def start_phase(progress: ProgressFn | None, name: str, total: int | None, unit: str = BYTES,
                detail: str = "", main: bool = False) -> ProgressFn | None:
    """Open phase ``name`` on a Reporter and return the callable that advances it. A plain callable sees only the
    ``main`` phase (the one it was made for: the function's bytes); None stays None."""
    if isinstance(progress, Reporter):
        progress.phase(name, total, unit, detail)
        return progress
    return progress if main else None


def step(progress: ProgressFn | None, text: str) -> None:
    """A step line of the current phase through a Reporter (``Reporter.step``); nothing for other callers."""
    if isinstance(progress, Reporter):
        progress.step(text)


def warn(progress: ProgressFn | None, text: str) -> None:
    """A warning line through a Reporter; library callers without one read it from the function's report."""
    if isinstance(progress, Reporter):
        progress.warn(text)

"""Helpers shared by the subcommands."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, TypeVar

import typer

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

# a source given as a Hugging Face Hub id (fp4kit.io.hub): which revision, and whether to fetch what the cache lacks
Revision = Annotated[str | None, typer.Option(
    metavar="REV", help="a Hub id's branch, tag or commit in the local Hugging Face cache [default: main]",
    show_default=False)]
Download = Annotated[bool, typer.Option(
    "--download", help="fetch a Hub id the local Hugging Face cache lacks through huggingface_hub")]


def source_directory(source: Path, revision: str | None, download: bool, option: str = "SRC") -> Path:
    """``source`` as a directory: itself, or a Hub id's snapshot in the local Hugging Face cache."""
    from fp4kit.io.hub import resolve_source

    return resolve_source(source, revision, download, option)

"""`fp4kit demo`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def demo(
    workdir: Annotated[Path | None, typer.Option(help="keep the demo files here (default: a temp dir)")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
) -> None:
    """Build a tiny Qwen3-MoE checkpoint offline, quantize it, and summarize the result."""
    from fp4kit.demo import run_demo

    for line in run_demo(workdir, device):
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command()(demo)

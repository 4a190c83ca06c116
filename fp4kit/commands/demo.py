"""`fp4kit demo`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def demo(
    workdir: Annotated[Path | None, typer.Option(help="keep the demo files here (default: a temp dir)")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda: where quantize and verify run")] = "cpu",
) -> None:
    """Build a tiny seeded Qwen3-MoE offline and run the whole pipeline on it (calibrated W4A4 quantize, TRT-LLM
    layout, EP=2 shard, verify: the demo recipe), then print the run's summary. Exit 0 verified, 1 a check failed."""
    from fp4kit.demo import run_demo

    for line in run_demo(workdir, device):
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command()(demo)

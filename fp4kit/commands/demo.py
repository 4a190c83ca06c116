"""`fp4kit demo`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, get_args

import typer

from fp4kit.pipeline.demo import DEMO_FAMILIES

# the families the demo builds a model of
Family = Literal[DEMO_FAMILIES]  # type: ignore[valid-type]


def demo(
    family: Annotated[Family, typer.Option(
        metavar="FAMILY", help=f"the model family of the demo model: {', '.join(get_args(Family))}")] = "qwen3_moe",
    keep: Annotated[Path | None, typer.Option(
        "--keep", "--workdir", help="keep the model, every step's output and the summary in this directory "
                                   "(default: a temporary directory, removed at the end)")] = None,
    device: Annotated[Literal["cpu", "cuda"], typer.Option(help="where quantize and verify run")] = "cpu",
) -> None:
    """Build a small model of the --family offline (seeded random weights, 8 experts, sized so that the TRT-LLM, CUTLASS
    and Marlin layouts all accept it) and run the demo recipe on it: calibrated W4A4 quantize to compressed-tensors,
    TRT-LLM layout, EP=2 shard, verify. Prints the run's summary. Exit 0 verified, 1 a check failed."""
    from fp4kit.pipeline.demo import run_demo

    for line in run_demo(keep, device, family):
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command()(demo)

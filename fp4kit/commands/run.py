"""`fp4kit run`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def run(
    recipe: Annotated[Path, typer.Argument(
        help="recipe YAML (see recipes/ and docs/pipelines.md), or an llm-compressor recipe (with --set model=DIR)")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set model=/models/qwen3 --set shard.ep=4 (repeatable)")] = None,
    workdir: Annotated[Path | None, typer.Option(
        help="where step outputs, markers and the summary go (default: the recipe's workdir, else "
             "fp4kit-runs/NAME)")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only the summary path")] = False,
) -> None:
    """Run a recipe's steps (quantize, repair, layout, shard, verify) in order; finished steps are skipped on rerun.
    Exit 0 done, 1 a verify check failed, 2 invalid recipe or input."""
    from fp4kit.pipeline.recipe import load_recipe

    loaded = load_recipe(recipe, set_ or [])  # before torch's import: a bad recipe is refused at once
    for note in loaded.notes:  # even with -q: what an llm-compressor recipe asked for and will not get
        typer.echo(f"note: {note}", err=True)

    from rich.console import Console

    from fp4kit.pipeline.runner import run_loaded
    from fp4kit.quantize import distributed

    console = Console(stderr=True, quiet=quiet)
    summary = run_loaded(loaded, workdir, console)
    if not distributed.is_main():  # under torchrun, rank 0 reports for all
        return
    if not quiet:
        typer.echo(summary.markdown())
    quantized = summary.quantized()
    typer.echo(f"summary: {Path(summary.workdir) / 'summary.md'} and summary.json"
               + (f" (quantize: {quantized})" if quantized else ""))
    verify = loaded.recipe.verify
    if summary.passed is False and verify is not None and verify.fail_run:
        raise SystemExit(1)


def register(app: typer.Typer) -> None:
    app.command()(run)

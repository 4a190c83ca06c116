"""`fp4kit verify`."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from fp4kit.commands._common import Download, Revision, source_directory
from fp4kit.options import VERIFY, derive_command, library_kwargs

STDOUT = Path("-")


@contextlib.contextmanager
def verify_progress(quiet: bool) -> Iterator[tuple[Callable[[int, int], None] | None, Callable[[str], None] | None]]:
    """(progress, notify) for `verify_checkpoint`: a bar of layers x checks on a terminal, else a line per layer on
    stderr; warnings are lines in both cases; nothing with ``quiet``."""
    if quiet:
        yield None, None
        return
    if not sys.stderr.isatty():
        yield None, lambda text: typer.echo(f"verify: {text}", err=True)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True)
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), "checks",
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("verify", total=None)

        def notify(text: str) -> None:
            if text.startswith("warning: "):
                bar.console.print(f"verify: {text}", markup=False, highlight=False)
            else:
                bar.update(task, description=f"verify {text}")

        yield (lambda done, total: bar.update(task, completed=done, total=total)), notify


@derive_command(VERIFY)
def verify(
    ckpt: Annotated[Path, typer.Argument(help="NVFP4 checkpoint (compressed-tensors, ModelOpt or `fp4kit layout`)")],
    *,
    values: dict[str, Any],
    source: Annotated[Path | None, typer.Option(
        help="the BF16 checkpoint CKPT was made from (a directory, or a Hub id in the local Hugging Face cache)")
    ] = None,
    ep_shards: Annotated[Path | None, typer.Option(help="output of `fp4kit shard` made from CKPT")] = None,
    layout: Annotated[list[Path] | None, typer.Option(
        metavar="DIR", help="output of `fp4kit layout` made from CKPT (repeatable): undone and compared bit for bit")
    ] = None,
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="write the JSON report to this file (`--json -`: print it on stdout, instead of the table)")
    ] = None,
    plot: Annotated[Path | None, typer.Option(
        help="write a per-layer error plot (PNG; needs matplotlib: pip install 'fp4kit[plot]')")] = None,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="no progress and no table: the exit code (and `--json -`) say pass or fail")] = False,
    revision: Revision = None,
    download: Download = False,
) -> None:
    """Check that CKPT's MoE layers compute what the source model computes: kernels vs reference, quantized vs
    BF16, layout outputs, EP splits, NaN/Inf routing rows. Exit 0 pass, 1 fail, 2 unusable input."""
    import torch

    from fp4kit.verify.checks import VerifyOptions
    from fp4kit.verify.report import check_plot_available, plot_report, print_report
    from fp4kit.verify.runner import verify_checkpoint

    if plot is not None:
        check_plot_available()
    if source is not None:
        source = source_directory(source, revision, download, "--source")
    elif revision is not None or download:
        from fp4kit.errors import Fp4kitError

        raise Fp4kitError(f"{'--revision' if revision is not None else '--download'}: applies to --source, not given")
    options = VerifyOptions(**library_kwargs(VERIFY, values), source=source, ep_shards=ep_shards,
                            layouts=list(layout or []))
    options.device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with verify_progress(quiet) as (progress, notify):
        report = verify_checkpoint(ckpt, options, progress, notify)
    if json_path == STDOUT:
        typer.echo(json.dumps(report.to_json(), indent=2))
    elif json_path is not None:
        report.write_json(json_path)
    if plot is not None:
        plot_report(report, plot)
    if not quiet and json_path != STDOUT:
        print_report(report)
    if not report.passed:
        sys.exit(1)


def register(app: typer.Typer) -> None:
    app.command()(verify)

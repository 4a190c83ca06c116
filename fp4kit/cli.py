"""The `fp4kit` command: parse, call the library, print. Bad input exits 2 with one line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from fp4kit.errors import Fp4kitError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Turn BF16 MoE checkpoints into NVFP4 checkpoints that serving engines load and run.")


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


@app.command()
def quantize(
    src: Annotated[Path, typer.Argument(help="BF16 HF checkpoint directory (safetensors)")],
    dst: Annotated[Path, typer.Argument(help="output directory (created atomically)")],
    scheme: Annotated[str, typer.Option(help="nvfp4a16 (weight-only) or nvfp4 (W4A4)")] = "nvfp4a16",
    format: Annotated[str, typer.Option("--format", help="checkpoint dialect")] = "compressed-tensors",
    device: Annotated[str, typer.Option(help="cpu or cuda[:N]")] = "cpu",
    ignore: Annotated[list[str] | None, typer.Option(help="regex on module names to keep in bf16 (repeatable)")] = None,
    targets: Annotated[
        list[str] | None, typer.Option(help="regex: quantize only matching modules, e.g. 'experts\\.' (repeatable)")
    ] = None,
    no_default_ignore: Annotated[bool, typer.Option(help="drop the family's default ignore list")] = False,
    max_shard_size: Annotated[str, typer.Option(help="output shard size, e.g. 5GB")] = "5GB",
    overwrite: Annotated[bool, typer.Option(help="replace an existing non-empty DST")] = False,
    exact_fp32_global_scale: Annotated[
        bool, typer.Option(help="compute weight global scales in fp32 (default: as llm-compressor, in bf16)")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
) -> None:
    """Quantize a checkpoint to NVFP4, streaming one tensor group at a time."""
    from fp4kit.checkpoint import parse_size
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    options = QuantizeOptions(
        scheme=scheme, format=format, device=device, ignore=ignore or [], targets=targets or [],
        default_ignore=not no_default_ignore, max_shard_bytes=parse_size(max_shard_size), overwrite=overwrite,
        exact_fp32_global_scale=exact_fp32_global_scale,
    )
    report = _with_progress(lambda progress: quantize_checkpoint(src, dst, options, progress), quiet)
    if not quiet:
        rate = report.input_bytes / max(report.seconds, 1e-9)
        typer.echo(
            f"{report.family}: {report.quantized_linears} Linears quantized, {report.passthrough_tensors} tensors "
            f"kept, {_human(report.input_bytes)} -> {_human(report.output_bytes)} in {report.seconds:.1f} s "
            f"({_human(rate)}/s) -> {dst}"
        )


@app.command()
def demo(
    workdir: Annotated[Path | None, typer.Option(help="keep the demo files here (default: a temp dir)")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
) -> None:
    """Build a tiny Qwen3-MoE checkpoint offline, quantize it, and summarize the result."""
    from fp4kit.demo import run_demo

    for line in run_demo(workdir, device):
        typer.echo(line)


def _with_progress(fn, quiet: bool):
    if quiet or not sys.stderr.isatty():
        return fn(None)
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("quantizing", total=None)
        return fn(lambda done, total: bar.update(task, completed=done, total=total))


def main() -> None:
    try:
        app(standalone_mode=False)
    except Fp4kitError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted: no output was left behind", err=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click usage errors and the like
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(2)
        if isinstance(exc, click.exceptions.Abort):
            sys.exit(130)
        raise

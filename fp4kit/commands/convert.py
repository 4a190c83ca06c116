"""`fp4kit convert`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from fp4kit.commands._common import human_bytes, with_progress
from fp4kit.registry import DIALECT_NAMES

DENSE = "bf16"  # fp4kit.tools.dense.TARGET, spelled here so that the CLI imports no torch


def convert(
    src: Annotated[Path, typer.Argument(help="NVFP4 checkpoint directory (compressed-tensors or ModelOpt)")],
    dst: Annotated[Path, typer.Argument(help="output directory (created atomically)")],
    to: Annotated[Literal[(*DIALECT_NAMES, DENSE)], typer.Option(  # type: ignore[valid-type]
        "--to", help="target dialect, or bf16: a dense dequantized checkpoint (weight-only emulation)")],
    max_shard_size: Annotated[str, typer.Option(metavar="SIZE", help="output shard size, e.g. 5GB")] = "5GB",
    repair: Annotated[bool, typer.Option(
        help="one weight global scale per fused group (q/k/v, gate/up) and one input scale per expert projection; "
             "moves values by at most half an FP8 block-scale step")] = False,
    overwrite: Annotated[bool, typer.Option(help="replace an existing non-empty DST")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar and no summary line")] = False,
) -> None:
    """Rewrite an NVFP4 checkpoint in another dialect (packed weights and block scales byte for byte) or as a dense
    BF16 checkpoint (--to bf16)."""
    from fp4kit.io.checkpoint import parse_size
    from fp4kit.tools.convert import convert_checkpoint

    shard_bytes = parse_size(max_shard_size)
    report = with_progress(lambda progress: convert_checkpoint(src, dst, to, overwrite, shard_bytes, progress, repair),
                           quiet, "convert", "converting")
    if quiet:
        return
    for note in report.notes:
        typer.echo(f"note: {note}")
    if report.repair is not None:
        r = report.repair
        typer.echo(f"repair: {r.weight_groups_unified} fused groups put on one weight scale, "
                   f"{r.input_groups_unified} input-scale groups unified, {len(r.modules_changed)} Linears "
                   f"rescaled, largest change of a dequantized weight {r.max_abs_change:.3g}")
    rate = report.input_bytes / max(report.seconds, 1e-9)
    fused = f", {report.fused_tensors} fused expert tensors" if report.fused_tensors else ""
    exact = f", {report.exact_scales_recorded} exact scales kept in metadata" if report.exact_scales_recorded else ""
    fp8 = f", {report.fp8_modules} FP8 Linears" if report.fp8_modules else ""
    typer.echo(
        f"{report.family} {report.scheme}: {report.source_dialect} -> {report.target_dialect}, "
        f"{report.quantized_modules} quantized Linears{fp8}{fused}, {report.passthrough_tensors} tensors copied"
        f"{exact}, "
        f"{human_bytes(report.output_bytes)} in {report.seconds:.1f} s ({human_bytes(rate)}/s) -> {dst}"
    )


def register(app: typer.Typer) -> None:
    app.command()(convert)

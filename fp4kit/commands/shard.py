"""`fp4kit shard`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from fp4kit.commands._common import human_bytes, with_progress
from fp4kit.options import SHARD, derive_command, library_kwargs


@derive_command(SHARD)
def shard(
    src: Annotated[Path, typer.Argument(help="NVFP4 checkpoint directory (as `fp4kit quantize` writes it)")],
    dst: Annotated[Path, typer.Argument(help="output directory: one rank-NNNNN/ per rank (created atomically)")],
    *,
    values: dict[str, Any],
    overwrite: Annotated[bool, typer.Option(help="replace an existing non-empty DST")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar and no summary line")] = False,
) -> None:
    """Split a checkpoint into per-rank expert-parallel checkpoints, each loadable on its own."""
    from fp4kit.ep.shard import ShardOptions, shard_checkpoint

    options = ShardOptions(**library_kwargs(SHARD, values), overwrite=overwrite)
    report = with_progress(lambda progress: shard_checkpoint(src, dst, options, progress), quiet, "shard", "sharding")
    for warning in report.warnings:  # even with -q: the split works, but not with every serving kernel
        typer.echo(f"warning: {warning}", err=True)
    if quiet:
        return
    if values["stats"] is None and report.stats is not None:
        typer.echo(f"routing statistics: {report.stats} (found in SRC; --stats FILE uses another)")
    counts = sorted(set(report.experts_per_rank))
    typer.echo(
        f"{report.family}: {report.num_experts} experts x {report.moe_layers} MoE layers over {report.ep} ranks "
        f"({report.placement}, {'/'.join(map(str, counts))} experts per rank), {human_bytes(report.input_bytes)} "
        f"in {report.seconds:.1f} s -> {dst}"
    )
    if report.imbalance:
        before = [b for b, _ in report.imbalance.values()]
        after = [a for _, a in report.imbalance.values()]
        typer.echo(
            f"max/mean tokens per rank: linear {max(before):.3f} worst layer, {sum(before) / len(before):.3f} mean; "
            f"{report.placement} {max(after):.3f} worst layer, {sum(after) / len(after):.3f} mean"
        )
    if report.input_scales_changed:
        typer.echo(f"{report.input_scales_changed} expert activation scales set to their layer's max-amax value "
                   f"(EP-invariant numerics)")


def register(app: typer.Typer) -> None:
    app.command()(shard)

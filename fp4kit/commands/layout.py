"""`fp4kit layout`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from fp4kit.commands._common import human_bytes, with_progress
from fp4kit.options import LAYOUT, derive_command, library_kwargs


@derive_command(LAYOUT)
def layout(
    src: Annotated[Path, typer.Argument(help="NVFP4 checkpoint directory (compressed-tensors or ModelOpt)")],
    dst: Annotated[Path, typer.Argument(help="output directory (created atomically)")],
    *,
    values: dict[str, Any],
    overwrite: Annotated[bool, typer.Option(help="replace an existing non-empty DST")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar and no summary line")] = False,
) -> None:
    """Pre-build every MoE layer's fused-kernel layout (TRT-LLM, CUTLASS or Marlin), one layer at a time."""
    import gc

    from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint

    # torch's imports leave many long-lived objects that every full collection would walk again while the layers'
    # tensors come and go (~0.7 of ~11 CPU s of a 2-layer Marlin layout); frozen, the collector skips them
    gc.freeze()
    options = LayoutOptions(**library_kwargs(LAYOUT, values), overwrite=overwrite)
    report = with_progress(lambda progress: layout_checkpoint(src, dst, options, progress), quiet, "layout",
                           "laying out")
    if not quiet:
        rate = report.input_bytes / max(report.seconds, 1e-9)
        typer.echo(
            f"{report.backend}: {report.moe_layers} MoE layers x {report.num_experts} experts laid out, "
            f"{report.passthrough_tensors} tensors copied, {human_bytes(report.input_bytes)} -> "
            f"{human_bytes(report.output_bytes)} in {report.seconds:.1f} s ({human_bytes(rate)}/s) -> {dst}"
        )
    if report.collapsed_input_scales:  # said even with --quiet: the kernel runs those experts on another scale
        typer.echo(f"note: {len(report.collapsed_input_scales)} MoE layers have per-expert gate/up input scales; "
                   f"{report.backend} quantizes the hidden states once for all experts, so each of those layers "
                   f"uses its largest (as vLLM does; recorded in fp4kit_layout.json): "
                   f"{', '.join(report.collapsed_input_scales)}", err=True)


def register(app: typer.Typer) -> None:
    app.command()(layout)

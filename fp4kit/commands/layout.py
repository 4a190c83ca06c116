"""`fp4kit layout`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from fp4kit.commands._common import human_bytes, with_progress
from fp4kit.registry import BACKEND_NAMES


def layout(
    src: Annotated[Path, typer.Argument(help="NVFP4 checkpoint directory (compressed-tensors or ModelOpt)")],
    dst: Annotated[Path, typer.Argument(help="output directory (created atomically)")],
    backend: Annotated[Literal[BACKEND_NAMES], typer.Option(  # type: ignore[valid-type]
        help="the MoE kernel to lay out for")],
    act_dtype: Annotated[Literal["bf16", "fp16"], typer.Option(
        help="activation dtype the kernel runs with")] = "bf16",
    cutlass_flavor: Annotated[Literal["flashinfer", "vllm"], typer.Option(
        help="cutlass only: whose CUTLASS kernel")] = "flashinfer",
    max_shard_size: Annotated[str, typer.Option(metavar="SIZE", help="output shard size, e.g. 5GB")] = "5GB",
    overwrite: Annotated[bool, typer.Option(help="replace an existing non-empty DST")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar and no summary line")] = False,
) -> None:
    """Pre-build every MoE layer's fused-kernel layout (TRT-LLM, CUTLASS or Marlin), one layer at a time."""
    import gc

    from fp4kit.io.checkpoint import parse_size
    from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint

    # torch's imports leave many long-lived objects that every full collection would walk again while the layers'
    # tensors come and go (~0.7 of ~11 CPU s of a 2-layer Marlin layout); frozen, the collector skips them
    gc.freeze()
    options = LayoutOptions(backend=backend, act_dtype=act_dtype, cutlass_flavor=cutlass_flavor,
                            max_shard_bytes=parse_size(max_shard_size), overwrite=overwrite)
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

"""`fp4kit quantize`."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from fp4kit.commands._common import INVOKED_ARGS, Download, Revision, human_bytes, source_directory, with_progress
from fp4kit.options import QUANTIZE, derive_command, quantize_kwargs


@derive_command(QUANTIZE)
def quantize(
    src: Annotated[Path, typer.Argument(help="BF16 HF checkpoint directory (safetensors), or its Hub id in the local "
                                             "Hugging Face cache")],
    dst: Annotated[Path, typer.Argument(help="output directory (created atomically)")],
    *,
    values: dict[str, Any],
    overwrite: Annotated[bool, typer.Option(help="replace an existing non-empty DST")] = False,
    revision: Revision = None,
    download: Download = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar and no summary line")] = False,
) -> None:
    """Quantize a checkpoint to NVFP4, streaming one tensor group at a time."""
    from fp4kit.quantize import distributed
    from fp4kit.quantize.checkpoint import QuantizeOptions, describe, quantize_checkpoint

    main = distributed.is_main()  # under torchrun, rank 0 speaks for all
    quiet = quiet or not main

    options = QuantizeOptions(**quantize_kwargs(values), overwrite=overwrite, command=command_line(src, dst))
    # warnings even with -q (they say what an option did not do), on rank 0 only
    src_dir = source_directory(src, revision, download)
    report = with_progress(lambda progress: quantize_checkpoint(src_dir, dst, options, progress), quiet, "quantize",
                           "quantizing", warnings=main)
    if not quiet:
        if report.fallback_modules:
            shown = ", ".join(report.fallback_modules[:8]) + (" ..." if len(report.fallback_modules) > 8 else "")
            typer.echo(f"{report.method}: {len(report.fallback_modules)} Linears fell back to mse (too few "
                       f"calibration tokens, or outside the calibrated layers): {shown}")
        if report.mxfp4_cast:
            typer.echo(f"MXFP4 source: {report.mxfp4_cast.get('exact', 0)} NVFP4 blocks cast exactly, "
                       f"{report.mxfp4_cast.get('requantized', 0)} re-quantized (outside the E4M3 range of their "
                       "group's global scale)")
        rate = report.input_bytes / max(report.seconds, 1e-9)
        typer.echo(
            f"{report.family}: {describe(report)}: {report.quantized_linears} Linears quantized, "
            f"{report.passthrough_tensors} tensors kept, {human_bytes(report.input_bytes)} -> "
            f"{human_bytes(report.output_bytes)} in {report.seconds:.1f} s ({human_bytes(rate)}/s) -> {dst}"
        )


def command_line(src: Path, dst: Path) -> str:
    """This run's command line as the output records it, SRC and DST as those words: the record says what SRC was
    (its base model), and the same command into any DST writes the same bytes."""
    words = {src: "SRC", dst: "DST"}
    args = INVOKED_ARGS.get()
    args = sys.argv[1:] if args is None else args
    return shlex.join(["fp4kit", *(words.get(Path(arg), arg) for arg in args)])


def register(app: typer.Typer) -> None:
    app.command()(quantize)

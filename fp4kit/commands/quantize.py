"""`fp4kit quantize`."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer

from fp4kit.commands._common import INVOKED_ARGS, Download, Revision, human_bytes, source_directory, with_progress
from fp4kit.registry import DEFAULT_DIALECT, DIALECT_NAMES


def quantize(
    src: Annotated[Path, typer.Argument(help="BF16 HF checkpoint directory (safetensors), or its Hub id in the local "
                                             "Hugging Face cache")],
    dst: Annotated[Path, typer.Argument(help="output directory (created atomically)")],
    scheme: Annotated[Literal["nvfp4a16", "nvfp4"], typer.Option(
        help="nvfp4a16 (weight-only) or nvfp4 (W4A4)")] = "nvfp4a16",
    format: Annotated[Literal[DIALECT_NAMES], typer.Option(  # type: ignore[valid-type]
        "--format", help="checkpoint dialect")] = DEFAULT_DIALECT,
    device: Annotated[str, typer.Option(metavar="cpu|cuda[:N]", help="where to quantize")] = "cpu",
    ignore: Annotated[list[str] | None, typer.Option(
        metavar="REGEX", help="regex on module names to keep in bf16 (repeatable)")] = None,
    targets: Annotated[
        list[str] | None, typer.Option(metavar="REGEX",
                                       help="regex: quantize only matching modules, e.g. 'experts\\.' (repeatable)")
    ] = None,
    no_default_ignore: Annotated[bool, typer.Option(
        "--no-default-ignore", help="drop the family's default ignore list")] = False,
    max_shard_size: Annotated[str, typer.Option(metavar="SIZE", help="output shard size, e.g. 5GB")] = "5GB",
    overwrite: Annotated[bool, typer.Option(help="replace an existing non-empty DST")] = False,
    exact_fp32_global_scale: Annotated[
        bool, typer.Option(help="compute weight global scales in fp32 (default: as llm-compressor, in bf16)")
    ] = False,
    calib: Annotated[
        Path | None, typer.Option(help="W4A4 calibration text: .jsonl (text or input_ids), .txt or .parquet")
    ] = None,
    samples: Annotated[int | None, typer.Option(
        help="calibration samples [default: 256; without --calib, as many as the small packaged set holds]",
        show_default=False)] = None,
    seq_len: Annotated[int, typer.Option(help="tokens per calibration sample")] = 512,
    batch_size: Annotated[int, typer.Option(help="calibration batch size")] = 8,
    dtype: Annotated[Literal["auto", "bf16", "fp32"], typer.Option(
        help="compute dtype of the calibration forward: auto (the checkpoint's on a GPU or a CPU with bf16 "
             "instructions, AVX512-BF16 or AMX; else fp32), bf16 or fp32")] = "auto",
    moe_input_scales: Annotated[
        Literal["shared", "per-expert"],
        typer.Option(help="shared: one input scale per layer and projection for all experts (EP-invariant); "
                          "per-expert: each expert's own")
    ] = "shared",
    method: Annotated[Literal["rtn", "mse", "gptq"] | None, typer.Option(
        help="rtn: round to nearest (llm-compressor's bytes); mse: block scales by squared-error search (weighted by "
             "calibration activations when calibrating: scheme nvfp4 or --calib); gptq: GPTQ on calibration data. "
             "Default: rtn, and an MXFP4 source cast to NVFP4 without rounding (any --method re-quantizes it from "
             "its exact values)", show_default=False)
    ] = None,
    gptq_damp: Annotated[float, typer.Option(help="GPTQ damping, a fraction of the Hessian's mean diagonal")] = 0.01,
    gptq_min_tokens: Annotated[
        int, typer.Option(help="GPTQ: routed experts with fewer calibration tokens fall back to mse")
    ] = 32,
    gptq_scales: Annotated[Literal["mse", "rtn"], typer.Option(
        help="GPTQ block scales: mse (searched on the error-compensated weights) or rtn")] = "mse",
    mse_range: Annotated[str, typer.Option(
        help="mse search candidates (mse, gptq's mse block scales): codes (the RTN FP8 code +-1 and max-to-4) or "
             "LOW:HIGH, every E4M3 block-scale code within LOW..HIGH x the block's RTN scale (e.g. 0.8:1.8)")
    ] = "codes",
    mse_norm: Annotated[float, typer.Option(
        help="error exponent of the LOW:HIGH search (2: squared error)")] = 2.0,
    input_scales_from: Annotated[Literal["auto", "quantized", "source"], typer.Option(
        help="gptq/mse W4A4 input scales: quantized (the calibrated pass's forward of the quantized model, the "
             "activations it will serve; no extra pass), source (the source model's forward, a pass of its own, as "
             "rtn) or auto (quantized; source for ModelOpt output)")
    ] = "auto",
    native: Annotated[
        bool, typer.Option("--native/--no-native",
                           help="encode bf16 weights on the CPU with fp4kit's C loop (same bytes as torch ops)")
    ] = True,
    dequant_dtype: Annotated[Literal["fp32", "bf16"], typer.Option(
        help="FP8 / INT4 / MXFP4 sources: dequantize to fp32 (one rounding) or bf16 (the peers' two)")] = "fp32",
    mtp: Annotated[Literal["keep", "quantize"], typer.Option(
        help="an MTP block outside the decoder layers (Qwen3-Next, Qwen3.5/3.6-MoE `mtp.*`): keep it as stored (as "
             "published NVFP4 checkpoints do) or quantize its routed experts (weight-only)")] = "keep",
    revision: Revision = None,
    download: Download = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar and no summary line")] = False,
) -> None:
    """Quantize a checkpoint to NVFP4, streaming one tensor group at a time."""
    from fp4kit.io.checkpoint import parse_size
    from fp4kit.quantize import distributed
    from fp4kit.quantize.checkpoint import QuantizeOptions, describe, quantize_checkpoint

    main = distributed.is_main()  # under torchrun, rank 0 speaks for all
    quiet = quiet or not main

    options = QuantizeOptions(
        scheme=scheme, format=format, device=device, ignore=ignore or [], targets=targets or [],
        default_ignore=not no_default_ignore, max_shard_bytes=parse_size(max_shard_size), overwrite=overwrite,
        exact_fp32_global_scale=exact_fp32_global_scale, native_cpu=native, calib=calib, samples=samples,
        seq_len=seq_len, batch_size=batch_size, dtype=dtype, moe_input_scales=moe_input_scales,
        dequant_dtype=dequant_dtype,
        method=method or "rtn", cast_mxfp4=method is None, gptq_damp=gptq_damp, gptq_min_tokens=gptq_min_tokens,
        gptq_scales=gptq_scales, input_scales_from=input_scales_from, mtp=mtp, mse_range=mse_range, mse_norm=mse_norm,
        command=command_line(src, dst),
    )
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

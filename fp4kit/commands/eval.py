"""`fp4kit eval`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import typer

from fp4kit.commands._common import Download, Revision, source_directory


def eval_command(
    src: Annotated[Path, typer.Argument(help="the BF16 source checkpoint directory, or its Hub id in the local "
                                             "Hugging Face cache")],
    ckpt: Annotated[Path, typer.Argument(help="its NVFP4 checkpoint (compressed-tensors or ModelOpt) or a dense one")],
    text: Annotated[Path | None, typer.Option(
        help=".jsonl (text or input_ids), .txt or .parquet; default: the packaged calibration set")] = None,
    samples: Annotated[int | None, typer.Option(
        help="windows of --seq-len tokens [default: 48; without --text, as many as the small packaged set holds]",
        show_default=False)] = None,
    seq_len: Annotated[int, typer.Option(help="tokens per window")] = 512,
    batch_size: Annotated[int, typer.Option(help="windows per forward")] = 8,
    device: Annotated[str, typer.Option(metavar="cpu|cuda[:N]", help="where to run")] = "cpu",
    dtype: Annotated[Literal["float32", "bfloat16"], typer.Option(help="compute dtype")] = "float32",
    json_path: Annotated[Path | None, typer.Option(
        "--json", metavar="FILE", help="also write the results as JSON (`--json -`: print them on stdout, instead of "
                                       "the text)")] = None,
    activations_only: Annotated[bool, typer.Option(
        "--activations-only", help="run the source's weights with CKPT's activation (and KV-cache) quantization: "
                                   "the part of the KL that no weight rounding can remove")] = False,
    revision: Revision = None,
    download: Download = False,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="no progress and no results (with --json: the file alone); warnings still print")
    ] = False,
) -> None:
    """Next-token KL, cross-entropy and top-1 agreement of a quantized checkpoint against its source, streaming one
    decoder layer at a time (W4A4 checkpoints with their activations quantized as the kernels do)."""
    import torch

    from fp4kit.errors import Fp4kitError
    from fp4kit.families import detect
    from fp4kit.io.checkpoint import read_config
    from fp4kit.progress import Reporter
    from fp4kit.quantize.calib_data import load_calibration
    from fp4kit.tools.evaluate import evaluate

    if batch_size < 1:
        raise Fp4kitError(f"--batch-size must be at least 1, got {batch_size}")
    if seq_len < 2:  # next-token statistics need a token after the first
        raise Fp4kitError(f"--seq-len must be at least 2, got {seq_len}")
    src = source_directory(src, revision, download)
    config = read_config(src)
    text_config = detect(config).text_config(config)
    vocab_size = int(text_config.get("vocab_size") or config["vocab_size"])
    with Reporter("eval", quiet) as reporter:
        token_ids = load_calibration(text, src, vocab_size, samples, seq_len, reporter.warn, default_samples=48,
                                     purpose="eval text")
        batches = -(-token_ids.shape[0] // batch_size)
        reporter.phase("evaluating", None, "batches", f"{token_ids.shape[0]} samples x {token_ids.shape[1]} tokens, "
                       f"{batches} batches through each decoder layer of both models")
        result = evaluate(src, ckpt, token_ids, device, batch_size, getattr(torch, dtype), reporter,
                          activations_only)
    if json_path == Path("-"):  # as `fp4kit verify --json -`
        typer.echo(json.dumps(result.to_json(), indent=2))
        return
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    if quiet:
        return
    typer.echo(f"{result.checkpoint} ({result.scheme}) against {result.source}: {result.samples} x {result.seq_len} "
               f"tokens, {result.dtype} on {result.device}, {result.seconds:.1f} s")
    typer.echo(f"  KL(source || quantized) per token  {result.kl:.5f}")
    typer.echo(f"  cross-entropy source / quantized   {result.ce_source:.4f} / {result.ce_quantized:.4f}")
    typer.echo(f"  top-1 agreement                    {100 * result.top1:.2f}%")
    typer.echo("  hidden-state relative error by layer  " + " ".join(f"{e:.4f}" for e in result.layers))


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)

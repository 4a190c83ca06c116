"""`fp4kit inspect`."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from fp4kit.commands._common import human_bytes
from fp4kit.registry import BACKEND_NAMES


def inspect(
    ckpt: Annotated[Path, typer.Argument(help="NVFP4 checkpoint directory (compressed-tensors or ModelOpt)")],
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    backend: Annotated[
        list[str] | None, typer.Option(help="count this backend's shape constraints as problems: "
                                            f"{', '.join(sorted(BACKEND_NAMES))} (repeatable)")
    ] = None,
    ep: Annotated[int | None, typer.Option(help="count E % ep != 0 as a problem")] = None,
    engine: Annotated[
        str | None, typer.Option(help="also check what this engine loads but serves wrongly: vllm")
    ] = None,
    source: Annotated[
        Path | None, typer.Option(help="BF16 source: audit input scales against its own causal forward")
    ] = None,
    calib: Annotated[Path | None, typer.Option(help="calibration text for the audit (default: packaged set)")] = None,
    samples: Annotated[int, typer.Option(help="audit samples")] = 64,
    seq_len: Annotated[int, typer.Option(help="audit tokens per sample")] = 256,
) -> None:
    """Dialect, scheme, family, per-layer summary and health checks. Exit 0 clean, 1 problems, 2 unusable."""
    from fp4kit.inspect import inspect_checkpoint

    report = inspect_checkpoint(ckpt, backend or [], ep, engine)
    if source is not None:
        from fp4kit.audit import audit_input_scales
        from fp4kit.progress import Reporter

        with Reporter("inspect") as reporter:
            report.problems.extend(audit_input_scales(ckpt, source, calib, samples, seq_len, progress=reporter)[0])
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(report) | {"clean": report.clean}, indent=2))
    else:
        for line in _text(report):
            typer.echo(line)
    if not report.clean:
        sys.exit(1)


def _text(report) -> list[str]:
    lines = [
        f"{report.path}: {report.dialect}, {report.scheme}, family {report.family}",
        f"experts per layer {report.num_experts}, hidden {report.hidden_size}, "
        f"moe intermediate {report.moe_intermediate_size}",
        f"{'layer':>6} {'linears':>8} {'experts':>8} {'quantized':>11} {'other':>11}  shapes [N, K]",
    ]
    for s in report.layers:
        shapes = ", ".join(f"{k} {v}" for k, v in s.shapes.items())
        layer = "-" if s.layer is None else str(s.layer)
        lines.append(f"{layer:>6} {s.quantized_linears:>8} {s.experts:>8} {human_bytes(s.quantized_bytes):>11} "
                     f"{human_bytes(s.other_bytes):>11}  {shapes}")
    lines.append("backends: " + "; ".join(f"{b}: {why}" for b, why in report.backends.items()))
    lines.append(f"even EP splits: {report.even_ep_sizes or 'none'}")
    if report.marlin_zeroed_scales:
        lines.append("marlin (vLLM, bf16) stores these block scales as 0 (near-dead 16-weight blocks): " + ", ".join(
            f"{key} {count}" for key, count in report.marlin_zeroed_scales.items()))
    if report.clean:
        lines.append("no problems found")
    else:
        lines.append(f"{len(report.problems)} problems:")
        lines.extend(f"  [{p.check}] {p.module}: {p.detail}" + (f" ({p.source})" if p.source else "")
                     for p in report.problems)
    return lines


def register(app: typer.Typer) -> None:
    app.command()(inspect)

"""`fp4kit inspect`."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer

from fp4kit.commands._common import Download, Revision, human_bytes, source_directory
from fp4kit.registry import BACKEND_NAMES


def inspect(
    ckpt: Annotated[Path, typer.Argument(
        help="a checkpoint (NVFP4 of either dialect, or a bf16 / FP8 / INT4 source), or what fp4kit made from one: "
             "a layout directory, an EP split or one of its rank directories; or a Hub id in the local Hugging Face "
             "cache")],
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    backend: Annotated[list[str] | None, typer.Option(
        metavar="|".join(sorted(BACKEND_NAMES)), help="count this backend's shape constraints as problems (repeatable)")
    ] = None,
    ep: Annotated[int | None, typer.Option(help="count E % ep != 0 as a problem")] = None,
    engine: Annotated[
        Literal["vllm", "sglang", "trtllm"] | None,
        typer.Option(help="also check what this engine loads but serves wrongly: vllm, sglang or trtllm"),
    ] = None,
    source: Annotated[
        Path | None, typer.Option(help="BF16 source: audit input scales against its own causal forward")
    ] = None,
    calib: Annotated[Path | None, typer.Option(help="calibration text for the audit (default: packaged set)")] = None,
    samples: Annotated[int, typer.Option(help="audit samples")] = 64,
    seq_len: Annotated[int, typer.Option(help="audit tokens per sample")] = 256,
    revision: Revision = None,
    download: Download = False,
) -> None:
    """What CKPT is (its kind, dialect, scheme, family), a per-layer summary and the checks of its kind. Exit 0
    clean, 1 problems, 2 unusable."""
    from fp4kit.progress import Reporter
    from fp4kit.tools.inspect_artifacts import inspect_path

    ckpt = source_directory(ckpt, revision, download, "CKPT")
    # the report is the output: a bar on a terminal, no phase lines in a log (the audit's pass has one)
    with Reporter("inspect", lines=False) as reporter:
        report = inspect_path(ckpt, backend or [], ep, engine, reporter)
    if source is not None:
        from fp4kit.tools.audit import audit_input_scales

        with Reporter("inspect") as reporter:
            report.problems.extend(audit_input_scales(ckpt, source, calib, samples, seq_len, progress=reporter)[0])
    if as_json:
        document = dataclasses.asdict(report)
        head = {key: document.pop(key) for key in ("format", "kind")}
        for key in ("module_schemes", "kv_cache"):  # present for mixed-precision / FP8 KV-cache checkpoints only
            if document[key] is None:
                del document[key]
        typer.echo(json.dumps(head | document | {"clean": report.clean}, indent=2))
    else:
        for line in _text(report):
            typer.echo(line)
    if not report.clean:
        sys.exit(1)


SHOWN_MODULES = 6


def _scheme(report) -> str:
    if not report.module_schemes:
        return report.scheme
    schemes = dict.fromkeys(g["scheme"] for g in report.module_schemes if g["scheme"] != "kept")
    return "mixed precision (" + " + ".join(schemes) + ")"


def _text(report) -> list[str]:
    what = (f"{report.precision} source" if report.kind == "source" else
            f"{report.dialect}, {_scheme(report)}" + ("" if report.kind == "checkpoint" else f", {report.kind}"))
    kv = getattr(report, "kv_cache", None)
    if kv:
        what += f", {kv['scheme'].upper()} KV cache ({kv['attention_layers']} attention layers)"
    lines = [
        f"{report.path}: {what}, family {report.family}",
        f"experts per layer {report.num_experts}, hidden {report.hidden_size}, "
        f"moe intermediate {report.moe_intermediate_size}",
    ]
    lines.extend(f"note: {note}" for note in report.notes)
    if report.layers:
        lines.append(f"{'layer':>6} {'linears':>8} {'experts':>8} {'quantized':>11} {'other':>11}  shapes [N, K]"
                     if report.kind != "source" else f"{'layer':>6} {'linears':>8} {'experts':>8} {'bytes':>11}")
        for s in report.layers:
            layer = s.part if s.part != "text" else "-" if s.layer is None else str(s.layer)
            if report.kind == "source":
                lines.append(f"{layer:>6} {s.quantized_linears:>8} {s.experts:>8} {human_bytes(s.other_bytes):>11}")
                continue
            shapes = ", ".join(f"{k} {v}" for k, v in s.shapes.items())
            lines.append(f"{layer:>6} {s.quantized_linears:>8} {s.experts:>8} {human_bytes(s.quantized_bytes):>11} "
                         f"{human_bytes(s.other_bytes):>11}  {shapes}")
    if report.module_schemes:
        lines.append(f"{'scheme':>11} {'linears':>8}  modules")
        lines.extend(f"{g['scheme']:>11} {g['count']:>8}  {g['modules']}" for g in report.module_schemes)
    if report.expert_parallel and "ranks" in report.expert_parallel:
        lines.append(f"{'rank':>6}  {'directory':<12} {'experts':>8} {'problems':>9}")
        for rank in report.expert_parallel["ranks"]:
            counts = "/".join(map(str, rank["experts_per_layer"]))
            lines.append(f"{rank['rank']:>6}  {rank['directory']:<12} {counts:>8} {rank['problems']:>9}")
    elif report.expert_parallel:
        split = report.expert_parallel
        for layer, ids in split["experts"].items():
            lines.append(f"layer {layer}: experts {', '.join(map(str, ids))} (local 0..{len(ids) - 1})")
    if report.routing:
        routing = report.routing
        calibration = routing.get("calibration") or {}
        data = (f"{calibration.get('samples')} samples x {calibration.get('seq_len')} tokens of "
                f"{calibration.get('data')}" if calibration else "calibration data not recorded")
        lines.append(f"routing statistics ({routing['file']}): {routing['layers']} MoE layers, {data}; busiest "
                     f"expert / mean {routing['max_over_mean_expert']}; experts no token reached: "
                     f"{sum(routing['unrouted_experts'].values())}")
    if report.kind != "source":
        modules = report.unquantized_modules
        shown = ", ".join(modules[:SHOWN_MODULES]) + (f", ... ({len(modules)} in all)" if len(modules) >
                                                      SHOWN_MODULES else "")
        lines.append(f"kept unquantized: {shown or 'nothing'}")
    lines.append("backends: " + "; ".join(f"{b}: {why}" for b, why in report.backends.items()))
    lines.append(f"even EP splits: {report.even_ep_sizes or 'none'}")
    if report.marlin_zeroed_scales:
        lines.append("marlin (vLLM, bf16) stores these block scales as 0 (near-dead 16-weight blocks): " + ", ".join(
            f"{key} {count}" for key, count in report.marlin_zeroed_scales.items()))
    if report.engine:
        from fp4kit.tools.engine_checks import engines

        version, checks = engines()[report.engine]
        found = sum(1 for p in report.problems if p.check in checks)
        lines.append(f"engine {report.engine} {version}: {len(checks)} load-contract checks, "
                     + (f"{found} problem{'s' if found > 1 else ''} (below)" if found else "none found a problem"))
    if report.clean:
        lines.append("no problems found")
    else:
        lines.append(f"{len(report.problems)} problems:")
        lines.extend(f"  [{p.check}] {p.module}: {p.detail}" + (f" ({p.source})" if p.source else "")
                     for p in report.problems)
    return lines


def register(app: typer.Typer) -> None:
    app.command()(inspect)

"""`fp4kit verify` as a library call: pick the mode and the backends, then run the checks layer by layer."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import group_experts
from fp4kit.formats.detect import QuantizedCheckpoint
from fp4kit.verify.backends import BACKENDS, enable_triton_interpreter
from fp4kit.verify.checks import (
    DEFAULT_TOL_SOURCE,
    EXPERT_SAMPLE_TOKENS,
    LayerVerifier,
    VerifyOptions,
    activation_divisors,
    load_source,
)
from fp4kit.verify.moe_layer import QuantizedModel, QuantizedMoe
from fp4kit.verify.output_checks import check_expert_parallel, check_layouts
from fp4kit.verify.report import BackendStatus, VerifyReport

MODES = ("w4a16", "w4a4")


def resolve_device(name: str) -> torch.device:
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise Fp4kitError(f"unknown device {name!r}; use cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise Fp4kitError(f"--device {name}: no CUDA device is available")
    return torch.device(name)


def select_backends(requested: str, device: torch.device, mode: str) -> list[BackendStatus]:
    """Every backend with ran/skipped and why; ``requested`` other than auto must be able to run."""
    if requested != "auto" and requested not in BACKENDS:
        raise Fp4kitError(f"unknown backend {requested!r}; choose auto or one of {', '.join(BACKENDS)}")
    if device.type == "cpu":
        enable_triton_interpreter()
    statuses = []
    for name, backend in BACKENDS.items():
        ok, reason = backend.available(device)
        if ok and mode not in backend.modes:
            ok, reason = False, f"runs {'/'.join(backend.modes)} only; this run is {mode}"
        if ok and requested not in ("auto", name) and name != "reference":
            ok, reason = False, f"not requested (--backend {requested})"
        statuses.append(BackendStatus(name, ok, reason))
    chosen = next(s for s in statuses if s.name == requested) if requested != "auto" else None
    if chosen is not None and not chosen.ran:
        raise Fp4kitError(f"--backend {requested} cannot run here: {chosen.reason}")
    return statuses


def _mode(model: QuantizedModel, requested: str | None) -> str:
    if requested is not None and requested not in MODES:
        raise Fp4kitError(f"unknown mode {requested!r}; choose w4a16 or w4a4")
    return requested or ("w4a4" if model.ckpt.scheme == "nvfp4" else "w4a16")


def _layers(model: QuantizedModel, requested: list[int] | None) -> list[int]:
    if not requested:
        return model.layers
    unknown = [layer for layer in requested if layer not in model.layers]
    if unknown:
        raise Fp4kitError(
            f"layer {unknown[0]} is not an NVFP4 MoE layer of {model.root} (MoE layers: "
            f"{','.join(map(str, model.layers))})"
        )
    return list(requested)


def _check_inputs(options: VerifyOptions) -> None:
    if not options.tokens or any(t < 1 for t in options.tokens):
        raise Fp4kitError("--tokens must be positive token counts, e.g. 1,16,256")
    for path in [options.source, options.ep_shards, *options.layouts]:
        if path is not None and not Path(path).is_dir():
            raise Fp4kitError(f"{path}: not a directory")


def checks_per_layer(options: VerifyOptions) -> int:
    """How many progress steps one layer takes: each token count, the per-expert source check, the routing rows,
    each layout output and the EP split (the steps `LayerVerifier` and `fp4kit.verify.output_checks` report)."""
    with_source, with_ep = options.source is not None, options.ep_shards is not None
    return len(options.tokens) + with_source + 1 + len(options.layouts) + with_ep


def layer_cost(moe: QuantizedMoe, options: VerifyOptions, top_k: int) -> tuple[float, float]:
    """(fp32 bytes, multiply-adds) the checks of one layer need, roughly: the dequantized experts (and the source's),
    every token count through the reference and each kernel, and the per-expert source check through every expert."""
    num_experts, hidden = moe.num_experts, moe.w2.packed.shape[1]
    intermediate = moe.w13.packed.shape[1] // 2
    expert_macs = 3 * hidden * intermediate
    copies = 2 + (options.source is not None)
    macs = expert_macs * top_k * sum(options.tokens) * (1 + (options.source is not None))
    if options.source is not None:
        macs += 2 * EXPERT_SAMPLE_TOKENS * num_experts * expert_macs
    return copies * num_experts * expert_macs * 4, float(macs)


SLOW_LAYER_MACS = 2e10  # on the CPU: tens of seconds at least
SLOW_LAYER_BYTES = 2e9


def slow_layer_warning(moe: QuantizedMoe, options: VerifyOptions, top_k: int, device: torch.device) -> str | None:
    """A warning before a layer whose checks will take long on the CPU (None when they will not)."""
    if device.type != "cpu":
        return None
    nbytes, macs = layer_cost(moe, options, top_k)
    if nbytes < SLOW_LAYER_BYTES and macs < SLOW_LAYER_MACS:
        return None
    hidden, intermediate = moe.w2.packed.shape[1], moe.w13.packed.shape[1] // 2
    return (f"layer {moe.layer}: {moe.num_experts} experts of {hidden}x{intermediate} on the CPU need about "
            f"{nbytes / 1e9:.1f} GB and {macs / 1e9:.0f} G multiply-adds: expect minutes per layer "
            f"(--tokens 1,16 or --layers {moe.layer} check less; a GPU with --device cuda is much faster)")


def verify_checkpoint(
    ckpt: str | Path,
    options: VerifyOptions,
    progress: Callable[[int, int], None] | None = None,
    notify: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Run every check that ``options`` asks for on each selected MoE layer of ``ckpt``.

    ``progress(done, total)`` counts checks, layers x `checks_per_layer` in all (called with 0 before the first);
    ``notify(text)`` gets a line as each layer starts, and a warning before a layer that will be slow on the CPU."""
    start = time.perf_counter()
    _check_inputs(options)
    device = resolve_device(options.device)
    with QuantizedModel(ckpt) as model:
        mode = _mode(model, options.mode)
        layers = _layers(model, options.layers)
        statuses = select_backends(options.backend, device, mode)
        report = VerifyReport(
            str(ckpt),
            model.kind,
            model.family.name,
            mode,
            str(device),
            statuses,
            options.tol_kernel,
            options.tol_source or DEFAULT_TOL_SOURCE[mode],
        )
        ran = [s.name for s in statuses if s.ran]
        if device.type == "cpu":
            triton = "and fp4kit's Triton kernel under TRITON_INTERPRET=1 on tiny shapes" if "triton" in ran else "only"
            report.notes.append(
                f"{'no GPU' if not torch.cuda.is_available() else '--device cpu'}: the fp32 reference "
                f"on the CPU {triton}; no serving kernel ran"
            )
        report.notes.append(
            f"mode {mode}: "
            + (
                "weights NVFP4, activations bf16"
                if mode == "w4a16"
                else "weights and activations NVFP4 (static activation scales)"
            )
        )
        report.notes.extend(fp8_notes(model.ckpt))
        per_layer, done = checks_per_layer(options), 0
        total = per_layer * len(layers)

        def tick(steps: int = 1) -> None:
            nonlocal done
            done += steps
            if progress:
                progress(done, total)

        tick(0)
        for number, index in enumerate(layers, 1):
            layer_start = done
            try:
                moe = model.layer(index)
            except Fp4kitError as exc:
                if model.layout is None:
                    raise
                report.add_failure(index, "layout", model.root.name, f"undo failed: {exc}")
                tick(per_layer)
                continue
            if number == 1:
                activation_divisors(moe, mode)  # unusable input (w4a4 without scales) stops here, exit 2
            if notify:  # after the checks of the input: an unusable one gets its error line alone
                notify(f"layer {index} ({number} of {len(layers)})")
                warning = slow_layer_warning(moe, options, model.spec.top_k, device)
                if warning:
                    notify(f"warning: {warning}")
            runners = {}
            for name in ran:
                try:
                    runners[name] = BACKENDS[name].prepare(moe, model.spec, activation_divisors(moe, mode), device)
                except Exception as exc:
                    if name == "reference":
                        raise
                    report.add_failure(index, "kernel", name, f"could not prepare: {exc!r}"[:300])
            verifier = LayerVerifier(model, moe, options, mode, runners, device, tick)
            source = load_source(options, moe)
            verifier.kernels_and_source(source)
            verifier.routing_robustness()
            tick()
            check_layouts(verifier, source)
            tick(len(options.layouts))
            if options.ep_shards is not None:
                check_expert_parallel(verifier, Path(options.ep_shards))
                tick()
            report.results.extend(verifier.results)
            tick(layer_start + per_layer - done)  # exact even if a check above reported fewer steps
    report.seconds = time.perf_counter() - start
    return report


def fp8_notes(ckpt: QuantizedCheckpoint) -> list[str]:
    """What verify does with a mixed-precision checkpoint's FP8 Linears, said in notes: it runs no FP8 GEMM (it runs
    the fused NVFP4 MoE kernels; eval measures FP8 modules), and leaves out the MoE layers whose routed experts are
    FP8."""
    if not ckpt.fp8_modules:
        return []
    schemes = sorted({m.scheme for m in ckpt.fp8_modules})
    notes = [f"mixed precision: {len(ckpt.fp8_modules)} FP8 Linears ({', '.join(schemes)}) not run: verify runs "
             f"the fused NVFP4 MoE kernels (an FP8 shared expert joins the reference at its exact dequantized "
             f"weights; fp4kit eval measures FP8 modules)"]
    fp8_experts = group_experts(((m.name, m) for m in ckpt.fp8_modules), ckpt.grammar)
    if fp8_experts:
        notes.append(f"routed experts in FP8, not verified (no NVFP4 MoE kernel runs them): "
                     f"{', '.join(fp8_experts)}")
    return notes

"""The checks of `fp4kit verify`, per MoE layer, on fresh random hidden states (docs/verify.md describes each).

- ``kernel``: every backend that runs against the fp32 reference on the same quantized weights and routing;
- ``source``: the quantized layer (reference, routed + shared experts) against the BF16 source's layer, and
  ``source-expert``: each expert's weights alone against the source's (worst expert), whatever the routing picks;
- ``layout``: a layout output undone to canonical form, bit for bit against the checkpoint's weights (a layout
  CKPT: transform of the undone weights against the stored kernel tensors); with --source also its reference error;
- ``ep``: every expert on exactly one rank, each rank's tensors matching its expert_map.json, and the rank-local
  outputs summed against the unsharded output;
- ``routing``: rows of NaN/±Inf router logits and padding rows through every backend that ran.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from fp4kit.errors import Fp4kitError
from fp4kit.nvfp4 import GLOBAL_NUMERATOR
from fp4kit.routing import RoutingSpec, route
from fp4kit.verify.backends import BACKENDS, ActivationDiv, Runner, dequantized
from fp4kit.verify.moe_layer import (
    QuantizedModel,
    QuantizedMoe,
    SourceMoe,
    layout_transform,
    read_rank_layer,
    read_source_layer,
    undo_layout,
)
from fp4kit.verify.reference import moe_reference, swiglu_mlp

DEFAULT_TOL_KERNEL = 1e-2
DEFAULT_TOL_SOURCE = {"w4a16": 0.25, "w4a4": 0.35}
TOL_EP = 1e-5
EXPERT_SAMPLE_TOKENS = 64
SIDE_CHECK_TOKENS = 256  # the largest batch the layout and EP checks use
UNIT_BATCH_AMAX = 5.0  # about the largest |x| of a few thousand N(0, 1) rows of a few thousand values


@dataclass
class CheckResult:
    layer: int
    check: str
    target: str  # the backend, layout directory, EP split or source the check is about
    passed: bool
    error: float | None = None
    tolerance: float | None = None
    tokens: int | None = None
    detail: str = ""


@dataclass
class VerifyOptions:
    source: Path | None = None
    layers: list[int] | None = None
    tokens: list[int] = field(default_factory=lambda: [1, 16, 256, 4096])
    backend: str = "auto"
    ep_shards: Path | None = None
    layouts: list[Path] = field(default_factory=list)
    mode: str | None = None  # w4a16 | w4a4; default: w4a4 when the checkpoint has activation scales
    device: str = "cpu"
    seed: int = 0
    tol_kernel: float = DEFAULT_TOL_KERNEL
    tol_source: float | None = None  # default per mode: DEFAULT_TOL_SOURCE


def relative_error(got: Tensor, expected: Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30))


def random_hidden(num_tokens: int, hidden_size: int, seed: int, device: torch.device) -> Tensor:
    """bf16-valued hidden states (every kernel reads bf16), roughly unit scale like post-norm activations."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden_size, generator=generator).to(torch.bfloat16).float().to(device)


def activation_divisors(moe: QuantizedMoe, mode: str, unified: bool = False) -> ActivationDiv:
    if mode != "w4a4":
        return None
    if moe.input_div13 is None or moe.input_div2 is None:
        raise Fp4kitError("--mode w4a4 needs activation scales and this checkpoint is weight-only (nvfp4a16)")
    if unified:  # one value per layer and projection, as EP-invariant engines run (largest amax)
        return moe.input_div13.max().expand_as(moe.input_div13), moe.input_div2.max().expand_as(moe.input_div2)
    return moe.input_div13, moe.input_div2


def _shared_output(shared: tuple[Tensor, Tensor] | None, hidden: Tensor) -> Tensor:
    if shared is None:
        return torch.zeros_like(hidden)
    return swiglu_mlp(hidden, shared[0].to(hidden.device), shared[1].to(hidden.device))


def _route(moe: QuantizedMoe | SourceMoe, hidden: Tensor, spec: RoutingSpec) -> tuple[Tensor, Tensor, Tensor]:
    logits = moe.router.logits(hidden)
    bias = moe.router.correction_bias
    weights, ids = route(logits, spec, None if bias is None else bias.to(hidden.device))
    return logits, weights, ids


class LayerVerifier:
    """Runs every check of one MoE layer; ``runners`` are the backends that ran, prepared on its weights."""

    def __init__(
        self,
        model: QuantizedModel,
        moe: QuantizedMoe,
        options: VerifyOptions,
        mode: str,
        runners: dict[str, Runner],
        device: torch.device,
    ):
        self.model, self.moe, self.options, self.mode = model, moe, options, mode
        self.runners, self.device, self.spec = runners, device, model.spec
        self.act = activation_divisors(moe, mode)
        self.results: list[CheckResult] = []

    def _add(self, check: str, target: str, passed: bool, **fields: object) -> None:
        self.results.append(CheckResult(self.moe.layer, check, target, passed, **fields))  # type: ignore[arg-type]

    def _hidden(self, num_tokens: int, salt: int = 0) -> Tensor:
        seed = ((self.options.seed * 1_000_003 + self.moe.layer) * 100_003 + num_tokens) * 7 + salt
        hidden = random_hidden(num_tokens, self.moe.w13.shape[2], seed, self.device)
        if self.act is not None:
            # W4A4: bring unit-scale states to the range the static activation scales were calibrated for
            calibrated_amax = float(self.act[0].median()) * GLOBAL_NUMERATOR
            hidden = (hidden * (calibrated_amax / UNIT_BATCH_AMAX)).to(torch.bfloat16).float()
        return hidden

    def kernels_and_source(self, source: SourceMoe | None) -> None:
        tol_source = self.options.tol_source or DEFAULT_TOL_SOURCE[self.mode]
        for num_tokens in self.options.tokens:
            hidden = self._hidden(num_tokens)
            logits, weights, ids = _route(self.moe, hidden, self.spec)
            expected = self.runners["reference"](hidden, weights, ids, logits)
            for name, run in self.runners.items():
                if name == "reference":
                    continue
                fits, why = BACKENDS[name].fits(self.device, num_tokens, self.moe, self.spec)
                if not fits:
                    self._add("kernel", name, True, tokens=num_tokens, detail=f"skipped: {why}")
                    continue
                try:
                    error = relative_error(run(hidden, weights, ids, logits), expected)
                except Exception as exc:  # a crashing kernel is a finding, not a reason to stop
                    self._add("kernel", name, False, tokens=num_tokens, detail=f"crashed: {exc!r}"[:300])
                    continue
                self._add(
                    "kernel",
                    name,
                    error <= self.options.tol_kernel,
                    error=error,
                    tolerance=self.options.tol_kernel,
                    tokens=num_tokens,
                )
            if source is not None:
                quantized = expected + _shared_output(self.moe.shared, hidden)
                _, src_weights, src_ids = _route(source, hidden, self.spec)
                reference = moe_reference(
                    hidden, src_weights, src_ids, source.w13.to(self.device), source.w2.to(self.device), self.spec
                )
                reference += _shared_output(source.shared, hidden)
                error = relative_error(quantized, reference)
                self._add("source", "bf16", error <= tol_source, error=error, tolerance=tol_source, tokens=num_tokens)
        if source is not None:
            self._expert_errors(source, tol_source)

    def _expert_errors(self, source: SourceMoe, tolerance: float) -> None:
        hidden = self._hidden(EXPERT_SAMPLE_TOKENS, salt=1)
        w13, w2 = dequantized(self.moe, self.device)
        errors = [
            relative_error(
                swiglu_mlp(hidden, w13[e], w2[e]),
                swiglu_mlp(hidden, source.w13[e].to(self.device), source.w2[e].to(self.device)),
            )
            for e in range(self.moe.num_experts)
        ]
        worst = max(range(len(errors)), key=errors.__getitem__)
        self._add(
            "source-expert",
            "bf16",
            errors[worst] <= tolerance,
            error=errors[worst],
            tolerance=tolerance,
            tokens=EXPERT_SAMPLE_TOKENS,
            detail=f"worst expert {worst}",
        )

    def routing_robustness(self) -> None:
        hidden = self._hidden(12, salt=2)
        hidden[9] = 0.0  # a padding row of zeros: valid, must give a finite output
        hidden[10] = float("nan")  # a padding row of garbage: its output may be anything, others must not suffer
        logits = self.moe.router.logits(hidden)
        logits[0] = float("nan")
        logits[1] = float("inf")
        logits[2] = float("-inf")
        logits[3, ::3], logits[3, 1::3] = float("nan"), float("inf")
        logits[4, 0], logits[5, -1] = float("inf"), float("-inf")
        logits[6, ::2] = float("-inf")
        valid = torch.isfinite(hidden).all(dim=1)
        bias = self.moe.router.correction_bias
        weights, ids = route(logits, self.spec, None if bias is None else bias.to(self.device))
        problems = []
        if bool(((ids < 0) | (ids >= self.moe.num_experts)).any()):
            problems.append("expert id out of range")
        if bool((ids.sort(dim=1).values.diff(dim=1) == 0).any()):
            problems.append("duplicate expert id in a row")
        if not bool(torch.isfinite(weights).all()):
            problems.append("non-finite routing weight")
        self._add("routing", "route", not problems, tokens=len(hidden), detail="; ".join(problems))
        for name, run in self.runners.items():
            if not BACKENDS[name].fits(self.device, len(hidden), self.moe, self.spec)[0]:
                continue
            try:
                out = run(hidden, weights, ids, logits)
            except Exception as exc:
                self._add("routing", name, False, tokens=len(hidden), detail=f"crashed: {exc!r}"[:300])
                continue
            bad = (~torch.isfinite(out[valid]).all(dim=1)).nonzero().flatten().tolist()
            rows = valid.nonzero().flatten()[bad].tolist()
            self._add(
                "routing",
                name,
                not rows,
                tokens=len(hidden),
                detail=f"non-finite output on valid rows {rows}" if rows else "",
            )

    def layouts(self, source: SourceMoe | None) -> None:
        moe = self.moe
        if self.model.layout is not None:
            stored, rebuilt = layout_transform(
                self.model.root, moe.layer, moe.w13, moe.w2, moe.input_div13, moe.input_div2
            )
            differ = [k for k in stored if not _same_bytes(stored[k], rebuilt[k])]
            self._add(
                "layout",
                f"{self.model.root.name} (round trip)",
                not differ,
                detail=f"transform(undo) differs in {', '.join(differ)}" if differ else "bit exact",
            )
        for path in self.options.layouts:
            try:
                w13, w2, div13, div2 = undo_layout(path, moe.layer)
            except Fp4kitError as exc:
                self._add("layout", str(path), False, detail=f"undo failed: {exc}")
                continue
            differ = _canonical_differences(moe, w13, w2, div13, div2)
            self._add(
                "layout",
                str(path),
                not differ,
                detail=("differs from the checkpoint: " + "; ".join(differ)) if differ else "bit exact",
            )
            if source is not None:
                undone = QuantizedMoe(moe.layer, moe.experts_module, w13, w2, div13, div2, moe.router, moe.shared)
                self._layout_source_error(str(path), undone, source)

    def _layout_source_error(self, target: str, undone: QuantizedMoe, source: SourceMoe) -> None:
        num_tokens = min(max(self.options.tokens), SIDE_CHECK_TOKENS)
        hidden = self._hidden(num_tokens)
        logits, weights, ids = _route(undone, hidden, self.spec)
        run = BACKENDS["reference"].prepare(undone, self.spec, activation_divisors(undone, self.mode), self.device)
        got = run(hidden, weights, ids, logits) + _shared_output(undone.shared, hidden)
        _, src_weights, src_ids = _route(source, hidden, self.spec)
        expected = moe_reference(
            hidden, src_weights, src_ids, source.w13.to(self.device), source.w2.to(self.device), self.spec
        ) + _shared_output(source.shared, hidden)
        tolerance = self.options.tol_source or DEFAULT_TOL_SOURCE[self.mode]
        error = relative_error(got, expected)
        self._add("layout-source", target, error <= tolerance, error=error, tolerance=tolerance, tokens=num_tokens)

    def expert_parallel(self, shards: Path) -> None:
        moe, target = self.moe, str(shards)
        rank_dirs = rank_directories(shards)
        ranks = [read_rank_layer(d, r, moe.layer, moe.experts_module, moe.num_experts) for r, d in enumerate(rank_dirs)]
        problems = []
        for rank in ranks:
            for e in (rank.mapped & ~rank.held).nonzero().flatten().tolist():
                problems.append(f"rank {rank.rank}: expert {e} is in its expert_map but its tensors are missing")
            for e in (rank.held & ~rank.mapped).nonzero().flatten().tolist():
                problems.append(f"rank {rank.rank}: holds expert {e}, which its expert_map does not list")
        owners = torch.stack([r.mapped & r.held for r in ranks]).sum(dim=0)
        problems += [f"expert {e} is on {int(owners[e])} ranks" for e in range(moe.num_experts) if owners[e] != 1]
        self._add("ep", f"{target} ({len(ranks)} ranks)", not problems, detail="; ".join(problems[:4]))
        num_tokens = min(max(self.options.tokens), SIDE_CHECK_TOKENS)
        hidden = self._hidden(num_tokens, salt=3)
        logits, weights, ids = _route(moe, hidden, self.spec)
        full = BACKENDS["reference"].prepare(
            moe, self.spec, activation_divisors(moe, self.mode, unified=True), self.device
        )(hidden, weights, ids, logits)
        total = torch.zeros_like(full)
        for rank in ranks:
            w13, w2 = dequantized(rank.moe, self.device)
            rank_logits = rank.moe.router.logits(hidden)
            bias = rank.moe.router.correction_bias
            rank_weights, rank_ids = route(rank_logits, self.spec, None if bias is None else bias.to(self.device))
            total += moe_reference(
                hidden,
                rank_weights,
                rank_ids,
                w13,
                w2,
                self.spec,
                rank.held.to(self.device),
                activation_global_div=activation_divisors(rank.moe, self.mode),
            )
        error = relative_error(total, full)
        self._add(
            "ep-sum",
            f"{target} ({len(ranks)} ranks)",
            error <= TOL_EP,
            error=error,
            tolerance=TOL_EP,
            tokens=num_tokens,
        )


def rank_directories(shards: Path) -> list[Path]:
    from fp4kit.shard import MANIFEST

    manifest = shards / MANIFEST
    try:
        names = json.loads(manifest.read_text())["ranks"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        raise Fp4kitError(f"{shards}: not an EP split of `fp4kit shard` (no usable {MANIFEST} with ranks)") from None
    return [shards / name for name in names]


def _same_bytes(a: Tensor, b: Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8).flatten(), b.contiguous().view(torch.uint8).flatten())
    )


def _canonical_differences(moe: QuantizedMoe, w13, w2, div13: Tensor | None, div2: Tensor | None) -> list[str]:
    pairs = {
        "w13 packed": (moe.w13.packed, w13.packed),
        "w13 block scales": (moe.w13.block_scale, w13.block_scale),
        "w13 global scales": (moe.w13.global_scale_div, w13.global_scale_div),
        "w2 packed": (moe.w2.packed, w2.packed),
        "w2 block scales": (moe.w2.block_scale, w2.block_scale),
        "w2 global scales": (moe.w2.global_scale_div, w2.global_scale_div),
    }
    if moe.input_div13 is not None and div13 is not None and moe.input_div2 is not None and div2 is not None:
        pairs.update({"w13 input scales": (moe.input_div13, div13), "w2 input scales": (moe.input_div2, div2)})
    differ = []
    for what, (ours, theirs) in pairs.items():
        if ours.shape != theirs.shape:
            differ.append(f"{what}: shape {list(theirs.shape)} vs {list(ours.shape)}")
            continue
        flat_ours = ours.contiguous().view(torch.uint8).reshape(ours.shape[0], -1)
        flat_theirs = theirs.contiguous().view(torch.uint8).reshape(theirs.shape[0], -1)
        experts = (flat_ours != flat_theirs).any(dim=1).nonzero().flatten().tolist()
        if experts:
            differ.append(f"{what} of experts {experts[:8]}")
    return differ


def load_source(options: VerifyOptions, moe: QuantizedMoe) -> SourceMoe | None:
    if options.source is None:
        return None
    return read_source_layer(options.source, moe.experts_module, moe.num_experts)

"""The numerical checks of `fp4kit verify` on one MoE layer, on fresh random hidden states (docs/verify.md):

- ``kernel``: every backend that runs against the fp32 reference on the same quantized weights and routing;
- ``source``: the quantized layer (reference, routed + shared experts) against the BF16 source's layer, and
  ``source-expert``: each expert's weights alone against the source's (worst expert), whatever the routing picks;
- ``routing``: rows of NaN/±Inf router logits and padding rows through every backend that ran.

Layout outputs and EP splits are checked in `fp4kit.verify.output_checks`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from fp4kit.errors import Fp4kitError
from fp4kit.families.routing import RoutingSpec, route
from fp4kit.layouts import shared_input_divisor
from fp4kit.nvfp4 import amax_of_divisor
from fp4kit.verify.ambiguity import w4a4_flip_bound
from fp4kit.verify.backends import BACKENDS, ActivationDiv, Runner, dequantized
from fp4kit.verify.moe_layer import QuantizedModel, QuantizedMoe, SourceMoe, read_source_layer
from fp4kit.verify.reference import moe_reference, swiglu_mlp

DEFAULT_TOL_KERNEL = 1e-2
DEFAULT_TOL_SOURCE = {"w4a16": 0.25, "w4a4": 0.35}
TOL_EP = 1e-5
EXPERT_SAMPLE_TOKENS = 64
SIDE_CHECK_TOKENS = 256  # the largest batch the layout and EP checks use
UNIT_BATCH_AMAX = 5.0  # about the largest |x| of a few thousand N(0, 1) rows of a few thousand values


PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass
class CheckResult:
    layer: int
    check: str
    target: str  # the backend, layout directory, EP split or source the check is about
    status: str  # PASSED, FAILED or SKIPPED (the check could not run here: ``detail`` says why)
    error: float | None = None
    tolerance: float | None = None
    tokens: int | None = None
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    @property
    def skipped(self) -> bool:
        return self.status == SKIPPED


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


def ambiguous_rows_check(
    got: Tensor, expected: Tensor, ambiguous: Tensor, bound: Tensor, tolerance: float
) -> tuple[bool, str]:
    """W4A4 emulation rounds the GEMM inputs inside the kernel, and a kernel's few-ulp differences from the reference
    (summation order, exp) can flip a rounding that sits on a boundary, moving that token's whole output row
    (`fp4kit.verify.ambiguity`). Pass when the rows whose rounding is unambiguous are within ``tolerance`` together
    and each ambiguous row is within ``tolerance`` of its norm plus ``bound``, the most its possible flips can move it.
    A systematic error shows on the unambiguous rows; a gross error in an ambiguous row exceeds its bound."""
    row_diff = (got.float() - expected.float()).norm(dim=-1)
    row_norm = expected.float().norm(dim=-1)
    differ = row_diff > tolerance * row_norm
    clear = ~ambiguous
    clear_error = relative_error(got[clear], expected[clear]) if bool(clear.any()) else 0.0
    allowance = row_diff / (bound + tolerance * row_norm).clamp_min(1e-30)
    worst = float(allowance[ambiguous].max()) if bool(ambiguous.any()) else 0.0
    passed = clear_error <= tolerance and worst <= 1.0
    detail = (
        f"{int(ambiguous.sum())} of {len(ambiguous)} rows with ambiguous activation rounding (a value or block scale "
        f"within the accumulated-error bound of an E2M1/FP8 rounding boundary), {int(differ.sum())} rows differ "
        f"({int((differ & ambiguous).sum())} of them ambiguous, worst at {worst:.2g} of its one-step-flip bound); "
        f"the unambiguous rows {clear_error:.3g}"
    )
    return passed, detail


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
        return shared_input_divisor(moe.input_div13), shared_input_divisor(moe.input_div2)
    return moe.input_div13, moe.input_div2


def shared_output(shared: tuple[Tensor, Tensor] | None, hidden: Tensor) -> Tensor:
    if shared is None:
        return torch.zeros_like(hidden)
    return swiglu_mlp(hidden, shared[0].to(hidden.device), shared[1].to(hidden.device))


def route_batch(moe: QuantizedMoe | SourceMoe, hidden: Tensor, spec: RoutingSpec) -> tuple[Tensor, Tensor, Tensor]:
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
        tick: Callable[[], None] = lambda: None,
    ):
        self.model, self.moe, self.options, self.mode = model, moe, options, mode
        self.runners, self.device, self.spec = runners, device, model.spec
        self.tick = tick  # one progress step: after each token count and the per-expert source check
        self.act = activation_divisors(moe, mode)
        self.results: list[CheckResult] = []
        self._dense: tuple[Tensor, Tensor] | None = None

    def flip_bound(self, hidden: Tensor, weights: Tensor, ids: Tensor, input_eps: float) -> tuple[Tensor, Tensor]:
        """Which rows of the W4A4 reference may flip a rounding, and by how much at most (`w4a4_flip_bound`)."""
        assert self.act is not None
        if self._dense is None:
            self._dense = dequantized(self.moe, self.device)
        return w4a4_flip_bound(hidden, weights, ids, *self._dense, self.spec, self.act, input_eps=input_eps,
                               activation=self.moe.activation, biases=self.moe.biases)

    def add(self, check: str, target: str, passed: bool, **fields: object) -> None:
        status = PASSED if passed else FAILED
        self.results.append(CheckResult(self.moe.layer, check, target, status, **fields))  # type: ignore[arg-type]

    def skip(self, check: str, target: str, why: str, **fields: object) -> None:
        """A check that could not run here: reported as skipped, never counted as passed."""
        self.results.append(CheckResult(self.moe.layer, check, target, SKIPPED, detail=why, **fields))  # type: ignore[arg-type]

    def hidden_states(self, num_tokens: int, salt: int = 0) -> Tensor:
        seed = ((self.options.seed * 1_000_003 + self.moe.layer) * 100_003 + num_tokens) * 7 + salt
        hidden = random_hidden(num_tokens, self.moe.w13.shape[2], seed, self.device)
        if self.act is not None:
            # W4A4: bring unit-scale states to the range the static activation scales were calibrated for
            calibrated_amax = amax_of_divisor(float(self.act[0].median()))
            hidden = (hidden * (calibrated_amax / UNIT_BATCH_AMAX)).to(torch.bfloat16).float()
        return hidden

    def kernels_and_source(self, source: SourceMoe | None) -> None:
        tol_source = self.options.tol_source or DEFAULT_TOL_SOURCE[self.mode]
        for num_tokens in self.options.tokens:
            hidden = self.hidden_states(num_tokens)
            logits, weights, ids = route_batch(self.moe, hidden, self.spec)
            expected = self.runners["reference"](hidden, weights, ids, logits)
            for name, run in self.runners.items():
                if name == "reference":
                    continue
                fits, why = BACKENDS[name].fits(self.device, num_tokens, self.moe, self.spec)
                if not fits:
                    self.skip("kernel", name, why, tokens=num_tokens)
                    continue
                try:
                    got = run(hidden, weights, ids, logits)
                except Exception as exc:  # a crashing kernel is a finding, not a reason to stop
                    self.add("kernel", name, False, tokens=num_tokens, detail=f"crashed: {exc!r}"[:300])
                    continue
                error = relative_error(got, expected)
                passed, detail = error <= self.options.tol_kernel, ""
                if not passed and self.mode == "w4a4":
                    ambiguous, bound = self.flip_bound(hidden, weights, ids, BACKENDS[name].input_rounding_eps)
                    passed, detail = ambiguous_rows_check(got, expected, ambiguous, bound, self.options.tol_kernel)
                self.add("kernel", name, passed, error=error, tolerance=self.options.tol_kernel, tokens=num_tokens,
                         detail=detail)
            if source is not None:
                quantized = expected + shared_output(self.moe.shared, hidden)
                _, src_weights, src_ids = route_batch(source, hidden, self.spec)
                reference = moe_reference(
                    hidden, src_weights, src_ids, source.w13.to(self.device), source.w2.to(self.device), self.spec,
                    activation=source.activation, biases=source.biases,
                )
                reference += shared_output(source.shared, hidden)
                error = relative_error(quantized, reference)
                self.add("source", source.precision, error <= tol_source, error=error, tolerance=tol_source,
                         tokens=num_tokens)
            self.tick()
        if source is not None:
            self._expert_errors(source, tol_source)
            self.tick()

    def _expert_errors(self, source: SourceMoe, tolerance: float) -> None:
        hidden = self.hidden_states(EXPERT_SAMPLE_TOKENS, salt=1)
        w13, w2 = dequantized(self.moe, self.device)

        def biases(moe: QuantizedMoe | SourceMoe, e: int) -> tuple[Tensor | None, Tensor | None]:
            return (None, None) if moe.biases is None else (moe.biases[0][e], moe.biases[1][e])

        errors = [
            relative_error(
                swiglu_mlp(hidden, w13[e], w2[e], self.moe.activation, *biases(self.moe, e)),
                swiglu_mlp(hidden, source.w13[e].to(self.device), source.w2[e].to(self.device), source.activation,
                           *biases(source, e)),
            )
            for e in range(self.moe.num_experts)
        ]
        worst = max(range(len(errors)), key=errors.__getitem__)
        self.add(
            "source-expert",
            source.precision,
            errors[worst] <= tolerance,
            error=errors[worst],
            tolerance=tolerance,
            tokens=EXPERT_SAMPLE_TOKENS,
            detail=f"worst expert {worst}",
        )

    def routing_robustness(self) -> None:
        hidden = self.hidden_states(12, salt=2)
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
        self.add("routing", "route", not problems, tokens=len(hidden), detail="; ".join(problems))
        for name, run in self.runners.items():
            fits, why = BACKENDS[name].fits(self.device, len(hidden), self.moe, self.spec)
            if not fits:
                self.skip("routing", name, why, tokens=len(hidden))
                continue
            try:
                with warnings.catch_warnings():
                    # the NaN padding row is fed on purpose: Triton's interpreter takes its block amax with numpy's
                    # nanmax (triton/runtime/interpreter.py), which warns on that all-NaN block
                    warnings.filterwarnings("ignore", "All-NaN slice encountered", RuntimeWarning)
                    out = run(hidden, weights, ids, logits)
            except Exception as exc:
                self.add("routing", name, False, tokens=len(hidden), detail=f"crashed: {exc!r}"[:300])
                continue
            bad = (~torch.isfinite(out[valid]).all(dim=1)).nonzero().flatten().tolist()
            rows = valid.nonzero().flatten()[bad].tolist()
            self.add(
                "routing",
                name,
                not rows,
                tokens=len(hidden),
                detail=f"non-finite output on valid rows {rows}" if rows else "",
            )


def load_source(options: VerifyOptions, moe: QuantizedMoe) -> SourceMoe | None:
    if options.source is None:
        return None
    return read_source_layer(options.source, moe.experts_module, moe.num_experts)

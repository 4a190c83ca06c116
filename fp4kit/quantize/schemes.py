"""Which scheme each quantized module gets, and the FP8 weight schemes' math.

``--scheme`` names the default; ``--scheme-for REGEX=SCHEME`` rules map module names to another scheme, the first
matching rule winning as in compressed-tensors' ``config_groups``. Modules a kernel fuses (q/k/v, gate/up:
fp4kit.families.base.weight_scale_group) are read as one weight, so they must end up with one scheme.

The FP8 weights follow compressed-tensors' float quantization exactly (its ``calculate_qparams`` and ``_quantize``),
in the weight's own dtype: the scale is amax / 448 rounded to that dtype (an all-zero channel or block gets the
dtype's eps), and the codes are ``clamp(w / scale, -448, 448)`` cast to E4M3, the division rounded to the weight's
dtype first. Byte identity with llm-compressor's output depends on keeping those two roundings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fp4kit.errors import Fp4kitError

if TYPE_CHECKING:
    from fp4kit.quantize.plan import QuantGroup

NVFP4_SCHEMES = ("nvfp4", "nvfp4a16")
FP8_SCHEMES = ("fp8-dynamic", "fp8-block", "fp8-static")
# schemes whose modules carry a calibrated static input scale
STATIC_INPUT_SCHEMES = ("nvfp4", "fp8-static")
KEPT = "bf16"
SCHEMES = (*NVFP4_SCHEMES, *FP8_SCHEMES, KEPT)
FP8_MAX = 448.0
FP8_BLOCK = 128  # fp8-block's weight blocks are FP8_BLOCK x FP8_BLOCK


@dataclass(frozen=True)
class SchemeRule:
    pattern: re.Pattern[str]
    scheme: str
    spelled: str  # as the user wrote it, for messages


def parse_rule(text: str, what: str = "--scheme-for") -> SchemeRule:
    """``REGEX=SCHEME`` (the regex may carry llm-compressor's ``re:`` prefix); the last ``=`` separates them."""
    pattern, sep, scheme = text.rpartition("=")
    if not sep or not pattern:
        raise Fp4kitError(f"{what} {text!r}: expected REGEX=SCHEME")
    scheme = scheme.strip().lower()
    if scheme not in SCHEMES:
        raise Fp4kitError(f"{what} {text!r}: unknown scheme {scheme!r} (choose from {', '.join(SCHEMES)})")
    regex = pattern[3:] if pattern.startswith("re:") else pattern
    try:
        compiled = re.compile(regex)
    except re.error as exc:
        raise Fp4kitError(f"{what} {text!r}: {pattern!r} is not a valid regex: {exc}") from None
    return SchemeRule(compiled, scheme, text)


@dataclass(frozen=True)
class SchemeMap:
    """The default scheme and the rules that override it, first match wins."""

    default: str
    rules: tuple[SchemeRule, ...] = ()

    @classmethod
    def parse(cls, default: str, rules: Iterable[str] = (), what: str = "--scheme-for") -> SchemeMap:
        if default not in SCHEMES:
            raise Fp4kitError(f"--scheme {default!r}: unknown scheme (choose from {', '.join(SCHEMES)})")
        return cls(default, tuple(parse_rule(r, what) for r in rules))

    @property
    def mixed(self) -> bool:
        return any(r.scheme != self.default for r in self.rules)

    def scheme_of(self, module: str) -> str:
        for rule in self.rules:
            if rule.pattern.search(module):
                return rule.scheme
        return self.default

    def group_scheme(self, modules: Sequence[str]) -> str:
        """The one scheme of modules quantized together (a fused group); an error naming two that disagree."""
        schemes = {m: self.scheme_of(m) for m in modules}
        first = modules[0]
        for module, scheme in schemes.items():
            if scheme != schemes[first]:
                raise Fp4kitError(
                    f"--scheme-for: {first} gets {schemes[first]} but {module} gets {scheme}; modules a kernel "
                    f"fuses must share one scheme (match them with one rule)"
                )
        return schemes[first]

    def unused_rules(self, modules: Iterable[str]) -> list[str]:
        """Rules that win for no module (most likely a typo in the regex)."""
        winners = set()
        modules = list(modules)
        for module in modules:
            for rule in self.rules:
                if rule.pattern.search(module):
                    winners.add(rule.spelled)
                    break
        return [r.spelled for r in self.rules if r.spelled not in winners]


def assign(groups: Iterable[QuantGroup], smap: SchemeMap) -> dict[int, str]:
    """The scheme of each planned group (keyed by its index), every member of a fused group agreeing; an error
    for a rule that wins for no planned module, as an ignore pattern that matches nothing would."""
    groups = list(groups)
    modules = [c.linear.module for g in groups for c in g.members]
    unused = smap.unused_rules(modules)
    if unused:
        raise Fp4kitError(f"--scheme-for {unused[0]!r}: matches no module that is quantized (see --ignore)")
    return {i: smap.group_scheme([c.linear.module for c in g.members]) for i, g in enumerate(groups)}


def module_schemes(groups: Iterable[QuantGroup], smap: SchemeMap) -> dict[str, str]:
    """The scheme of every planned module (fused groups whole; see ``assign``)."""
    groups = list(groups)
    schemes = assign(groups, smap)
    return {c.linear.module: schemes[i] for i, g in enumerate(groups) for c in g.members}


def single_nvfp4(schemes: Iterable[str]) -> bool:
    """Whether the quantized modules all have one NVFP4 scheme: the output is then a plain NVFP4 checkpoint."""
    distinct = set(schemes)
    return len(distinct) <= 1 and distinct <= set(NVFP4_SCHEMES)


@dataclass
class Fp8Weight:
    """An FP8 E4M3 weight [N, K] and its scale in the weight's dtype: [N, 1] per channel (fp8-dynamic),
    [ceil(N/128), ceil(K/128)] per block (fp8-block) or [1] per tensor (fp8-static); dequantized as codes * scale."""

    codes: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.scale.float()
        if scale.dim() == 2 and scale.shape[-1] != 1:  # per block: expand each over its block, crop the padding
            n, k = self.codes.shape
            scale = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
        return (self.codes.float() * scale).to(dtype)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    scale = amax / torch.tensor(FP8_MAX, dtype=amax.dtype)
    eps = torch.tensor(torch.finfo(amax.dtype).eps, dtype=amax.dtype)
    return torch.where(scale == 0, eps, scale)


def _codes(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(weight / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _check(weight: torch.Tensor, module: str) -> None:
    if weight.dim() != 2 or not weight.dtype.is_floating_point or weight.dtype.itemsize == 1:
        raise Fp4kitError(f"{module}: an FP8 scheme needs a 2-D bf16/fp16/fp32 weight, got {weight.dtype} "
                          f"{list(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise Fp4kitError(f"{module}: weight holds non-finite values")


def quantize_fp8_channel(weight: torch.Tensor, module: str = "weight") -> Fp8Weight:
    """fp8-dynamic's weight: one scale per output channel."""
    _check(weight, module)
    amax = weight.abs().amax(dim=1, keepdim=True)
    scale = _scale_from_amax(amax)
    return Fp8Weight(_codes(weight, scale), scale)


def quantize_fp8_block(weight: torch.Tensor, module: str = "weight") -> Fp8Weight:
    """fp8-block's weight: one scale per 128x128 block (partial edge blocks as compressed-tensors pads them)."""
    _check(weight, module)
    n, k = weight.shape
    rows, cols = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(rows * FP8_BLOCK, cols * FP8_BLOCK, dtype=weight.dtype)
    padded[:n, :k] = weight
    blocks = padded.unflatten(0, (rows, FP8_BLOCK)).unflatten(2, (cols, FP8_BLOCK))  # [r, 128, c, 128]
    amax = blocks.abs().amax(dim=(1, 3))
    scale = _scale_from_amax(amax)
    expanded = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
    return Fp8Weight(_codes(weight, expanded), scale)


def quantize_fp8_tensor(weight: torch.Tensor, module: str = "weight") -> Fp8Weight:
    """fp8-static's weight: one scale for the whole tensor."""
    _check(weight, module)
    scale = _scale_from_amax(weight.abs().amax().reshape(1))
    return Fp8Weight(_codes(weight, scale), scale)


def quantize_fp8(weight: torch.Tensor, scheme: str, module: str = "weight") -> Fp8Weight:
    if scheme == "fp8-dynamic":
        return quantize_fp8_channel(weight, module)
    if scheme == "fp8-block":
        return quantize_fp8_block(weight, module)
    if scheme == "fp8-static":
        return quantize_fp8_tensor(weight, module)
    raise ValueError(f"not an FP8 scheme: {scheme}")


def fp8_scale_shape(scheme: str, out_features: int, in_features: int) -> tuple[int, ...]:
    """The shape of an FP8 weight's scale as quantize_fp8 returns it."""
    if scheme == "fp8-dynamic":
        return (out_features, 1)
    if scheme == "fp8-block":
        return (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
    if scheme == "fp8-static":
        return (1,)
    raise ValueError(f"not an FP8 scheme: {scheme}")


def fp8_input_scale(amax: float) -> torch.Tensor:
    """fp8-static's per-tensor input scale (a divisor, float64) from the calibrated input amax: amax / 448, and 1
    where the module saw no non-zero input (no scale is ever 0)."""
    if not math.isfinite(amax):
        raise Fp4kitError(f"calibration gave a non-finite input amax ({amax})")
    return torch.tensor(amax / FP8_MAX if amax > 0 else 1.0, dtype=torch.float64)

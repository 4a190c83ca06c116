"""Block-scale choice by (weighted) squared error: the `mse` quantization method.

Round-to-nearest takes each 16-block's FP8 scale as fp8(G * amax_blk / 6). The search keeps the global scale G and,
per block, picks the scale whose dequantized block is closest to the weights among candidates that include the RTN
scale itself (so the result is never worse under this metric): the FP8 codes a few steps below and above the RTN
code, and "max to 4" (fp8(G * amax_blk / 4), Four Over Six), which trades resolution at the top for a finer grid
below. The error of a block is sum_k w_k (x_k - dq(x_k))^2 with w the input channel's mean squared activation
(llm-compressor's imatrix weighting) when calibration data is given, else 1. All blocks are searched at once, one
candidate at a time (memory: a few tensors of the weight's size), in fp32 on the weight's device.

A wider search (``ScaleSearch``, ``--mse-range``; the mse method's default) tries every representable E4M3 code
whose value lies within [low, high] x the block's unrounded RTN scale G * amax_blk / 6 (e.g. 0.8 to 1.8: clipping
the largest weights a little up to mapping them to 3.3), besides the RTN code, under the error
sum_k w_k |x_k - dq(x_k)|^norm. The codes are enumerated exactly (no float grid to round afterwards), as a fixed
list of code offsets from the RTN code with a per-block mask, so its shapes are static (GPTQ replays it in a CUDA
graph).

The output is a plain NVFP4 tensor: only the block scale bytes (and so the codes) differ from RTN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.native import nvfp4_cpu
from fp4kit.nvfp4 import (
    BLOCK,
    FP4_MAX,
    FP8_MAX,
    ZERO_BLOCK_SCALE,
    NVFP4Tensor,
    _encode_with_scales,
    _native_block_amax,
    _per_leading_index,
    block_amax,
    divisor_of,
    global_scale_mul,
    rtn_block_scale,
)

# FP8 E4M3 code steps tried around the RTN code (neighbouring codes differ by 1/16 to 1/8 in value); "max to 4"
# (1.5x) is tried besides. On a trained model's weights the squared error relative to RTN's was 0.759 with +-1,
# 0.755 with +-2 and 0.751 with +-3: the method stays at +-1 (each candidate costs as much as the RTN encode five
# times over), GPTQ, whose compensated weights stray further, searches +-2
CODE_OFFSETS = (-1, 1)
GPTQ_CODE_OFFSETS = (-2, -1, 1, 2)
MAX_FP8_CODE = 0x7E  # 448; 0x7F is NaN in E4M3FN


@dataclass(frozen=True)
class ScaleSearch:
    """Every E4M3 block-scale code within [low, high] x the unrounded RTN scale, by sum_k w_k |error_k|^norm."""

    low: float = 0.8
    high: float = 1.8
    norm: float = 2.0

    def __post_init__(self) -> None:
        if not (0 < self.low <= 1 <= self.high <= 8) or not math.isfinite(self.norm) or self.norm <= 0:
            raise Fp4kitError(f"mse search range {self.low}:{self.high} (needs 0 < LOW <= 1 <= HIGH <= 8) or norm "
                              f"{self.norm} (needs > 0) out of bounds")

    @property
    def offsets(self) -> tuple[int, ...]:
        return _range_offsets(self.low, self.high)

    def describe(self) -> str:
        return f"{self.low:g}:{self.high:g}, norm {self.norm:g}"


@lru_cache
def _range_offsets(low: float, high: float) -> tuple[int, ...]:
    """Code offsets from the RTN code that can land in [low, high] x the unrounded RTN scale for some block: from each
    code's rounding interval [v_lo, v_hi] (the unrounded scales that round to it), the codes with value in
    [low * v_lo, high * v_hi]. Cached: options build a ScaleSearch per tensor group."""
    values = torch.arange(MAX_FP8_CODE + 1, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    found: set[int] = set()
    for code in range(1, MAX_FP8_CODE + 1):
        v_lo = (values[code - 1] + values[code]) / 2
        v_hi = (values[code] + values[code + 1]) / 2 if code < MAX_FP8_CODE else values[code] * 2
        inside = ((values >= low * v_lo) & (values <= high * v_hi)).nonzero().flatten()
        found.update(int(c) - code for c in inside if int(c) >= 1)
    found.discard(0)
    return tuple(sorted(found))


def parse_scale_search(span: str, norm: float) -> ScaleSearch | None:
    """--mse-range (``codes``: the RTN code +-1 and max-to-4; or ``LOW:HIGH``) and --mse-norm -> the search, or
    None for the RTN-neighbour candidates (squared error only)."""
    if span == "codes":
        if norm != 2.0:
            raise Fp4kitError("--mse-norm other than 2 needs a --mse-range LOW:HIGH")
        return None
    low, sep, high = span.partition(":")
    try:
        if not sep:
            raise ValueError
        return ScaleSearch(float(low), float(high), float(norm))
    except ValueError:
        raise Fp4kitError(f"--mse-range {span!r}: expected codes or LOW:HIGH (e.g. 0.8:1.8)") from None


def round_e2m1_magnitude_(y: torch.Tensor) -> torch.Tensor:
    """In place: non-negative fp32 values -> the nearest E2M1 magnitude (ties to even, saturating at 6), the same
    rounding as fp4kit.nvfp4.e2m1_codes. The grid step is 0.5 below 2, 1 below 4, 2 up to 6: half the value's power
    of two (read off its exponent bits), at least 0.5; dividing by a power of two is exact, so torch.round's
    ties-to-even is the E2M1 one."""
    step = (y.view(torch.int32) & 0x7F800000).view(torch.float32).clamp_(min=1.0).mul_(0.5)
    return y.div_(step).round_().mul_(step).clamp_(max=FP4_MAX)


def block_errors(magnitudes: torch.Tensor, divisor: torch.Tensor, importance: torch.Tensor | None,
                 norm: float = 2.0) -> torch.Tensor:
    """Per-block weighted error sum_k w_k |e_k|^norm [..., K/16] of |blocks| [..., K/16, 16] quantized with per-block
    divisor (block scale / G) [..., K/16], dequantized the way NVFP4Tensor.dequantize does (code value x divisor)."""
    div = divisor.unsqueeze(-1)
    dequantized = round_e2m1_magnitude_(magnitudes / div).mul_(div)
    error = dequantized.sub_(magnitudes)
    error = error.square_() if norm == 2.0 else error.abs_().pow_(norm)
    if importance is not None:
        error.mul_(importance)
    # the C loop's order (same choices, same bytes): halves, quarters, then (e0 + e2) + (e1 + e3)
    error = error[..., :8] + error[..., 8:]
    error = error[..., :4] + error[..., 4:]
    return (error[..., 0] + error[..., 2]) + (error[..., 1] + error[..., 3])


def _candidate_scales(rtn_scale: torch.Tensor, amax: torch.Tensor, global_mul: torch.Tensor,
                      offsets: tuple[int, ...]) -> list[torch.Tensor]:
    codes = rtn_scale.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    candidates = [
        (codes + offset).clamp_(1, MAX_FP8_CODE).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        for offset in offsets
    ]
    max_to_4 = torch.clamp(global_mul * (amax.to(torch.float32) / 4.0), max=FP8_MAX)
    max_to_4 = max_to_4.to(torch.float8_e4m3fn).to(torch.float32)
    candidates.append(torch.where(max_to_4 == 0, ZERO_BLOCK_SCALE, max_to_4))
    return candidates


def search_block_scales(
    weight: torch.Tensor,
    global_mul: torch.Tensor,
    importance: torch.Tensor | None = None,
    amax_per_block: torch.Tensor | None = None,
    offsets: tuple[int, ...] = CODE_OFFSETS,
    search: ScaleSearch | None = None,
) -> torch.Tensor:
    """fp32 values of the chosen FP8 block scales [..., N, K/16] of weight [..., N, K] under the fp32 multiplier
    global scale ``global_mul`` (0-d, or [B] for a stack [B, N, K]). ``importance``: per input channel weights
    [..., K] (one per leading index of a stack, or one [K] for all), or None for plain squared error. ``search``:
    the range search instead of the RTN code ``offsets`` and max-to-4."""
    if amax_per_block is None:
        amax_per_block = block_amax(weight)
    global_mul = _per_leading_index(global_mul.to(device=weight.device, dtype=torch.float32), amax_per_block.dim())
    magnitudes = weight.unflatten(-1, (-1, BLOCK)).to(torch.float32).abs()
    if importance is not None:
        importance = importance.to(device=weight.device, dtype=torch.float32).unflatten(-1, (-1, BLOCK))
        importance = importance.unsqueeze(-3)  # one weight per input channel, the same for every row
    best_scale = rtn_block_scale(amax_per_block, global_mul)
    if search is not None:
        return _range_search(magnitudes, amax_per_block, global_mul, importance, best_scale, search)
    best_error = block_errors(magnitudes, best_scale / global_mul, importance)
    for candidate in _candidate_scales(best_scale, amax_per_block, global_mul, offsets):
        error = block_errors(magnitudes, candidate / global_mul, importance)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, candidate, best_scale)
    return best_scale


def _range_search(magnitudes: torch.Tensor, amax: torch.Tensor, global_mul: torch.Tensor,
                  importance: torch.Tensor | None, best_scale: torch.Tensor, search: ScaleSearch) -> torch.Tensor:
    exact = global_mul * (amax.to(torch.float32) / FP4_MAX)
    low, high = exact * search.low, exact * search.high
    codes = best_scale.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    best_error = block_errors(magnitudes, best_scale / global_mul, importance, search.norm)
    for offset in search.offsets:
        candidate_code = codes + offset
        candidate = candidate_code.clamp(1, MAX_FP8_CODE).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        error = block_errors(magnitudes, candidate / global_mul, importance, search.norm)
        better = (error < best_error) & (candidate >= low) & (candidate <= high)
        better &= (candidate_code >= 1) & (candidate_code <= MAX_FP8_CODE)
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, candidate, best_scale)
    return best_scale


def quantize_mse(
    weight: torch.Tensor, global_mul: torch.Tensor, importance: torch.Tensor | None = None, native: bool = False,
    search: ScaleSearch | None = None,
) -> NVFP4Tensor:
    """fp4kit.nvfp4.quantize with searched block scales instead of RTN ones (same global scale). ``native``: a bf16
    weight on the CPU goes through fp4kit's C loop (fp4kit.native.nvfp4_cpu), which makes the same choices (squared
    error only: a range ``search`` with another norm runs in torch)."""
    global_shape = global_mul.shape
    if (native and nvfp4_cpu.handles_mse(weight) and global_mul.dim() == 0
            and (importance is None or importance.dim() == 1) and (search is None or search.norm == 2.0)):
        amax, _ = _native_block_amax(weight)
        offsets, bounds = (CODE_OFFSETS, None) if search is None else (search.offsets, (search.low, search.high))
        packed, block_scale = nvfp4_cpu.mse_encode(weight, amax, float(global_mul), offsets,
                                                   None if importance is None else importance.cpu(), bounds)
        return NVFP4Tensor(packed, block_scale, divisor_of(global_mul.cpu()))
    scales = search_block_scales(weight, global_mul, importance, search=search)
    global_mul = _per_leading_index(global_mul.to(device=weight.device, dtype=torch.float32), scales.dim())
    return _encode_with_scales(weight, global_mul, scales, global_shape)


def quantize_group_mse(
    weights: list[torch.Tensor],
    exact_fp32: bool = False,
    importance: list[torch.Tensor | None] | None = None,
    native: bool = False,
    search: ScaleSearch | None = None,
) -> list[NVFP4Tensor]:
    """fp4kit.nvfp4.quantize_group with searched block scales: the members still share one global scale, the
    RTN one (448*6 / amax of the group)."""
    global_mul = group_global_mul(weights, exact_fp32)
    importance = importance or [None] * len(weights)
    return [quantize_mse(w, global_mul, imp, native, search) for w, imp in zip(weights, importance, strict=True)]


def quantize_stacked_mse(
    stack: torch.Tensor, exact_fp32: bool = False, importance: torch.Tensor | None = None,
    search: ScaleSearch | None = None,
) -> NVFP4Tensor:
    """fp4kit.nvfp4.quantize_stacked with searched block scales (each entry its own RTN global scale)."""
    amax = block_amax(stack)
    global_mul = global_scale_mul(amax.flatten(1).amax(dim=1), exact_fp32)
    scales = search_block_scales(stack, global_mul, importance, amax, search=search)
    return _encode_with_scales(stack, _per_leading_index(global_mul.to(stack.device), scales.dim()), scales,
                               global_mul.shape)


def group_global_mul(weights: list[torch.Tensor], exact_fp32: bool = False) -> torch.Tensor:
    """The RTN global scale multiplier a fused group shares (fp4kit.nvfp4.quantize_group's)."""
    if all(nvfp4_cpu.handles(w) for w in weights):
        amax = max((_native_block_amax(w)[1] for w in weights), key=float)
    else:
        amax = torch.stack([block_amax(w).amax() for w in weights]).amax()
    return global_scale_mul(amax, exact_fp32)

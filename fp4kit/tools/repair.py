"""`fp4kit convert --repair`: one weight global scale per fused group, one input scale per expert projection.

Weights: the group's shared divisor is its largest (the largest amax), so every rescaled block scale shrinks and none
overflows FP8. A block scale s becomes s' = fp8(s * D / D'); where s' * D' == s * D exactly the codes are kept, else
the block is requantized from its dequantized values on the new scale. A value then moves by at most
6 * D' * ulp(s') / 2: half an FP8 step of its block scale.
Input scales: q/k/v (one activation) and, per layer, every expert's gate/up (w13) and down (w2) get the largest
divisor of their set (the largest calibrated amax, so nothing clips), which also makes EP numerics rank-independent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fp4kit.families.base import input_scale_group, largest_amax, weight_scale_group
from fp4kit.families.grammar import DEFAULT, ExpertGrammar
from fp4kit.nvfp4 import BLOCK, FP8_MAX, NVFP4Tensor, e2m1_codes, pack_codes, unpack_codes, unpack_e2m1

_SMALLEST_FP8 = 2.0**-9


@dataclass
class RepairReport:
    weight_groups_unified: int = 0
    input_groups_unified: int = 0
    modules_changed: list[str] = field(default_factory=list)
    max_abs_change: float = 0.0  # largest change of a dequantized weight value


def unified_scales(
    scales: dict[str, tuple[torch.Tensor, torch.Tensor | None]], report: RepairReport,
    grammar: ExpertGrammar = DEFAULT,
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Per-module (weight divisor, input divisor) -> the repaired ones (largest of each group)."""
    out = dict(scales)
    for index, grouping in ((0, weight_scale_group), (1, input_scale_group)):
        groups: dict[str, list[str]] = {}
        for name, pair in scales.items():
            if pair[index] is not None:
                groups.setdefault(grouping(name, grammar), []).append(name)
        for members in groups.values():
            values = [scales[m][index] for m in members]
            largest = largest_amax("divisor")(values, key=float)
            if all(torch.equal(v, largest) for v in values):  # type: ignore[arg-type]
                continue
            if index == 0:
                report.weight_groups_unified += 1
            else:
                report.input_groups_unified += 1
            for m in members:
                pair = list(out[m])
                pair[index] = largest
                out[m] = (pair[0], pair[1])
    return out


def rescale(weight: NVFP4Tensor, new_div: torch.Tensor) -> tuple[NVFP4Tensor, float]:
    """``weight`` re-expressed on global divisor ``new_div`` (>= its own); returns it and the largest value change."""
    if torch.equal(weight.global_scale_div, new_div):
        return weight, 0.0
    old_scale = weight.block_scale.double()
    wanted = old_scale * (weight.global_scale_div / new_div)
    new_scale = wanted.float().clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    underflow = (new_scale.double() == 0) & (old_scale > 0)
    new_scale = torch.where(underflow, torch.tensor(_SMALLEST_FP8).to(torch.float8_e4m3fn), new_scale)
    exact = (new_scale.double() == wanted).unsqueeze(-1)
    codes = unpack_codes(weight.packed).unflatten(-1, (-1, BLOCK))
    values = unpack_e2m1(weight.packed).double().unflatten(-1, (-1, BLOCK)) * wanted.unsqueeze(-1)
    requantized = e2m1_codes((values / new_scale.double().unsqueeze(-1)).float())
    codes = torch.where(exact, codes, requantized)
    repaired = NVFP4Tensor(pack_codes(codes.flatten(-2)), new_scale, new_div.double().reshape(()))
    before = unpack_e2m1(weight.packed).double().unflatten(-1, (-1, BLOCK)) * (old_scale * weight.global_scale_div
                                                                                ).unsqueeze(-1)
    after = unpack_e2m1(repaired.packed).double().unflatten(-1, (-1, BLOCK)) * (new_scale.double() * new_div
                                                                                 ).unsqueeze(-1)
    return repaired, float((after - before).abs().max()) if before.numel() else 0.0

"""Which output rows of a W4A4-emulated MoE may legitimately differ between two correct computations.

W4A4 emulation rounds the input of each GEMM to NVFP4 (`fp4kit.nvfp4.fake_quantize_activation`): an E2M1
code per element and an FP8 E4M3 scale per 16-block. Rounding is discontinuous, so when a kernel's value differs from
the reference's by a few fp32 ulps (another summation order in GEMM1, another exp), an element sitting within that
distance of an E2M1 rounding boundary can round one code apart, and a block whose amax·G/6 sits that close to an FP8
rounding boundary can take the neighbouring block scale (re-rounding all 16 elements): that token's whole output row
moves, by far more than fp32 rounding. Whether that can happen is decided by the data, per row.

The bound on how far two correct computations of the same value can be apart:

- GEMM1 (gate and up, each a K-term fp32 dot product of exact operand products): |δ| <= ``ACCUMULATION_EPS`` ·
  Σ_k |x̂_k|·|ŵ_k|. Any summation order of n terms in fp32 is within (n-1)·u·Σ|terms| (u = 2^-24) of the exact sum,
  rounding errors of random sign give ~sqrt(n)·u·Σ|terms|, and tensor-core MMAs that align their products with
  truncation lose a few more ulps per 16-term step; the reference's dequantized operands (x̂ = e2m1·s/G, ŵ) each add
  one rounding. 1e-5 ≈ 170 u: the worst case up to 170 terms, the random-sign case far beyond any hidden size.
- SwiGLU: |silu'| <= 1.1, so h = silu(g)·u moves by at most 1.1·δg·(|u| + δu) + |silu(g)|·δu, plus exp and division
  approximations (Triton's on GPUs are within a few ulps) covered by ``ACCUMULATION_EPS``·|h|. gpt-oss's
  (clamp(u) + 1)·g·sigmoid(αg) (g clamped): the same bound with |u| + 1 for |u| and g·sigmoid(αg) for silu(g), whose
  slope in g is also at most 1.1 (it is silu(αg) / α); the clamps only shrink differences, the biases none.
- GEMM1's input: an identical IEEE computation (the Triton kernel) is bit-identical and has no ambiguity; a kernel
  that multiplies by a reciprocal instead of dividing gets ``input_eps`` = 2 ulps of relative uncertainty, and its
  flips propagate through GEMM1 into the intermediate's uncertainty.

An element (block) is ambiguous when its scaled value (amax·G/6) lies strictly closer to a rounding boundary than its
uncertainty. For such a row the output can move by at most Σ_i |w2[:, i]|·c_i (times the routing weight), c_i the most
the dequantized intermediate element i can change: one E2M1 step for an element flip; for a block-scale flip the
reference's own rounding error plus the uncertainty plus the worst rounding error with the other scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fp4kit.families.activation import SILU, ExpertActivation
from fp4kit.families.routing import RoutingSpec
from fp4kit.nvfp4 import BLOCK, FP4_MAX, FP8_MAX, block_scale_input, fake_quantize_activation, fp32_multiplier

ACCUMULATION_EPS = 1e-5
RECIPROCAL_EPS = 2.0**-22  # x·(1/d) instead of x/d: within 2 ulps
SILU_LIPSCHITZ = 1.1  # max |d silu / dx| = 1.0998 at x ~ 2.4
E2M1_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_STEPS = (0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0)  # distance between the two codes on either side of each boundary


def _fp8_values(device: torch.device) -> Tensor:
    """Every non-negative finite E4M3FN value, ascending (0 .. 448)."""
    return torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().to(device)


def _worst_rounding_error(scaled: Tensor) -> Tensor:
    """The largest |e2m1(z) - z| for any |z| up to ``scaled`` (half the code spacing; saturation above 6)."""
    return torch.where(scaled <= 2, 0.25, torch.where(scaled <= 4, 0.5, torch.clamp(scaled - FP4_MAX, min=1.0)))


def quantization_flips(x: Tensor, delta: Tensor, global_div: Tensor) -> tuple[Tensor, Tensor]:
    """For values ``x`` [R, K] that `fake_quantize_activation` rounds with divisor ``global_div`` (0-d), and a bound
    ``delta`` [R, K] >= 0 on how far another correct computation's values can be from them: (ambiguous bool [R],
    change [R, K]), the most each dequantized element can differ between the two (0 where no rounding can flip)."""
    global_mul = fp32_multiplier(global_div).to(x.device)
    blocks, block_delta = x.float().unflatten(-1, (-1, BLOCK)), delta.float().unflatten(-1, (-1, BLOCK))
    pre = block_scale_input(blocks.abs().amax(dim=-1, keepdim=True), global_mul)  # the reference's exact value
    scale = torch.clamp(pre, max=FP8_MAX).to(torch.float8_e4m3fn).float()
    unit = scale / global_mul  # one E2M1 unit in x's terms
    safe_unit = torch.where(unit > 0, unit, torch.ones_like(unit))
    # elements: the nearest E2M1 boundary of |x| / unit, closer than the uncertainty in the same units
    boundaries = torch.tensor(E2M1_BOUNDARIES, device=x.device)
    distance, nearest = ((blocks.abs() / safe_unit).unsqueeze(-1) - boundaries).abs().min(dim=-1)
    element_flip = (unit > 0) & (distance < block_delta / safe_unit)
    change = torch.where(element_flip, torch.tensor(E2M1_STEPS, device=x.device)[nearest] * unit, 0.0)
    # blocks: amax·G/6 (which moves by at most max(delta)·G/6) closer to an FP8 midpoint than that
    values = _fp8_values(x.device)
    midpoints = (values[1:] + values[:-1]) / 2
    pre_delta = block_delta.amax(dim=-1, keepdim=True) / FP4_MAX * global_mul
    gap, mid = (pre - midpoints).abs().min(dim=-1, keepdim=True)
    block_flip = gap < pre_delta
    other_scale = torch.where(values[mid] == scale, values[mid + 1], values[mid])  # across that midpoint
    other_unit = other_scale / global_mul
    reference_error = (fake_quantize_activation(x, global_div).unflatten(-1, (-1, BLOCK)) - blocks).abs()
    reach = blocks.abs() + block_delta
    other_error = torch.where(
        other_unit > 0,
        _worst_rounding_error(reach / torch.where(other_unit > 0, other_unit, 1.0)) * other_unit,
        reach,  # the other scale is 0: that block is all zeros
    )
    change = torch.where(block_flip, torch.maximum(change, reference_error + block_delta + other_error), change)
    ambiguous = element_flip.flatten(-2).any(dim=-1) | block_flip.flatten(-2).any(dim=-1)
    return ambiguous, change.flatten(-2)


def w4a4_flip_bound(
    hidden: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    spec: RoutingSpec,
    activation_global_div: tuple[Tensor, Tensor],
    expert_mask: Tensor | None = None,
    *,
    input_eps: float = 0.0,
    accumulation_eps: float = ACCUMULATION_EPS,
    activation: ExpertActivation = SILU,
    biases: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """For the W4A4 `moe_reference` with the same arguments: (ambiguous bool [T], bound fp32 [T]), whether a token's
    emulated activation rounding (GEMM1 input or intermediate) can flip between correct computations, and an upper
    bound on the L2 norm by which such flips can move its output row. ``input_eps``: the relative uncertainty of
    GEMM1's input values before rounding (0 for a kernel that rounds them with the reference's IEEE operations).
    ``activation`` and ``biases`` (b13 [E, 2I], b2 [E, H]): gpt-oss's experts, as `moe_reference` takes them."""
    hidden = hidden.float()
    ambiguous = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    reach = torch.zeros_like(hidden)
    div13, div2 = activation_global_div
    for expert in torch.unique(ids).tolist():
        if not 0 <= expert < w13.shape[0] or (expert_mask is not None and not bool(expert_mask[expert])):
            continue
        token_idx, slot = torch.where(ids == expert)
        expert_in = hidden[token_idx]
        routing_weight = weights[token_idx, slot].float().unsqueeze(-1)
        if spec.scales_input:
            expert_in = expert_in * routing_weight
        w13_e, w2_e = w13[expert].float(), w2[expert].float()
        in_ambiguous, in_change = quantization_flips(expert_in, input_eps * expert_in.abs(), div13[expert])
        x = fake_quantize_activation(expert_in, div13[expert])
        bias13 = None if biases is None else biases[0][expert].float().to(x.device)
        gate, up = F.linear(x, w13_e, bias13).chunk(2, dim=-1)
        spread = (accumulation_eps * F.linear(x.abs(), w13_e.abs()) + F.linear(in_change, w13_e.abs())).chunk(2, -1)
        inter = activation(gate, up)
        if activation.kind == "silu":
            glu, up_factor = F.silu(gate), up.abs()
        elif activation.kind == "silu_clamped":  # the clamps are 1-Lipschitz: silu's bound holds
            glu, up_factor = F.silu(gate.clamp(max=activation.limit)), up.abs()
        else:
            clamped = gate.clamp(max=activation.limit)
            glu, up_factor = clamped * torch.sigmoid(clamped * activation.alpha), up.abs() + 1
        inter_delta = (SILU_LIPSCHITZ * spread[0] * (up_factor + spread[1]) + glu.abs() * spread[1]
                       + accumulation_eps * inter.abs())
        mid_ambiguous, change = quantization_flips(inter, inter_delta, div2[expert])
        out_reach = F.linear(change, w2_e.abs())
        if not spec.scales_input:
            out_reach = out_reach * routing_weight.abs()
        reach.index_add_(0, token_idx, out_reach)
        ambiguous[token_idx] |= in_ambiguous | mid_ambiguous
    return ambiguous, reach.norm(dim=-1)

"""fp32 torch reference MoE: the function every kernel and layout is checked against.

Weights use the checkpoint/vLLM orientation: ``w13`` [E, 2I, H] with rows [w1 (gate); w3 (up)], ``w2`` [E, H, I].
The expert is SwiGLU: w2 · (silu(w1 x) * (w3 x)), or with gpt-oss's activation and biases w2 · act(w13 x + b13) + b2
(`fp4kit.families.activation`). Routing weights multiply the expert output, except for Llama-4
(`RoutingSpec.scales_input`), where they multiply the expert input (transformers' `Llama4TextMoe`).

W4A4 emulation (docs/verify.md): with ``activation_global_div`` = (D_a13 [E], D_a2 [E]) the input of each GEMM is
quantized per 16-block the way NVFP4 kernels do at run time (``fp4kit.nvfp4.fake_quantize_activation``) and
dequantized again, so the kernel's W4A4 arithmetic and this reference differ only in summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fp4kit.families.activation import SILU, ExpertActivation
from fp4kit.families.routing import RoutingSpec
from fp4kit.nvfp4 import (
    NVFP4Tensor,
    fake_quantize_activation,
    global_scale_mul,
    quantize,
)


def swiglu_mlp(hidden: Tensor, w13: Tensor, w2: Tensor, activation: ExpertActivation = SILU,
               bias13: Tensor | None = None, bias2: Tensor | None = None) -> Tensor:
    """One gated MLP in fp32 (a routed expert, a shared expert or a dense MLP): w13 [2I, H] = [gate; up], w2 [H, I],
    and gpt-oss's output biases bias13 [2I] (same row order) and bias2 [H]."""
    gate, up = _linear(hidden.float(), w13, bias13).chunk(2, dim=-1)
    return _linear(activation(gate, up), w2, bias2)


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight.float(), None if bias is None else bias.float().to(x.device))


def dense_mlp(hidden: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """A shared expert or dense MLP from its three nn.Linear weights ([I, H], [I, H], [H, I])."""
    return swiglu_mlp(hidden, torch.cat([gate, up], dim=0), down)


def quantize_experts(experts: Tensor, exact_fp32: bool = False) -> NVFP4Tensor:
    """Quantize stacked expert weights [E, N, K] with one global scale per expert (for w13 that is the scale gate
    and up share). The result carries a float64 [E] divisor."""
    parts = [quantize(w, global_scale_mul(w.abs().amax(), exact_fp32)) for w in experts]
    return NVFP4Tensor(
        torch.stack([p.packed for p in parts]),
        torch.stack([p.block_scale for p in parts]),
        torch.stack([p.global_scale_div for p in parts]),
    )


def dequantize_experts(experts: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Stacked [E, N, K] NVFP4 experts with a float64 [E] divisor -> dense, expert by expert."""
    divisors = experts.global_scale_div.reshape(-1)
    return torch.stack(
        [
            NVFP4Tensor(experts.packed[e], experts.block_scale[e], divisors[e]).dequantize(dtype)
            for e in range(experts.packed.shape[0])
        ]
    )


def moe_reference(
    hidden: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    spec: RoutingSpec,
    expert_mask: Tensor | None = None,
    *,
    activation_global_div: tuple[Tensor, Tensor] | None = None,
    activation: ExpertActivation = SILU,
    biases: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Routed-expert output [T, H] in fp32 (no shared expert: add `swiglu_mlp` / `dense_mlp` for that).

    hidden [T, H]; weights [T, k] and ids [T, k] from `fp4kit.families.routing.route`; ``expert_mask`` (bool [E])
    computes only the experts of one EP rank, so that the outputs of all ranks sum to the full output.
    ``activation_global_div`` = (D_a13 [E], D_a2 [E]) switches on W4A4 emulation (module docstring).
    ``activation`` and ``biases`` = (b13 [E, 2I] in w13's row order, b2 [E, H]): gpt-oss's experts.
    """
    hidden = hidden.float()
    out = torch.zeros_like(hidden)
    num_experts = w13.shape[0]
    for expert in torch.unique(ids).tolist():
        if not 0 <= expert < num_experts or (expert_mask is not None and not bool(expert_mask[expert])):
            continue
        token_idx, slot = torch.where(ids == expert)
        expert_in = hidden[token_idx]
        routing_weight = weights[token_idx, slot].float().unsqueeze(-1)
        if spec.scales_input:
            expert_in = expert_in * routing_weight
        bias13, bias2 = (None, None) if biases is None else (biases[0][expert], biases[1][expert])
        if activation_global_div is None:
            expert_out = swiglu_mlp(expert_in, w13[expert], w2[expert], activation, bias13, bias2)
        else:
            div13, div2 = activation_global_div
            gate, up = _linear(fake_quantize_activation(expert_in, div13[expert]), w13[expert], bias13).chunk(2, -1)
            intermediate = fake_quantize_activation(activation(gate, up), div2[expert])
            expert_out = _linear(intermediate, w2[expert], bias2)
        if not spec.scales_input:
            expert_out = expert_out * routing_weight
        out.index_add_(0, token_idx, expert_out)
    return out

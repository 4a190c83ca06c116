"""`fp4kit.verify.reference` against transformers 5.17's MoE blocks built from tiny configs with seeded weights.

Oracles: Qwen3MoeSparseMoeBlock (`models/qwen3_moe/modeling_qwen3_moe.py`), Glm4MoeMoE (`models/glm4_moe/...`),
Llama4TextMoe (`models/llama4/modeling_llama4.py`: fused gate_up_proj [E, H, 2I], router score scales the input),
MiniMaxM2SparseMoeBlock (`models/minimax_m2/...`: sigmoid router with correction bias), GptOssMLP
(`models/gpt_oss/...`: gate_up_proj [E, H, 2I] with gate and up interleaved, biases, clamped SwiGLU with (up + 1)).
"""

from __future__ import annotations

import pytest
import torch

from fp4kit.families.activation import swiglu_oai
from fp4kit.families.routing import RoutingSpec, route
from fp4kit.nvfp4 import fake_quantize_activation, quantize
from fp4kit.verify.reference import dense_mlp, moe_reference

HIDDEN, INTER, TOKENS = 32, 16, 24


def _seed_parameters(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)


def test_matches_qwen3_moe_block() -> None:
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
    )
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config).eval()
    _seed_parameters(block, 0)
    hidden = torch.randn(1, TOKENS, HIDDEN)
    with torch.no_grad():
        expected = block(hidden)[0]
        logits = torch.nn.functional.linear(hidden[0], block.gate.weight)
    weights, ids = route(logits, RoutingSpec("softmax_topk", 8, 2))
    got = moe_reference(
        hidden[0], weights, ids, block.experts.gate_up_proj, block.experts.down_proj, RoutingSpec("softmax_topk", 8, 2)
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_matches_glm4_moe_block_with_shared_expert() -> None:
    from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    config = Glm4MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        n_shared_experts=1,
    )
    config._experts_implementation = "eager"
    block = Glm4MoeMoE(config).eval()
    _seed_parameters(block, 1)
    block.gate.e_score_correction_bias.copy_(torch.randn(16) * 0.2)
    hidden = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        expected = block(hidden)
    spec = RoutingSpec("sigmoid_grouped_topk", 16, 4, True, 4, 2, 2.5)
    logits = torch.nn.functional.linear(hidden, block.gate.weight)
    weights, ids = route(logits, spec, block.gate.e_score_correction_bias)
    shared = block.shared_experts
    got = moe_reference(hidden, weights, ids, block.experts.gate_up_proj, block.experts.down_proj, spec)
    got = got + dense_mlp(hidden, shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_matches_llama4_moe_block_input_scaling() -> None:
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = Llama4TextConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=8, num_experts_per_tok=1)
    block = Llama4TextMoe(config).eval()
    _seed_parameters(block, 2)
    hidden = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        expected, logits = block(hidden)
    spec = RoutingSpec("llama4_sigmoid_top1", 8, 1)
    weights, ids = route(logits, spec)
    # Fused BMM layout [E, H, 2I] (gate = first I columns) -> checkpoint orientation [E, 2I, H], [E, H, I].
    w13 = block.experts.gate_up_proj.transpose(1, 2)
    w2 = block.experts.down_proj.transpose(1, 2)
    shared = block.shared_expert
    got = moe_reference(hidden, weights, ids, w13, w2, spec)
    got = got + dense_mlp(hidden, shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_matches_minimax_m2_moe_block() -> None:
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock

    config = MiniMaxM2Config(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=8, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    block = MiniMaxM2SparseMoeBlock(config).eval()
    _seed_parameters(block, 4)
    block.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    hidden = torch.randn(1, TOKENS, HIDDEN)
    with torch.no_grad():
        expected = block(hidden)[0]
    spec = RoutingSpec("sigmoid_grouped_topk", 8, 2)
    weights, ids = route(torch.nn.functional.linear(hidden[0], block.gate.weight), spec, block.e_score_correction_bias)
    got = moe_reference(hidden[0], weights, ids, block.experts.gate_up_proj, block.experts.down_proj, spec)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("w4a4", [False, True])
def test_matches_gpt_oss_mlp_with_biases_and_clamped_swiglu(w4a4: bool) -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=8, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    block = GptOssMLP(config).eval()
    _seed_parameters(block, 5)
    hidden = 4 * torch.randn(1, TOKENS, HIDDEN)  # large enough that the clamp at 7 bites
    experts = block.experts
    gate_up = experts.gate_up_proj.transpose(1, 2)  # [E, 2I, H], rows gate, up, gate, up, ...
    w13 = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)  # the canonical [gate; up] rows
    b13 = torch.cat([experts.gate_up_proj_bias[:, 0::2], experts.gate_up_proj_bias[:, 1::2]], dim=1)
    w2, b2 = experts.down_proj.transpose(1, 2), experts.down_proj_bias
    with torch.no_grad():
        expected = block(hidden)[0][0]
        logits = torch.nn.functional.linear(hidden[0], block.router.weight, block.router.bias)
        assert bool((hidden[0] @ gate_up[0].T).abs().max() > 7)
    spec = RoutingSpec("topk_softmax", 8, 2)
    weights, ids = route(logits, spec)
    activation = swiglu_oai(limit=experts.limit, alpha=experts.alpha)
    got = moe_reference(hidden[0], weights, ids, w13, w2, spec, activation=activation, biases=(b13, b2))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    unbiased = moe_reference(hidden[0], weights, ids, w13, w2, spec, activation=activation)
    assert not torch.allclose(unbiased, expected, rtol=1e-3, atol=1e-3)
    if w4a4:  # W4A4 emulation adds the biases and the activation at the same places
        divisors = (torch.full((8,), 100 / 2688, dtype=torch.float64),) * 2  # amax 100 covers both GEMM inputs
        emulated = moe_reference(hidden[0], weights, ids, w13, w2, spec, activation_global_div=divisors,
                                 activation=activation, biases=(b13, b2))
        relative = (emulated - expected).norm() / expected.norm()
        assert 0 < relative < 0.25, relative


@pytest.mark.parametrize("ep_size", [2, 3])
def test_expert_mask_ranks_sum_to_full_output(ep_size: int) -> None:
    torch.manual_seed(3)
    num_experts = 8
    spec = RoutingSpec("softmax_topk", num_experts, 3)
    hidden = torch.randn(TOKENS, HIDDEN)
    w13, w2 = torch.randn(num_experts, 2 * INTER, HIDDEN), torch.randn(num_experts, HIDDEN, INTER)
    weights, ids = route(torch.randn(TOKENS, num_experts), spec)
    full = moe_reference(hidden, weights, ids, w13, w2, spec)
    owner = torch.arange(num_experts) * ep_size // num_experts
    per_rank = [
        moe_reference(hidden, weights, ids, w13, w2, spec, expert_mask=owner == rank) for rank in range(ep_size)
    ]
    torch.testing.assert_close(sum(per_rank), full, rtol=1e-5, atol=1e-4)


def test_fake_quantized_activation_equals_weight_quantization_math() -> None:
    torch.manual_seed(4)
    x = torch.randn(8, 64) * 3
    x[0, :16] = 0  # all-zero block
    divisor = x.abs().amax().double() / 2688
    expected = quantize(x, (1.0 / divisor).float()).dequantize()
    torch.testing.assert_close(fake_quantize_activation(x, divisor), expected, rtol=1e-6, atol=0)


def test_w4a4_emulation_stays_near_unquantized() -> None:
    torch.manual_seed(5)
    num_experts = 4
    spec = RoutingSpec("softmax_topk", num_experts, 2)
    hidden = torch.randn(TOKENS, HIDDEN)
    w13, w2 = torch.randn(num_experts, 2 * INTER, HIDDEN) * 0.2, torch.randn(num_experts, HIDDEN, INTER) * 0.2
    weights, ids = route(torch.randn(TOKENS, num_experts), spec)
    divisors = (torch.full((num_experts,), 8.0 / 2688, dtype=torch.float64),) * 2
    plain = moe_reference(hidden, weights, ids, w13, w2, spec)
    emulated = moe_reference(hidden, weights, ids, w13, w2, spec, activation_global_div=divisors)
    relative = (emulated - plain).norm() / plain.norm()
    assert 0 < relative < 0.25  # two FP4 activation roundings on tiny random layers: ~17%

"""`fp4kit.families.routing.route` against the routers of transformers 5.17 and on non-finite logits.

Oracles: `transformers/models/qwen3_moe/modeling_qwen3_moe.py` (Qwen3MoeTopKRouter),
`transformers/models/glm4_moe/modeling_glm4_moe.py` (Glm4MoeTopkRouter),
`transformers/models/minimax_m2/modeling_minimax_m2.py` (MiniMaxM2SparseMoeBlock's gate and correction bias),
`transformers/models/llama4/modeling_llama4.py` (Llama4Router), `transformers/models/gpt_oss/modeling_gpt_oss.py`
(GptOssMLP's router, with its bias). The non-finite rule follows vLLM's
`csrc/moe/topk_softmax_kernels.cu` fix (vllm-project/vllm#39391): zero non-finite scores before selection.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4kit.errors import Fp4kitError
from fp4kit.families.routing import RoutingSpec, route

HIDDEN = 32


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_softmax_topk_matches_qwen3_router(norm_topk_prob: bool) -> None:
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight, std=0.5)
    hidden = torch.randn(64, HIDDEN)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = route(logits, RoutingSpec("softmax_topk", 16, 4, renormalize=norm_topk_prob))
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights)


@pytest.mark.parametrize(
    ("n_group", "topk_group", "norm", "scaling"), [(1, 1, True, 1.0), (4, 2, True, 2.5), (8, 3, False, 1.8)]
)
def test_sigmoid_grouped_topk_matches_glm4_router(n_group: int, topk_group: int, norm: bool, scaling: float) -> None:
    from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = Glm4MoeConfig(
        hidden_size=HIDDEN,
        n_routed_experts=32,
        num_experts_per_tok=6,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scaling,
    )
    router = Glm4MoeTopkRouter(config)
    torch.manual_seed(1)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.copy_(torch.randn(32) * 0.3)
    hidden = torch.randn(64, HIDDEN)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    spec = RoutingSpec("sigmoid_grouped_topk", 32, 6, norm, n_group, topk_group, scaling)
    weights, ids = route(logits, spec, router.e_score_correction_bias)
    # transformers selects with sorted=False: compare as sets, weights up to the summation order of the denominator.
    weights, ids = _sorted_by_id(weights, ids)
    hf_weights, hf_ids = _sorted_by_id(hf_weights, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=0)


@pytest.mark.parametrize("top_k", [1, 8])
def test_sigmoid_grouped_topk_matches_minimax_m2_moe_block(top_k: int) -> None:
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock

    config = MiniMaxM2Config(hidden_size=HIDDEN, intermediate_size=16, num_local_experts=32, num_experts_per_tok=top_k)
    block = MiniMaxM2SparseMoeBlock(config)
    torch.manual_seed(4)
    torch.nn.init.normal_(block.gate.weight, std=0.5)
    block.e_score_correction_bias.copy_(torch.randn(32) * 0.3)  # wide enough to change the choice of experts
    hidden = torch.randn(64, HIDDEN)
    with torch.no_grad():
        logits, hf_weights, hf_ids = block.gate(hidden, block.e_score_correction_bias)
    weights, ids = route(logits, RoutingSpec("sigmoid_grouped_topk", 32, top_k), block.e_score_correction_bias)
    unbiased = torch.topk(torch.sigmoid(logits), top_k, dim=-1).indices.sort(dim=-1).values
    weights, ids = _sorted_by_id(weights, ids)
    hf_weights, hf_ids = _sorted_by_id(hf_weights, hf_ids)
    assert torch.equal(ids, hf_ids)
    assert top_k == 1 or not torch.equal(ids, unbiased)  # the bias did select other experts somewhere
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=0)


@pytest.mark.parametrize("top_k", [1, 4])
def test_topk_softmax_matches_gpt_oss_router(top_k: int) -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=16, num_local_experts=32, num_experts_per_tok=top_k)
    mlp = GptOssMLP(config)
    torch.manual_seed(5)
    torch.nn.init.normal_(mlp.router.weight, std=0.5)
    torch.nn.init.normal_(mlp.router.bias, std=0.5)
    hidden = torch.randn(64, HIDDEN)
    with torch.no_grad():
        logits, hf_weights, hf_ids = mlp.router(hidden)
    weights, ids = route(logits, RoutingSpec("topk_softmax", 32, top_k))
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=0)


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_matches_llama4_router(top_k: int) -> None:
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    config = Llama4TextConfig(hidden_size=HIDDEN, num_local_experts=16, num_experts_per_tok=top_k)
    router = Llama4Router(config)
    torch.manual_seed(2)
    hidden = torch.randn(64, HIDDEN)
    with torch.no_grad():
        hf_scores, logits = router(hidden)
    weights, ids = route(logits, RoutingSpec("llama4_sigmoid_top1", 16, top_k))
    # Llama4Router returns dense [T, E] scores: sigmoid(logit) on the chosen experts, 0 elsewhere.
    # torch's CPU sigmoid may differ by one ulp between its vectorized body and scalar tail: fp32 level.
    dense = torch.zeros_like(hf_scores).scatter_(1, ids, weights)
    torch.testing.assert_close(dense, hf_scores, rtol=2e-7, atol=0)
    assert torch.equal(ids, torch.topk(logits, top_k, dim=1).indices)


SPECS = [
    RoutingSpec("softmax_topk", 16, 4),
    RoutingSpec("softmax_topk", 8, 8, renormalize=False),
    RoutingSpec("sigmoid_grouped_topk", 32, 6, True, 4, 2, 2.5),
    RoutingSpec("sigmoid_grouped_topk", 16, 3, False, 1, 1, 1.0),
    RoutingSpec("llama4_sigmoid_top1", 16, 1),
    RoutingSpec("topk_softmax", 16, 4),
]
SPECIALS = st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, 1e30, -1e30, 3.0])


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from(SPECS), data=st.data())
def test_non_finite_rows_give_distinct_ids_and_finite_weights(spec: RoutingSpec, data: st.DataObject) -> None:
    rows = data.draw(
        st.lists(st.lists(SPECIALS, min_size=spec.num_experts, max_size=spec.num_experts), min_size=1, max_size=4)
    )
    logits = torch.tensor(rows, dtype=torch.float32)
    logits[0] = float("nan")  # always one all-NaN row (CUDA-graph padding)
    bias = torch.randn(spec.num_experts) if spec.kind == "sigmoid_grouped_topk" else None
    weights, ids = route(logits, spec, bias)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (len(rows), spec.top_k)
    assert bool(((ids >= 0) & (ids < spec.num_experts)).all())
    assert all(len(set(row.tolist())) == spec.top_k for row in ids)
    assert bool(torch.isfinite(weights).all())


def test_all_nan_row_picks_lowest_ids() -> None:
    logits = torch.full((2, 8), float("nan"))
    weights, ids = route(logits, RoutingSpec("softmax_topk", 8, 3))
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert bool((weights == 0).all())


def test_valid_rows_unaffected_by_nan_rows() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, 16)
    spec = RoutingSpec("softmax_topk", 16, 4)
    clean = route(logits, spec)
    poisoned = logits.clone()
    poisoned[2] = float("nan")
    poisoned[4, 3] = float("inf")
    weights, ids = route(poisoned, spec)
    keep = [0, 1, 3, 5]
    assert torch.equal(ids[keep], clean[1][keep])
    assert torch.equal(weights[keep], clean[0][keep])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "softmax_topk", "num_experts": 4, "top_k": 5},
        {"kind": "topk", "num_experts": 4, "top_k": 1},
        {"kind": "sigmoid_grouped_topk", "num_experts": 10, "top_k": 2, "n_group": 4},
        {"kind": "sigmoid_grouped_topk", "num_experts": 8, "top_k": 5, "n_group": 4, "topk_group": 2},
    ],
)
def test_bad_specs_are_rejected(kwargs: dict) -> None:
    with pytest.raises(Fp4kitError):
        RoutingSpec(**kwargs)


def test_bias_outside_grouped_kind_is_rejected() -> None:
    with pytest.raises(Fp4kitError):
        route(torch.zeros(1, 4), RoutingSpec("softmax_topk", 4, 2), torch.zeros(4))

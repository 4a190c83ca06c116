"""The deepseek_v3 family (DeepSeek-V3/R1, Kimi-K2): routing against transformers 5.17's DeepseekV3TopkRouter
(`models/deepseek_v3/modeling_deepseek_v3.py`, the gate of DeepseekV3MoE), what is quantized by default (vLLM's
`model_executor/models/deepseek_v2.py` builds every MLA projection with the quant config, q_a_proj and
kv_a_proj_with_mqa fused as `fused_qkv_a_proj`), and the output of the tiny fixture."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from fp4kit.checkpoint import CheckpointReader
from fp4kit.errors import Fp4kitError
from fp4kit.families import detect
from fp4kit.plan import build_plan
from fp4kit.routing import route

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


@pytest.mark.parametrize(("experts", "top_k", "n_group", "topk_group", "norm", "scaling"),
                         [(64, 8, 8, 4, True, 2.5),  # DeepSeek-V3's shape of routing (256 experts, 8 groups, 4 kept)
                          (48, 8, 1, 1, True, 2.827),  # Kimi-K2: no groups
                          (32, 4, 4, 2, False, 1.0)])
def test_routing_matches_deepseek_v3_router_nan_rows_included(experts, top_k, n_group, topk_group, norm, scaling):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=experts, num_experts_per_tok=top_k, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scaling)
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(experts)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.copy_(torch.randn(experts) * 0.3)
    hidden = torch.randn(96, 32)
    hidden[[5, 40]] = float("nan")  # padding rows of a CUDA graph
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    spec = detect(config.to_dict()).routing(config.to_dict())
    assert (spec.num_experts, spec.top_k, spec.n_group, spec.topk_group) == (experts, top_k, n_group, topk_group)
    weights, ids = route(logits, spec, router.e_score_correction_bias)
    valid = torch.isfinite(logits).all(dim=1)
    assert int((~valid).sum()) == 2
    # transformers selects with sorted=False: compare as sets, weights up to the summation order of the denominator
    weights_v, ids_v = _sorted_by_id(weights[valid], ids[valid])
    hf_weights_v, hf_ids_v = _sorted_by_id(hf_weights[valid], hf_ids[valid])
    assert torch.equal(ids_v, hf_ids_v)
    torch.testing.assert_close(weights_v, hf_weights_v, rtol=1e-6, atol=0)
    assert all(len(set(row.tolist())) == top_k for row in ids[~valid])
    assert bool(torch.isfinite(weights).all()) and bool(((ids >= 0) & (ids < experts)).all())


def test_kimi_k2_is_deepseek_v3_and_other_scoring_is_refused():
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(n_routed_experts=16, num_experts_per_tok=2, n_group=1, topk_group=1).to_dict()
    assert detect({**config, "model_type": "kimi_k2"}).name == "deepseek_v3"
    with pytest.raises(Fp4kitError, match="scoring_func 'softmax'"):
        detect(config).check_config({**config, "scoring_func": "softmax"}, {})


def test_default_plan_quantizes_mla_mlps_and_experts(tiny):
    src = tiny("deepseek_v3")
    config = json.loads((src / "config.json").read_text())
    with CheckpointReader(src) as reader:
        plan = build_plan(reader, config)
    quantized = {c.linear.module for g in plan.groups for c in g.members}
    layer1 = "model.layers.1."
    for module in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj", "self_attn.kv_b_proj",
                   "self_attn.o_proj", "mlp.shared_experts.gate_proj", "mlp.experts.7.down_proj"):
        assert layer1 + module in quantized, module
    assert "model.layers.0.mlp.gate_proj" in quantized  # the dense layer
    assert not any(m.endswith("mlp.gate") or m.startswith("model.layers.3.") or m == "lm_head" for m in quantized)
    fused = [sorted(c.linear.module.rsplit(".", 1)[1] for c in g.members) for g in plan.groups
             if g.members[0].linear.module.startswith(layer1 + "self_attn.")]
    assert ["kv_a_proj_with_mqa", "q_a_proj"] in fused  # one global scale: vLLM's fused_qkv_a_proj


def test_output_shares_fused_qkv_a_scale_and_keeps_router_bias(tiny, tiny_nvfp4a16):
    src, out = tiny("deepseek_v3"), tiny_nvfp4a16("deepseek_v3")
    attn = "model.layers.2.self_attn."
    with safe_open(out / "model.safetensors", "pt") as q, safe_open(src / "model.safetensors", "pt") as s:
        assert torch.equal(q.get_tensor(attn + "q_a_proj.weight_global_scale"),
                           q.get_tensor(attn + "kv_a_proj_with_mqa.weight_global_scale"))
        assert q.get_tensor(attn + "kv_a_proj_with_mqa.weight_packed").shape == (80, 32)  # kv_lora_rank + rope rows
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert q.get_tensor(bias).dtype == torch.float32 and torch.equal(q.get_tensor(bias), s.get_tensor(bias))
        assert q.get_tensor("model.layers.3.mlp.experts.0.gate_proj.weight").dtype == torch.bfloat16  # MTP kept

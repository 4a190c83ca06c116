"""Qwen3-VL-MoE: text model under `model.language_model`, fused transposed experts [E, H, 2I] / [E, I, H]."""

from fp4kit.families import qwen3_moe
from fp4kit.families.base import Family, sub_config

FAMILY = Family(
    name="qwen3_vl_moe",
    model_types=("qwen3_vl_moe",),
    text_config=sub_config,
    num_experts=qwen3_moe.num_experts,
    routing=qwen3_moe.routing,
    ignore=lambda config: [r"mlp\.gate$", r"(^|\.)visual\."],
    hf_fused_experts=True,
)

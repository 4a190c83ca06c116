"""Llama-4 (Scout, Maverick; multimodal and text-only): fused BMM experts [E, H, 2I], top-1 sigmoid router whose
score scales the expert input, shared expert, vision tower and projector kept in bf16."""

import dataclasses

from fp4kit.families.base import Family, sub_config


def routing(tc: dict):
    from fp4kit.families.routing import RoutingSpec

    return RoutingSpec("llama4_sigmoid_top1", int(tc["num_local_experts"]), int(tc.get("num_experts_per_tok") or 1))


def moe_modules():
    from fp4kit.families.moe_modules import BMM_EXPERTS

    return BMM_EXPERTS  # transformers' Llama4TextExperts: BMM layout [E, H, 2I] / [E, I, H]


FAMILY = Family(
    name="llama4",
    model_types=("llama4",),
    text_config=sub_config,
    num_experts=lambda tc: int(tc["num_local_experts"]),
    routing=routing,
    ignore=lambda config: [r"feed_forward\.router$", r"(^|\.)vision_model\.", r"(^|\.)multi_modal_projector\."],
    moe_intermediate=lambda tc: int(tc["intermediate_size"]),
    modelopt_fused_experts=True,
    hf_fused_experts=True,
    moe_modules=moe_modules,
)

# Llama4ForCausalLM: vLLM 0.33's text-only loader (models/llama4.py, Llama4Model.load_moe_expert_weights) maps fused
# expert tensors only onto `w13_weight` / `w2_weight`, so a fused ModelOpt scale name raises KeyError there; it reads
# per-expert `experts.{e}.{gate,up,down}_proj.*` tensors, which the ModelOpt dialect then writes.
TEXT_FAMILY = dataclasses.replace(FAMILY, model_types=("llama4_text",), modelopt_fused_experts=False)

"""Llama-4 (Scout, Maverick; multimodal and text-only): fused BMM experts [E, H, 2I], top-1 sigmoid router whose
score scales the expert input, shared expert, vision tower and projector kept in bf16."""

from fp4kit.families.base import Family, sub_config


def routing(tc: dict):
    from fp4kit.routing import RoutingSpec

    return RoutingSpec("llama4_sigmoid_top1", int(tc["num_local_experts"]), int(tc.get("num_experts_per_tok") or 1))


FAMILY = Family(
    name="llama4",
    model_types=("llama4", "llama4_text"),
    text_config=sub_config,
    num_experts=lambda tc: int(tc["num_local_experts"]),
    routing=routing,
    ignore=lambda config: [r"feed_forward\.router$", r"(^|\.)vision_model\.", r"(^|\.)multi_modal_projector\."],
    moe_intermediate=lambda tc: int(tc["intermediate_size"]),
    modelopt_fused_experts=True,
    hf_fused_experts=True,
)

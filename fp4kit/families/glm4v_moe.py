"""GLM-4.5V: GLM-4.5-Air's text model under `model.language_model`, plus a vision tower kept in bf16."""

from fp4kit.families import glm4_moe
from fp4kit.families.base import Family, sub_config

FAMILY = Family(
    name="glm4v_moe",
    model_types=("glm4v_moe",),
    text_config=sub_config,
    num_experts=lambda tc: int(tc["n_routed_experts"]),
    routing=glm4_moe.routing,
    ignore=lambda config: [*glm4_moe.ignore(config), r"(^|\.)visual\."],
    extra_layers=glm4_moe.mtp_layers,
)

"""Model families, detected from config.json."""

from fp4kit.errors import Fp4kitError
from fp4kit.families import (
    deepseek_v3,
    deepseek_v4,
    deepseek_v32,
    glm4_moe,
    glm4_moe_lite,
    glm4v_moe,
    glm_moe_dsa,
    gpt_oss,
    llama4,
    minimax_m2,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
    qwen3_vl_moe,
)
from fp4kit.families.base import Family

FAMILIES: tuple[Family, ...] = (*(m.FAMILY for m in (qwen3_moe, qwen3_vl_moe, glm4_moe, glm4v_moe, llama4)),
                                 llama4.TEXT_FAMILY, deepseek_v3.FAMILY,
                                 glm4_moe_lite.FAMILY,
                                 deepseek_v32.FAMILY,
                                 glm_moe_dsa.FAMILY,
                                 qwen3_next.FAMILY,
                                 qwen3_5_moe.FAMILY,
                                 minimax_m2.FAMILY,
                                 gpt_oss.FAMILY,
                                 deepseek_v4.FAMILY,
                                 )


def detect(config: dict) -> Family:
    model_type = config.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = ", ".join(t for f in FAMILIES for t in f.model_types)
    archs = ",".join(config.get("architectures") or []) or "?"
    raise Fp4kitError(f"unsupported architecture: model_type {model_type!r} ({archs}); fp4kit knows {known}")

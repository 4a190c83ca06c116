"""DeepSeek-V3 / R1 / V3.1 and Kimi-K2 (``model_type: kimi_k2``, the DeepSeek-V3 architecture): MLA attention, first
``first_k_dense_replace`` layers dense, one shared expert, sigmoid router with ``e_score_correction_bias`` (fp32) and
grouped top-k, MTP layers after the decoder layers.

Quantized by default: every MLA projection (vLLM's deepseek_v2.py builds q_a_proj + kv_a_proj_with_mqa as one
``fused_qkv_a_proj``, q_b_proj / q_proj, kv_b_proj and o_proj with the checkpoint's quant config), the dense and
shared MLPs and the routed experts. Kept: lm_head, the router ``mlp.gate`` and the MTP layers (the engines' drafters
load them as the source stores them; from a quantized source they are written dequantized).
"""

from fp4kit.errors import Fp4kitError
from fp4kit.families import glm4_moe
from fp4kit.families.base import Family


def routing(tc: dict):
    scoring = tc.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise Fp4kitError(f"scoring_func {scoring!r}; the DeepSeek-V3 router fp4kit knows scores with sigmoid")
    # transformers' DeepseekV3TopkRouter: the routing of GLM-4.5 (sigmoid, bias to select, grouped top-k)
    return glm4_moe.routing(tc)


def mtp_layers(tc: dict) -> int:
    return int(tc.get("num_nextn_predict_layers") or 0)


def ignore(config: dict) -> list[str]:
    tc = config.get("text_config") or config
    first_mtp, count = int(tc["num_hidden_layers"]), mtp_layers(tc)
    kept = [r"mlp\.gate$"]
    if count:
        kept.append(rf"layers\.({'|'.join(str(first_mtp + i) for i in range(count))})\.")
    return kept


FAMILY = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3", "kimi_k2"),
    text_config=lambda config: config,
    num_experts=lambda tc: int(tc["n_routed_experts"]),
    routing=routing,
    ignore=ignore,
    extra_layers=mtp_layers,
    mla_attention=True,
)

"""GLM-4.7-Flash (``model_type: glm4_moe_lite``): DeepSeek-V3's MLA attention (transformers 5.17's
`Glm4MoeLiteAttention` is `DeepseekV3Attention`) over GLM-4.5's MoE (`Glm4MoeLiteMoE` is `Glm4MoeMoE`: fp32 sigmoid
router with ``e_score_correction_bias``, grouped top-k, routed scaling, one shared expert). Which layers are dense
comes from ``mlp_layer_types`` (transformers; default: the first one) and, for vLLM 0.33's `glm4_moe_lite.py`, from
``first_k_dense_replace``; routed experts are stored one module per expert. The MTP layer sits after the decoder
layers (``model.layers.{num_hidden_layers}``, which `Glm4MoeLitePreTrainedModel` drops on load and vLLM's
`glm4_moe_lite_mtp.py` drafts with: ``num_nextn_predict_layers``, one when the config does not say, as GLM-4.5's).

Quantized by default: the MLA projections (vLLM builds q_a_proj + kv_a_proj_with_mqa as one ``fused_qkv_a_proj``,
q_b_proj, kv_b_proj and o_proj with the quant config), the dense and shared MLPs and the routed experts. Kept: lm_head,
the router ``mlp.gate`` (vLLM builds it as a GateLinear without quant config, fp32) and the MTP layer, as GLM-4.5's
(fp4kit.families.glm4_moe).
"""

from fp4kit.families import glm4_moe
from fp4kit.families.base import Family

FAMILY = Family(
    name="glm4_moe_lite",
    model_types=("glm4_moe_lite",),
    text_config=lambda config: config,
    num_experts=lambda tc: int(tc["n_routed_experts"]),
    routing=glm4_moe.routing,
    ignore=glm4_moe.ignore,
    extra_layers=glm4_moe.mtp_layers,
    mla_attention=True,
)

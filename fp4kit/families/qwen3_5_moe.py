"""Qwen3.5-MoE and Qwen3.6-MoE (Qwen3.5-397B-A17B, Qwen3.6-35B-A3B; `Qwen3_5MoeForConditionalGeneration`, and the
text-only `qwen3_5_moe_text`): the Qwen3-Next hybrid (fp4kit.families.qwen3_next: Gated DeltaNet : gated full
attention, per-expert routed experts on disk, shared expert with its gate, an `mtp.*` block transformers does not
load) with the text model under `model.language_model.` and a vision tower `model.visual.*`. Gated DeltaNet stores
its input projections unfused (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`; vLLM 0.33 fuses them into
`in_proj_qkvz` / `in_proj_ba`), and the router always renormalizes its top-k (`Qwen3_5MoeTopKRouter`; the config has
no norm_topk_prob).

Kept as the source stores them, besides Qwen3-Next's (routers, shared-expert gate, `linear_attn.*`, `mtp.*`): the
vision tower, as every published NVFP4 export does (ModelOpt `*visual*` disabled; e.g. the ModelOpt export
natfii/Qwen3.6-27B-VLM-NVFP4-MTP lists the vision blocks and the MTP modules in its ignore).
"""

from fp4kit.families import qwen3_next
from fp4kit.families.base import Family, sub_config


def routing(tc: dict):
    from fp4kit.families.routing import RoutingSpec

    return RoutingSpec("softmax_topk", qwen3_next.num_experts(tc), int(tc["num_experts_per_tok"]), renormalize=True)


FAMILY = Family(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    text_config=sub_config,
    num_experts=qwen3_next.num_experts,
    routing=routing,
    ignore=lambda config: [*qwen3_next.HYBRID_KEPT, r"(^|\.)visual\."],
    mtp_prefix="mtp.",
)

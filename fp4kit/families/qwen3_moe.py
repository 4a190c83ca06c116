"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-expert tensors, softmax top-k router `mlp.gate`."""

from fp4kit.families.base import Family


def num_experts(tc: dict) -> int:
    # transformers 5 writes num_local_experts where older Qwen3 configs say num_experts.
    return int(tc.get("num_experts") or tc["num_local_experts"])


def routing(tc: dict):
    from fp4kit.families.routing import RoutingSpec

    return RoutingSpec("softmax_topk", num_experts(tc), int(tc["num_experts_per_tok"]),
                       renormalize=bool(tc.get("norm_topk_prob", False)))


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    text_config=lambda config: config,
    num_experts=num_experts,
    routing=routing,
    ignore=lambda config: [r"mlp\.gate$", r"shared_expert_gate$"],
    awq_folds=True,
)

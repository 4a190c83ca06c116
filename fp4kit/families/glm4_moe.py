"""GLM-4.5 / GLM-4.5-Air: dense first layers, shared experts, fp32 sigmoid router with correction bias, MTP layer."""

from fp4kit.families.base import Family


def routing(tc: dict):
    from fp4kit.families.routing import RoutingSpec

    return RoutingSpec(
        "sigmoid_grouped_topk",
        int(tc["n_routed_experts"]),
        int(tc["num_experts_per_tok"]),
        renormalize=bool(tc.get("norm_topk_prob", True)),
        n_group=int(tc.get("n_group") or 1),
        topk_group=int(tc.get("topk_group") or 1),
        routed_scaling_factor=float(tc.get("routed_scaling_factor") or 1.0),
    )


def mtp_layers(tc: dict) -> int:
    return max(1, int(tc.get("num_nextn_predict_layers") or 1))


def ignore(config: dict) -> list[str]:
    tc = config.get("text_config") or config
    # The MTP (next-token prediction) layers sit after the decoder layers: indices num_hidden_layers and up.
    first_mtp = int(tc["num_hidden_layers"])
    mtp = "|".join(str(first_mtp + i) for i in range(mtp_layers(tc)))
    return [r"mlp\.gate$", rf"layers\.({mtp})\."]


FAMILY = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    text_config=lambda config: config,
    num_experts=lambda tc: int(tc["n_routed_experts"]),
    routing=routing,
    ignore=ignore,
    extra_layers=mtp_layers,
)

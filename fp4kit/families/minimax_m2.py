"""MiniMax-M2 / M2.1 / M2.5 / M2.7 (``model_type: minimax_m2``): every layer MoE (256 experts, top-8), no shared
expert, sigmoid router with a correction bias, full-width QK norm, partial RoPE; released as FP8 128x128 blocks.

Names on disk (transformers 5.17 ``conversion_mapping.py``: ``minimax_m2`` is loaded with Mixtral's renames,
``.block_sparse_moe.`` -> ``.mlp.``, experts ``w1`` and ``w3`` stacked into ``gate_up_proj`` in that order, ``w2``
into ``down_proj``, plus ``block_sparse_moe.e_score_correction_bias``): routed experts per expert as
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down) — vLLM 0.33's ``MiniMaxM2MoE`` builds them
with ``ckpt_names=("w1", "w2", "w3")``, FusedMoE's (gate, down, up) —, the router ``block_sparse_moe.gate`` and its
bias ``block_sparse_moe.e_score_correction_bias`` beside the experts (not inside the gate, as GLM's).

Routing (transformers' ``MiniMaxM2TopKRouter``, vLLM's FusedMoE with ``scoring_func`` sigmoid, ``renormalize=True``
and the bias when ``use_routing_bias``): ``sigmoid_grouped_topk`` with one group, always renormalized.

Kept in BF16 by default: the router (vLLM's ``GateLinear``, built without a quant config) and, as the published NVFP4
checkpoints do (nvidia/MiniMax-M2.5-NVFP4, ModelOpt's "nvfp4_experts_only" recipe; mconcat/MiniMax-M2.5-NVFP4;
TheHouseOfTheDude/MiniMax-M2.5 in compressed-tensors), the attention projections: only the routed experts are
quantized. vLLM would load a quantized ``qkv_proj`` / ``o_proj`` too (both take the quant config); ``--no-default-
ignore`` with the user's own ``--ignore`` does that. The MTP modules (config ``num_mtp_modules``, 3 in the
released M2.x configs) are stored as decoder layers past the last one, ``model.layers.{num_hidden_layers + i}.*``:
vLLM 0.33's ``MiniMaxM2Model`` drops that prefix and SGLang's ``get_spec_layer_idx_from_weight_name``
(``minimax_m2.py``) skips it for the main model; msModelSlim's M2.5 recipe keeps ``mtp_modules`` /
``mtp_transition`` unquantized. All of them stay as stored.
"""

import functools

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import Family
from fp4kit.families.grammar import ExpertGrammar

GRAMMAR = ExpertGrammar(gate="w1", up="w3", down="w2", routers=("gate",), router_bias="e_score_correction_bias",
                        shared_experts=())


def routing(tc: dict):
    from fp4kit.families.routing import RoutingSpec

    scoring = tc.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise Fp4kitError(f"scoring_func {scoring!r}; the MiniMax-M2 router fp4kit knows scores with sigmoid")
    if int(tc.get("shared_intermediate_size") or 0):
        raise Fp4kitError("shared_intermediate_size is not 0: transformers' MiniMax-M2 has no shared expert")
    return RoutingSpec("sigmoid_grouped_topk", int(tc["num_local_experts"]), int(tc["num_experts_per_tok"]))


def mtp_layers(tc: dict) -> int:
    return int(tc.get("num_mtp_modules") or 0)


def ignore(config: dict) -> list[str]:
    kept = [r"block_sparse_moe\.gate$", r"self_attn\.(q|k|v|o)_proj$", r"(^|\.)mtp_(modules|transition)\."]
    first_mtp, count = int(config["num_hidden_layers"]), mtp_layers(config)
    if count:
        kept.append(rf"layers\.({'|'.join(str(first_mtp + i) for i in range(count))})\.")
    return kept


@functools.cache
def moe_modules():
    from fp4kit.families.moe_modules import MoEModules

    # transformers' MiniMaxM2DecoderLayer holds the block as `mlp` (conversion_mapping.py renames it on load)
    return MoEModules(renames=(("mlp", "block_sparse_moe"),))


FAMILY = Family(
    name="minimax_m2",
    model_types=("minimax_m2",),
    text_config=lambda config: config,
    num_experts=lambda tc: int(tc["num_local_experts"]),
    routing=routing,
    ignore=ignore,
    moe_intermediate=lambda tc: int(tc["intermediate_size"]),
    extra_layers=mtp_layers,
    grammar=GRAMMAR,
    moe_modules=moe_modules,
)

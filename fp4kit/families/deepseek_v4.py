"""DeepSeek-V4 (``model_type: deepseek_v4``; V4-Flash, V4-Pro): every layer MoE with one shared expert, attention
with a low-rank query, one shared KV head, per-head sinks, a grouped low-rank output projection and, on compressed
layers, a KV compressor (and on CSA layers a lightning indexer); the residual is ``hc_mult`` streams mixed by
hyper-connections (``hc_*`` tensors). Released with FP4 routed experts and FP8 everything else quantized.

Names on disk (the release's, with no ``model.`` prefix: transformers 5.17 ``conversion_mapping.py`` "deepseek_v4"
renames them on load, vLLM 0.33 ``models/deepseek_v4/nvidia/model.py`` ``_make_deepseek_v4_weights_mapper`` maps
``layers.`` / ``embed.`` / ``mtp.`` into its model): ``embed.weight``, ``head.weight``, ``norm.weight``,
``hc_head_{fn,base,scale}``; per layer ``layers.L.attn.{wq_a,wq_b,wkv,wo_a,wo_b}``, ``attn.{q_norm,norm}``,
``attn.attn_sink``, ``attn.compressor.{wkv,wgate,norm,ape}``, ``attn.indexer.{wq_b,weights_proj}`` and
``attn.indexer.compressor.*``, ``layers.L.ffn.gate.weight`` with ``ffn.gate.bias`` (the selection bias) or, on the
first ``num_hash_layers`` layers (transformers: ``mlp_layer_types`` "hash_moe"), ``ffn.gate.tid2eid`` [vocab, top_k],
the routed experts ``ffn.experts.E.{w1,w3,w2}`` (gate, up, down) and ``ffn.shared_experts.{w1,w3,w2}``; the MTP
block (``num_nextn_predict_layers``) as ``mtp.N.*``, a decoder layer's names plus ``e_proj`` / ``h_proj`` and norms,
which transformers' classes do not load (``_keys_to_ignore_on_load_unexpected``).

Release precision (config ``quantization_config``: ``quant_method: fp8``, ``weight_block_size [128, 128]``,
``scale_fmt: ue8m0``; top-level ``expert_dtype: fp4``): routed experts int8 [N, K/2] E2M1 pairs with
``<m>.scale`` F8_E8M0 [N, K/32] (MXFP4); attention, indexer ``wq_b``, shared experts and MTP projections
F8_E4M3 with ``<m>.scale`` F8_E8M0 per 128x128 block; compressors, indexer ``weights_proj``, router, embeddings and
head bf16 (transformers' ``Fp8Dequantize`` reads both scale grids; fp4kit.io.sources reads them exactly).

Quantized by default: the routed experts only (from the FP4 release, the exact MXFP4 -> NVFP4 cast). vLLM 0.33 loads
NVFP4 DeepSeek-V4 experts beside FP8 attention and shared experts (``DeepseekV4FP8Config``, ``moe_quant_algo:
NVFP4``), so the rest stays in its source precision: written dequantized (bf16 from FP8 is exact), or, with
``quantize --source-config``, as the release stores it under the release's config (the form vLLM serves). Kept:
``head``, the router, the compressors and indexer (transformers keeps them out of FP8 quantization,
``_keep_in_fp32_modules``), the MTP block, and every attention and shared-expert projection.

Routing (transformers' ``DeepseekV4TopKRouter``): scores sqrt(softplus(logits)), top-k of scores + bias, weights the
chosen scores divided by their sum (+1e-20), times ``routed_scaling_factor`` (fp4kit.families.routing
``sqrtsoftplus_topk``); hash layers (``DeepseekV4HashRouter``) take the experts from ``tid2eid[token id]`` and weight
them the same way. Experts (``DeepseekV4Experts._apply_gate``): gate clamped from above and up to +-``swiglu_limit``,
then silu(gate) * up (fp4kit.families.activation ``silu_clamped``). Calibration and eval, which stream
transformers' decoder layers, refuse the family for now (``streams_layers``); data-free quantize, convert, layout,
shard, inspect and verify take it.
"""

from fp4kit.errors import Fp4kitError
from fp4kit.families.activation import silu_clamped
from fp4kit.families.base import Family
from fp4kit.families.grammar import ExpertGrammar

GRAMMAR = ExpertGrammar(gate="w1", up="w3", down="w2", routers=("gate",), router_bias="gate.bias",
                        shared_experts=("shared_experts",))
MTP_PREFIX = "mtp."
SCORING = "sqrtsoftplus"


def routing(tc: dict):
    from fp4kit.families.routing import RoutingSpec

    scoring = tc.get("scoring_func", SCORING)
    if scoring != SCORING:
        raise Fp4kitError(f"scoring_func {scoring!r}; the DeepSeek-V4 router fp4kit knows scores with {SCORING}")
    return RoutingSpec("sqrtsoftplus_topk", int(tc["n_routed_experts"]), int(tc["num_experts_per_tok"]),
                       renormalize=bool(tc.get("norm_topk_prob", True)),
                       routed_scaling_factor=float(tc.get("routed_scaling_factor", 1.0)))


def activation(tc: dict):
    limit = float(tc.get("swiglu_limit") or 10.0)
    if limit <= 0:
        raise Fp4kitError(f"config.json: swiglu_limit is {limit}, not a positive number")
    return silu_clamped(limit)


def ignore(config: dict) -> list[str]:
    return [r"(^|\.)head$", r"ffn\.gate$", r"attn\.(compressor|indexer)\.", r"attn\.w(q_a|q_b|kv|o_a|o_b)$",
            r"ffn\.shared_experts\."]


FAMILY = Family(
    name="deepseek_v4",
    model_types=("deepseek_v4",),
    text_config=lambda config: config,
    num_experts=lambda tc: int(tc["n_routed_experts"]),
    routing=routing,
    ignore=ignore,
    mtp_prefix=MTP_PREFIX,
    grammar=GRAMMAR,
    activation=activation,
    # its decoder layers run [B, S, hc_mult, H] streams, hash layers take the token ids, and the release's names are
    # not transformers' (conversion_mapping.py merges the experts): not streamed yet
    streams_layers=False,
    # vLLM 0.33 models/deepseek_v4/quant_config.py: DeepseekV4FP8Config serves `moe_quant_algo: NVFP4` routed experts
    # through ModelOpt's NVFP4 MoE method beside the release's FP8 Linears (quantize --source-config)
    source_config_moe_key="moe_quant_algo",
    mla_attention=True,
)

"""gpt-oss (``model_type: gpt_oss``; gpt-oss-20b / -120b as released, experts MXFP4, or as BF16 checkpoints, e.g.
transformers' own dequantized save): every layer MoE, no shared expert, a router Linear with a bias, top-k of its
logits then softmax over the k, experts with biases and a clamped SwiGLU, attention with biases and per-head sinks.
The release's ``gate_up_proj_blocks`` / ``_scales`` [E, 2I, H/32, 16] / [E, 2I, H/32] (and ``down_proj``'s) read as
the fused tensors below (fp4kit.io.sources ``FusedMxfp4``; docs/sources.md), and the cast keeps their values.

Names on disk (transformers 5.17 ``GptOssExperts``, no conversion mapping: what ``save_pretrained`` writes is what
the model holds): ``mlp.experts.gate_up_proj`` [E, H, 2I] K-major with gate and up *interleaved* along the output
features (``_apply_gate``: ``gate_up[..., ::2]``, ``gate_up[..., 1::2]``), ``gate_up_proj_bias`` [E, 2I] in the same
order, ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]; the router ``mlp.router`` (weight and bias); attention
``self_attn.{q,k,v,o}_proj`` (weights and biases) and ``self_attn.sinks`` [heads].

Activation (``_apply_gate``, vLLM 0.33's ``SwigluOAIAndMul`` / MoE activation "swigluoai"): gate clamped at 7 from
above, up to [-7, 7], (up + 1) * gate * sigmoid(1.702 gate); the released config states the limit as
``swiglu_limit``. Routing: ``GptOssTopKRouter`` (fp4kit.families.routing ``topk_softmax``).

Quantized by default: the routed experts (split per expert, de-interleaved into gate and up rows) and the attention
projections, whose Linears vLLM 0.33 builds with the quant config (``OAIAttention``: ``QKVParallelLinear``,
``RowParallelLinear``). Kept: lm_head, the router (vLLM's ``GateLinear`` takes no quant config), and as stored the
expert biases, the attention biases and sinks. vLLM 0.33 cannot load the result: docs/serving.md says why.
Calibration runs transformers' GptOssDecoderLayer (fp4kit.families.moe_modules.GptOssExperts: the interleaved rows,
the biases, ``_apply_gate``); verify computes the experts with their biases and activation (W4A16 mode).
"""

from fp4kit.errors import Fp4kitError
from fp4kit.families.activation import swiglu_oai
from fp4kit.families.base import Family
from fp4kit.families.grammar import ExpertGrammar

GRAMMAR = ExpertGrammar(interleaved=True, routers=("router",), shared_experts=())


def routing(tc: dict):
    from fp4kit.families.routing import RoutingSpec

    return RoutingSpec("topk_softmax", int(tc["num_local_experts"]), int(tc["num_experts_per_tok"]))


def activation(tc: dict):
    limit = float(tc.get("swiglu_limit") or 7.0)
    if limit <= 0:
        raise Fp4kitError(f"config.json: swiglu_limit is {limit}, not a positive number")
    return swiglu_oai(limit=limit)


def moe_modules():
    from fp4kit.families.moe_modules import GPT_OSS_EXPERTS

    return GPT_OSS_EXPERTS


FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    text_config=lambda config: config,
    num_experts=lambda tc: int(tc["num_local_experts"]),
    routing=routing,
    ignore=lambda config: [r"mlp\.router$"],
    moe_intermediate=lambda tc: int(tc["intermediate_size"]),
    grammar=GRAMMAR,
    activation=activation,
    hf_fused_experts=True,
    moe_modules=moe_modules,
)

"""Qwen3-Next (Qwen3-Next-80B-A3B, Qwen3-Coder-Next): hybrid decoder layers, 3 Gated DeltaNet (`linear_attn.*`) to 1
gated full attention (`self_attn.q_proj` carries the output gate: 2 x heads x head_dim rows), every layer an MoE block
with per-expert tensors on disk, a softmax top-k router `mlp.gate`, a shared expert and its sigmoid
`shared_expert_gate`; one MTP block (`mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.norm`, `mtp.layers.0.*`, a
full-attention MoE layer) which transformers' class does not load (`_keys_to_ignore_on_load_unexpected = ["^mtp.*"]`).

Quantized by default: full attention q/k/v/o (vLLM 0.33 fuses them into `qkv_proj`, built with the quant config),
the shared expert and the routed experts. Kept in the source precision, and why:
- `linear_attn.*`: the published NVFP4 exports of these hybrids keep Gated DeltaNet in BF16 (ModelOpt's
  `exclude_modules` lists `model.layers.<i>.linear_attn*` for every linear-attention layer, e.g.
  huggingface.co/FINAL-Bench/Darwin-9B-MFP4 hf_quant_config.json; the llm-compressor NVFP4 build
  Infatoshi/Qwen3.6-35B-A3B-NVFP4-FP8 keeps "DeltaNet linear-attention layers" BF16). vLLM 0.33 could load them
  either way (layers/mamba/gdn/qwen_gdn_linear_attn.py builds in_proj / out_proj with the quant config), so this
  follows the checkpoints.
- `mlp.gate` (vLLM's `GateLinear`, never quantized) and `shared_expert_gate` (qwen3_next.py builds it as a
  `ReplicatedLinear` with `quant_config=None`).
- `mtp.*`: published NVFP4 checkpoints store the MTP block BF16 (vLLM 0.33's qwen3_next_mtp.py forces `mtp.fc`
  unquantized under modelopt_fp4 for that reason), and the main model's loader drops `mtp.` (its
  `hf_to_vllm_mapper` maps the prefix to None): the drafter reads it as stored. `--mtp quantize` quantizes its
  routed experts like a decoder layer's (the drafter builds its MoE with the checkpoint's quant config); weight-only,
  since no calibration forward reaches the block.
"""

from fp4kit.families.base import Family

# what every Qwen hybrid keeps (module docstring): routers, the shared-expert gate, Gated DeltaNet; the MTP block
# (`mtp_prefix`) is kept by Family.default_ignore
HYBRID_KEPT = (r"mlp\.gate$", r"shared_expert_gate$", r"(^|\.)linear_attn\.")


def num_experts(tc: dict) -> int:
    return int(tc["num_experts"])


def routing(tc: dict):
    from fp4kit.families.routing import RoutingSpec

    # Qwen3NextTopKRouter: softmax in fp32, top-k, divided by the k probabilities' sum when norm_topk_prob
    return RoutingSpec("softmax_topk", num_experts(tc), int(tc["num_experts_per_tok"]),
                       renormalize=bool(tc.get("norm_topk_prob", True)))


FAMILY = Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    text_config=lambda config: config,
    num_experts=num_experts,
    routing=routing,
    ignore=lambda config: list(HYBRID_KEPT),
    mtp_prefix="mtp.",
)

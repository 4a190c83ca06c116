"""DeepSeek-V3.2 (``model_type: deepseek_v32``): DeepSeek-V3 (MLA, the first ``first_k_dense_replace`` layers dense,
sigmoid router with fp32 ``e_score_correction_bias`` and grouped top-k, one shared expert, the MTP layer after the
decoder layers) plus DeepSeek Sparse Attention: every attention holds a lightning indexer ``self_attn.indexer``
(``wq_b`` [index_n_heads * index_head_dim, q_lora_rank], ``wk`` [index_head_dim, hidden], ``k_norm`` a LayerNorm,
``weights_proj`` [index_n_heads, hidden]; transformers 5.17's `DeepseekV32Indexer`) that picks the ``index_topk``
keys each query attends to. The official release is FP8-block: wq_b and wk e4m3 with ``weight_scale_inv``,
weights_proj bf16, k_norm fp32 (its safetensors index; vLLM's `_try_load_fp8_indexer_wk` reads wk so).

Kept by default, beside DeepSeek-V3's kept modules (lm_head, the router ``mlp.gate``, the MTP layer): the whole
indexer. vLLM 0.33 (`deepseek_v2.py`, `Indexer`) fuses wk and weights_proj into ``wk_weights_proj`` built with
``quant_config=None`` (an FP8 wk is upcast to bf16 while loading), so neither may be NVFP4; wq_b could take the quant
config, but the indexer only ranks keys for a top-k, and published NVFP4 conversions keep it (eousphoros/
DeepSeek-V3.2-NVFP4's model card: weights_proj and k_norm; nvidia/DeepSeek-V3.2-NVFP4's exclude_modules is reported
to list ``self_attn.indexer*``, not read first-hand), so it stays in the source's precision too (dequantized to the
model's dtype when the source stores it FP8, as every kept Linear of a quantized source). transformers keeps
``indexer.weights_proj`` fp32 in memory (``_keep_in_fp32_modules``), which calibration follows.
"""

from fp4kit.families import deepseek_v3
from fp4kit.families.base import Family

INDEXER = r"self_attn\.indexer\."


def ignore(config: dict) -> list[str]:
    return [*deepseek_v3.ignore(config), INDEXER]


FAMILY = Family(
    name="deepseek_v32",
    model_types=("deepseek_v32",),
    text_config=lambda config: config,
    num_experts=lambda tc: int(tc["n_routed_experts"]),
    routing=deepseek_v3.routing,
    ignore=ignore,
    extra_layers=deepseek_v3.mtp_layers,
    mla_attention=True,
)

"""GLM-5 / GLM-5.1 (``model_type: glm_moe_dsa``): DeepSeek-V3.2's architecture (MLA with a DSA lightning indexer
``self_attn.indexer``, the first ``first_k_dense_replace`` layers dense, fp32 sigmoid router with
``e_score_correction_bias``, one shared expert, the MTP layer ``model.layers.{num_hidden_layers}``) with GLM's choices:
no expert groups, interleaved RoPE in the indexer, and cross-layer top-k sharing. transformers 5.17's
`GlmMoeDsaConfig.indexer_types` (from ``index_topk_freq`` / ``index_skip_topk_offset`` or ``index_topk_pattern``;
every layer "full" by default) marks "shared" layers, which build no indexer and reuse the previous full layer's top-k:
`GlmMoeDsaDecoderLayer` takes ``prev_topk_indices`` and returns (hidden states, top-k indices); ``TopkCarry`` lets the
layer-streaming passes run it one layer at a time. MTP layers: ``num_nextn_predict_layers``, one when the config does
not say (GLM-5's `GlmMoeDsaPreTrainedModel` drops ``model.layers.78.*`` on load). A checkpoint may ship indexer
weights for layers that build none (vLLM 0.33's `deepseek_v2.py` load_weights drops those); they reach DST unchanged.

Kept by default, as DeepSeek-V3.2's (fp4kit.families.deepseek_v32): lm_head, the router ``mlp.gate``, the indexer
(vLLM builds its wk + weights_proj as one ``wk_weights_proj`` without quant config) and the MTP layer (vLLM's drafter
loads it; the published CortexLM/GLM-5.1-NVFP4-MTP keeps it BF16, lukealonso/GLM-5-NVFP4 quantizes only the routed
experts).
"""

from __future__ import annotations

import weakref

from fp4kit.errors import Fp4kitError
from fp4kit.families import deepseek_v32, glm4_moe
from fp4kit.families.base import Family


class TopkCarry:
    """Runs `GlmMoeDsaDecoderLayer`s as hidden -> hidden, one layer at a time: each call's top-k indices are kept
    beside (a weak reference to) the hidden states it returned and handed to the layer that gets those hidden states
    next as ``prev_topk_indices``; the model's own layer loop unpacks (hidden, top-k) from its stand-ins. One carry
    per streamed model: the indices of a batch live as long as that batch's hidden states."""

    def __init__(self) -> None:
        self._carried: dict[int, tuple[weakref.ref, object]] = {}

    def stand_in_output(self, hidden_states: object) -> tuple[object, None]:
        return hidden_states, None

    def adapt(self, layers: list) -> None:
        for index, layer in enumerate(layers):
            layer.forward = self._forward(layer.forward, index, bool(getattr(layer.self_attn, "skip_topk", False)))

    def _forward(self, run, index: int, shared: bool):
        carried = self._carried

        def forward(hidden_states, *args, **kwargs):
            kwargs.pop("prev_topk_indices", None)  # what the recording pass saw: None
            entry = carried.get(id(hidden_states))
            previous = entry[1] if entry is not None and entry[0]() is hidden_states else None
            if shared and previous is None:
                raise Fp4kitError(f"config.json: indexer_types makes layer {index} share the top-k of an earlier "
                                  "layer, but no earlier layer runs an indexer")
            output, topk = run(hidden_states, *args, prev_topk_indices=previous, **kwargs)
            key = id(output)
            carried[key] = (weakref.ref(output, lambda _: carried.pop(key, None)), topk)
            return output

        return forward


FAMILY = Family(
    name="glm_moe_dsa",
    model_types=("glm_moe_dsa",),
    text_config=lambda config: config,
    num_experts=lambda tc: int(tc["n_routed_experts"]),
    routing=glm4_moe.routing,
    ignore=lambda config: [*glm4_moe.ignore(config), deepseek_v32.INDEXER],
    extra_layers=glm4_moe.mtp_layers,
    layer_call=TopkCarry,
    mla_attention=True,
)

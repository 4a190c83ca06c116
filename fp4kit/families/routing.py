"""MoE routing: router logits -> (weights, expert ids), one function for every supported family.

Semantics, as read from transformers 5.17 (`models/{qwen3_moe,glm4_moe,deepseek_v3,minimax_m2,llama4,gpt_oss}/
modeling_*.py`):

- ``softmax_topk`` (Qwen3-MoE, Qwen3-VL-MoE; `Qwen3MoeTopKRouter`): softmax over all experts in fp32, top-k,
  divide by the sum of the k probabilities when ``renormalize`` (config ``norm_topk_prob``).
- ``sigmoid_grouped_topk`` (GLM-4.5, `Glm4MoeTopkRouter`; DeepSeek-V3 and Kimi-K2, `DeepseekV3TopkRouter`, the same
  computation): scores = sigmoid(fp32 logits); selection uses
  scores + ``e_score_correction_bias``; experts are split into ``n_group`` groups, a group's score is the sum of its
  two best biased scores, only the ``topk_group`` best groups compete; the weights are the *unbiased* scores of the
  chosen experts, divided by (their sum + 1e-20) when ``renormalize``, then times ``routed_scaling_factor``.
- ``llama4_sigmoid_top1`` (Llama-4; `Llama4Router`): top-k (k = 1 in every released model) on the raw logits, weight
  = sigmoid(logit); never renormalized (``renormalize`` is ignored). The weight scales the expert *input*
  (`fp4kit.verify.reference.moe_reference` does that), not the output.
- ``sqrtsoftplus_topk`` (DeepSeek-V4; `DeepseekV4TopKRouter`, transformers' `SqrtSoftplusActivation`): scores =
  sqrt(softplus(fp32 logits)); selection uses scores + ``e_score_correction_bias`` (stored as the gate's ``bias``);
  the weights are the chosen unbiased scores, divided by (their sum + 1e-20) when ``renormalize``, times
  ``routed_scaling_factor``. Its hash layers (`DeepseekV4HashRouter`) choose the experts by token id
  (``tid2eid``), which a reference given only router logits does not have: routed by score like the other layers.
- ``topk_softmax`` (gpt-oss; `GptOssTopKRouter`): top-k on the raw logits (the router Linear has a bias, which the
  logits include), then softmax over the k chosen logits only; ``renormalize`` is ignored (the weights sum to 1).

Robustness (as vLLM's topk_softmax fix): non-finite selection scores are replaced by 0 before selection,
and ties are broken towards the lowest expert id, so a row of NaN/±Inf logits still yields k distinct ids in [0, E)
and finite weights; a renormalization over a zero sum gives zero weights instead of NaN.
``routed_scaling_factor`` multiplies the weights of every kind (1.0 unless a config says otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from fp4kit.errors import Fp4kitError

RoutingKind = Literal["softmax_topk", "sigmoid_grouped_topk", "llama4_sigmoid_top1", "topk_softmax",
                      "sqrtsoftplus_topk"]
_KINDS = ("softmax_topk", "sigmoid_grouped_topk", "llama4_sigmoid_top1", "topk_softmax", "sqrtsoftplus_topk")
_BIASED = ("sigmoid_grouped_topk", "sqrtsoftplus_topk")  # kinds whose selection adds a score correction bias
# GLM scores a group by the sum of its best two biased scores (vLLM and transformers alike).
_GROUP_SCORE_TOP = 2


@dataclass(frozen=True)
class RoutingSpec:
    kind: RoutingKind
    num_experts: int
    top_k: int
    renormalize: bool = True  # Qwen3: config norm_topk_prob; GLM, DeepSeek: norm_topk_prob
    n_group: int = 1  # GLM, DeepSeek
    topk_group: int = 1  # GLM, DeepSeek
    routed_scaling_factor: float = 1.0  # GLM, DeepSeek

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise Fp4kitError(f"unknown routing kind {self.kind!r}; expected one of {', '.join(_KINDS)}")
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise Fp4kitError(f"top_k={self.top_k} must lie in [1, num_experts={self.num_experts}]")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise Fp4kitError(f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise Fp4kitError(f"topk_group={self.topk_group} must lie in [1, n_group={self.n_group}]")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise Fp4kitError(
                f"top_k={self.top_k} exceeds the {self.topk_group} selected groups of "
                f"{self.num_experts // self.n_group} experts"
            )

    @property
    def scales_input(self) -> bool:
        """True when the routing weight multiplies the expert input rather than its output (Llama-4)."""
        return self.kind == "llama4_sigmoid_top1"


def _finite_or_zero(scores: Tensor) -> Tensor:
    return torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores))


def _topk_lowest_id_on_ties(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k of finite scores, descending; among equal scores the lower expert id wins (deterministic)."""
    values, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


def _renormalize(weights: Tensor, eps: float = 0.0) -> Tensor:
    total = weights.sum(dim=-1, keepdim=True) + eps
    return weights / torch.where(total > 0, total, torch.ones_like(total))


def route(logits: Tensor, spec: RoutingSpec, correction_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Route [T, E] router logits: (weights fp32 [T, k], expert ids int64 [T, k]), best expert first.

    ``correction_bias`` ([E], GLM's ``e_score_correction_bias``) is used only with ``sigmoid_grouped_topk`` and
    ``sqrtsoftplus_topk``.
    """
    if logits.dim() != 2 or logits.shape[1] != spec.num_experts:
        raise Fp4kitError(f"router logits must be [T, {spec.num_experts}], got {list(logits.shape)}")
    if correction_bias is not None and spec.kind not in _BIASED:
        raise Fp4kitError(f"a score correction bias is not part of {spec.kind} routing")
    logits = logits.to(torch.float32)
    if spec.kind == "softmax_topk":
        probs = _finite_or_zero(torch.softmax(logits, dim=-1))
        weights, ids = _topk_lowest_id_on_ties(probs, spec.top_k)
        if spec.renormalize:
            weights = _renormalize(weights)
    elif spec.kind == "sigmoid_grouped_topk":
        weights, ids = _grouped_topk(_finite_or_zero(torch.sigmoid(logits)), spec, correction_bias)
    elif spec.kind == "sqrtsoftplus_topk":
        scores = torch.sqrt(torch.nn.functional.softplus(logits))
        weights, ids = _grouped_topk(_finite_or_zero(scores), spec, correction_bias)
    elif spec.kind == "topk_softmax":
        top_logits, ids = _topk_lowest_id_on_ties(_finite_or_zero(logits), spec.top_k)
        weights = torch.softmax(top_logits, dim=-1)
    else:
        top_logits, ids = _topk_lowest_id_on_ties(_finite_or_zero(logits), spec.top_k)
        weights = torch.sigmoid(top_logits)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights.to(torch.float32), ids.to(torch.int64)


def _grouped_topk(scores: Tensor, spec: RoutingSpec, correction_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    num_tokens = scores.shape[0]
    choice = scores
    if correction_bias is not None:
        choice = _finite_or_zero(scores + _finite_or_zero(correction_bias.to(torch.float32)))
    if spec.n_group > 1:
        grouped = choice.view(num_tokens, spec.n_group, -1)
        group_scores = grouped.topk(min(_GROUP_SCORE_TOP, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        _, best_groups = _topk_lowest_id_on_ties(group_scores, spec.topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, -1)
        choice = choice.masked_fill(~keep, float("-inf"))
    _, ids = _topk_lowest_id_on_ties(choice, spec.top_k)
    weights = scores.gather(1, ids)
    if spec.renormalize:
        # transformers adds 1e-20 to the denominator; keeping it makes weights match to the last bit.
        weights = _renormalize(weights, eps=1e-20)
    return weights, ids

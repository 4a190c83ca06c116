"""The gated activation between a routed expert's two GEMMs, on the canonical halves of w13's output (gate rows
first, then up rows: the order fp4kit stores w13 in, whatever the family's checkpoint interleaves).

- ``silu`` (every family but gpt-oss and DeepSeek-V4): silu(gate) * up.
- ``silu_clamped`` (DeepSeek-V4; transformers `DeepseekV4Experts._apply_gate`, vLLM 0.33 `SiluAndMulWithClamp`): gate
  clamped from above at ``limit``, up clamped to [-limit, limit], then silu(gate) * up (config ``swiglu_limit``).
- ``swiglu_oai`` (gpt-oss; transformers 5.17 `GptOssExperts._apply_gate`, vLLM 0.33 `SwigluOAIAndMul`, the MoE
  activation "swigluoai"): gate clamped from above at ``limit``, up clamped to [-limit, limit], then
  (up + 1) * gate * sigmoid(alpha * gate). transformers holds alpha 1.702 and limit 7.0 as constants; the released
  config states the limit as ``swiglu_limit``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fp4kit.errors import Fp4kitError

if TYPE_CHECKING:  # torch-free to import: families are read by torch-free commands
    from torch import Tensor

ActivationKind = Literal["silu", "swiglu_oai", "silu_clamped"]
_KINDS = ("silu", "swiglu_oai", "silu_clamped")


@dataclass(frozen=True)
class ExpertActivation:
    kind: ActivationKind = "silu"
    alpha: float = 1.0  # swiglu_oai: the sigmoid's slope
    limit: float = float("inf")  # swiglu_oai, silu_clamped: the clamp

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise Fp4kitError(f"unknown expert activation {self.kind!r}; expected one of {', '.join(_KINDS)}")
        if not (self.alpha > 0 and self.limit > 0):
            raise Fp4kitError(f"expert activation {self.kind}: alpha {self.alpha} and limit {self.limit} must be > 0")

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        """fp32 intermediate from fp32 gate and up halves."""
        import torch
        import torch.nn.functional as F

        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        if self.kind == "silu_clamped":
            return F.silu(gate) * up
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SILU = ExpertActivation()


def swiglu_oai(limit: float = 7.0, alpha: float = 1.702) -> ExpertActivation:
    return ExpertActivation("swiglu_oai", alpha, limit)


def silu_clamped(limit: float) -> ExpertActivation:
    return ExpertActivation("silu_clamped", limit=limit)

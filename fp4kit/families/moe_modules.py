"""transformers' MoE modules as a family's classes hold and run them in memory (the layer-streaming model's view).

transformers 5 holds every supported family's routed experts as one experts module with fused parameters
``gate_up_proj`` (gate rows, then up rows) and ``down_proj``; what differs per family is stated by a ``MoEModules``
(``Family.moe_modules()``): the parameter layout (Qwen3 / GLM / DeepSeek [E, 2I, H] and [E, H, I], used as
``F.linear(x, W)``; Llama-4's BMM layout [E, H, 2I] and [E, I, H], used as ``x @ W``), what the router module returns,
and the experts forward that W4A4 evaluation swaps in. Names on disk are the grammar's (fp4kit.families.grammar).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fp4kit.families.grammar import ExpertGrammar

# (activations, divisor) -> activations quantized and dequantized as the W4A4 kernels do
FakeQuantize = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class MoEModules:
    """Qwen3 / GLM / DeepSeek experts: [E, 2I, H] / [E, H, I], ``forward(hidden [T, H], top_k_index,
    top_k_weights)``; the router returns (logits, top-k weights, top-k ids)."""

    gate_up = "gate_up_proj"  # transformers' parameter names on the experts module
    down = "down_proj"
    experts_attribute = "experts"  # the experts module under the MoE block
    bmm = False  # experts held [E, K, N] (x @ W) rather than [E, N, K]

    def __init__(self, renames: tuple[tuple[str, str], ...] = ()) -> None:
        # (transformers' module name, the checkpoint's) under a decoder layer where the two differ: transformers'
        # conversion mapping renames them on load (MiniMax-M2's block_sparse_moe is its mlp)
        self.renames = renames

    def checkpoint_name(self, key: str) -> str:
        """The checkpoint's name (relative to the decoder layer) of a module or state-dict key of transformers'
        decoder layer."""
        return _rename(key, self.renames)

    def module_name(self, name: str) -> str:
        """transformers' name of a checkpoint module or tensor name relative to the decoder layer."""
        return _rename(name, tuple((disk, module) for module, disk in self.renames))

    def experts(self, block: nn.Module) -> nn.Module | None:
        """The routed experts module of a MoE block, None for any other module."""
        experts = getattr(block, self.experts_attribute, None)
        return experts if self.is_experts(experts) else None

    def is_experts(self, module: object) -> bool:
        fused = getattr(module, self.gate_up, None)
        return isinstance(fused, torch.Tensor) and fused.dim() == 3

    def router(self, block: nn.Module) -> nn.Module:
        return block.router if hasattr(block, "router") else block.gate

    def router_choice(self, router_output: tuple, block: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(router logits [T, E], chosen expert ids [T, k]) from what the router module returned."""
        if len(router_output) == 3:  # Qwen3 / GLM / DeepSeek routers: (logits, top-k weights, top-k ids)
            return router_output[0], router_output[2]
        logits = router_output[1]  # Llama-4 router: (scores, logits), top-k on the logits
        return logits, torch.topk(logits, block.top_k, dim=1).indices

    def stacked_parts(self, key: str, grammar: ExpertGrammar) -> tuple[str, ...] | None:
        """The per-expert projections on disk (in row order) that fused parameter ``key`` of a layer's state dict
        stacks, or None when ``key`` is not a fused expert parameter."""
        if key.endswith(f"{self.experts_attribute}.{self.gate_up}"):
            return grammar.w13
        if key.endswith(f"{self.experts_attribute}.{self.down}"):
            return (grammar.down,)
        return None

    def num_experts(self, experts: nn.Module) -> int:
        return getattr(experts, self.gate_up).shape[0]

    def intermediate(self, experts: nn.Module) -> int:
        return getattr(experts, self.gate_up).shape[-1 if self.bmm else -2] // 2

    def w13(self, experts: nn.Module, expert: int) -> torch.Tensor:
        """Expert ``expert``'s fused gate/up weight as [2I, H] (a view)."""
        weight = getattr(experts, self.gate_up)[expert]
        return weight.t() if self.bmm else weight

    def w2(self, experts: nn.Module, expert: int) -> torch.Tensor:
        """Expert ``expert``'s down weight as [H, I] (a view)."""
        weight = getattr(experts, self.down)[expert]
        return weight.t() if self.bmm else weight

    def weight(self, experts: nn.Module, expert: int, proj: str, grammar: ExpertGrammar) -> torch.Tensor:
        """The [N, K] weight of one projection (the grammar's gate, up or down) of one expert, a view."""
        if proj == grammar.down:
            return self.w2(experts, expert)
        fused = self.w13(experts, expert)
        rows = fused.shape[0] // 2
        return fused[:rows] if proj == grammar.gate else fused[rows:]

    def gated(self, experts: nn.Module, expert: int, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The input of expert ``expert``'s down projection from its gate and up products (w13 x, no bias)."""
        return experts.act_fn(gate) * up

    def w4a4_forward(self, experts: nn.Module, div13: list[torch.Tensor], div2: list[torch.Tensor],
                     fake_quantize: FakeQuantize) -> Callable:
        """The experts' forward with each expert's gate/up input and down input quantized (expert by expert, the
        eager loop of transformers' experts class)."""
        owner = weakref.ref(experts)  # the forward is stored on the module: a strong reference would be a cycle
        gate_up, down = self.gate_up, self.down

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
            experts = owner()
            out = torch.zeros_like(hidden_states)
            for e in torch.unique(top_k_index).tolist():
                token_idx, slot = torch.where(top_k_index == e)
                x = fake_quantize(hidden_states[token_idx], div13[e])
                gate, up = F.linear(x, getattr(experts, gate_up)[e]).chunk(2, dim=-1)
                y = F.linear(fake_quantize(experts.act_fn(gate) * up, div2[e]), getattr(experts, down)[e])
                out.index_add_(0, token_idx, (y * top_k_weights[token_idx, slot, None]).to(out.dtype))
            return out

        return forward


class BmmExperts(MoEModules):
    """Llama-4 experts: [E, H, 2I] / [E, I, H], ``forward(routed_in [E * T, H])``, every expert over all tokens
    with the router score already applied to its input; the router returns (scores, logits)."""

    bmm = True

    def w4a4_forward(self, experts: nn.Module, div13: list[torch.Tensor], div2: list[torch.Tensor],
                     fake_quantize: FakeQuantize) -> Callable:
        owner = weakref.ref(experts)
        gate_up, down = self.gate_up, self.down

        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            experts = owner()
            per_expert = hidden_states.view(getattr(experts, gate_up).shape[0], -1, hidden_states.shape[-1])
            outs = []
            for e in range(per_expert.shape[0]):
                fused = fake_quantize(per_expert[e], div13[e]) @ getattr(experts, gate_up)[e]
                gate, up = fused.chunk(2, dim=-1)
                outs.append(fake_quantize(up * experts.act_fn(gate), div2[e]) @ getattr(experts, down)[e])
            return torch.stack(outs).view(-1, hidden_states.shape[-1])

        return forward


class GptOssExperts(MoEModules):
    """gpt-oss's experts (transformers' GptOssExperts): BMM layout [E, H, 2I] / [E, I, H] with gate and up interleaved
    along 2I, biases ``gate_up_proj_bias`` [E, 2I] (same order) and ``down_proj_bias`` [E, H], the clamped SwiGLU of
    ``_apply_gate`` with the module's ``alpha`` and ``limit``; ``forward(hidden [T, H], router_indices,
    routing_weights)``."""

    bmm = True

    def w13(self, experts: nn.Module, expert: int) -> torch.Tensor:
        """[2I, H] in fp4kit's [gate; up] order (a copy: the stored rows are interleaved)."""
        fused = experts.gate_up_proj[expert].t()
        return torch.cat([fused[0::2], fused[1::2]])

    def weight(self, experts: nn.Module, expert: int, proj: str, grammar: ExpertGrammar) -> torch.Tensor:
        if proj == grammar.down:
            return self.w2(experts, expert)
        fused = experts.gate_up_proj[expert].t()
        return fused[0::2] if proj == grammar.gate else fused[1::2]  # views: every other row

    def gated(self, experts: nn.Module, expert: int, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        bias = experts.gate_up_proj_bias[expert]
        return self._apply(experts, gate + bias[0::2], up + bias[1::2])

    @staticmethod
    def _apply(experts: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=experts.limit)
        up = up.clamp(min=-experts.limit, max=experts.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * experts.alpha))

    def w4a4_forward(self, experts: nn.Module, div13: list[torch.Tensor], div2: list[torch.Tensor],
                     fake_quantize: FakeQuantize) -> Callable:
        owner = weakref.ref(experts)

        def forward(hidden_states: torch.Tensor, router_indices: torch.Tensor,
                    routing_weights: torch.Tensor) -> torch.Tensor:
            experts = owner()
            out = torch.zeros_like(hidden_states)
            for e in torch.unique(router_indices).tolist():
                token_idx, slot = torch.where(router_indices == e)
                x = fake_quantize(hidden_states[token_idx], div13[e])
                fused = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
                inter = self._apply(experts, fused[..., 0::2], fused[..., 1::2])
                y = fake_quantize(inter, div2[e]) @ experts.down_proj[e] + experts.down_proj_bias[e]
                out.index_add_(0, token_idx, (y * routing_weights[token_idx, slot, None]).to(out.dtype))
            return out

        return forward


def _rename(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        if name == old or name.startswith(f"{old}."):
            return new + name[len(old):]
    return name


FUSED_EXPERTS = MoEModules()
BMM_EXPERTS = BmmExperts()
GPT_OSS_EXPERTS = GptOssExperts()

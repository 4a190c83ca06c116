"""How a family names its MoE block on disk: the routed experts, their projections, the router and the shared expert.

A family states its names in one ``ExpertGrammar`` (``Family.grammar``); every module outside ``families/`` builds and
parses expert, router and shared-expert names through it, never by spelling them. Names on disk are also the names
fp4kit writes: an output keeps its source's module names, so engines load it with the family's own loader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

W13, W2 = "w13", "w2"  # the kernels' names: gate and up share one input and one weight scale; down is w2


@dataclass(frozen=True)
class ExpertGrammar:
    """The names of one family's MoE block, relative to the block (``model.layers.3.mlp``).

    Routed experts live at ``{block}.{experts}.{e}.{gate|up|down}`` per expert; a checkpoint may instead store them
    fused per layer as ``{block}.{experts}.{fused_gate_up}`` (gate rows, then up rows) and ``{experts}.{fused_down}``.
    """

    experts: str = "experts"  # the routed experts container under the MoE block
    # a routed expert's Linears: gate and up read the block input (w13), down reads act(gate) * up (w2)
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    fused_gate_up: str = "gate_up_proj"  # the fused-on-disk tensors, [E, ...] over every expert of a layer
    fused_down: str = "down_proj"
    # the fused gate/up tensor's output features alternate gate, up, gate, ... (gpt-oss) instead of gate rows, then
    # up rows
    interleaved: bool = False
    # beside the experts: the router (Qwen3 / GLM / DeepSeek `gate`, Llama-4 `router`), in the order to try; GLM's
    # and DeepSeek's selection bias; the shared expert (GLM / DeepSeek `shared_experts`, Qwen3 / Llama-4
    # `shared_expert`), in the order to try
    routers: tuple[str, ...] = ("gate", "router")
    router_bias: str = "gate.e_score_correction_bias"
    shared_experts: tuple[str, ...] = ("shared_experts", "shared_expert")

    def __post_init__(self) -> None:
        experts = re.escape(self.experts)
        # one pattern for module and tensor names: the experts container, the expert index, what follows it
        object.__setattr__(self, "_expert_re", re.compile(
            rf"^(?P<experts>.*?\.{experts})\.(?P<expert>\d+)\.(?P<rest>.+)$"))

    @property
    def projections(self) -> tuple[str, str, str]:
        """A routed expert's Linears in w13 (gate, up) then w2 order."""
        return (self.gate, self.up, self.down)

    @property
    def w13(self) -> tuple[str, str]:
        return (self.gate, self.up)

    @property
    def fused_tensors(self) -> tuple[str, str]:
        return (self.fused_gate_up, self.fused_down)

    @property
    def hint(self) -> str:
        """How per-expert names look, for messages: ``...experts.E.{gate,up,down}_proj``."""
        common = "_proj" if all(p.endswith("_proj") for p in self.projections) else ""
        parts = ",".join(p.removesuffix(common) if common else p for p in self.projections)
        return f"...{self.experts}.E.{{{parts}}}{common}"

    def kernel_projection(self, proj: str) -> str:
        """w13 for gate and up (one input, one weight scale in the fused kernels), w2 for down."""
        return W13 if proj in self.w13 else W2

    def fused_leaf(self, proj: str) -> str:
        """The fused-on-disk tensor holding an expert projection."""
        return self.fused_gate_up if proj in self.w13 else self.fused_down

    def gate_up_rows(self, proj: str, inter: int) -> tuple[int, int, int]:
        """(start, stop, step) of gate's or up's output features inside the fused gate/up tensor."""
        first = 0 if proj == self.gate else (1 if self.interleaved else inter)
        return (first, 2 * inter, 2) if self.interleaved else (first, first + inter, 1)

    def fused_parts(self, leaf: str) -> tuple[str, ...]:
        """The projections a fused tensor holds, in row order (gate rows before up rows)."""
        return self.w13 if leaf == self.fused_gate_up else (self.down,)

    def expert_linear(self, experts: str, expert: int, proj: str) -> str:
        return f"{experts}.{expert}.{proj}"

    def expert_linears(self, experts: str, expert: int) -> list[str]:
        """An expert's gate, up and down module names."""
        return [self.expert_linear(experts, expert, p) for p in self.projections]

    def fused_tensor(self, experts: str, leaf: str) -> str:
        return f"{experts}.{leaf}"

    def is_fused_tensor(self, name: str, ndim: int) -> bool:
        """A fused-on-disk expert tensor ([E, ...], 3-D) of an experts container."""
        return ndim == 3 and name.rsplit(".", 1)[-1] in self.fused_tensors and f".{self.experts}." in f".{name}"

    def split_expert(self, name: str) -> tuple[str, int, str] | None:
        """(experts container, expert index, what follows the index) of a per-expert module or tensor name."""
        m = self._expert_re.match(name)  # type: ignore[attr-defined]
        return (m["experts"], int(m["expert"]), m["rest"]) if m else None

    def moe_block(self, experts: str) -> str:
        """The MoE block that holds an experts container: its router and shared expert live there."""
        return experts.removesuffix(f".{self.experts}")

    def experts_of(self, block: str) -> str:
        return f"{block}.{self.experts}" if block else self.experts

    def router_weights(self, experts: str) -> list[str]:
        return [f"{self.moe_block(experts)}.{leaf}.weight" for leaf in self.routers]

    def router_bias_name(self, experts: str) -> str:
        return f"{self.moe_block(experts)}.{self.router_bias}"

    def shared_expert_modules(self, experts: str) -> list[str]:
        return [f"{self.moe_block(experts)}.{leaf}" for leaf in self.shared_experts]


DEFAULT = ExpertGrammar()  # Qwen3-MoE, Qwen3-VL-MoE, GLM-4.5 / 4.6 / 4.5V, Llama-4, DeepSeek-V3

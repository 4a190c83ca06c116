"""The routed experts of a per-expert NVFP4 checkpoint, found by their names (the family's grammar), torch-free."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import expert_tensor, layer_of
from fp4kit.families.grammar import DEFAULT, ExpertGrammar


@dataclass(frozen=True)
class ExpertTensor:
    layer: int
    expert: int
    proj: str  # the family grammar's gate, up or down
    leaf: str  # what follows the projection: weight_packed, weight_scale, input_global_scale, weight, ...
    kernel: str  # w13 (gate, up) or w2 (down), by the family's grammar


@dataclass
class ExpertInventory:
    experts: dict[str, ExpertTensor]  # tensor name -> where it belongs
    modules: dict[int, str]  # MoE layer index -> experts module path

    @property
    def layers(self) -> list[int]:
        return sorted(self.modules)


def scan_experts(names: list[str], num_experts: int, grammar: ExpertGrammar = DEFAULT,
                 layer_index: Callable[[str], int | None] = layer_of) -> ExpertInventory:
    """Find the routed experts by their per-expert names and check every MoE layer has E complete experts;
    ``layer_index`` numbers the layers (the family's, for an MTP block outside the decoder layers)."""
    experts: dict[str, ExpertTensor] = {}
    modules: dict[int, str] = {}
    for name in names:
        found = expert_tensor(name, grammar)
        if found is None:
            if grammar.is_fused_tensor(name, 3):
                raise Fp4kitError(f"{name}: fused expert tensor; shard needs per-expert tensors "
                                  f"(`{grammar.hint}.*`), as `fp4kit quantize` writes them")
            continue
        expert, leaf = found
        layer = layer_index(name)
        if expert.proj not in grammar.projections or not leaf or layer is None:
            raise Fp4kitError(f"{name}: unrecognised expert tensor (expected layers.L{grammar.hint}.*)")
        module = expert.experts
        if modules.setdefault(layer, module) != module:
            raise Fp4kitError(f"layer {layer} has experts under two modules: {modules[layer]} and {module}")
        experts[name] = ExpertTensor(layer, expert.expert, expert.proj, leaf, expert.fused)
    _check_complete(experts, modules, num_experts, grammar)
    return ExpertInventory(experts, modules)


def _check_complete(experts: dict[str, ExpertTensor], modules: dict[int, str], num_experts: int,
                    grammar: ExpertGrammar) -> None:
    per_expert: dict[tuple[int, int], set[tuple[str, str]]] = {}
    for t in experts.values():
        per_expert.setdefault((t.layer, t.expert), set()).add((t.proj, t.leaf))
    for layer, module in modules.items():
        ids = sorted(e for (lay, e) in per_expert if lay == layer)
        if ids != list(range(num_experts)):
            raise Fp4kitError(f"{module}: experts {ids[:3]}...{ids[-3:]} ({len(ids)}) on disk, config.json says "
                              f"{num_experts}")
        first = per_expert[(layer, 0)]
        for e in ids:
            if per_expert[(layer, e)] != first or {p for p, _ in first} != set(grammar.projections):
                raise Fp4kitError(f"{module}.{e}: tensors {sorted(per_expert[(layer, e)])} differ from expert 0's "
                                  f"or lack a projection")

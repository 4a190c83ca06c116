"""One MoE layer of a checkpoint, read into the form the verify checks compute with.

Three kinds of quantized input are read into the same canonical stacked NVFP4 experts (w13 [E, 2I, H] in [w1; w3]
row order, w2 [E, H, I], float64 [E] divisors), plus the router, GLM's correction bias and the shared expert:

- a dialect checkpoint (compressed-tensors or ModelOpt, through `fp4kit.formats.detect`);
- a layout checkpoint (`fp4kit layout`, `fp4kit_layout.json`): its kernel tensors are undone by the backend's exact
  inverse (`fp4kit.layouts.<backend>.undo`), which also checks the stored scalars and padding;
- one rank directory of an EP split (`fp4kit shard`): only the experts its `expert_map.json` holds.

The BF16 source reads the same layer as fp32 dense experts, whichever expert layout the family stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from fp4kit.ep.format import EXPERT_MAP, read_expert_map
from fp4kit.ep.format import MANIFEST as SHARD_MANIFEST
from fp4kit.errors import Fp4kitError
from fp4kit.families import detect
from fp4kit.families.activation import SILU, ExpertActivation
from fp4kit.families.base import EXPERT_PROJS, Family, group_experts
from fp4kit.families.grammar import ExpertGrammar
from fp4kit.families.routing import RoutingSpec
from fp4kit.formats.detect import QuantizedCheckpoint, QuantModule, open_checkpoint
from fp4kit.io.checkpoint import CheckpointReader, read_config
from fp4kit.io.sources import SourceFormat
from fp4kit.layouts import StackedExperts
from fp4kit.layouts.directory import find_moe_layers
from fp4kit.layouts.directory import read_layer as read_canonical_layer
from fp4kit.layouts.manifest import MANIFEST as LAYOUT_MANIFEST
from fp4kit.nvfp4 import BLOCK, NVFP4Tensor
from fp4kit.quantize.plan import QuantGroup, read_group_weights, read_linear_weight, source_candidates, source_view

PROJS = EXPERT_PROJS


@dataclass
class Router:
    weight: Tensor  # fp32 [E, H]
    correction_bias: Tensor | None  # fp32 [E] (GLM)
    bias: Tensor | None = None  # fp32 [E]: the router Linear's own bias, part of the logits (gpt-oss)

    def logits(self, hidden: Tensor) -> Tensor:
        logits = hidden.float() @ self.weight.to(hidden.device).T
        return logits if self.bias is None else logits + self.bias.to(hidden.device)


@dataclass
class QuantizedMoe:
    """A layer's routed experts in canonical NVFP4 (input divisors None for weight-only checkpoints), its router and
    shared expert."""

    layer: int
    experts_module: str
    experts: StackedExperts
    router: Router
    shared: tuple[Tensor, Tensor] | None  # dense fp32 shared expert (w13 [2Is, H], w2 [H, Is])
    # gpt-oss: the experts' output biases (b13 [E, 2I] as [gate; up], b2 [E, H]) and activation
    biases: tuple[Tensor, Tensor] | None = None
    activation: ExpertActivation = SILU

    @property
    def w13(self) -> NVFP4Tensor:
        return self.experts.w13

    @property
    def w2(self) -> NVFP4Tensor:
        return self.experts.w2

    @property
    def input_div13(self) -> Tensor | None:
        return self.experts.input_scale_div13

    @property
    def input_div2(self) -> Tensor | None:
        return self.experts.input_scale_div2

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts


@dataclass
class SourceMoe:
    """The source's layer: dense fp32 experts w13 [E, 2I, H], w2 [E, H, I] (a quantized source's dequantized), and
    how the source stores them (``precision``: bf16, fp8-block, int4-pack-quantized, as fp4kit.io.sources names it)."""

    w13: Tensor
    w2: Tensor
    router: Router
    shared: tuple[Tensor, Tensor] | None
    precision: str = "bf16"
    biases: tuple[Tensor, Tensor] | None = None
    activation: ExpertActivation = SILU


def model_spec(config: dict) -> tuple[Family, RoutingSpec]:
    family = detect(config)
    return family, family.routing(family.text_config(config))


def expert_activation(config: dict) -> ExpertActivation:
    family = detect(config)
    return family.activation(family.text_config(config))


def _expert_biases(reader: CheckpointReader, experts_module: str, grammar: ExpertGrammar,
                   num_experts: int) -> tuple[Tensor, Tensor] | None:
    """gpt-oss's stored expert biases, b13 in the canonical [gate; up] order (de-interleaved), b2; None elsewhere."""
    names = [grammar.fused_tensor(experts_module, f"{leaf}_bias") for leaf in grammar.fused_tensors]
    if not all(n in reader for n in names):
        return None
    b13, b2 = (reader.read(n).float() for n in names)
    if b13.dim() != 2 or b13.shape[0] != num_experts or b2.dim() != 2 or b2.shape[0] != num_experts:
        raise Fp4kitError(f"{names[0]}, {names[1]}: shapes {list(b13.shape)}, {list(b2.shape)}, expected "
                          f"[{num_experts}, 2I] and [{num_experts}, H]")
    if grammar.interleaved:
        b13 = torch.cat([b13[:, 0::2], b13[:, 1::2]], dim=1)
    return b13, b2


def _router(reader: CheckpointReader, experts_module: str, grammar: ExpertGrammar) -> Router:
    candidates = grammar.router_weights(experts_module)
    for weight in candidates:
        if weight in reader:
            bias = grammar.router_bias_name(experts_module)
            linear_bias = weight.removesuffix(".weight") + ".bias"
            return Router(reader.read(weight).float(), reader.read(bias).float() if bias in reader else None,
                          reader.read(linear_bias).float() if linear_bias in reader else None)
    raise Fp4kitError(f"{experts_module}: no router weight ({' or '.join(candidates)})")


def _dense_or_quantized(
    reader: CheckpointReader, quantized: dict[str, QuantModule], ckpt: QuantizedCheckpoint | None, module: str,
    source: SourceFormat | None = None,
) -> Tensor | None:
    if module in quantized and ckpt is not None:
        return ckpt.read_weight(quantized[module]).dequantize()
    fp8 = next((m for m in ckpt.fp8_modules if m.name == module), None) if ckpt is not None else None
    if fp8 is not None:  # a mixed-precision checkpoint's FP8 shared expert: its exact dequantized weight
        return ckpt.read_fp8(fp8)[0].dequantize()  # type: ignore[union-attr]
    if source is not None and module in source.linears:  # a quantized --source: its dequantized weight
        return read_linear_weight(reader, source, module)
    return reader.read(f"{module}.weight").float() if f"{module}.weight" in reader else None


def _shared_expert(
    reader: CheckpointReader, experts_module: str, ckpt: QuantizedCheckpoint | None, grammar: ExpertGrammar,
    source: SourceFormat | None = None,
) -> tuple[Tensor, Tensor] | None:
    quantized = {m.name: m for m in ckpt.modules} if ckpt is not None else {}
    for shared in grammar.shared_expert_modules(experts_module):
        # a shared expert is a dense MLP: transformers' gate_proj / up_proj / down_proj in every family
        gate, up, down = (_dense_or_quantized(reader, quantized, ckpt, f"{shared}.{p}", source) for p in PROJS)
        if gate is not None and up is not None and down is not None:
            return torch.cat([gate, up]), down
    return None


class QuantizedModel:
    """An NVFP4 checkpoint (dialect or layout) opened for verification; ``layer(i)`` reads one MoE layer."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if (self.root / SHARD_MANIFEST).is_file() and not (self.root / "config.json").is_file():
            raise Fp4kitError(
                f"{self.root} is an EP split (`fp4kit shard`): pass the unsharded checkpoint as CKPT "
                f"and this directory as --ep-shards"
            )
        self.config = read_config(self.root)
        self.family, self.spec = model_spec(self.config)
        self.layout: dict | None = None
        if (self.root / LAYOUT_MANIFEST).is_file():
            from fp4kit.layouts.manifest import read_manifest

            self.layout = read_manifest(self.root)
        self.ckpt = open_checkpoint(self.root, mixed=True)
        if self.layout is not None:
            self.experts_modules = {int(k): v["module"] for k, v in self.layout["layers"].items()}
            self._layers = {}
        else:
            self._layers = {layer.layer: layer for layer in find_moe_layers(self.ckpt)}
            self.experts_modules = {k: v.experts for k, v in self._layers.items()}
        if not self.experts_modules:
            raise Fp4kitError(f"{self.root}: no MoE layer with NVFP4 routed experts")

    @property
    def kind(self) -> str:
        return f"layout ({self.layout['backend']})" if self.layout else f"{self.ckpt.dialect} ({self.ckpt.scheme})"

    @property
    def layers(self) -> list[int]:
        return sorted(self.experts_modules)

    def layer(self, index: int) -> QuantizedMoe:
        if index not in self.experts_modules:
            raise Fp4kitError(
                f"layer {index} is not an NVFP4 MoE layer of {self.root} (MoE layers: "
                f"{','.join(map(str, self.layers))})"
            )
        module = self.experts_modules[index]
        if self.layout is not None:
            experts = undo_layout(self.root, index)
        else:
            experts = read_canonical_layer(self.ckpt, self._layers[index])
        reader = self.ckpt.reader
        grammar = self.family.grammar
        return QuantizedMoe(
            index, module, experts, _router(reader, module, grammar),
            _shared_expert(reader, module, self.ckpt, grammar),
            _expert_biases(reader, module, grammar, experts.num_experts), expert_activation(self.config),
        )

    def close(self) -> None:
        self.ckpt.close()

    def __enter__(self) -> QuantizedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def undo_layout(root: str | Path, layer: int) -> StackedExperts:
    """A layout checkpoint's layer back in canonical form (Fp4kitError when the stored tensors are inconsistent)."""
    from fp4kit.layouts.runtime import read_layer
    from fp4kit.registry import backend

    tensors, meta, document = read_layer(root, layer)
    return StackedExperts(*backend(document["backend"]).undo(tensors, meta))


def layout_transform(root: str | Path, layer: int, experts: StackedExperts
                     ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(stored kernel tensors, what the layout's transform writes for these canonical weights) of one layer."""
    from fp4kit.layouts.manifest import stored_options
    from fp4kit.layouts.runtime import read_layer
    from fp4kit.registry import backend

    tensors, _, document = read_layer(root, layer)
    return tensors, backend(document["backend"]).transform(*experts.arguments(), **stored_options(document))


def read_source_layer(root: str | Path, experts_module: str, num_experts: int) -> SourceMoe:
    """The source's routed experts of the layer whose quantized experts live at ``experts_module``."""
    root = Path(root)
    config = read_config(root)
    grammar = detect(config).grammar
    with CheckpointReader(root) as reader:
        candidates = source_candidates(reader, config, experts_module + ".")
        found = {c.linear.module: c for c in candidates}
        members = []
        for e in range(num_experts):
            missing = [p for p in grammar.projections if f"{experts_module}.{e}.{p}" not in found]
            if missing:
                raise Fp4kitError(
                    f"{root}: source has no {experts_module}.{e}.{missing[0]} (does --source hold the "
                    f"model this checkpoint was made from?)"
                )
            members.extend(found[f"{experts_module}.{e}.{p}"] for p in grammar.projections)
        weights = [w.float() for w in read_group_weights(reader, QuantGroup(members))]
        w13 = torch.stack([torch.cat(weights[3 * e : 3 * e + 2]) for e in range(num_experts)])
        w2 = torch.stack([weights[3 * e + 2] for e in range(num_experts)])
        source = source_view(reader, config)[0]
        return SourceMoe(w13, w2, _router(reader, experts_module, grammar),
                         _shared_expert(reader, experts_module, None, grammar, source), source.name,
                         _expert_biases(reader, experts_module, grammar, num_experts), expert_activation(config))


@dataclass
class RankExperts:
    rank: int
    held: Tensor  # bool [E]: experts whose tensors this rank stores
    mapped: Tensor  # bool [E]: experts its expert_map.json says it holds
    moe: QuantizedMoe  # non-held experts are all-zero weights with unit scales
    local_index: Tensor  # int64 [E]: each expert's index on this rank by its expert_map.json, -1 elsewhere


def read_rank_layer(rank_dir: str | Path, rank: int, full: QuantizedMoe) -> RankExperts:
    """One EP rank's local experts of the layer ``full`` (the unsharded one), stacked at their global ids, zero
    weights elsewhere."""
    layer, experts_module, num_experts = full.layer, full.experts_module, full.num_experts
    rank_dir = Path(rank_dir)
    expert_map = read_expert_map(rank_dir)["layers"].get(str(layer))
    if expert_map is None:
        raise Fp4kitError(f"{rank_dir / EXPERT_MAP}: no entry for layer {layer}")
    if len(expert_map) != num_experts:
        raise Fp4kitError(
            f"{rank_dir / EXPERT_MAP}: layer {layer} maps {len(expert_map)} experts, expected {num_experts}"
        )
    local_index = torch.tensor([int(local) for local in expert_map], dtype=torch.int64)
    mapped = local_index >= 0
    with open_checkpoint(rank_dir, mixed=True) as ckpt:
        grammar = ckpt.grammar
        found = group_experts(((m.name, m) for m in ckpt.modules), grammar).get(experts_module, {})
        held = torch.tensor([len(found.get(e, {})) == 3 for e in range(num_experts)])
        moe = _stack_held(ckpt, found, held, full, grammar)
    return RankExperts(rank, held, mapped, moe, local_index)


def _stack_held(ckpt: QuantizedCheckpoint, found: dict[int, dict[str, QuantModule]], held: Tensor,
                full: QuantizedMoe, grammar: ExpertGrammar) -> QuantizedMoe:
    hidden, inter = full.w13.shape[2], full.w2.shape[2]
    num = held.shape[0]
    w13 = NVFP4Tensor(
        torch.zeros(num, 2 * inter, hidden // 2, dtype=torch.uint8),
        torch.zeros(num, 2 * inter, hidden // BLOCK, dtype=torch.float8_e4m3fn),
        torch.ones(num, dtype=torch.float64),
    )
    w2 = NVFP4Tensor(
        torch.zeros(num, hidden, inter // 2, dtype=torch.uint8),
        torch.zeros(num, hidden, inter // BLOCK, dtype=torch.float8_e4m3fn),
        torch.ones(num, dtype=torch.float64),
    )
    div13, div2 = torch.ones(num, dtype=torch.float64), torch.ones(num, dtype=torch.float64)
    has_input = True
    for e in held.nonzero().flatten().tolist():
        (gate, gate_in), (up, _), (down, down_in) = (ckpt.read(found[e][p]) for p in grammar.projections)
        w13.packed[e] = torch.cat([gate.packed, up.packed])
        w13.block_scale[e] = torch.cat([gate.block_scale, up.block_scale])
        w2.packed[e], w2.block_scale[e] = down.packed, down.block_scale
        w13.global_scale_div[e], w2.global_scale_div[e] = gate.global_scale_div, down.global_scale_div
        if gate_in is None or down_in is None:
            has_input = False
        else:
            div13[e], div2[e] = gate_in, down_in
    router = _router(ckpt.reader, full.experts_module, grammar)
    if not has_input:
        div13 = div2 = None
    return QuantizedMoe(full.layer, full.experts_module, StackedExperts(w13, w2, div13, div2), router, None,
                        full.biases, full.activation)

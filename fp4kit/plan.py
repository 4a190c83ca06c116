"""Which source tensors become which output tensors: the quantization plan, built from headers alone."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from fp4kit.checkpoint import CheckpointReader, PlannedTensor
from fp4kit.errors import Fp4kitError
from fp4kit.families import detect
from fp4kit.families.base import Candidate, Family, fused_groups, linear_candidates
from fp4kit.nvfp4 import BLOCK


def _compile(patterns: list[str], what: str) -> list[re.Pattern[str]]:
    compiled = []
    for p in patterns:
        text = p[3:] if p.startswith("re:") else p  # llm-compressor's spelling
        try:
            compiled.append(re.compile(text))
        except re.error as exc:
            raise Fp4kitError(f"{what} pattern {p!r} is not a valid regex: {exc}") from None
    return compiled


@dataclass
class QuantGroup:
    """Linears quantized together with one shared weight global scale (q/k/v, gate/up, or a lone Linear)."""

    members: list[Candidate]

    @property
    def layer(self) -> int | None:
        return self.members[0].layer

    @property
    def sources(self) -> list[str]:
        return sorted({c.linear.source.tensor for c in self.members})

    @property
    def fused_experts_tensor(self) -> str | None:
        """The fused on-disk expert tensor when this group holds all its experts (layer-wide scale), else None."""
        experts = {c.linear.source.expert for c in self.members}
        if None in experts or len(experts) < 2:
            return None
        return self.members[0].linear.source.tensor


@dataclass
class ModelPlan:
    family: Family
    config: dict
    text_config: dict
    groups: list[QuantGroup]
    passthrough: list[str]
    ignored_modules: list[str]  # Linears left unquantized, for the config's ignore list
    jobs: list[QuantGroup | str] = field(default_factory=list)  # execution (and output) order


def build_plan(
    reader: CheckpointReader,
    config: dict,
    ignore: list[str] | None = None,
    targets: list[str] | None = None,
    default_ignore: bool = True,
    modelopt_layout: bool = False,
) -> ModelPlan:
    """``modelopt_layout``: for families whose experts ModelOpt keeps fused (Llama-4), every expert of a fused
    on-disk expert tensor goes into one group (one global scale for all gate/up, one for all down)."""
    family = detect(config)
    shapes = {name: info.shape for name, info in reader.tensors.items()}
    text_config = family.check_config(config, shapes)
    candidates = linear_candidates(shapes, text_config, family.moe_intermediate(text_config))
    ignore_res = _compile((family.default_ignore(config) if default_ignore else []) + (ignore or []), "--ignore")
    target_res = _compile(targets or [], "--targets")

    def selected(c: Candidate) -> bool:
        module = c.linear.module
        if any(r.search(module) for r in ignore_res):
            return False
        return not target_res or any(r.search(module) for r in target_res)

    chosen = [c for c in candidates if selected(c)]
    if target_res and not chosen:
        raise Fp4kitError(f"--targets {' '.join(targets or [])}: no Linear to quantize matches (after the ignores)")
    for c in chosen:
        if c.linear.in_features % BLOCK:
            raise Fp4kitError(
                f"{c.linear.source.tensor}: input dimension {c.linear.in_features} of {c.linear.module} is not "
                f"divisible by {BLOCK} (NVFP4 blocks); exclude it with --ignore"
            )
        dtype = reader.info(c.linear.source.tensor).dtype
        if not dtype.is_floating_point or dtype.itemsize == 1:
            raise Fp4kitError(f"{c.linear.source.tensor}: dtype {dtype} cannot be quantized (already quantized?)")
    grouped = fused_groups(chosen)
    if modelopt_layout and family.modelopt_fused_experts:
        grouped = _merge_fused_experts(grouped)
    groups = [QuantGroup(g) for g in grouped]
    consumed = {c.linear.source.tensor for c in chosen}
    ignored_modules = sorted({_ignore_name(c) for c in candidates if c.linear.source.tensor not in consumed})
    passthrough = [name for name in reader.names() if name not in consumed]

    jobs: list[QuantGroup | str] = [*groups, *passthrough]
    jobs.sort(key=lambda j: _order_key(j.members[0].linear.source.tensor if isinstance(j, QuantGroup) else j))
    return ModelPlan(family, config, text_config, groups, passthrough, ignored_modules, jobs)


def _merge_fused_experts(groups: list[list[Candidate]]) -> list[list[Candidate]]:
    by_tensor: dict[str, list[Candidate]] = {}
    merged: list[list[Candidate]] = []
    for group in groups:
        source = group[0].linear.source
        if source.expert is None:
            merged.append(group)
            continue
        if source.tensor not in by_tensor:
            by_tensor[source.tensor] = []
            merged.append(by_tensor[source.tensor])
        by_tensor[source.tensor].extend(group)
    return merged


def _ignore_name(c: Candidate) -> str:
    # An unselected fused expert tensor stays fused on disk: name the experts module, not a per-expert Linear.
    return c.linear.module if c.linear.source.expert is None else c.linear.source.tensor.rsplit(".", 1)[0]


def _order_key(name: str) -> tuple[int, str]:
    from fp4kit.families.base import layer_of

    layer = layer_of(name)
    return (-1 if layer is None else layer, name)


def planned_passthrough(reader: CheckpointReader, name: str) -> PlannedTensor:
    info = reader.info(name)
    return PlannedTensor(name, info.dtype, info.shape)


def read_group_weights(reader: CheckpointReader, group: QuantGroup) -> list[torch.Tensor]:
    """The [N, K] weights of a group's Linears; one fused expert row is read once for gate and up."""
    rows: dict[tuple[str, int], torch.Tensor] = {}
    weights = []
    for c in group.members:
        src = c.linear.source
        if src.expert is None:
            weights.append(reader.read(src.tensor, check_finite=False))  # quantizing checks them
            continue
        key = (src.tensor, src.expert)
        if key not in rows:
            rows[key] = reader.read_rows(src.tensor, src.expert, src.expert + 1, check_finite=False)[0]
        matrix = rows[key].t() if src.transposed else rows[key]  # [N_total, K]
        if src.span is not None:
            matrix = matrix[src.span[0] : src.span[1]]
        weights.append(matrix.contiguous())
    return weights

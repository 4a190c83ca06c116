"""Activation (input) global scales for W4A4 from calibration statistics, and the EP-invariant sharing policy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import input_scale_group, largest_amax
from fp4kit.families.grammar import ExpertGrammar
from fp4kit.nvfp4 import divisor_from_amax
from fp4kit.quantize.plan import ModelPlan

POLICIES = ("shared", "per-expert")
ROUTING_STATS_NAME = "fp4kit_routing_stats.json"


def _projection_key(module: str, expert: int | None, grammar: ExpertGrammar) -> str:
    """Modules that share one input scale under the `shared` policy: a layer's routed experts, per projection."""
    return module if expert is None else input_scale_group(module, grammar)


def input_scale_divisors(plan: ModelPlan, input_amax: dict[str, float], policy: str) -> dict[str, torch.Tensor]:
    """float64 divisor amax / (448*6) per quantized module. `shared` gives every routed expert of a layer the
    layer's largest amax per projection (EP-invariant, as ModelOpt writes); a module whose amax is 0 takes its
    projection's shared value, and failing that a divisor of 1 (multiplier 1, compressed-tensors' own fallback), so
    no scale is ever 0, Inf or NaN. A non-finite amax is an error: no default would make the layer's scales right."""
    members = [c for g in plan.groups for c in g.members]
    recorded: dict[str, list[float]] = {}
    for c in members:
        amax = input_amax.get(c.linear.module, 0.0)
        if not math.isfinite(amax):
            raise Fp4kitError(f"{c.linear.module}: calibration gave a non-finite input amax ({amax}) in layer "
                              f"{c.layer}: the layer's activations overflow or hold NaN")
        if amax > 0:
            recorded.setdefault(_projection_key(c.linear.module, c.expert, plan.family.grammar), []).append(amax)
    shared = {key: largest_amax("amax")(values) for key, values in recorded.items()}
    divisors = {}
    for c in members:
        amax = input_amax.get(c.linear.module, 0.0)
        key = _projection_key(c.linear.module, c.expert, plan.family.grammar)
        if policy == "shared" or not amax > 0:
            amax = shared.get(key, 0.0)
        divisors[c.linear.module] = torch.tensor(divisor_from_amax(amax), dtype=torch.float64)
    return divisors


def write_routing_stats(path: Path, plan: ModelPlan, routing_counts: dict[int, list[int]],
                        calibration: dict | None = None) -> None:
    """Tokens routed to each expert per MoE layer, in the schema `fp4kit shard --stats` reads (fp4kit.ep.placement),
    and the calibration set they were counted over (docs/formats.md)."""
    stats = {
        "model_type": plan.config.get("model_type"),
        "num_experts": plan.family.num_experts(plan.text_config),
        "layers": {str(layer): list(counts) for layer, counts in sorted(routing_counts.items())},
    }
    if calibration:
        stats["calibration"] = calibration
    path.write_text(json.dumps(stats, indent=1) + "\n")

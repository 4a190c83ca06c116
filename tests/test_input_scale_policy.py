"""The input-scale policy (fp4kit.families.base.largest_amax) and the callers that state it through it: the value of
largest amax wins in every scale form, on floats and on tensors, and shard's torch-free table, the layouts' shared
divisor and repair pick what it picks."""

from __future__ import annotations

import pytest
import torch

from fp4kit import registry
from fp4kit.ep.scales import INPUT_SCALE_LEAVES
from fp4kit.families.base import largest_amax
from fp4kit.layouts import collapsed_input_scales, shared_input_divisor
from fp4kit.nvfp4 import divisor_from_amax
from fp4kit.tools.repair import RepairReport, unified_scales

AMAX = [0.5, 4.0, 2.0]


def test_the_largest_amax_wins_in_every_form() -> None:
    assert largest_amax("amax")(AMAX) == 4.0
    divisors = [divisor_from_amax(a) for a in AMAX]
    assert largest_amax("divisor")(divisors) == divisor_from_amax(4.0)
    assert largest_amax("multiplier")([1 / d for d in divisors]) == 1 / divisor_from_amax(4.0)
    with pytest.raises(ValueError, match="amax, a divisor or a multiplier"):
        largest_amax("scale")


def test_shard_table_follows_each_dialects_scale_form() -> None:
    for dialect in registry.dialects():
        assert INPUT_SCALE_LEAVES[dialect.suffixes["input"].lstrip(".")] is largest_amax(dialect.stores)


def test_layouts_share_the_largest_divisor() -> None:
    divisors = torch.tensor([divisor_from_amax(a) for a in AMAX], dtype=torch.float64)
    shared = shared_input_divisor(divisors)
    assert torch.equal(shared, torch.full_like(divisors, divisor_from_amax(4.0)))
    assert collapsed_input_scales(divisors) == 2 and collapsed_input_scales(shared) == 0


def test_repair_gives_each_expert_projection_the_largest_divisor() -> None:
    weight = torch.tensor(1.0, dtype=torch.float64)
    def divisor(amax: float) -> torch.Tensor:
        return torch.tensor(divisor_from_amax(amax), dtype=torch.float64)

    scales = {f"model.layers.0.mlp.experts.{e}.{proj}": (weight, divisor(a))
              for e, a in enumerate(AMAX) for proj in ("gate_proj", "down_proj")}
    repaired = unified_scales(scales, RepairReport())
    assert {float(pair[1]) for pair in repaired.values()} == {divisor_from_amax(4.0)}

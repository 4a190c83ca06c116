"""EP-invariant activation scales for `fp4kit shard`.

Engines that reduce an MoE layer's activation global scale over the experts one rank holds (compressed-tensors
checkpoints on FlashInfer backends, without EPLB) compute different numbers at different EP sizes. Giving every
expert of a layer the value of largest amax, per fused projection (gate and up share one input and one kernel scale,
down has its own), makes every rank's reduction return the EP=1 value. The scales are compressed-tensors
``input_global_scale`` multipliers (largest amax = smallest value) or ModelOpt ``input_scale`` divisors (largest
value); zero, negative, infinite or NaN values (experts that saw no calibration tokens) are left out of the choice
and replaced like the others.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import largest_amax
from fp4kit.io.shard_io import SourceTensor, read_bytes

if TYPE_CHECKING:
    from fp4kit.ep.inventory import ExpertInventory

# Tensor leaf -> how to pick the value of largest amax among a layer's experts.
INPUT_SCALE_LEAVES: dict[str, Callable[[list[float]], float]] = {
    "input_global_scale": largest_amax("multiplier"), "input_scale": largest_amax("divisor")}
_STRUCT = {"F64": "d", "F32": "f", "F16": "e"}


def decode_floats(dtype: str, data: bytes) -> list[float]:
    if dtype == "BF16":
        halves = struct.unpack(f"<{len(data) // 2}H", data)
        return list(struct.unpack(f"<{len(halves)}f", struct.pack(f"<{len(halves)}I", *(h << 16 for h in halves))))
    if dtype not in _STRUCT:
        raise Fp4kitError(f"activation scales of dtype {dtype} are not supported")
    code = _STRUCT[dtype]
    return list(struct.unpack(f"<{len(data) // struct.calcsize(code)}{code}", data))


def encode_floats(dtype: str, values: list[float]) -> bytes:
    """Exact for values that ``decode_floats`` produced from the same dtype."""
    if dtype == "BF16":
        words = struct.unpack(f"<{len(values)}I", struct.pack(f"<{len(values)}f", *values))
        return struct.pack(f"<{len(values)}H", *(w >> 16 for w in words))
    return struct.pack(f"<{len(values)}{_STRUCT[dtype]}", *values)


def unify_input_scales(
    tensors: dict[str, SourceTensor], inventory: ExpertInventory
) -> tuple[dict[str, bytes], dict[str, dict[str, dict[str, float]]], int]:
    """(new bytes of every expert activation-scale tensor, {"<layer>": {"w13"|"w2": {leaf: value}}}, how many
    tensors changed value)."""
    groups: dict[tuple[int, str, str], list[str]] = {}
    for name, t in inventory.experts.items():
        if t.leaf in INPUT_SCALE_LEAVES:
            groups.setdefault((t.layer, t.kernel, t.leaf), []).append(name)
    replacements: dict[str, bytes] = {}
    record: dict[str, dict[str, dict[str, float]]] = {}
    changed = 0
    for (layer, proj, leaf), names in sorted(groups.items()):
        values = {n: decode_floats(tensors[n].dtype, read_bytes(tensors[n])) for n in names}
        if any(len(v) != 1 for v in values.values()):
            raise Fp4kitError(f"{inventory.modules[layer]}: {leaf} must be one value per expert (per-tensor scale)")
        usable = [v[0] for v in values.values() if v[0] > 0 and math.isfinite(v[0])]
        if not usable:
            raise Fp4kitError(f"{inventory.modules[layer]}: no expert has a usable {leaf} ({proj}): "
                              f"all are zero, negative or not finite")
        value = INPUT_SCALE_LEAVES[leaf](usable)
        for n in names:
            replacements[n] = encode_floats(tensors[n].dtype, [value])
            changed += values[n][0] != value
        record.setdefault(str(layer), {}).setdefault(proj, {})[leaf] = value
    return replacements, record, changed

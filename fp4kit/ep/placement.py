"""Expert placement for expert parallelism: which rank holds which expert of a MoE layer (docs/formats.md).

A placement of one layer is a list ``rank_of[e]`` for the layer's E experts. Three strategies:

- ``linear``: vLLM's default (``determine_expert_map`` in vllm/model_executor/layers/fused_moe/layer.py):
  base = E // N, rem = E % N; rank r holds the contiguous range starting at r * base + min(r, rem), of base + 1
  experts when r < rem, else base. With E % N == 0 this is also TRT-LLM's and FlashInfer CUTLASS's
  offset = rank * E/N.
- ``round-robin``: expert e on rank e % N (vLLM's ``round_robin``).
- ``balanced``: from per-expert token counts (routing statistics, below), each layer on its own: experts largest
  count first, each to the least-loaded rank that still has room, then pairwise swaps/moves while they lower the
  busiest rank's tokens. Every rank keeps the expert count linear would give it (E // N or E // N + 1), so weight
  memory stays even. Linear and round-robin are candidates too: the result is never worse than either.

Local ids on a rank follow global order: rank r's local expert i is its i-th smallest global id.

Routing statistics (``--stats``), a JSON object::

    {"model_type": "qwen3_moe",            # config.json model_type of the model the counts were taken on
     "num_experts": 128,                   # E
     "layers": {"0": [c_0, ..., c_127],    # per MoE layer index (the N in "layers.N."): tokens routed to
                "1": [...], ...}}          #   each expert, non-negative numbers, E of them

``layers`` must name exactly the model's MoE layers (for GLM, the MTP layer too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fp4kit.errors import Fp4kitError
from fp4kit.io.safetensors_files import read_json

PLACEMENTS = ("linear", "round-robin", "balanced")
_MAX_REFINE_STEPS = 10_000


def rank_capacities(num_experts: int, ep: int) -> list[int]:
    base, rem = divmod(num_experts, ep)
    return [base + 1 if r < rem else base for r in range(ep)]


def linear(num_experts: int, ep: int) -> list[int]:
    rank_of: list[int] = []
    for rank, count in enumerate(rank_capacities(num_experts, ep)):
        rank_of.extend([rank] * count)
    return rank_of


def round_robin(num_experts: int, ep: int) -> list[int]:
    return [e % ep for e in range(num_experts)]


def rank_loads(rank_of: Sequence[int], counts: Sequence[float], ep: int) -> list[float]:
    loads = [0.0] * ep
    for expert, rank in enumerate(rank_of):
        loads[rank] += counts[expert]
    return loads


def imbalance(loads: Sequence[float]) -> float:
    """max / mean tokens per rank; 1.0 is perfect (and is reported for a layer that saw no tokens)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def balanced(counts: Sequence[float], ep: int) -> list[int]:
    num_experts = len(counts)
    room = rank_capacities(num_experts, ep)
    loads = [0.0] * ep
    rank_of = [0] * num_experts
    for expert in sorted(range(num_experts), key=lambda e: (-counts[e], e)):
        rank = min((r for r in range(ep) if room[r] > 0), key=lambda r: (loads[r], r))
        rank_of[expert] = rank
        room[rank] -= 1
        loads[rank] += counts[expert]
    _refine(rank_of, counts, ep)
    candidates = [rank_of, linear(num_experts, ep), round_robin(num_experts, ep)]
    return min(candidates, key=lambda p: max(rank_loads(p, counts, ep)))


def _refine(rank_of: list[int], counts: Sequence[float], ep: int) -> None:
    """Swap an expert of the busiest rank with a lighter one elsewhere while that lowers the busiest rank's load
    without making the other rank the new maximum. Expert counts per rank never change."""
    for _ in range(_MAX_REFINE_STEPS):
        loads = rank_loads(rank_of, counts, ep)
        busiest = max(range(ep), key=lambda r: (loads[r], -r))
        best: tuple[float, int, int] | None = None
        for heavy in (e for e, r in enumerate(rank_of) if r == busiest):
            for light, other in enumerate(rank_of):
                delta = counts[heavy] - counts[light]
                if other == busiest or delta <= 0:
                    continue
                new_max = max(loads[busiest] - delta, loads[other] + delta)
                if new_max < loads[busiest] and (best is None or new_max < best[0]):
                    best = (new_max, heavy, light)
        if best is None:
            return
        _, heavy, light = best
        rank_of[heavy], rank_of[light] = rank_of[light], rank_of[heavy]


@dataclass(frozen=True)
class LayerPlacement:
    rank_of: list[int]  # global expert id -> rank
    loads_before: list[float] | None  # tokens per rank under linear placement (None without statistics)
    loads_after: list[float] | None

    def expert_map(self, rank: int) -> list[int]:
        """vLLM's expert_map for ``rank``: global id -> local id, -1 where another rank holds the expert."""
        local, out = 0, []
        for owner in self.rank_of:
            out.append(local if owner == rank else -1)
            local += owner == rank
        return out


def place(strategy: str, num_experts: int, ep: int, counts: Sequence[float] | None = None) -> LayerPlacement:
    if strategy not in PLACEMENTS:
        raise Fp4kitError(f"unknown placement {strategy!r}; choose one of {', '.join(PLACEMENTS)}")
    check_ep(num_experts, ep)
    if strategy == "balanced":
        if counts is None:
            raise Fp4kitError("--placement balanced needs routing statistics (--stats ROUTING_STATS.json)")
        rank_of = balanced(counts, ep)
    else:
        rank_of = linear(num_experts, ep) if strategy == "linear" else round_robin(num_experts, ep)
    if counts is None:
        return LayerPlacement(rank_of, None, None)
    return LayerPlacement(rank_of, rank_loads(linear(num_experts, ep), counts, ep), rank_loads(rank_of, counts, ep))


def check_ep(num_experts: int, ep: int) -> None:
    if ep < 1:
        raise Fp4kitError(f"--ep {ep}: the expert-parallel size must be at least 1")
    if ep > num_experts:
        raise Fp4kitError(f"--ep {ep} exceeds the model's {num_experts} experts per layer: some rank would hold none")


def load_stats(
    path: str | Path, model_type: str | None, num_experts: int, moe_layers: Sequence[int],
    unrouted_layers: Sequence[int] = (),
) -> dict[int, list[float]]:
    """Read and validate routing statistics against the model; returns layer index -> per-expert counts.
    ``unrouted_layers`` (e.g. GLM's MTP layer, which no calibration forward reaches) may be absent: they get equal
    counts, i.e. every placement is balanced for them."""
    path = Path(path)
    if not path.exists():
        raise Fp4kitError(f"{path}: routing statistics file not found")
    stats = read_json(path, "routing statistics file")
    if not isinstance(stats, dict) or not isinstance(stats.get("layers"), dict):
        raise Fp4kitError(f"{path}: routing statistics need an object with a 'layers' object (see fp4kit.ep.placement)")
    if stats.get("model_type") != model_type:
        raise Fp4kitError(f"{path}: statistics are for model_type {stats.get('model_type')!r}, the model is "
                          f"{model_type!r}")
    if stats.get("num_experts") != num_experts:
        raise Fp4kitError(f"{path}: statistics are for {stats.get('num_experts')} experts, the model has {num_experts}")
    wanted = {str(layer) for layer in moe_layers}
    given = set(stats["layers"])
    if given != wanted and not (given < wanted and wanted - given <= {str(layer) for layer in unrouted_layers}):
        missing, extra = sorted(wanted - given, key=int), sorted(given - wanted)
        raise Fp4kitError(f"{path}: statistics do not match the model's MoE layers {sorted(wanted, key=int)} "
                          f"(missing {missing}, unexpected {extra})")
    counts: dict[int, list[float]] = {}
    for key, values in stats["layers"].items():
        ok = isinstance(values, list) and all(
            isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in values
        )
        if not ok or len(values) != num_experts:
            raise Fp4kitError(f"{path}: layer {key} needs {num_experts} non-negative token counts")
        counts[int(key)] = [float(v) for v in values]
    for layer in moe_layers:
        counts.setdefault(layer, [1.0] * num_experts)
    return counts

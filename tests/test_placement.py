"""Expert placements (fp4kit.ep.placement) and routing-statistics validation.

Oracle for `linear` and `round-robin`: vLLM's `determine_expert_map` (vllm/model_executor/layers/fused_moe/layer.py):
base = E // ep, rem = E % ep, local = base + 1 if rank < rem else base; linear starts at rank * base + min(rank, rem);
round_robin holds range(rank, E, ep); local ids in increasing global order, -1 elsewhere.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4kit.ep.placement import (
    balanced,
    imbalance,
    linear,
    load_stats,
    place,
    rank_capacities,
    rank_loads,
    round_robin,
)
from fp4kit.errors import Fp4kitError


def _vllm_expert_map(num_experts: int, ep: int, rank: int, strategy: str) -> list[int]:
    base, rem = divmod(num_experts, ep)
    local = base + 1 if rank < rem else base
    if strategy == "linear":
        start = rank * base + min(rank, rem)
        owned = list(range(start, start + local))
    else:
        owned = list(range(rank, num_experts, ep))
    out = [-1] * num_experts
    for i, g in enumerate(owned):
        out[g] = i
    return out


@pytest.mark.parametrize(
    ("num_experts", "ep"), [(e, n) for e in (1, 4, 7, 8, 60, 128, 160) for n in (1, 2, 3, 4, 8, 16) if n <= e]
)
@pytest.mark.parametrize("strategy", ["linear", "round-robin"])
def test_matches_vllm_expert_map(num_experts: int, ep: int, strategy: str) -> None:
    layer = place(strategy, num_experts, ep)
    for rank in range(ep):
        assert layer.expert_map(rank) == _vllm_expert_map(num_experts, ep, rank, strategy.replace("-", "_"))


def test_linear_equal_split_is_trtllm_offset() -> None:
    # TRT-LLM / FlashInfer CUTLASS: local_expert_offset = rank * E / ep.
    rank_of = linear(128, 8)
    for rank in range(8):
        assert [e for e, r in enumerate(rank_of) if r == rank] == list(range(rank * 16, rank * 16 + 16))


def test_balanced_beats_linear_on_skewed_stats() -> None:
    counts = [1000.0 / (i + 1) for i in range(16)]  # Zipf, hot experts all at the start: linear's worst case
    layer = place("balanced", 16, 4, counts)
    assert layer.loads_before == rank_loads(linear(16, 4), counts, 4)
    assert imbalance(layer.loads_after) < imbalance(layer.loads_before)
    # Expert 0 alone is 1.18x the mean; with 4 experts per rank its rank also holds the 3 coldest: 1.42 is optimal.
    assert imbalance(layer.loads_after) < 1.43 and imbalance(layer.loads_before) > 2.4
    assert sorted(layer.rank_of.count(r) for r in range(4)) == [4, 4, 4, 4]


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 40).flatmap(
        lambda e: st.tuples(
            st.lists(st.integers(0, 10**6), min_size=e, max_size=e),
            st.integers(1, e),
        )
    )
)
def test_balanced_never_worse_and_keeps_expert_counts(case: tuple[list[int], int]) -> None:
    counts, ep = case
    counts_f = [float(c) for c in counts]
    rank_of = balanced(counts_f, ep)
    assert sorted(rank_of) == sorted(linear(len(counts), ep))  # same experts per rank as vLLM's linear
    best = max(rank_loads(rank_of, counts_f, ep))
    assert best <= max(rank_loads(linear(len(counts), ep), counts_f, ep))
    assert best <= max(rank_loads(round_robin(len(counts), ep), counts_f, ep))
    assert best >= max(max(counts_f), sum(counts_f) / ep) - 1e-9  # no placement beats the trivial bound


def test_capacities_follow_remainder_rule() -> None:
    assert rank_capacities(10, 4) == [3, 3, 2, 2]
    assert rank_capacities(8, 8) == [1] * 8


@pytest.mark.parametrize("ep", [0, -1, 9])
def test_bad_ep_is_refused(ep: int) -> None:
    with pytest.raises(Fp4kitError, match="--ep"):
        place("linear", 8, ep)


def test_balanced_without_stats_and_unknown_strategy() -> None:
    with pytest.raises(Fp4kitError, match="--stats"):
        place("balanced", 8, 2)
    with pytest.raises(Fp4kitError, match="unknown placement"):
        place("random", 8, 2)


def _stats(tmp_path, **overrides) -> str:
    stats = {"model_type": "qwen3_moe", "num_experts": 4, "layers": {"0": [1, 2, 3, 4], "1": [0, 0, 5, 1.5]}}
    stats.update(overrides)
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(stats))
    return str(path)


def test_load_stats_ok(tmp_path) -> None:
    counts = load_stats(_stats(tmp_path), "qwen3_moe", 4, [0, 1])
    assert counts == {0: [1.0, 2.0, 3.0, 4.0], 1: [0.0, 0.0, 5.0, 1.5]}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model_type": "glm4_moe"}, "model_type"),
        ({"num_experts": 8}, "8 experts"),
        ({"layers": {"0": [1, 2, 3, 4]}}, "missing"),
        ({"layers": {"0": [1, 2, 3, 4], "1": [1, 2, 3, 4], "7": [1, 2, 3, 4]}}, "unexpected"),
        ({"layers": {"0": [1, 2, 3], "1": [1, 2, 3, 4]}}, "4 non-negative"),
        ({"layers": {"0": [1, 2, -3, 4], "1": [1, 2, 3, 4]}}, "non-negative"),
        ({"layers": {"0": [1, 2, "x", 4], "1": [1, 2, 3, 4]}}, "non-negative"),
        ({"layers": [1, 2]}, "'layers'"),
    ],
)
def test_load_stats_rejects_other_models(tmp_path, overrides: dict, message: str) -> None:
    with pytest.raises(Fp4kitError, match=message):
        load_stats(_stats(tmp_path, **overrides), "qwen3_moe", 4, [0, 1])


def test_load_stats_unrouted_layers_may_be_absent(tmp_path) -> None:
    """GLM's MTP layer has experts but no calibration forward reaches it: absent, it gets equal counts; any other
    missing layer is still a mismatch."""
    counts = load_stats(_stats(tmp_path), "qwen3_moe", 4, [0, 1, 2], unrouted_layers=[2])
    assert counts[2] == [1.0] * 4 and counts[1] == [0.0, 0.0, 5.0, 1.5]
    with pytest.raises(Fp4kitError, match="missing"):
        load_stats(_stats(tmp_path), "qwen3_moe", 4, [0, 1, 2, 3], unrouted_layers=[3])


def test_load_stats_bad_file(tmp_path) -> None:
    with pytest.raises(Fp4kitError, match="not found"):
        load_stats(tmp_path / "nope.json", "qwen3_moe", 4, [0])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(Fp4kitError, match="not valid JSON"):
        load_stats(tmp_path / "bad.json", "qwen3_moe", 4, [0])

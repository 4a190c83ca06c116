"""Checks of what was made from a checkpoint: layout outputs (undone, bit for bit against the checkpoint, and
against the BF16 source) and EP splits (every expert on one rank, rank outputs summing to the unsharded output)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from fp4kit.ep.format import rank_directories
from fp4kit.errors import Fp4kitError
from fp4kit.families.routing import route
from fp4kit.layouts import StackedExperts
from fp4kit.nvfp4 import NVFP4Tensor
from fp4kit.verify.backends import BACKENDS, EXPERT_MAP_BACKEND, dequantized, marlin_runner
from fp4kit.verify.checks import (
    DEFAULT_TOL_SOURCE,
    SIDE_CHECK_TOKENS,
    TOL_EP,
    LayerVerifier,
    activation_divisors,
    relative_error,
    route_batch,
    shared_output,
)
from fp4kit.verify.moe_layer import (
    QuantizedMoe,
    RankExperts,
    SourceMoe,
    layout_transform,
    read_rank_layer,
    undo_layout,
)
from fp4kit.verify.reference import moe_reference


def check_layouts(v: LayerVerifier, source: SourceMoe | None) -> None:
    moe = v.moe
    if v.model.layout is not None:
        stored, rebuilt = layout_transform(v.model.root, moe.layer, moe.experts)
        differ = [k for k in stored if not _same_bytes(stored[k], rebuilt[k])]
        v.add(
            "layout",
            f"{v.model.root.name} (round trip)",
            not differ,
            detail=f"transform(undo) differs in {', '.join(differ)}" if differ else "bit exact",
        )
    for path in v.options.layouts:
        try:
            undone_experts = undo_layout(path, moe.layer)
        except Fp4kitError as exc:
            v.add("layout", str(path), False, detail=f"undo failed: {exc}")
            continue
        differ = _canonical_differences(moe.experts, undone_experts)
        v.add(
            "layout",
            str(path),
            not differ,
            detail=("differs from the checkpoint: " + "; ".join(differ)) if differ else "bit exact",
        )
        if source is not None:
            undone = QuantizedMoe(moe.layer, moe.experts_module, undone_experts, moe.router, moe.shared, moe.biases,
                                   moe.activation)
            _layout_source_error(v, str(path), undone, source)

def _layout_source_error(v: LayerVerifier, target: str, undone: QuantizedMoe, source: SourceMoe) -> None:
    num_tokens = min(max(v.options.tokens), SIDE_CHECK_TOKENS)
    hidden = v.hidden_states(num_tokens)
    logits, weights, ids = route_batch(undone, hidden, v.spec)
    run = BACKENDS["reference"].prepare(undone, v.spec, activation_divisors(undone, v.mode), v.device)
    got = run(hidden, weights, ids, logits) + shared_output(undone.shared, hidden)
    _, src_weights, src_ids = route_batch(source, hidden, v.spec)
    expected = moe_reference(
        hidden, src_weights, src_ids, source.w13.to(v.device), source.w2.to(v.device), v.spec,
        activation=source.activation, biases=source.biases,
    ) + shared_output(source.shared, hidden)
    tolerance = v.options.tol_source or DEFAULT_TOL_SOURCE[v.mode]
    error = relative_error(got, expected)
    v.add("layout-source", target, error <= tolerance, error=error, tolerance=tolerance, tokens=num_tokens)

def check_expert_parallel(v: LayerVerifier, shards: Path) -> None:
    moe, target = v.moe, str(shards)
    rank_dirs = rank_directories(shards)
    ranks = [read_rank_layer(d, r, moe) for r, d in enumerate(rank_dirs)]
    problems = []
    for rank in ranks:
        for e in (rank.mapped & ~rank.held).nonzero().flatten().tolist():
            problems.append(f"rank {rank.rank}: expert {e} is in its expert_map but its tensors are missing")
        for e in (rank.held & ~rank.mapped).nonzero().flatten().tolist():
            problems.append(f"rank {rank.rank}: holds expert {e}, which its expert_map does not list")
    owners = torch.stack([r.mapped & r.held for r in ranks]).sum(dim=0)
    problems += [f"expert {e} is on {int(owners[e])} ranks" for e in range(moe.num_experts) if owners[e] != 1]
    v.add("ep", f"{target} ({len(ranks)} ranks)", not problems, detail="; ".join(problems[:4]))
    num_tokens = min(max(v.options.tokens), SIDE_CHECK_TOKENS)
    hidden = v.hidden_states(num_tokens, salt=3)
    logits, weights, ids = route_batch(moe, hidden, v.spec)
    full = BACKENDS["reference"].prepare(
        moe, v.spec, activation_divisors(moe, v.mode, unified=True), v.device
    )(hidden, weights, ids, logits)
    total = torch.zeros_like(full)
    for rank in ranks:
        w13, w2 = dequantized(rank.moe, v.device)
        rank_logits = rank.moe.router.logits(hidden)
        bias = rank.moe.router.correction_bias
        rank_weights, rank_ids = route(rank_logits, v.spec, None if bias is None else bias.to(v.device))
        total += moe_reference(
            hidden,
            rank_weights,
            rank_ids,
            w13,
            w2,
            v.spec,
            rank.mapped.to(v.device),
            activation_global_div=activation_divisors(rank.moe, v.mode),
            activation=rank.moe.activation,
            biases=rank.moe.biases,
        )
    error = relative_error(total, full)
    v.add(
        "ep-sum",
        f"{target} ({len(ranks)} ranks)",
        error <= TOL_EP,
        error=error,
        tolerance=TOL_EP,
        tokens=num_tokens,
    )
    if EXPERT_MAP_BACKEND in v.runners:
        _expert_map_kernel(v, ranks, f"{target} ({len(ranks)} ranks)", hidden, logits, weights, ids)


def _expert_map_kernel(v: LayerVerifier, ranks: list[RankExperts], target: str, hidden: Tensor, logits: Tensor,
                       weights: Tensor, ids: Tensor) -> None:
    """``ep-kernel``: each rank through the engine's kernel with only its own experts and vLLM's expert_map (global
    id -> local index, -1 for the other ranks' experts), summed over ranks, vs the unsharded reference."""
    name, num_tokens = EXPERT_MAP_BACKEND, len(hidden)
    fits, why = BACKENDS[name].fits(v.device, num_tokens, v.moe, v.spec)
    if not fits:
        v.skip("ep-kernel", f"{name}: {target}", why, tokens=num_tokens)
        return
    expected = v.runners["reference"](hidden, weights, ids, logits)
    total = torch.zeros_like(expected)
    try:
        for rank in ranks:
            local = [int(e) for e in rank.local_index.argsort() if rank.local_index[e] >= 0]
            w13, w2 = rank.moe.w13, rank.moe.w2
            pick = torch.tensor(local, dtype=torch.long)
            run = marlin_runner(
                NVFP4Tensor(w13.packed[pick], w13.block_scale[pick], w13.global_scale_div[pick]),
                NVFP4Tensor(w2.packed[pick], w2.block_scale[pick], w2.global_scale_div[pick]),
                local, v.moe.num_experts, v.spec, v.device, expert_map=True,
            )
            total += run(hidden, weights, ids, logits)
    except Exception as exc:
        v.add("ep-kernel", f"{name}: {target}", False, tokens=num_tokens, detail=f"crashed: {exc!r}"[:300])
        return
    error = relative_error(total, expected)
    v.add("ep-kernel", f"{name}: {target}", error <= v.options.tol_kernel, error=error,
          tolerance=v.options.tol_kernel, tokens=num_tokens)


def _same_bytes(a: Tensor, b: Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8).flatten(), b.contiguous().view(torch.uint8).flatten())
    )


def _canonical_differences(checkpoint: StackedExperts, undone: StackedExperts) -> list[str]:
    pairs = {
        "w13 packed": (checkpoint.w13.packed, undone.w13.packed),
        "w13 block scales": (checkpoint.w13.block_scale, undone.w13.block_scale),
        "w13 global scales": (checkpoint.w13.global_scale_div, undone.w13.global_scale_div),
        "w2 packed": (checkpoint.w2.packed, undone.w2.packed),
        "w2 block scales": (checkpoint.w2.block_scale, undone.w2.block_scale),
        "w2 global scales": (checkpoint.w2.global_scale_div, undone.w2.global_scale_div),
    }
    scales = (checkpoint.input_scale_div13, undone.input_scale_div13, checkpoint.input_scale_div2,
              undone.input_scale_div2)
    if all(s is not None for s in scales):
        pairs.update({"w13 input scales": scales[:2], "w2 input scales": scales[2:]})  # type: ignore[dict-item]
    differ = []
    for what, (ours, theirs) in pairs.items():
        if ours.shape != theirs.shape:
            differ.append(f"{what}: shape {list(theirs.shape)} vs {list(ours.shape)}")
            continue
        flat_ours = ours.contiguous().view(torch.uint8).reshape(ours.shape[0], -1)
        flat_theirs = theirs.contiguous().view(torch.uint8).reshape(theirs.shape[0], -1)
        experts = (flat_ours != flat_theirs).any(dim=1).nonzero().flatten().tolist()
        if experts:
            differ.append(f"{what} of experts {experts[:8]}")
    return differ

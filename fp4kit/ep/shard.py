"""`fp4kit shard`: one checkpoint directory per expert-parallel rank, each loadable on its own (docs/formats.md).

On-disk layout of DST for ``--ep N`` (format ``fp4kit-ep``, version 1; its readers: fp4kit.ep.format)::

    DST/
      fp4kit_shard.json                  summary: ep size, placement, tokens per rank per layer, unified input scales
      _shared/                           everything that is not a routed expert, stored once:
        shared-0000i-of-0000S.safetensors    non-expert tensors (attention, norms, router, shared experts, ...)
        config.json, hf_quant_config.json, tokenizer and other side files, byte for byte from SRC
      rank-00000/ ... rank-{N-1:05d}/     each a HF checkpoint directory:
        shared-*.safetensors, config.json, side files    hard links to _shared (same inode: no extra disk)
        experts-0000i-of-0000X.safetensors   this rank's routed experts, under their global names
                                             (`...experts.{e}.{gate,up,down}_proj.*`, as vLLM-style loaders expect)
        model.safetensors.index.json         every tensor of the rank -> its file
        expert_map.json                      {"ep_size", "ep_rank", "num_experts", "placement", "layers":
                                              {"<layer>": [local id, or -1 if on another rank, per global id]}}
        fp4kit_shard.json                    {"format", "version", "ep_size", "ep_rank", "placement", "input_scales",
                                              "files": {"<path>": {"sha256", "bytes"}} for every other file of the rank}

Hard links share bytes: editing one rank's config.json in place edits every rank's. Local expert ids follow global
order (fp4kit.ep.placement). EP-invariant numerics: when the source stores activation scales per expert
(compressed-tensors ``input_global_scale`` multipliers, ModelOpt ``input_scale`` divisors), every expert of a layer
gets the one of largest amax, per fused projection (gate and up together, down alone), so ranks that reduce over
their local experts only still use the value of EP=1; ``input_scales`` records them (``{"<layer>": {"w13"|"w2":
{"<tensor leaf>": value}}}``). Non-finite or non-positive source values are ignored in that reduction.

Sources: dialect checkpoints (per-expert tensors, as `fp4kit quantize` writes). Layout outputs (a
``fp4kit_layout.json`` manifest) are recognised; sharding them is not implemented yet, and E % N != 0 is refused
for them since their kernels need equal local expert counts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fp4kit.ep.copy import FileEntry, ShardCopier, file_jobs, sha256_file
from fp4kit.ep.format import EXPERT_MAP, FORMAT, MANIFEST, SHARED_DIR, VERSION, rank_dir_name
from fp4kit.ep.inventory import ExpertInventory, scan_experts
from fp4kit.ep.placement import LayerPlacement, check_ep, imbalance, load_stats, place
from fp4kit.ep.scales import unify_input_scales
from fp4kit.errors import Fp4kitError
from fp4kit.families import detect
from fp4kit.io.output import atomic_directory
from fp4kit.io.shard_io import (
    INDEX_NAME,
    ShardLayout,
    SourceTensor,
    copy_side_files,
    hard_link,
    read_config,
    read_tensors,
    write_json,
)

LAYOUT_MANIFEST = "fp4kit_layout.json"


@dataclass
class ShardOptions:
    ep: int
    placement: str = "linear"
    stats: Path | None = None
    max_shard_bytes: int = 5 * 10**9
    overwrite: bool = False


@dataclass
class ShardReport:
    family: str
    num_experts: int
    ep: int
    placement: str
    moe_layers: int
    experts_per_rank: list[int]
    imbalance: dict[int, tuple[float, float]]  # layer -> max/mean tokens per rank (linear, chosen); with --stats
    input_scales_changed: int
    input_bytes: int
    seconds: float
    stats: str | None = None  # the routing statistics used (--stats, or the file found in SRC)
    warnings: list[str] = field(default_factory=list)


# backends that hold E / ep experts on every rank (the expert at global id g lives on rank g // (E / ep)):
# vLLM's TRT-LLM-gen NVFP4 MoE (fused_moe/experts/trtllm_nvfp4_moe.py: local_expert_offset = ep_rank *
# local_num_experts) and FlashInfer's CUTLASS fused MoE (flashinfer/fused_moe/core.py refuses E % ep_size != 0)
EVEN_SPLIT_BACKENDS = "TRT-LLM-gen and FlashInfer CUTLASS MoE"


def uneven_split_warning(num_experts: int, ep: int) -> str | None:
    """The warning for an EP size that does not divide the expert count (None when it does)."""
    if num_experts % ep == 0:
        return None
    counts = [num_experts // ep + (rank < num_experts % ep) for rank in range(ep)]
    return (f"{num_experts} experts over {ep} ranks is uneven ({'/'.join(map(str, counts))} per rank): vLLM's "
            f"Triton and Marlin MoE run it, {EVEN_SPLIT_BACKENDS} need E % ep == 0 (an EP size dividing "
            f"{num_experts})")


def _refuse_layout(src: Path, num_experts: int, ep: int) -> None:
    from fp4kit.layouts import check_expert_parallel

    try:
        backend = json.loads((src / LAYOUT_MANIFEST).read_text()).get("backend", "the layout's kernel")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise Fp4kitError(f"{src / LAYOUT_MANIFEST}: not a valid layout manifest") from None
    check_expert_parallel(num_experts, ep, str(backend))
    raise Fp4kitError(f"{src}: sharding `fp4kit layout` outputs is not supported yet; shard the dialect checkpoint "
                      f"it came from")


def routing_stats(src: Path, options: ShardOptions) -> Path | None:
    """The routing statistics to use: --stats, else for --placement balanced the file a calibrated `fp4kit
    quantize` wrote into SRC."""
    if options.stats is not None:
        return Path(options.stats)
    if options.placement != "balanced":
        return None
    from fp4kit.quantize.input_scales import ROUTING_STATS_NAME

    found = src / ROUTING_STATS_NAME
    if not found.is_file():
        raise Fp4kitError(f"--placement balanced needs routing statistics: --stats ROUTING_STATS.json, or the "
                          f"{ROUTING_STATS_NAME} that a calibrated `fp4kit quantize` writes into SRC (not in {src})")
    return found


def _placements(options: ShardOptions, stats: Path | None, config: dict, num_experts: int,
                layers: list[int]) -> dict[int, LayerPlacement]:
    counts = None
    if stats is not None:
        text_config = config.get("text_config") or config
        decoder_layers = int(text_config.get("num_hidden_layers", max(layers) + 1))
        counts = load_stats(stats, config.get("model_type"), num_experts, layers,
                            unrouted_layers=[layer for layer in layers if layer >= decoder_layers])
    return {layer: place(options.placement, num_experts, options.ep, counts and counts[layer]) for layer in layers}


def shard_checkpoint(
    src: str | Path,
    dst: str | Path,
    options: ShardOptions,
    progress: Callable[[int, int], None] | None = None,
) -> ShardReport:
    """Write ``options.ep`` rank directories of checkpoint ``src`` into ``dst`` (created atomically as a whole)."""
    src, dst = Path(src), Path(dst)
    start = time.perf_counter()
    config = read_config(src)
    family = detect(config)
    num_experts = family.num_experts(family.text_config(config))
    check_ep(num_experts, options.ep)
    if (src / LAYOUT_MANIFEST).exists():
        _refuse_layout(src, num_experts, options.ep)
    tensors = read_tensors(src)
    text_config = family.text_config(config)
    inventory = scan_experts(list(tensors), num_experts, family.grammar,
                             lambda name: family.layer_index(name, text_config))
    if not inventory.modules:
        raise Fp4kitError(f"{src}: no routed expert tensors (`{family.grammar.hint}.*`) found")
    stats = routing_stats(src, options)
    placements = _placements(options, stats, config, num_experts, inventory.layers)
    scales, scale_record, changed = unify_input_scales(tensors, inventory)
    by_owner: dict[int | None, list[SourceTensor]] = {rank: [] for rank in [None, *range(options.ep)]}
    for t in sorted(tensors.values(), key=lambda t: (str(t.file), t.begin)):  # source order: sequential reads
        expert = inventory.experts.get(t.name)
        by_owner[None if expert is None else placements[expert.layer].rank_of[expert.expert]].append(t)
    input_bytes, done = sum(t.nbytes for t in tensors.values()), 0

    def moved(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress:
            progress(done, input_bytes)

    with atomic_directory(dst, src, options.overwrite) as work:
        layouts = {rank: ShardLayout(work / (SHARED_DIR if rank is None else rank_dir_name(rank)), owned,
                                     options.max_shard_bytes, "shared" if rank is None else "experts")
                   for rank, owned in by_owner.items()}
        copier = ShardCopier(moved)
        try:
            for rank, layout in layouts.items():
                for job in file_jobs(layout, by_owner[rank], scales):
                    copier.fill(job)
            checksums = copier.results()
        finally:
            copier.close()
        files = {rank: {f: checksums[out.directory / f] for f in out.files} for rank, out in layouts.items()}
        shared_files = {**files[None], **_copy_small_files(src, work / SHARED_DIR)}
        for rank in range(options.ep):
            _finish_rank(work, rank, layouts[rank], layouts[None], {**files[rank], **shared_files}, shared_files,
                         placements, options, num_experts, scale_record)
        write_json(work / MANIFEST, _summary(family.name, num_experts, options, inventory, placements,
                                             scale_record, shared_files))
    return ShardReport(
        family=family.name, num_experts=num_experts, ep=options.ep, placement=options.placement,
        moe_layers=len(inventory.modules),
        experts_per_rank=[placements[inventory.layers[0]].rank_of.count(r) for r in range(options.ep)],
        imbalance={layer: (imbalance(p.loads_before), imbalance(p.loads_after))
                   for layer, p in placements.items() if p.loads_before is not None and p.loads_after is not None},
        input_scales_changed=changed, input_bytes=input_bytes, seconds=time.perf_counter() - start,
        stats=None if stats is None else str(stats),
        warnings=[w for w in [uneven_split_warning(num_experts, options.ep)] if w],
    )


def _copy_small_files(src: Path, shared_dir: Path) -> dict[str, FileEntry]:
    """config.json (quantization_config kept), hf_quant_config.json and the side files, byte for byte."""
    copied = copy_side_files(src, shared_dir, skip={MANIFEST, EXPERT_MAP, LAYOUT_MANIFEST})
    return {rel: sha256_file(shared_dir / rel) for rel in copied}


def _finish_rank(work: Path, rank: int, layout: ShardLayout, shared: ShardLayout, files: dict[str, FileEntry],
                 shared_files: dict[str, FileEntry], placements: dict[int, LayerPlacement], options: ShardOptions,
                 num_experts: int, scale_record: dict) -> None:
    rank_dir = work / rank_dir_name(rank)
    hard_link(work / SHARED_DIR, rank_dir, list(shared_files))
    weight_map = {**shared.weight_map(), **layout.weight_map()}
    index = {"metadata": {"total_size": shared.total_bytes + layout.total_bytes},
             "weight_map": dict(sorted(weight_map.items()))}
    write_json(rank_dir / INDEX_NAME, index)
    expert_map = {"ep_size": options.ep, "ep_rank": rank, "num_experts": num_experts, "placement": options.placement,
                  "layers": {str(layer): p.expert_map(rank) for layer, p in sorted(placements.items())}}
    write_json(rank_dir / EXPERT_MAP, expert_map)
    for name in (INDEX_NAME, EXPERT_MAP):
        files[name] = sha256_file(rank_dir / name)
    manifest = {"format": FORMAT, "version": VERSION, "ep_size": options.ep, "ep_rank": rank,
                "placement": options.placement, "input_scales": scale_record,
                "files": {rel: entry.as_json() for rel, entry in sorted(files.items())}}
    write_json(rank_dir / MANIFEST, manifest)


def _summary(family: str, num_experts: int, options: ShardOptions, inventory: ExpertInventory,
             placements: dict[int, LayerPlacement], scale_record: dict, shared_files: dict[str, FileEntry]) -> dict:
    load = {
        str(layer): {"tokens_per_rank_linear": p.loads_before, "tokens_per_rank": p.loads_after,
                     "max_over_mean_linear": imbalance(p.loads_before), "max_over_mean": imbalance(p.loads_after)}
        for layer, p in sorted(placements.items()) if p.loads_before is not None and p.loads_after is not None
    }
    return {"format": FORMAT, "version": VERSION, "family": family, "num_experts": num_experts, "ep_size": options.ep,
            "placement": options.placement, "ranks": [rank_dir_name(r) for r in range(options.ep)],
            "moe_modules": {str(layer): m for layer, m in sorted(inventory.modules.items())},
            "load": load, "input_scales": scale_record,
            "shared_files": {rel: e.as_json() for rel, e in sorted(shared_files.items())}}

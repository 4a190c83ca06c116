"""`fp4kit shard`: one checkpoint directory per expert-parallel rank, each loadable on its own (DESIGN.md §6).

On-disk layout of DST for ``--ep N`` (format ``fp4kit-ep``, version 1)::

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
order (fp4kit.placement). EP-invariant numerics: when the source stores activation scales per expert
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
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4kit.checkpoint import INDEX_NAME, CheckpointReader, PlannedTensor, copy_side_files, read_config
from fp4kit.errors import Fp4kitError
from fp4kit.families import detect
from fp4kit.families.base import EXPERT_RE, FUSED_EXPERT_TENSORS, layer_of
from fp4kit.output import atomic_directory, check_destination
from fp4kit.placement import LayerPlacement, check_ep, imbalance, load_stats, place
from fp4kit.shard_io import FileEntry, HashedShardWriter, link_files, read_ahead, sha256_file, write_json

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# Tensor leaf -> which value of a layer is the one of largest amax: the smallest multiplier / the largest divisor.
INPUT_SCALE_LEAVES: dict[str, Callable[[list[float]], float]] = {"input_global_scale": min, "input_scale": max}
LAYOUT_MANIFEST = "fp4kit_layout.json"
MANIFEST = "fp4kit_shard.json"
EXPERT_MAP = "expert_map.json"
SHARED_DIR = "_shared"
FORMAT, VERSION = "fp4kit-ep", 1


@dataclass
class ShardOptions:
    ep: int
    placement: str = "linear"
    stats: Path | None = None
    max_shard_bytes: int = 5 * 10**9
    overwrite: bool = False


@dataclass(frozen=True)
class ExpertTensor:
    layer: int
    expert: int
    proj: str  # gate_proj / up_proj / down_proj
    leaf: str  # what follows the projection: weight_packed, weight_scale, input_global_scale, weight, ...


@dataclass
class ExpertInventory:
    experts: dict[str, ExpertTensor]  # tensor name -> where it belongs
    modules: dict[int, str]  # MoE layer index -> experts module path

    @property
    def layers(self) -> list[int]:
        return sorted(self.modules)


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


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def scan_experts(names: list[str], num_experts: int) -> ExpertInventory:
    """Find the routed experts by their per-expert names and check every MoE layer has E complete experts."""
    experts: dict[str, ExpertTensor] = {}
    modules: dict[int, str] = {}
    for name in names:
        match = EXPERT_RE.search(name)
        if match is None:
            if name.rsplit(".", 1)[-1] in FUSED_EXPERT_TENSORS and ".experts." in f".{name}":
                raise Fp4kitError(f"{name}: fused expert tensor; shard needs per-expert tensors "
                                  f"(`...experts.E.gate_proj.*`), as `fp4kit quantize` writes them")
            continue
        proj, _, leaf = name[match.end():].partition(".")
        layer = layer_of(name)
        if proj not in EXPERT_PROJS or not leaf or layer is None:
            raise Fp4kitError(f"{name}: unrecognised expert tensor (expected layers.L...experts.E."
                              f"{{gate,up,down}}_proj.*)")
        module = name[: match.start()] + ".experts"
        if modules.setdefault(layer, module) != module:
            raise Fp4kitError(f"layer {layer} has experts under two modules: {modules[layer]} and {module}")
        experts[name] = ExpertTensor(layer, int(match.group("expert")), proj, leaf)
    _check_complete(experts, modules, num_experts)
    return ExpertInventory(experts, modules)


def _check_complete(experts: dict[str, ExpertTensor], modules: dict[int, str], num_experts: int) -> None:
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
            if per_expert[(layer, e)] != first or {p for p, _ in first} != set(EXPERT_PROJS):
                raise Fp4kitError(f"{module}.{e}: tensors {sorted(per_expert[(layer, e)])} differ from expert 0's "
                                  f"or lack a projection")


def unify_input_scales(
    reader: CheckpointReader, inventory: ExpertInventory
) -> tuple[dict[str, torch.Tensor], dict, int]:
    """Per layer and fused projection, the activation scale of largest amax, for every expert (module docstring).

    Returns (tensor name -> replacement, for every expert scale tensor; {"<layer>": {"w13"|"w2": {leaf: value}}};
    how many tensors changed value)."""
    groups: dict[tuple[int, str, str], list[str]] = {}
    for name, t in inventory.experts.items():
        if t.leaf in INPUT_SCALE_LEAVES:
            groups.setdefault((t.layer, "w2" if t.proj == "down_proj" else "w13", t.leaf), []).append(name)
    replacements: dict[str, torch.Tensor] = {}
    record: dict[str, dict[str, dict[str, float]]] = {}
    changed = 0
    for (layer, proj, leaf), names in sorted(groups.items()):
        tensors = {n: reader.read(n) for n in names}
        values = [float(v) for t in tensors.values() for v in t.reshape(-1).tolist()]
        usable = [v for v in values if v > 0 and v != float("inf")]
        if not usable or any(t.numel() != 1 for t in tensors.values()):
            raise Fp4kitError(f"{inventory.modules[layer]}: no usable per-tensor {leaf} on any expert ({proj})")
        value = INPUT_SCALE_LEAVES[leaf](usable)
        for n, t in tensors.items():
            replacements[n] = torch.full_like(t, value)
            changed += not torch.equal(replacements[n], t)
        record.setdefault(str(layer), {}).setdefault(proj, {})[leaf] = value
    return replacements, record, changed


def _refuse_layout(src: Path, num_experts: int, ep: int) -> None:
    from fp4kit.layouts import check_expert_parallel

    try:
        backend = json.loads((src / LAYOUT_MANIFEST).read_text()).get("backend", "the layout's kernel")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise Fp4kitError(f"{src / LAYOUT_MANIFEST}: not a valid layout manifest") from None
    check_expert_parallel(num_experts, ep, str(backend))
    raise Fp4kitError(f"{src}: sharding `fp4kit layout` outputs is not supported yet; shard the dialect checkpoint "
                      f"it came from")


def _placements(options: ShardOptions, config: dict, num_experts: int, layers: list[int]) -> dict[int, LayerPlacement]:
    counts = None
    if options.stats is not None:
        counts = load_stats(options.stats, config.get("model_type"), num_experts, layers)
    elif options.placement == "balanced":
        raise Fp4kitError("--placement balanced needs routing statistics (--stats ROUTING_STATS.json)")
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
    check_destination(src, dst, options.overwrite)
    with CheckpointReader(src) as reader:
        inventory = scan_experts(reader.names(), num_experts)
        if not inventory.modules:
            raise Fp4kitError(f"{src}: no routed expert tensors (`...experts.E.{{gate,up,down}}_proj.*`) found")
        placements = _placements(options, config, num_experts, inventory.layers)
        scales, scale_record, changed = unify_input_scales(reader, inventory)
        order = sorted(reader.names(), key=lambda n: (str(reader.info(n).file), reader.info(n).begin))

        def owner(name: str) -> int | None:
            t = inventory.experts.get(name)
            return None if t is None else placements[t.layer].rank_of[t.expert]

        def plan(rank: int | None) -> list[PlannedTensor]:
            infos = (reader.info(n) for n in order if owner(n) == rank)
            return [PlannedTensor(i.name, i.dtype, i.shape) for i in infos]

        input_bytes = sum(reader.info(n).nbytes for n in order)
        with atomic_directory(dst) as work:
            writers = [HashedShardWriter(work / rank_dir_name(r), plan(r), options.max_shard_bytes, "experts")
                       for r in range(options.ep)]
            shared = HashedShardWriter(work / SHARED_DIR, plan(None), options.max_shard_bytes, "shared")
            try:
                done = 0
                for name, tensor in read_ahead(reader, order):
                    rank = owner(name)
                    (shared if rank is None else writers[rank]).write(name, scales.get(name, tensor))
                    done += tensor.numel() * tensor.element_size()
                    if progress:
                        progress(done, input_bytes)
            except BaseException:
                for w in (*writers, shared):
                    w.abort()
                raise
            shared_files = shared.finish()
            shared_files.update(_copy_small_files(src, work / SHARED_DIR))
            for rank, writer in enumerate(writers):
                _finish_rank(work, rank, writer, shared, shared_files, placements, options, num_experts, scale_record)
            write_json(work / MANIFEST, _summary(family.name, num_experts, options, inventory, placements,
                                                 scale_record, shared_files))
    return ShardReport(
        family=family.name, num_experts=num_experts, ep=options.ep, placement=options.placement,
        moe_layers=len(inventory.modules),
        experts_per_rank=[placements[inventory.layers[0]].rank_of.count(r) for r in range(options.ep)],
        imbalance={layer: (imbalance(p.loads_before), imbalance(p.loads_after))
                   for layer, p in placements.items() if p.loads_before is not None and p.loads_after is not None},
        input_scales_changed=changed, input_bytes=input_bytes, seconds=time.perf_counter() - start,
    )


def _copy_small_files(src: Path, shared_dir: Path) -> dict[str, FileEntry]:
    """config.json (quantization_config kept), hf_quant_config.json and the side files, byte for byte."""
    copied = [name for name in ("config.json", "hf_quant_config.json") if (src / name).is_file()]
    for name in copied:
        shutil.copy2(src / name, shared_dir / name)
    copied += copy_side_files(src, shared_dir)
    ours = {MANIFEST, EXPERT_MAP, INDEX_NAME}
    return {rel: sha256_file(shared_dir / rel) for rel in copied if rel not in ours}


def _finish_rank(work: Path, rank: int, writer: HashedShardWriter, shared: HashedShardWriter,
                 shared_files: dict[str, FileEntry], placements: dict[int, LayerPlacement], options: ShardOptions,
                 num_experts: int, scale_record: dict) -> None:
    rank_dir = work / rank_dir_name(rank)
    files = writer.finish()
    link_files(work / SHARED_DIR, rank_dir, list(shared_files))
    files.update(shared_files)
    weight_map = {**shared.weight_map(), **writer.weight_map()}
    index = {"metadata": {"total_size": shared.total_bytes + writer.total_bytes},
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

"""`fp4kit inspect` on every kind of directory fp4kit reads or writes (docs/formats.md, docs/layouts.md):

- ``source``: a checkpoint that is not NVFP4 (bf16, FP8-block, INT4 pack-quantized: fp4kit.io.sources), from its
  headers alone: precision, family, sizes, Linears per layer. Nothing to check: exit 0.
- ``checkpoint``: an NVFP4 checkpoint of either dialect: fp4kit.tools.inspect's health checks.
- ``layout``: the output of `fp4kit layout`: the checkpoint checks on what is not a kernel tensor, its manifest
  (backend, kernel, MoE layers), and every kernel tensor the manifest names against the files (name, dtype, shape),
  the manifest's exact scales finite and positive.
- ``ep-root``: the output of `fp4kit shard`: the root manifest against its ranks (count, rank numbers, placement,
  every expert of every layer on exactly one rank, the shared files' sizes), and each rank as below.
- ``ep-rank``: one rank directory: the checkpoint checks, its manifest and expert map (rank, EP size, placement,
  local ids 0.. in global order), the experts its expert map lists against the experts its tensors hold, and the
  sizes of the files its manifest lists.
- Any of these with ``fp4kit_routing_stats.json`` (a calibrated `fp4kit quantize` output, and what is made from it):
  the statistics against the model (fp4kit.ep.placement.load_stats) and a summary: calibration data, tokens per layer,
  the busiest expert over the mean, experts no token reached.

A file that cannot be read as its kind requires (a manifest that is not JSON, of another format or version) makes
the directory unusable: Fp4kitError, exit 2. Contents that disagree are problems: exit 1.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.io.checkpoint import DTYPE_NAMES, CheckpointReader, read_config
from fp4kit.io.safetensors_files import read_json
from fp4kit.progress import start_phase
from fp4kit.tools.inspect import EP_SIZES, Finding, InspectReport, LayerSummary, _backends, inspect_checkpoint

KINDS = ("source", "checkpoint", "layout", "ep-root", "ep-rank")
SHOWN = 8  # ids or names listed in one finding before "..."


def _read_json(path: Path, what: str) -> dict:
    document = read_json(path, what)
    if not isinstance(document, dict):
        raise Fp4kitError(f"{path}: not a JSON object ({what})")
    return document


def artifact_kind(path: Path) -> str:
    """Which of KINDS ``path`` is, from the files that mark each (without reading tensors)."""
    from fp4kit.ep.format import EXPERT_MAP
    from fp4kit.ep.format import MANIFEST as SHARD_MANIFEST
    from fp4kit.layouts.manifest import MANIFEST as LAYOUT_MANIFEST

    if not path.is_dir():
        raise Fp4kitError(f"{path}: not a directory" if path.exists() else f"{path}: no such directory")
    if (path / SHARD_MANIFEST).is_file() and not (path / "config.json").is_file():
        return "ep-root"
    if (path / SHARD_MANIFEST).is_file() and (path / EXPERT_MAP).is_file():
        return "ep-rank"
    if (path / LAYOUT_MANIFEST).is_file():
        return "layout"
    return "source" if _source_precision(path) is not None else "checkpoint"


def _source_precision(path: Path) -> str | None:
    """The precision of a checkpoint that is not NVFP4 (None: it is, or claims to be, NVFP4)."""
    from fp4kit.formats.detect import config_files
    from fp4kit.io.sources import detect_source

    config = read_config(path)
    quantization = config.get("quantization_config")
    if any((path / name).exists() for name in config_files()):  # a dialect's own config file: NVFP4
        return None
    with CheckpointReader(path) as reader:
        headers = {name: (info.dtype, info.shape) for name, info in reader.tensors.items()}
    source = detect_source(config, headers)
    if source.quantized:
        return source.name
    if quantization or any(dtype == torch.uint8 for dtype, _ in headers.values()):
        return None  # NVFP4 (or a format inspect reports as unusable)
    return source.name


def inspect_path(path: str | Path, backends: list[str] | None = None, ep: int | None = None,
                 engine: str | None = None, progress: Callable[[int, int], None] | None = None) -> InspectReport:
    """Inspect ``path`` as the kind of artifact it is (the module docstring); ``progress``: fp4kit.progress (the
    checkpoint checks count modules, an EP root's ranks one phase each)."""
    path = Path(path)
    kind = artifact_kind(path)
    if kind == "ep-root":
        report = _ep_root(path, backends, ep, engine, progress)
    elif kind == "source":
        report = _source(path)
    else:
        phase = start_phase(progress, "checking", None, "modules", main=True)
        report = inspect_checkpoint(path, backends, ep, engine, phase, layout=kind == "layout")
        report.kind = kind
        if kind == "layout":
            _layout(report, path)
        elif kind == "ep-rank":
            _ep_rank(report, path)
    _routing(report, path)
    _mxfp4_cast(report, path)
    return report


def _mxfp4_cast(report: InspectReport, path: Path) -> None:
    """What `fp4kit quantize` recorded of casting an MXFP4 source: its blocks kept exact and re-quantized."""
    from fp4kit.quantize.checkpoint import MXFP4_CAST_NAME

    if not (path / MXFP4_CAST_NAME).is_file():
        return
    document = _read_json(path / MXFP4_CAST_NAME, "MXFP4 cast counts")
    report.notes.append(f"cast from an MXFP4 source: {document.get('exact_blocks')} NVFP4 blocks hold its values "
                        f"exactly, {document.get('requantized_blocks')} re-quantized ({MXFP4_CAST_NAME})")


def _source(path: Path) -> InspectReport:
    from fp4kit.families import detect
    from fp4kit.families.base import expert_module, layer_of
    from fp4kit.io.sources import PACKED_SUFFIXES
    from fp4kit.tools.inspect import VISION

    config = read_config(path)
    family = detect(config)
    text = family.text_config(config)
    precision = _source_precision(path)
    by_layer: dict[tuple[str, int | None], LayerSummary] = {}
    experts: dict[tuple[str, int | None], set[int]] = {}
    with CheckpointReader(path) as reader:
        for name, info in reader.tensors.items():
            part = "vision" if VISION.search(name) else "text"
            layer = layer_of(name) if part == "text" else None
            summary = by_layer.setdefault((part, layer), LayerSummary(layer, 0, 0, {}, 0, 0, part))
            summary.other_bytes += info.nbytes
            if name.endswith((".weight", PACKED_SUFFIXES[0])) and len(info.shape) == 2:
                summary.quantized_linears += 1  # here: Linears (the column counts them, quantized or not)
                if expert := expert_module(name.rsplit(".", 1)[0]):
                    experts.setdefault((part, layer), set()).add(expert.expert)
    for key, found in experts.items():
        by_layer[key].experts = len(found)
    num_experts = family.num_experts(text)
    hidden = text.get("hidden_size")
    inter = text.get("moe_intermediate_size") or text.get("intermediate_size")
    layers = sorted(by_layer.values(), key=lambda s: (s.part == "vision", -1 if s.layer is None else s.layer))
    return InspectReport(
        str(path), "none", "none", family.name, num_experts, hidden, inter, layers, [],
        _backends(num_experts, hidden, inter, False), [s for s in EP_SIZES if num_experts and num_experts % s == 0],
        kind="source", precision=precision,
        notes=[f"not an NVFP4 checkpoint: a {precision} source (`fp4kit quantize` reads it)"],
    )


def _layout(report: InspectReport, path: Path) -> None:
    from fp4kit.layouts.manifest import SCALE_KEYS, layer_meta, read_manifest

    document = read_manifest(path)
    layers = []
    with CheckpointReader(path) as reader:
        for key, entry in sorted(document["layers"].items(), key=lambda item: int(item[0])):
            meta = layer_meta(document, entry)  # raises on a malformed record
            layer_bytes = 0
            for argument, planned in (entry.get("tensors") or {}).items():
                name = planned.get("name") if isinstance(planned, dict) else None
                if not name or name not in reader:
                    report.problems.append(Finding("layout_tensor", str(name or argument),
                                                   f"layer {key}: the manifest's {argument} is not in the files"))
                    continue
                info = reader.info(name)
                stored = [DTYPE_NAMES.get(info.dtype, str(info.dtype)), list(info.shape)]
                if stored != [planned.get("dtype"), planned.get("shape")]:
                    report.problems.append(Finding("layout_tensor", name, f"stored {stored[0]}{stored[1]}, the "
                                                   f"manifest says {planned.get('dtype')}{planned.get('shape')}"))
                layer_bytes += info.nbytes
            for scale_key, values in zip(SCALE_KEYS, (meta.w13_global_scale_div, meta.w2_global_scale_div,
                                                      meta.input_scale_div13, meta.input_scale_div2), strict=True):
                if values is not None and not bool((torch.isfinite(values) & (values > 0)).all()):
                    report.problems.append(Finding("bad_scale", f"{entry.get('module')}",
                                                   f"layer {key}: manifest scales.{scale_key} holds a zero, negative "
                                                   "or non-finite divisor"))
            for summary in report.layers:
                if summary.part == "text" and summary.layer == int(key):
                    summary.experts = meta.num_experts
                    summary.quantized_bytes += layer_bytes
                    summary.other_bytes -= layer_bytes
            layers.append({"layer": int(key), "module": entry.get("module"), "num_experts": meta.num_experts,
                           "hidden_size": meta.hidden_size, "intermediate_size": meta.intermediate_size,
                           "padded_hidden_size": entry.get("padded_hidden_size"),
                           "padded_intermediate_size": entry.get("padded_intermediate_size")})
    kernel = document.get("kernel") or {}
    report.layout = {"backend": document["backend"], "act_dtype": document["act_dtype"],
                     "options": document.get("options") or {}, "kernel": kernel.get("function"),
                     "kernel_library": f"{kernel.get('library')} {kernel.get('version')}", "layers": layers}
    report.unquantized_modules = [m for m in report.unquantized_modules
                                  if not any(m.startswith(f"{layer['module']}.") for layer in layers)]
    if layers:
        first = layers[0]
        report.num_experts = first["num_experts"]
        report.hidden_size, report.moe_intermediate_size = first["hidden_size"], first["intermediate_size"]
        report.backends = _backends(report.num_experts, report.hidden_size, report.moe_intermediate_size,
                                     report.scheme == "nvfp4a16")
        report.even_ep_sizes = [s for s in EP_SIZES if report.num_experts % s == 0]
    report.notes.append(f"{document['backend']} layout of {len(layers)} MoE layers for "
                        f"{kernel.get('function')} ({kernel.get('library')} {kernel.get('version')}); "
                        f"`fp4kit shard` does not split layouts")


def _held_experts(path: Path) -> dict[int, set[int]]:
    """Per decoder layer, the expert ids whose tensors the rank holds."""
    from fp4kit.families.base import expert_module, layer_of

    held: dict[int, set[int]] = {}
    with CheckpointReader(path) as reader:
        for name in reader.names():
            expert = expert_module(name.rsplit(".", 1)[0])
            layer = layer_of(name)
            if expert and layer is not None:
                held.setdefault(layer, set()).add(expert.expert)
    return held


def _ep_rank(report: InspectReport, path: Path, alone: bool = True) -> dict:
    """The rank's checks (problems into ``report``) and its record: rank, EP size, placement, global ids held;
    ``alone``: the report is the rank's own (not a part of its EP root's), so it gets the record."""
    from fp4kit.ep.format import EXPERT_MAP, MANIFEST, read_expert_map, read_rank_manifest

    manifest, expert_map = read_rank_manifest(path), read_expert_map(path)
    rank, ep_size = manifest.get("ep_rank"), manifest.get("ep_size")
    where = path.name
    for key in ("ep_rank", "ep_size", "placement"):
        if expert_map.get(key) != manifest.get(key):
            report.problems.append(Finding("expert_map", f"{where}/{EXPERT_MAP}", f"{key} {expert_map.get(key)!r}, "
                                           f"the rank's {MANIFEST} says {manifest.get(key)!r}"))
    num_experts = expert_map.get("num_experts")
    held = _held_experts(path)
    experts: dict[str, list[int]] = {}
    for key, local_ids in sorted(expert_map["layers"].items(), key=lambda item: int(item[0])):
        mapped = [e for e, local in enumerate(local_ids) if isinstance(local, int) and local >= 0]
        experts[key] = mapped
        if len(local_ids) != num_experts:
            report.problems.append(Finding("expert_map", f"{where}/{EXPERT_MAP}", f"layer {key} maps "
                                           f"{len(local_ids)} experts, num_experts is {num_experts}"))
        if [local_ids[e] for e in mapped] != list(range(len(mapped))):
            report.problems.append(Finding("expert_map", f"{where}/{EXPERT_MAP}", f"layer {key}: local ids are not "
                                           "0.. in global order"))
        tensors = held.get(int(key), set())
        if missing := sorted(set(mapped) - tensors):
            report.problems.append(Finding("expert_map", f"{where} layer {key}", f"experts {_ids(missing)} are in "
                                           "the expert map but their tensors are missing"))
        if extra := sorted(tensors - set(mapped)):
            report.problems.append(Finding("expert_map", f"{where} layer {key}", f"holds experts {_ids(extra)}, "
                                           "which the expert map does not list"))
    for layer in sorted(set(held) - {int(k) for k in expert_map["layers"]}):
        report.problems.append(Finding("expert_map", f"{where} layer {layer}", "holds experts of a layer the "
                                       "expert map does not list"))
    _check_files(report.problems, path, manifest.get("files"), where)
    record = {"ep_rank": rank, "ep_size": ep_size, "placement": manifest.get("placement"),
              "num_experts": num_experts, "experts": experts}
    if alone:
        report.expert_parallel = record
        report.num_experts = num_experts if isinstance(num_experts, int) else report.num_experts
        report.even_ep_sizes = [s for s in EP_SIZES if report.num_experts and report.num_experts % s == 0]
        counts = sorted({len(ids) for ids in experts.values()})
        report.notes.append(f"rank {rank} of {ep_size} ({manifest.get('placement')} placement): "
                            f"{'/'.join(map(str, counts))} of {num_experts} experts per MoE layer")
    return record


def _check_files(problems: list[Finding], root: Path, files: object, where: str) -> None:
    """Every file a manifest lists exists with the size it records (the sha256 is left to `sha256sum`)."""
    if not isinstance(files, dict):
        problems.append(Finding("ep_files", where, "the manifest lists no files"))
        return
    for relative, entry in sorted(files.items()):
        file = root / relative
        expected = entry.get("bytes") if isinstance(entry, dict) else None
        if not file.is_file():
            problems.append(Finding("ep_files", f"{where}/{relative}", "listed in the manifest, missing"))
        elif expected is not None and file.stat().st_size != expected:
            problems.append(Finding("ep_files", f"{where}/{relative}", f"{file.stat().st_size} bytes, the "
                                           f"manifest says {expected}"))


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:SHOWN])) + (" ..." if len(ids) > SHOWN else "")


def _ep_root(path: Path, backends: list[str] | None, ep: int | None, engine: str | None,
             progress: Callable[[int, int], None] | None) -> InspectReport:
    from fp4kit.ep.format import MANIFEST, SHARED_DIR, read_root_manifest
    from fp4kit.ep.shard import uneven_split_warning

    manifest = read_root_manifest(path)
    names, num_experts, ep_size = manifest["ranks"], manifest["num_experts"], manifest["ep_size"]
    problems: list[Finding] = []
    if len(names) != ep_size:
        problems.append(Finding("ep_split", MANIFEST, f"{len(names)} ranks listed, ep_size is {ep_size}"))
    first: InspectReport | None = None
    ranks, owners = [], {}
    for index, name in enumerate(names):
        rank_dir = path / name
        if not rank_dir.is_dir():
            problems.append(Finding("ep_split", name, "listed in the manifest, missing"))
            continue
        phase = start_phase(progress, f"checking {name} ({index + 1} of {len(names)})", None, "modules", main=True)
        report = inspect_checkpoint(rank_dir, backends, None, engine, phase)
        record = _ep_rank(report, rank_dir, alone=False)
        problems.extend(Finding(p.check, p.module if p.module.startswith(name) else f"{name}: {p.module}", p.detail,
                                p.ratio, p.source) for p in report.problems)
        if record["ep_rank"] != index or record["ep_size"] != ep_size or \
                record["placement"] != manifest.get("placement"):
            problems.append(Finding("ep_split", name, f"rank {record['ep_rank']} of {record['ep_size']} "
                                    f"({record['placement']}), listed as rank {index} of {ep_size} "
                                    f"({manifest.get('placement')})"))
        for layer, ids in record["experts"].items():
            for e in ids:
                owners.setdefault(layer, {}).setdefault(e, []).append(index)
        ranks.append({"rank": index, "directory": name,
                      "experts_per_layer": sorted({len(ids) for ids in record["experts"].values()}),
                      "problems": len(report.problems)})
        first = first or report
    for layer in sorted(manifest.get("moe_modules") or owners, key=int):
        held = owners.get(str(layer), {})
        unowned = [e for e in range(num_experts) if e not in held]
        shared = [e for e, on in sorted(held.items()) if len(on) > 1]
        if unowned:
            problems.append(Finding("ep_split", f"layer {layer}", f"experts {_ids(unowned)} are on no rank"))
        if shared:
            problems.append(Finding("ep_split", f"layer {layer}", f"experts {_ids(shared)} are on several ranks"))
    _check_files(problems, path / SHARED_DIR, manifest.get("shared_files"), SHARED_DIR)
    if ep is not None and num_experts % ep:
        problems.append(Finding("backend_constraint", f"ep={ep}", f"E={num_experts} is not a multiple of {ep} "
                                                                   "(TRT-LLM / FlashInfer CUTLASS)"))
    notes = [f"EP split of {num_experts} experts over {ep_size} ranks ({manifest.get('placement')} placement)"]
    if warning := uneven_split_warning(num_experts, ep_size):
        notes.append(warning)
    moe_layers = sorted(int(layer) for layer in (manifest.get("moe_modules") or owners))
    split = {"ep_size": ep_size, "placement": manifest.get("placement"), "num_experts": num_experts,
             "moe_layers": moe_layers, "ranks": ranks, "load": manifest.get("load") or {}}
    base = first or InspectReport(str(path), "unknown", "unknown", str(manifest.get("family")), num_experts, None,
                                  None, [], [], {})
    return InspectReport(
        str(path), base.dialect, base.scheme, str(manifest.get("family") or base.family), num_experts,
        base.hidden_size, base.moe_intermediate_size, [], problems,
        _backends(num_experts, base.hidden_size, base.moe_intermediate_size, base.scheme == "nvfp4a16"),
        [s for s in EP_SIZES if num_experts % s == 0], engine=engine, kind="ep-root",
        unquantized_modules=base.unquantized_modules, expert_parallel=split, notes=notes,
        module_schemes=base.module_schemes,  # the first rank's groups, counted on that rank
    )


def _routing(report: InspectReport, path: Path) -> None:
    """Summarise and check the routing statistics beside the checkpoint (a calibrated quantize output)."""
    from fp4kit.ep.placement import imbalance, load_stats
    from fp4kit.quantize.input_scales import ROUTING_STATS_NAME

    stats_path = path / ROUTING_STATS_NAME
    if not stats_path.is_file():
        stats_path = path / "_shared" / ROUTING_STATS_NAME  # an EP root keeps its side files there
        if not stats_path.is_file():
            return
    document = _read_json(stats_path, "routing statistics")
    layers = sorted(int(key) for key in (document.get("layers") or {}) if str(key).isdigit())
    moe_layers = layers
    if report.layout is not None:
        moe_layers = [layer["layer"] for layer in report.layout["layers"]]
    elif report.layers:
        moe_layers = [s.layer for s in report.layers if s.experts and s.layer is not None and s.part == "text"]
    elif report.expert_parallel is not None:
        moe_layers = report.expert_parallel["moe_layers"]
    config_type = read_config(stats_path.parent).get("model_type")
    try:
        counts = load_stats(stats_path, config_type, report.num_experts or -1, moe_layers,
                            unrouted_layers=[layer for layer in moe_layers if layer not in layers])
    except Fp4kitError as exc:
        report.problems.append(Finding("routing_stats", ROUTING_STATS_NAME, str(exc).removeprefix(f"{stats_path}: ")))
        return
    unrouted = {layer: sum(1 for c in values if c == 0) for layer, values in counts.items() if layer in layers}
    worst = {layer: imbalance(values) for layer, values in counts.items() if layer in layers and sum(values)}
    report.routing = {
        "file": ROUTING_STATS_NAME, "calibration": document.get("calibration"), "model_type": config_type,
        "layers": len(layers), "tokens_per_layer": int(sum(counts[layers[0]])) if layers else 0,
        "max_over_mean_expert": round(max(worst.values()), 4) if worst else None,
        "unrouted_experts": {str(layer): n for layer, n in unrouted.items() if n},
    }

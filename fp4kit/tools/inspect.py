"""`fp4kit inspect`: what an NVFP4 checkpoint is, per-layer sizes, and the defects that break or skew serving.

Checks (each finding names the check, the module and a ratio where one applies):
- fused_scale_mismatch: q/k/v or gate/up siblings with different weight (or input) global scales; vLLM keeps one
  (w1's, or the max) for the fused GEMM and only warns.
- bad_scale / bad_block_scale: zero, negative, Inf or NaN per-tensor scales (NaN at serve time), NaN or negative FP8
  block scales. missing_input_scale: a W4A4 module without its activation scale.
- expert_input_scale_spread: experts of one layer and projection with different input scales; under expert
  parallelism each rank reduces them over its own experts, so results depend on the EP size.
- quantized_router / quantized_embedding: a router / gate or an embedding stored quantized (engines load them
  unquantized; llm-compressor 0.14's model_free_ptq quantizes embed_tokens).
- nonfinite_weight: NaN or Inf in an unquantized floating tensor, NaN in an FP8 module's weight codes.
- A mixed-precision checkpoint's FP8 modules: bad_scale for a zero, negative, Inf or NaN weight or input scale; the
  report lists every module group's scheme (``module_schemes``).
- backend_constraint: only for the backends / EP size asked for: what `fp4kit layout --backend` refuses (the
  backend's shape rules and a W4A4 kernel on a weight-only checkpoint; fp4kit.layouts.layout_refusal), and E % ep
  for TRT-LLM and FlashInfer CUTLASS. Without a request they are listed, not counted.
- marlin_zeroed_scales (reported, not a problem): per MoE projection, how many block scales vLLM's Marlin
  preparation (bf16) stores as 0 (docs/layouts.md, marlin).
- ``--engine vllm|sglang|trtllm`` adds that engine's load-contract checks (fp4kit/tools/engine_checks.py,
  fp4kit/tools/sglang_checks.py), each citing the engine source it comes from.
Streams: one tensor at a time; packed weights are read only by ``--engine`` (E2M1 codes have no NaN).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import torch

from fp4kit.families.base import ROUTER_RE, expert_module, layer_of, weight_scale_group
from fp4kit.families.grammar import ExpertGrammar
from fp4kit.formats.detect import Fp8Module, QuantizedCheckpoint, QuantModule, open_checkpoint
from fp4kit.layouts import marlin
from fp4kit.registry import BACKEND_NAMES, backends

EMBEDDING = re.compile(r"(embed_tokens|embedding|embeddings)$")
# vision towers and projectors (the families' default ignores): their own "layers.N" are not decoder layers
VISION = re.compile(r"(^|\.)(visual|vision_model|vision_tower|multi_modal_projector)\.")
FORMAT = "fp4kit.inspect/1"  # the JSON report's format and version
EP_SIZES = (2, 4, 8, 16, 32, 64)
BACKENDS = tuple(sorted(BACKEND_NAMES))


@dataclass
class Finding:
    check: str
    module: str
    detail: str
    ratio: float | None = None
    source: str | None = None  # the engine code a load-contract check (--engine) comes from


@dataclass
class LayerSummary:
    layer: int | None  # decoder layer; None: outside the decoder layers (embeddings, lm_head, the vision tower)
    quantized_linears: int
    experts: int
    shapes: dict[str, list[int]]  # projection -> [N, K]
    quantized_bytes: int
    other_bytes: int
    part: str = "text"  # "text" or "vision" (vision towers and projectors)


def _kv_cache(ckpt, problems: list[Finding]) -> dict | None:
    """The FP8 KV cache's scales summarised; a scale that is not a positive finite number is a problem (vLLM reads
    one <= 0 as absent and caches that layer with scale 1)."""
    if ckpt.kv_cache is None:
        return None
    values: dict[str, list[float]] = {"k_scale": [], "v_scale": []}
    for k_name, v_name in ckpt.kv_scales.values():
        for key, name in (("k_scale", k_name), ("v_scale", v_name)):
            value = float(ckpt.reader.read(name, check_finite=False).float().reshape(()))
            if not (value > 0 and math.isfinite(value)):
                problems.append(Finding("kv_cache_scale", name, f"{value}: not a positive finite scale"))
            values[key].append(value)
    return {"scheme": ckpt.kv_cache, "attention_layers": len(ckpt.kv_scales),
            **{key: [min(v), max(v)] for key, v in values.items()}}


@dataclass
class InspectReport:
    path: str
    dialect: str
    scheme: str
    family: str
    num_experts: int | None
    hidden_size: int | None
    moe_intermediate_size: int | None
    layers: list[LayerSummary]
    problems: list[Finding]
    backends: dict[str, str]  # backend -> "ok" or why not
    even_ep_sizes: list[int] = field(default_factory=list)
    # experts module + ".w13" / ".w2" -> block scales vLLM's Marlin path (bf16) stores as 0 (only where some are)
    marlin_zeroed_scales: dict[str, int] = field(default_factory=dict)
    engine: str | None = None
    format: str = FORMAT
    # checkpoint (NVFP4), source (not NVFP4: precision says what), layout, ep-root, ep-rank
    # (fp4kit.tools.inspect_artifacts)
    kind: str = "checkpoint"
    precision: str | None = None  # a source's: bf16, fp8-block, int4-pack-quantized (fp4kit.io.sources)
    unquantized_modules: list[str] = field(default_factory=list)  # Linears (and fused experts) stored unquantized
    layout: dict | None = None  # a layout directory's backend, kernel and MoE layers
    expert_parallel: dict | None = None  # an EP root's or rank's split: ranks, placement, expert map
    routing: dict | None = None  # the routing statistics beside the checkpoint, summarised
    notes: list[str] = field(default_factory=list)  # what is worth knowing and is not a problem
    # a mixed-precision checkpoint's module groups (module_scheme_groups); None for a single-scheme one
    module_schemes: list[dict] | None = None
    # the FP8 KV cache's scales: {"scheme", "attention_layers", "k_scale": [min, max], "v_scale": [min, max]}; None
    kv_cache: dict | None = None

    @property
    def clean(self) -> bool:
        return not self.problems


def _scale_problem(value: float) -> str | None:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Inf"
    if value <= 0:
        return "zero" if value == 0 else "negative"
    return None


def _ratio(values: list[float]) -> float:
    low, high = min(values), max(values)
    return float("inf") if low <= 0 else high / low


def _module_scales(ckpt: QuantizedCheckpoint, m: QuantModule, problems: list[Finding]) -> tuple[float, float | None]:
    weight_div = float(ckpt.divisor(m.global_scale))
    input_div = None if m.input_scale is None else float(ckpt.divisor(m.input_scale))
    for what, value in (("weight global", weight_div), ("input", input_div)):
        if value is not None and (why := _scale_problem(value)):
            problems.append(Finding("bad_scale", m.name, f"{what} scale (as divisor) is {why}"))
    if ckpt.scheme == "nvfp4" and m.input_scale is None:
        problems.append(Finding("missing_input_scale", m.name, "W4A4 module has no input scale"))
    if ROUTER_RE.search(m.name):
        problems.append(Finding("quantized_router", m.name, "router/gate is quantized; engines expect it unquantized"))
    if EMBEDDING.search(m.name):
        problems.append(Finding("quantized_embedding", m.name, "embedding is quantized; engines load it unquantized"))
    return weight_div, input_div


def _block_scale_problems(ckpt: QuantizedCheckpoint, m: QuantModule, problems: list[Finding]) -> numpy.ndarray:
    raw = ckpt.read_weight(m).block_scale.view(torch.uint8) if m.expert is not None \
        else ckpt.reader.read(m.block_scale).view(torch.uint8)
    # one pass over the codes (a few elementwise torch ops per module cost ~10x more, most of it thread start-up)
    counts = numpy.bincount(raw.numpy().reshape(-1), minlength=256)
    nan = int(counts[0x7F] + counts[0xFF])  # E4M3FN's only NaNs: S.1111.111
    negative = int(counts[0x81:0xFF].sum())  # sign set, neither -0 (0x80) nor NaN
    if nan or negative:
        problems.append(Finding("bad_block_scale", m.name, f"{nan} NaN and {negative} negative FP8 block scales "
                                                            f"of {raw.numel()}"))
    return counts


def _fp8_problems(ckpt: QuantizedCheckpoint, m: Fp8Module, problems: list[Finding]) -> None:
    weight, input_div = ckpt.read_fp8(m)
    counts = numpy.bincount(weight.codes.view(torch.uint8).numpy().reshape(-1), minlength=256)
    if nan := int(counts[0x7F] + counts[0xFF]):
        problems.append(Finding("nonfinite_weight", m.name, f"{nan} NaN FP8 weight codes of {weight.codes.numel()}"))
    scale = weight.scale.float()
    for why, bad in (("NaN", scale.isnan()), ("Inf", scale.isinf()), ("zero", scale == 0), ("negative", scale < 0)):
        if count := int(bad.sum()):
            problems.append(Finding("bad_scale", m.name, f"{count} of {scale.numel()} {m.scheme} weight scales are "
                                                         f"{why}"))
    if input_div is not None and (why := _scale_problem(float(input_div))):
        problems.append(Finding("bad_scale", m.name, f"input scale (as divisor) is {why}"))


_NUMBER = re.compile(r"\.\d+(?=\.|$)")


def module_scheme_groups(ckpt: QuantizedCheckpoint) -> list[dict]:
    """Every Linear by group (its name with each layer and expert number as ``*``) and scheme, in the order first
    seen: ``{"modules", "scheme", "count"}``; Linears stored unquantized have scheme ``kept``."""
    groups: dict[tuple[str, str], int] = {}
    schemes = {**ckpt.module_schemes(), **dict.fromkeys(unquantized_modules(ckpt), "kept")}
    for name, scheme in schemes.items():
        key = (_NUMBER.sub(".*", name), scheme)
        groups[key] = groups.get(key, 0) + 1
    return [{"modules": modules, "scheme": scheme, "count": count} for (modules, scheme), count in groups.items()]


def _marlin_zeroed(histograms: dict[str, numpy.ndarray]) -> dict[str, int]:
    """Per MoE projection (all experts together), the scales vLLM's Marlin preparation zeroes (layouts.marlin)."""
    zeroed = {}
    for key, counts in histograms.items():
        histogram = torch.from_numpy(counts.astype(numpy.int64))
        factor = marlin.factor_from_histogram(histogram, torch.bfloat16)
        if count := marlin.zeroed_from_histogram(histogram, factor):
            zeroed[key] = count
    return zeroed


def _group_checks(scales: dict[str, tuple[float, float | None]], problems: list[Finding],
                  grammar: ExpertGrammar) -> None:
    groups: dict[str, list[str]] = {}
    for name in scales:
        if (group := weight_scale_group(name, grammar)) != name:  # q/k/v or gate/up siblings
            groups.setdefault(group, []).append(name)
    for group, members in groups.items():
        if len(members) < 2:
            continue
        parent = group.rsplit("#", 1)[0]
        for kind, index in (("weight global", 0), ("input", 1)):
            values = [scales[m][index] for m in members]
            if any(v is None for v in values) or len(set(values)) == 1:
                continue
            ratio = _ratio(values)  # type: ignore[arg-type]
            leaves = "/".join(m.rsplit(".", 1)[-1] for m in members)
            problems.append(Finding("fused_scale_mismatch", parent, f"{leaves} {kind} scales differ "
                                                                     f"(max/min {ratio:.4g})", ratio))

    spread: dict[tuple[str, str], list[float]] = {}
    for name, (_, input_div) in scales.items():
        expert = expert_module(name, grammar)
        if expert and input_div is not None:
            spread.setdefault((expert.experts, expert.proj), []).append(input_div)
    for (experts, proj), values in spread.items():
        if len(set(values)) > 1:
            ratio = _ratio(values)
            problems.append(Finding("expert_input_scale_spread", f"{experts}.*.{proj}",
                                    f"{len(set(values))} different input scales over {len(values)} experts "
                                    f"(max/min {ratio:.4g}): EP results depend on the EP size", ratio))


def _sizes(ckpt: QuantizedCheckpoint) -> tuple[int | None, int | None, int | None]:
    experts: set[tuple[str, int]] = set()
    hidden = inter = None
    for m in ckpt.modules:
        expert = expert_module(m.name, ckpt.grammar)
        if expert:
            experts.add((expert.experts, expert.expert))
            if expert.fused == "w13":
                inter, hidden = m.out_features, m.in_features
    per_layer: dict[str, int] = {}
    for path, _ in experts:
        per_layer[path] = per_layer.get(path, 0) + 1
    return (max(per_layer.values()) if per_layer else None), hidden, inter


def _backends(num_experts: int | None, hidden: int | None, inter: int | None, weight_only: bool) -> dict[str, str]:
    """Per backend, "ok" or why `fp4kit layout --backend` (with its default options) refuses these sizes and scheme:
    the layout command's own rule (fp4kit.layouts.layout_refusal)."""
    if num_experts is None or hidden is None or inter is None:
        return {b: "no routed experts" for b in BACKENDS}
    from fp4kit.layouts import layout_refusal
    from fp4kit.layouts.directory import LayoutOptions

    modules = backends()
    return {b: layout_refusal(modules[b], num_experts, hidden, inter, weight_only,
                              **LayoutOptions(b).transform_options()) or "ok" for b in BACKENDS}


def _layers(ckpt: QuantizedCheckpoint) -> list[LayerSummary]:
    by_layer: dict[tuple[str, int | None], LayerSummary] = {}
    counted: set[str] = set()

    def entry(name: str) -> LayerSummary:
        part = "vision" if VISION.search(name) else "text"
        layer = layer_of(name) if part == "text" else None
        return by_layer.setdefault((part, layer), LayerSummary(layer, 0, 0, {}, 0, 0, part))

    experts: dict[tuple[str, int | None], set[int]] = {}
    for m in ckpt.modules:
        summary = entry(m.name)
        summary.quantized_linears += 1
        summary.shapes.setdefault(m.name.rsplit(".", 1)[-1], [m.out_features, m.in_features])
        if expert := expert_module(m.name, ckpt.grammar):
            experts.setdefault((summary.part, summary.layer), set()).add(expert.expert)
        for name in (m.packed, m.block_scale, m.global_scale, m.input_scale):
            if name and name not in counted:
                counted.add(name)
                summary.quantized_bytes += ckpt.reader.info(name).nbytes
    for f in ckpt.fp8_modules:
        summary = entry(f.name)
        summary.quantized_linears += 1
        summary.shapes.setdefault(f.name.rsplit(".", 1)[-1], [f.out_features, f.in_features])
        summary.quantized_bytes += sum(ckpt.reader.info(n).nbytes for n in (f.weight, f.scale, f.input_scale) if n)
    for name in ckpt.passthrough:
        entry(name).other_bytes += ckpt.reader.info(name).nbytes
    for key, found in experts.items():
        by_layer[key].experts = len(found)
    return sorted(by_layer.values(), key=lambda s: (s.part == "vision", -1 if s.layer is None else s.layer))


def unquantized_modules(ckpt: QuantizedCheckpoint) -> list[str]:
    """The Linears (and fused expert tensors) the checkpoint stores unquantized: every floating-point passthrough
    tensor of two or more dimensions but the embeddings, by module name."""
    modules = []
    for name in ckpt.passthrough:
        info = ckpt.reader.info(name)
        module = name.removesuffix(".weight")
        if len(info.shape) >= 2 and info.dtype.is_floating_point and info.dtype.itemsize > 1 and \
                not EMBEDDING.search(module):
            modules.append(module)
    return modules


def inspect_checkpoint(path: str | Path, backends: list[str] | None = None, ep: int | None = None,
                       engine: str | None = None, progress: Callable[[int, int], None] | None = None,
                       layout: bool = False) -> InspectReport:
    """Inspect an NVFP4 checkpoint; ``backends`` / ``ep`` turn those constraints into problems, ``engine`` adds that
    engine's load-contract checks (fp4kit.tools.engine_checks); ``progress(done, total)`` counts quantized modules."""
    from fp4kit.errors import Fp4kitError
    from fp4kit.tools.engine_checks import ENGINES, engines, vllm_checks
    from fp4kit.tools.sglang_checks import sglang_checks
    from fp4kit.tools.trtllm_checks import ENGINE as TRTLLM
    from fp4kit.tools.trtllm_checks import trtllm_checks

    if engine is not None and engine not in ENGINES:
        raise Fp4kitError(f"--engine {engine!r}: fp4kit checks {', '.join(ENGINES)}")

    for b in backends or []:
        if b not in BACKENDS:
            raise Fp4kitError(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    if ep is not None and ep < 1:
        raise Fp4kitError(f"--ep {ep}: must be at least 1")
    problems: list[Finding] = []
    with open_checkpoint(path, strict=False, modules_required=not layout, mixed=True) as ckpt:
        # Every per-tensor scale first (tiny reads, cached as small tensors): created one per module between the
        # block-scale buffers below, they left that heap unreusable and inspect grew ~15 MB per 350 MB layer.
        for m in ckpt.modules:
            for name in (m.global_scale, m.input_scale):
                if name is not None:
                    ckpt.divisor(name)
        scales: dict[str, tuple[float, float | None]] = {}
        histograms: dict[str, numpy.ndarray] = {}
        for done, m in enumerate(ckpt.modules):
            if progress:
                progress(done, len(ckpt.modules))
            scales[m.name] = _module_scales(ckpt, m, problems)
            counts = _block_scale_problems(ckpt, m, problems)
            if expert := expert_module(m.name, ckpt.grammar):
                key = f"{expert.experts}.{expert.fused}"
                histograms[key] = histograms[key] + counts if key in histograms else counts
        if progress:
            progress(len(ckpt.modules), len(ckpt.modules))
        _group_checks(scales, problems, ckpt.grammar)
        for m in ckpt.fp8_modules:
            _fp8_problems(ckpt, m, problems)
        notes: list[str] = []
        if engine is not None:
            sources = engines()[engine][1]

            def found(check: str, module: str, detail: str) -> None:
                problems.append(Finding(check, module, detail, source=sources[check]))

            if engine == "vllm":
                vllm_checks(ckpt, scales, found)
            elif engine == TRTLLM:
                trtllm_checks(ckpt, found)
            else:
                sglang_checks(ckpt, scales, found, notes.append)
        for name in ckpt.passthrough:
            info = ckpt.reader.info(name)
            if info.dtype.is_floating_point and info.dtype.itemsize > 1:
                bad = int((~torch.isfinite(ckpt.reader.read(name))).sum())
                if bad:
                    problems.append(Finding("nonfinite_weight", name, f"{bad} NaN/Inf values"))
        kv_cache = _kv_cache(ckpt, problems)
        num_experts, hidden, inter = _sizes(ckpt)
        compat = _backends(num_experts, hidden, inter, ckpt.scheme == "nvfp4a16")
        for b in backends or []:
            if compat[b] != "ok":
                problems.append(Finding("backend_constraint", b, compat[b]))
        if ep is not None and num_experts is not None and num_experts % ep:
            problems.append(Finding("backend_constraint", f"ep={ep}", f"E={num_experts} is not a multiple of "
                                                                       f"{ep} (TRT-LLM / FlashInfer CUTLASS)"))
        return InspectReport(
            str(path), ckpt.dialect, ckpt.scheme, ckpt.family.name if ckpt.family else "unknown", num_experts,
            hidden, inter, _layers(ckpt), problems, compat,
            [s for s in EP_SIZES if num_experts and num_experts % s == 0], _marlin_zeroed(histograms), engine,
            unquantized_modules=unquantized_modules(ckpt), notes=notes,
            module_schemes=module_scheme_groups(ckpt) if ckpt.mixed else None, kv_cache=kv_cache,
        )

"""`fp4kit convert`: rewrite an NVFP4 checkpoint in the other dialect (or the same one), losslessly and streaming.

Packed weights and FP8 block scales are copied byte for byte; only names, per-tensor scale forms and the config
change. Per-tensor scales go through the canonical float64 divisor (fp4kit/formats/detect.py says how values that
fp32 cannot carry in the target form are kept exact). One tensor group at a time is in memory: a reader thread reads
and re-encodes the next groups while the main thread writes, through a queue of bounded depth.

A mixed-precision checkpoint (FP8 Linears beside the NVFP4 ones, quantize --scheme-for) converts too: FP8 codes are
copied byte for byte and their scales change only in shape and dtype, exactly (compressed-tensors keeps them in the
model's dtype, ModelOpt in fp32; going back to compressed-tensors takes the model's dtype when every value is exact
in it), and the target's mixed config names every module's scheme again.

With ``repair``, fused groups are put on one weight global scale and expert projections on one input scale first
(fp4kit/tools/repair.py); that changes values by at most half an FP8 block-scale step and is reported.

Llama-4 experts become ModelOpt's fused [E, K/2, N] tensors when every expert of the layer shares the weight and
input scales (as ModelOpt's own export does); otherwise they stay per-expert, which vLLM also loads, since fusing
them would change values.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import engine_fused_name, fused_siblings, layer_of, routed_expert
from fp4kit.families.grammar import DEFAULT
from fp4kit.formats.base import Dialect, Fp8Module
from fp4kit.formats.detect import (
    EXACT_SCALES_KEY,
    QuantizedCheckpoint,
    QuantModule,
    needs_exact_record,
    open_checkpoint,
)
from fp4kit.fp8 import Fp8Weight
from fp4kit.io.checkpoint import PlannedTensor, ShardWriter, copy_side_files
from fp4kit.io.output import atomic_directory
from fp4kit.io.streaming import prefetched
from fp4kit.nvfp4 import NVFP4Tensor
from fp4kit.quantize.provenance import PROVENANCE_NAME
from fp4kit.registry import DIALECT_NAMES, dialect
from fp4kit.tools import dense
from fp4kit.tools.convert_report import ConvertReport
from fp4kit.tools.repair import RepairReport, rescale, unified_scales

QUEUE_DEPTH = 4


@dataclass
class FusedJob:
    experts: str
    leaf: str  # the grammar's fused gate/up or down tensor
    members: list[QuantModule]  # expert-major; gate before up


Job = QuantModule | FusedJob | Fp8Module | str  # str: a tensor copied unchanged


Scales = dict[str, tuple[torch.Tensor, torch.Tensor | None]]  # module -> (weight divisor, input divisor)


def _scales(ckpt: QuantizedCheckpoint) -> Scales:
    """Every module's per-tensor scales as canonical divisors (tiny reads, done before any data moves)."""
    return {m.name: (ckpt.divisor(m.global_scale), m.input_scale and ckpt.divisor(m.input_scale))
            for m in ckpt.modules}


def _fused_jobs(ckpt: QuantizedCheckpoint, scales: Scales) -> tuple[list[FusedJob], list[str]]:
    """Expert Linears (Llama-4's) that can be written in a fused layout (ModelOpt's) without changing a value."""
    by_leaf: dict[tuple[str, str], dict[int, dict[str, QuantModule]]] = {}
    grammar = ckpt.grammar
    for m in ckpt.modules:
        if expert := routed_expert(m.name, grammar):
            by_leaf.setdefault((expert.experts, expert.fused_leaf), {}).setdefault(expert.expert, {})[expert.proj] = m
    jobs, notes = [], []
    for (experts, leaf), found in by_leaf.items():
        projs = grammar.fused_parts(leaf)
        if sorted(found) != list(range(len(found))) or any(sorted(p) != sorted(projs) for p in found.values()):
            notes.append(f"{experts}.{leaf}: not every expert is quantized; kept per-expert")
            continue
        members = [found[e][p] for e in sorted(found) for p in projs]
        if len({(m.out_features, m.in_features) for m in members}) != 1:
            notes.append(f"{experts}.{leaf}: experts differ in shape; kept per-expert")
            continue
        weights = [torch.equal(scales[m.name][0], scales[members[0].name][0]) for m in members]
        inputs = [scales[m.name][1] for m in members]
        same_inputs = all(i is None for i in inputs) or (
            all(i is not None for i in inputs) and all(torch.equal(i, inputs[0]) for i in inputs))  # type: ignore
        if not (all(weights) and same_inputs):
            notes.append(f"{experts}.{leaf}: experts have different global scales; kept per-expert (lossless)")
            continue
        jobs.append(FusedJob(experts, leaf, members))
    return jobs, notes


def _ignore_for(target: Dialect, ckpt: QuantizedCheckpoint) -> list[str]:
    """The source's ignore list in the target's spelling (Dialect.spell_ignore)."""
    if ckpt.dialect == target.name:
        return list(ckpt.ignore)
    unquantized = sorted({n[: -len(".weight")] for n in ckpt.passthrough  # Linears, not norms
                          if n.endswith(".weight") and len(ckpt.reader.info(n).shape) == 2})
    quantized = [m.name for m in ckpt.modules] + [m.name for m in ckpt.fp8_modules]
    return target.exclusions(target.spell_ignore(list(ckpt.ignore), unquantized), quantized)


def _config_schemes(ckpt: QuantizedCheckpoint, fused: list[FusedJob]) -> dict[str, str]:
    """Each quantized module's scheme as a mixed config names it (what quantize passes the dialect): a fused expert
    tensor by its name, fused siblings also under the name an engine serves them by where no packed-module mapping
    gives it."""
    in_fused = {m.name for job in fused for m in job.members}
    schemes = ckpt.module_schemes()
    out = {f"{job.experts}.{job.leaf}": ckpt.scheme for job in fused}
    for group in fused_siblings([n for n in sorted(schemes, key=_order) if n not in in_fused], ckpt.grammar):
        out.update({m: schemes[m] for m in group})
        alias = engine_fused_name(group) if len(group) > 1 else None
        if alias is not None:
            out[alias] = schemes[group[0]]
    return out


def _fp8_scale_dtypes(ckpt: QuantizedCheckpoint) -> dict[str, torch.dtype]:
    """The dtype each FP8 module's weight was quantized in (compressed-tensors stores its scales in it): the stored
    scales' when they are not fp32; else the model's dtype (config.json) when every scale value is exact in it."""
    from fp4kit.quantize.layer_model import checkpoint_dtype

    model = checkpoint_dtype(ckpt.config)
    out = {}
    for m in ckpt.fp8_modules:
        stored = ckpt.reader.info(m.scale).dtype
        if stored != torch.float32:
            out[m.name] = stored
            continue
        values = [ckpt.reader.read(m.scale)] + ([ckpt.reader.read(m.input_scale)] if m.input_scale else [])
        exact = all(torch.equal(v.to(model).float(), v.float()) for v in values)
        out[m.name] = model if exact else torch.float32
    return out


def _planned(job: Job, target: Dialect, ckpt: QuantizedCheckpoint,
             fp8_dtypes: dict[str, torch.dtype]) -> list[PlannedTensor]:
    if isinstance(job, str):
        info = ckpt.reader.info(job)
        return [PlannedTensor(job, info.dtype, info.shape)]
    if isinstance(job, Fp8Module):
        return target.fp8_planned(job.name, job.scheme, job.out_features, job.in_features, fp8_dtypes[job.name],
                                  job.input_scale is not None)
    if isinstance(job, FusedJob):
        first = job.members[0]
        per_expert = len(ckpt.grammar.fused_parts(job.leaf))
        return target.fused_planned(job.experts, job.leaf, len(job.members) // per_expert,  # type: ignore[attr-defined]
                                    first.out_features * per_expert, first.in_features, first.input_scale is not None)
    return target.planned(job.name, job.out_features, job.in_features, job.input_scale is not None)


def _read(ckpt: QuantizedCheckpoint, module: QuantModule, scales: Scales,
          repaired: RepairReport | None) -> tuple[NVFP4Tensor, torch.Tensor | None]:
    """A module's weight on its (possibly repaired) divisor, and its input divisor."""
    weight = ckpt.read_weight(module)
    weight_div, input_div = scales[module.name]
    if not torch.equal(weight.global_scale_div, weight_div):
        weight, change = rescale(weight, weight_div)
        if repaired is not None:
            repaired.modules_changed.append(module.name)
            repaired.max_abs_change = max(repaired.max_abs_change, change)
    return weight, input_div


def _encode(job: Job, target: Dialect, ckpt: QuantizedCheckpoint, scales: Scales,
            repaired: RepairReport | None, fp8_dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    if isinstance(job, str):
        return {job: ckpt.reader.read(job)}
    if isinstance(job, Fp8Module):
        weight, input_div = ckpt.read_fp8(job)
        return target.fp8_encode(job.name, job.scheme, Fp8Weight(weight.codes, weight.scale.to(fp8_dtypes[job.name])),
                                 input_div)
    if isinstance(job, FusedJob):
        per_expert = len(ckpt.grammar.fused_parts(job.leaf))
        weights, inputs = [], []
        for i in range(0, len(job.members), per_expert):
            parts = [_read(ckpt, m, scales, repaired) for m in job.members[i : i + per_expert]]
            weights.append(NVFP4Tensor(torch.cat([w.packed for w, _ in parts]),
                                       torch.cat([w.block_scale for w, _ in parts]), parts[0][0].global_scale_div))
            inputs.append(parts[0][1])
        return target.encode_fused(job.experts, job.leaf, weights, inputs)  # type: ignore[attr-defined]
    weight, input_div = _read(ckpt, job, scales, repaired)
    return target.encode(job.name, weight, input_div)


def _scale_names(job: Job, target: Dialect) -> dict[str, tuple[str, int]]:
    """Target scale tensor name -> (module, 0 for its weight / 1 for its input divisor) whose value it holds."""
    if isinstance(job, str | Fp8Module):
        return {}
    if isinstance(job, FusedJob):
        first = job.members[0]
        weight, input_ = target.fused_scale_names(job.experts, job.leaf)  # type: ignore[attr-defined]
    else:
        first = job
        weight, input_ = target.scale_names(job.name)
    return {weight: (first.name, 0)} | ({input_: (first.name, 1)} if first.input_scale else {})


def _exact_records(jobs: list[Job], target: Dialect, scales: Scales) -> dict[str, str]:
    pairs = [(out, src) for job in jobs for out, src in _scale_names(job, target).items()]
    if not pairs:
        return {}
    values = torch.stack([scales[module][index] for _, (module, index) in pairs])  # type: ignore[misc]
    needed = needs_exact_record(target.name, values)
    return {out: float(values[i]).hex() for i, (out, _) in enumerate(pairs) if needed[i]}


def _order(job: Job) -> tuple[int, str]:
    name = job if isinstance(job, str) else job.experts if isinstance(job, FusedJob) else job.name
    layer = layer_of(name)
    return (-1 if layer is None else layer, name)


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    to: str,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 10**9,
    progress: Callable[[int, int], None] | None = None,
    repair: bool = False,
) -> ConvertReport:
    """Rewrite NVFP4 checkpoint ``src`` in dialect ``to`` into ``dst`` (created atomically); ``repair`` unifies
    fused-group weight scales and per-projection expert input scales (fp4kit/tools/repair.py). ``to`` "bf16": a dense
    dequantized checkpoint instead (fp4kit/tools/dense.py)."""
    if to == dense.TARGET:
        if repair:
            raise Fp4kitError("--repair rewrites scales for a dialect target; --to bf16 has none")
        return dense.dequantize_checkpoint(src, dst, overwrite, max_shard_bytes, progress)
    if to not in DIALECT_NAMES:
        raise Fp4kitError(f"unknown dialect {to!r}; choose one of {', '.join(DIALECT_NAMES)} (or bf16)")
    target = dialect(to)
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    with open_checkpoint(src, mixed=True) as ckpt:
        missing = [m.name for m in ckpt.modules if ckpt.scheme == "nvfp4" and m.input_scale is None]
        if missing:
            raise Fp4kitError(f"{missing[0]}: missing input scale tensor in a W4A4 checkpoint "
                              f"({len(missing)} modules lack one)")
        scales = _scales(ckpt)
        repaired = RepairReport() if repair else None
        if repaired is not None:
            scales = unified_scales(scales, repaired, ckpt.family.grammar if ckpt.family is not None else DEFAULT)
        fused, notes = _fused_jobs(ckpt, scales) if target.writes_fused(ckpt.family) else ([], [])
        in_fused = {id(m) for job in fused for m in job.members}
        jobs: list[Job] = [*fused, *(m for m in ckpt.modules if id(m) not in in_fused), *ckpt.fp8_modules,
                           *ckpt.passthrough]
        jobs.sort(key=_order)
        exact = _exact_records(jobs, target, scales)
        metadata = {"producer": "fp4kit"} | ({EXACT_SCALES_KEY: json.dumps(exact, sort_keys=True)} if exact else {})
        input_bytes = sum(info.nbytes for info in ckpt.reader.tensors.values())
        ignore = _ignore_for(target, ckpt)
        # before any data moves: a config that cannot be built then costs no copying
        if ckpt.mixed:
            schemes = _config_schemes(ckpt, fused)
            quant_config = target.mixed_quantization_config(schemes, ignore)
            side_configs = target.mixed_side_configs(schemes, ignore)
        else:
            quant_config = target.quantization_config(ckpt.scheme, ignore)
            side_configs = target.side_configs(ckpt.scheme, ignore)
        if ckpt.kv_cache is not None:
            target.add_kv_cache(quant_config, side_configs)
        fp8_dtypes = _fp8_scale_dtypes(ckpt)
        with atomic_directory(dst, src, overwrite) as work:
            planned = [t for job in jobs for t in _planned(job, target, ckpt, fp8_dtypes)]
            planned += [t for attention in ckpt.kv_scales for t in target.kv_planned(attention)]
            writer = ShardWriter(work, planned, max_shard_bytes, metadata=metadata)
            done = 0
            try:
                produce = lambda job: _encode(job, target, ckpt, scales, repaired, fp8_dtypes)  # noqa: E731
                for _, tensors in prefetched(jobs, produce, QUEUE_DEPTH):
                    for name, tensor in tensors.items():
                        writer.write(name, tensor)
                        done += tensor.numel() * tensor.element_size()
                    if progress:
                        progress(min(done, writer.total_bytes), writer.total_bytes)
                for attention in ckpt.kv_scales:  # the FP8 KV cache's scales: the same fp32 divisors, respelled
                    for name, tensor in target.kv_encode(attention, *ckpt.read_kv_scales(attention)).items():
                        writer.write(name, tensor)
            except BaseException:
                writer.abort()
                raise
            writer.finish()
            config = dict(ckpt.config)
            config["quantization_config"] = quant_config
            for name, document in side_configs.items():
                (work / name).write_text(json.dumps(document, indent=4) + "\n")
            (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            copy_side_files(src, work, skip={PROVENANCE_NAME})  # it describes SRC's dialect
    return ConvertReport(
        source_dialect=ckpt.dialect, target_dialect=to, scheme=_scheme_phrase(ckpt),
        family=ckpt.family.name if ckpt.family else "unknown", quantized_modules=len(ckpt.modules),
        fused_tensors=len(fused), passthrough_tensors=len(ckpt.passthrough), exact_scales_recorded=len(exact),
        input_bytes=input_bytes, output_bytes=writer.total_bytes, output_files=writer.files,
        seconds=time.perf_counter() - start, notes=notes, repair=repaired, fp8_modules=len(ckpt.fp8_modules),
    )


def _scheme_phrase(ckpt: QuantizedCheckpoint) -> str:
    """The scheme for the summary line: a mixed-precision checkpoint's every scheme."""
    if not ckpt.mixed:
        return ckpt.scheme
    return "mixed (" + " + ".join(sorted(set(ckpt.module_schemes().values()))) + ")"

"""Which source tensors become which output tensors: the quantization plan, built from headers alone."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field, replace

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.families import detect
from fp4kit.families.base import Candidate, Family, SourceRef, fused_groups, linear_candidates, weight_scale_group
from fp4kit.fp8 import FP8_BLOCK
from fp4kit.io.checkpoint import CheckpointReader, PlannedTensor
from fp4kit.io.sources import (
    Fp8Block,
    Mxfp4,
    QuantizedLinear,
    SourceFormat,
    dequantize,
    model_dtype,
    read_source,
    stored_bytes,
    stored_fp8_block,
    stored_mxfp4_bytes,
)
from fp4kit.native.nvfp4_cpu import Fp8BlockWeight
from fp4kit.nvfp4 import BLOCK, Mxfp4Weight


def _compile(patterns: list[str], what: str) -> list[re.Pattern[str]]:
    compiled = []
    for p in patterns:
        text = p[3:] if p.startswith("re:") else p  # llm-compressor's spelling
        try:
            compiled.append(re.compile(text))
        except re.error as exc:
            raise Fp4kitError(f"{what} pattern {p!r} is not a valid regex: {exc}") from None
    return compiled


@dataclass
class QuantGroup:
    """Linears quantized together with one shared weight global scale (q/k/v, gate/up, or a lone Linear)."""

    members: list[Candidate]

    @property
    def layer(self) -> int | None:
        return self.members[0].layer

    @property
    def sources(self) -> list[str]:
        return sorted({c.linear.source.tensor for c in self.members})

    @property
    def fused_experts_tensor(self) -> str | None:
        """The fused on-disk expert tensor when this group holds all its experts (layer-wide scale), else None."""
        experts = {c.linear.source.expert for c in self.members}
        if None in experts or len(experts) < 2:
            return None
        return self.members[0].linear.source.tensor


@dataclass
class ModelPlan:
    family: Family
    config: dict
    text_config: dict
    groups: list[QuantGroup]
    passthrough: list[str]
    ignored_modules: list[str]  # Linears left unquantized, for the config's ignore list
    jobs: list[QuantGroup | str] = field(default_factory=list)  # execution (and output) order
    source: SourceFormat | None = None  # how SRC stores its Linears (None: unquantized)
    # the scheme of each quantized module where --scheme-for rules give one (fp4kit.quantize.schemes); empty: every
    # module has the default scheme
    schemes: dict[str, str] = field(default_factory=dict)

    def scheme_of(self, group: QuantGroup, default: str) -> str:
        return self.schemes.get(group.members[0].linear.module, default)

    @property
    def stored_fp8(self) -> list[StoredFp8]:
        """The FP8 Linears written as the source stores them (scheme fp8-source)."""
        return [job for job in self.passthrough if isinstance(job, StoredFp8)]


class DequantizedWeight(str):
    """A passthrough job: ``<module>.weight`` of a Linear the source stores quantized and that stays unquantized
    in the output, written dequantized in the model's dtype (fp32 product, one rounding): the engines read an
    ignored module as a plain weight, as llm-compressor's model-free path with compressed-tensors'
    FP8BlockDequantizer writes it."""

    linear: QuantizedLinear
    dtype: torch.dtype

    def __new__(cls, linear: QuantizedLinear, dtype: torch.dtype) -> DequantizedWeight:
        job = super().__new__(cls, f"{linear.module}.weight")
        job.linear, job.dtype = linear, dtype
        return job


class StoredFp8(str):
    """A passthrough job: ``<module>.weight`` of a Linear the source stores as FP8 E4M3 that the output keeps as
    stored (scheme fp8-source): its weight and scale bytes. ``scheme`` is the FP8 scheme that stored form is in a
    dialect's terms (fp8-block for 128x128 blocks, fp8-dynamic per channel; None for any other form, which only the
    source's own config can hold)."""

    linear: QuantizedLinear
    scheme: str | None

    def __new__(cls, linear: QuantizedLinear, scheme: str | None) -> StoredFp8:
        job = super().__new__(cls, f"{linear.module}.weight")
        job.linear, job.scheme = linear, scheme
        return job

    @property
    def tensors(self) -> tuple[str, str]:
        """(weight, scale) as the source names them."""
        enc = self.linear.encoding
        return enc.weight, enc.scale  # type: ignore[union-attr]


def stored_fp8_scheme(reader: CheckpointReader, linear: QuantizedLinear) -> str | None:
    """The FP8 scheme (fp4kit.fp8) an FP8 source Linear's stored form is, where it is one."""
    enc = linear.encoding
    assert isinstance(enc, Fp8Block)
    if enc.block == (FP8_BLOCK, FP8_BLOCK):
        return "fp8-block"
    if enc.block == (1, linear.in_features) and reader.info(enc.scale).shape == (linear.out_features, 1):
        return "fp8-dynamic"
    return None


def build_plan(
    reader: CheckpointReader,
    config: dict,
    ignore: list[str] | None = None,
    targets: list[str] | None = None,
    default_ignore: bool = True,
    modelopt_layout: bool = False,
    dequant_dtype: str = "fp32",
    mtp: str = "keep",
    keep: Collection[str] = (),
    stored: Collection[str] = (),
) -> ModelPlan:
    """``modelopt_layout``: for families whose experts ModelOpt keeps fused (Llama-4), every expert of a fused
    on-disk expert tensor goes into one group (one global scale for all gate/up, one for all down).

    A source that stores Linears quantized (fp4kit.io.sources) plans them as their dequantized [N, K] weights:
    ``dequant_dtype`` fp32 (one rounding) or bf16 (the peers' bf16 intermediate); their scale tensors are consumed,
    and those left unquantized are written dequantized in the model's dtype. ``keep``: module names left unquantized
    like ignored ones (those a scheme rule keeps in bf16). ``stored``: unquantized FP8 Linears of the source written
    as stored (``StoredFp8``), not dequantized."""
    family = detect(config)
    source, shapes = source_view(reader, config, dequant_dtype)
    consumed_by_source = source.consumed()
    text_config = family.check_config(config, shapes)
    candidates = [_with_source(c, source) for c in
                  linear_candidates(shapes, text_config, family.moe_intermediate(text_config), family.grammar)]
    ignore_res = _compile((family.default_ignore(config, mtp) if default_ignore else []) + (ignore or []), "--ignore")
    target_res = _compile(targets or [], "--targets")

    def selected(c: Candidate) -> bool:
        module = c.linear.module
        if module in keep or any(r.search(module) for r in ignore_res):
            return False
        return not target_res or any(r.search(module) for r in target_res)

    chosen = [c for c in candidates if selected(c)]
    if target_res and not chosen:
        raise Fp4kitError(f"--targets {' '.join(targets or [])}: no Linear to quantize matches (after the ignores)")
    for c in chosen:
        if c.linear.in_features % BLOCK:
            raise Fp4kitError(
                f"{c.linear.source.tensor}: input dimension {c.linear.in_features} of {c.linear.module} is not "
                f"divisible by {BLOCK} (NVFP4 blocks); exclude it with --ignore"
            )
        if c.linear.source.quantized is not None:
            continue
        dtype = reader.info(c.linear.source.tensor).dtype
        if not dtype.is_floating_point or dtype.itemsize == 1:
            raise Fp4kitError(f"{c.linear.source.tensor}: dtype {dtype} cannot be quantized (already quantized?)")
    grouped = fused_groups(chosen, family.grammar)
    if modelopt_layout and family.modelopt_fused_experts:
        grouped = _merge_fused_experts(grouped)
    groups = [QuantGroup(g) for g in grouped]
    consumed = {c.linear.source.tensor for c in chosen}
    _check_stored(source, candidates, stored, family)
    ignored_modules = sorted({_ignore_name(c) for c in candidates
                              if c.linear.source.tensor not in consumed and c.linear.module not in stored})
    consumed |= {t for c in chosen if c.linear.source.quantized for t in c.linear.source.quantized.tensors}
    _refuse_partly_kept_fused(source, candidates, chosen)
    passthrough: list[str] = []
    kept_dtype = model_dtype(config)
    for name in reader.names():
        if name in consumed:
            continue
        if name in source.dropped:
            continue
        if name in consumed_by_source:  # a quantized Linear left unquantized: its weight, dequantized
            linear = next(q for q in source.linears.values() if name in q.tensors)
            if name == linear.tensor:
                passthrough.append(StoredFp8(linear, stored_fp8_scheme(reader, linear)) if linear.module in stored
                                   else DequantizedWeight(linear, kept_dtype))
            continue
        passthrough.append(name)

    jobs: list[QuantGroup | str] = [*groups, *passthrough]
    jobs.sort(key=lambda j: _order_key(j.members[0].linear.source.tensor if isinstance(j, QuantGroup) else j))
    return ModelPlan(family, config, text_config, groups, passthrough, ignored_modules, jobs,
                     source if source.quantized else None)


def source_view(reader: CheckpointReader, config: dict,
                dequant_dtype: str = "fp32") -> tuple[SourceFormat, dict[str, tuple[int, ...]]]:
    """How SRC stores its Linears, and its tensors' shapes as the model sees them: a quantized Linear's tensors
    stand in as ``<module>.weight`` [N, K]."""
    source = read_source(reader, config, dequant_dtype)
    consumed = source.consumed()
    shapes = {name: info.shape for name, info in reader.tensors.items() if name not in consumed}
    shapes.update({f"{m}.weight": (q.out_features, q.in_features) for m, q in source.linears.items()})
    shapes.update({name: fused.shape for name, fused in source.fused.items()})
    return source, shapes


def source_candidates(reader: CheckpointReader, config: dict, prefix: str = "",
                      dequant_dtype: str = "fp32") -> list[Candidate]:
    """SRC's Linears whose names start with ``prefix`` (e.g. one layer's experts, for verify --source), as the plan
    sees them: ``read_group_weights`` returns them dequantized when SRC stores them quantized."""
    family = detect(config)
    source, shapes = source_view(reader, config, dequant_dtype)
    text_config = family.text_config(config)
    shapes = {name: shape for name, shape in shapes.items() if name.startswith(prefix)}
    return [_with_source(c, source) for c in
            linear_candidates(shapes, text_config, family.moe_intermediate(text_config), family.grammar)]


def read_linear_weight(reader: CheckpointReader, source: SourceFormat | None, module: str) -> torch.Tensor:
    """``<module>.weight`` as the model sees it: dequantized in fp32 when SRC stores it quantized."""
    quantized = source.linears.get(module) if source is not None else None
    return dequantize(reader, quantized, torch.float32) if quantized else reader.read(f"{module}.weight")


def _with_source(c: Candidate, source: SourceFormat) -> Candidate:
    fused = source.fused.get(c.linear.source.tensor)
    if fused is not None and c.linear.source.expert is not None:  # gpt-oss's MXFP4 experts: this expert's rows
        ref = c.linear.source
        rows = None if ref.span is None else (ref.span[0], ref.span[1], ref.step)
        return replace(c, linear=replace(c.linear, source=replace(
            ref, tensor=fused.blocks, quantized=fused.linear(c.linear.module, ref.expert, rows))))
    quantized = source.linears.get(c.linear.module)
    if quantized is None or c.linear.source.tensor != f"{c.linear.module}.weight":
        return c
    return replace(c, linear=replace(c.linear, source=SourceRef(quantized.tensor, quantized=quantized)))


def _check_stored(source: SourceFormat, candidates: list[Candidate], stored: Collection[str], family: Family
                  ) -> None:
    """Modules kept as stored are FP8 in the source, and their fused siblings (q/k/v, gate/up) are kept so too."""
    if not stored:
        return
    for c in candidates:
        if c.linear.module not in stored:
            continue
        quantized = source.linears.get(c.linear.module)
        if quantized is None or not isinstance(quantized.encoding, Fp8Block):
            what = (f"stored {type(quantized.encoding).__name__}" if quantized is not None
                    else "not quantized in the source")
            raise Fp4kitError(f"--scheme-for fp8-source: {c.linear.source.tensor} ({c.linear.module}) is {what}; "
                              "fp8-source keeps a module the source stores as FP8 E4M3 as it is stored")
    keys = {weight_scale_group(m, family.grammar) for m in stored}
    for c in candidates:
        if c.linear.module not in stored and weight_scale_group(c.linear.module, family.grammar) in keys:
            sibling = next(m for m in stored if weight_scale_group(m, family.grammar)
                           == weight_scale_group(c.linear.module, family.grammar))
            raise Fp4kitError(f"--scheme-for fp8-source: {sibling} is kept as stored but {c.linear.module} is not; "
                              "modules a kernel fuses must share one scheme (match them with one rule)")


def _refuse_partly_kept_fused(source: SourceFormat, candidates: list[Candidate], chosen: list[Candidate]) -> None:
    """A fused MXFP4 tensor is quantized whole: keeping some of its Linears would need them written back in a form
    the engines load beside NVFP4 experts, which fp4kit does not write."""
    if not source.fused:
        return
    picked = {c.linear.module for c in chosen}
    for c in candidates:
        if c.linear.source.tensor in {f.blocks for f in source.fused.values()} and c.linear.module not in picked:
            raise Fp4kitError(f"{c.linear.source.tensor}: {c.linear.module} is left unquantized (--ignore / "
                              "--targets); fp4kit quantizes gpt-oss's MXFP4 experts whole")


def _merge_fused_experts(groups: list[list[Candidate]]) -> list[list[Candidate]]:
    by_tensor: dict[str, list[Candidate]] = {}
    merged: list[list[Candidate]] = []
    for group in groups:
        source = group[0].linear.source
        if source.expert is None:
            merged.append(group)
            continue
        if source.tensor not in by_tensor:
            by_tensor[source.tensor] = []
            merged.append(by_tensor[source.tensor])
        by_tensor[source.tensor].extend(group)
    return merged


def _ignore_name(c: Candidate) -> str:
    # An unselected fused expert tensor stays fused on disk: name the experts module, not a per-expert Linear.
    return c.linear.module if c.linear.source.expert is None else c.linear.source.tensor.rsplit(".", 1)[0]


def _order_key(name: str) -> tuple[int, str]:
    from fp4kit.families.base import layer_of

    layer = layer_of(name)
    return (-1 if layer is None else layer, name)


def planned_passthrough(reader: CheckpointReader, name: str) -> PlannedTensor:
    assert not isinstance(name, StoredFp8)  # its tensors are the dialect's (fp4kit.quantize.checkpoint)
    if isinstance(name, DequantizedWeight):
        return PlannedTensor(name, name.dtype, (name.linear.out_features, name.linear.in_features))
    info = reader.info(name)
    return PlannedTensor(name, info.dtype, info.shape)


def read_job(reader: CheckpointReader, job: QuantGroup | str, device: torch.device | str | None = None,
             fp8_codes: bool = False, mxfp4_codes: bool = False) -> object:
    """A job's data: a group's weights (``read_group_weights``, quantized sources dequantized on ``device``) or a
    passthrough tensor as the output holds it."""
    if isinstance(job, QuantGroup):
        if mxfp4_codes and mxfp4_group(job):
            return [stored_mxfp4(reader, c.linear.source.quantized) for c in job.members]  # type: ignore[arg-type]
        return read_group_weights(reader, job, device, fp8_codes)
    if isinstance(job, DequantizedWeight):
        return dequantize(reader, job.linear, torch.float32).to(job.dtype)
    if isinstance(job, StoredFp8):
        return {name: reader.read(name) for name in job.tensors}
    return reader.read(job)


def job_bytes(reader: CheckpointReader, job: QuantGroup | str) -> int:
    """Bytes a job reads from SRC (for progress and for splitting work between ranks)."""
    if isinstance(job, QuantGroup):
        total = 0
        for c in job.members:
            src = c.linear.source
            if src.quantized is not None:
                total += stored_bytes(reader, src.quantized)
            else:
                total += c.linear.out_features * c.linear.in_features * reader.info(src.tensor).dtype.itemsize
        return total
    if isinstance(job, (DequantizedWeight, StoredFp8)):
        return sum(reader.info(t).nbytes for t in job.linear.tensors)
    return reader.info(job).nbytes


def mxfp4_group(group: QuantGroup) -> bool:
    """Whether every member of the group is stored MXFP4 (the group can be cast to NVFP4 without rounding)."""
    return all(c.linear.source.quantized is not None and isinstance(c.linear.source.quantized.encoding, Mxfp4)
               for c in group.members)


def stored_mxfp4(reader: CheckpointReader, linear: QuantizedLinear) -> Mxfp4Weight:
    """An MXFP4 Linear as its stored code bytes and exponent bytes (fp4kit.nvfp4.cast_mxfp4_group); the code bytes a
    view of the file, which the cast reads little of and writes unchanged (the writer copies them file to file)."""
    enc = linear.encoding
    assert isinstance(enc, Mxfp4)
    return Mxfp4Weight(*stored_mxfp4_bytes(reader, enc, mapped=True))


def read_group_weights(reader: CheckpointReader, group: QuantGroup, device: torch.device | str | None = None,
                       fp8_codes: bool = False) -> list[torch.Tensor | Fp8BlockWeight]:
    """The [N, K] weights of a group's Linears; one fused expert row is read once for gate and up. Linears the
    source stores quantized come dequantized (fp32 or bf16, as planned), on ``device`` when given (a GPU: the
    stored bytes are copied there and dequantized there; other weights stay on the CPU). ``fp8_codes`` (for
    fp4kit.nvfp4.quantize_group with native, on the CPU): FP8-block Linears planned in fp32 come as their stored
    codes where the C loop reads them (``stored_fp8_block``)."""
    rows: dict[tuple[str, int], torch.Tensor] = {}
    weights: list[torch.Tensor | Fp8BlockWeight] = []
    for c in group.members:
        src = c.linear.source
        if src.quantized is not None:
            stored = stored_fp8_block(reader, src.quantized) if fp8_codes and device is None else None
            weights.append(stored if stored is not None else dequantize(reader, src.quantized, device=device))
            continue
        if src.expert is None:
            weights.append(reader.read(src.tensor, check_finite=False))  # quantizing checks them
            continue
        key = (src.tensor, src.expert)
        if key not in rows:
            rows[key] = reader.read_rows(src.tensor, src.expert, src.expert + 1, check_finite=False)[0]
        matrix = rows[key].t() if src.transposed else rows[key]  # [N_total, K]
        if src.span is not None:
            matrix = matrix[src.span[0] : src.span[1] : src.step]
        weights.append(matrix.contiguous())
    return weights

"""`fp4kit quantize`: stream a BF16 checkpoint into an NVFP4 one, one fused group at a time.

Reading, quantizing and writing overlap, so at most a few groups are in memory whatever the model's size. On the
CPU, data-free, each group is read, quantized and written by one of a pool of threads, one per CPU (the reads, the
C loops and the writes release the GIL; fp4kit.io.streaming.produced_in_parallel bounds the groups in flight). On a
GPU, and in the calibrated methods' layer pass, a reader thread prefetches the next group's tensors and a writer
thread places finished tensors in the output shards, both through queues of bounded depth.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import engine_fused_name, weight_scale_group
from fp4kit.formats.base import Dialect
from fp4kit.fp8 import Fp8Weight, fp8_input_scale, fp8_scale_shape, quantize_fp8
from fp4kit.io.checkpoint import CheckpointReader, copy_side_files, read_config
from fp4kit.io.sources import Fp8Block
from fp4kit.io.streaming import BackgroundWriter, cpu_workers, prefetched, produced_in_parallel
from fp4kit.native import nvfp4_cpu
from fp4kit.nvfp4 import Mxfp4Weight, NonFiniteError, NVFP4Tensor, cast_mxfp4_group, quantize_group, quantize_stacked
from fp4kit.progress import start_phase
from fp4kit.progress import warn as warn_progress
from fp4kit.quantize import distributed
from fp4kit.quantize.input_scales import POLICIES, ROUTING_STATS_NAME, input_scale_divisors, write_routing_stats
from fp4kit.quantize.kv_cache import check_kv_cache, kv_cache_attention, kv_scales
from fp4kit.quantize.plan import (
    ModelPlan,
    QuantGroup,
    StoredFp8,
    build_plan,
    job_bytes,
    planned_passthrough,
    read_job,
)
from fp4kit.quantize.scale_search import ScaleSearch, parse_scale_search, quantize_group_mse, quantize_stacked_mse
from fp4kit.quantize.schemes import (
    FP8_SCHEMES,
    KEPT,
    STATIC_INPUT_SCHEMES,
    STORED,
    SchemeMap,
    module_schemes,
    single_nvfp4,
)
from fp4kit.registry import DEFAULT_DIALECT, DIALECT_NAMES, dialect

SCHEMES = ("nvfp4a16", "nvfp4")
METHODS = ("rtn", "mse", "gptq", "awq", "awq+gptq")
# the AWQ methods: the scales folded first (fp4kit.quantize.awq), then the layer quantized by this method
AWQ_METHODS = {"awq": "mse", "awq+gptq": "gptq"}
# --mse-range auto: llm-compressor's expanded-MSE span for data-free mse (on the reference model it beat the RTN
# code's neighbours, docs/quality_methods.md); for calibrated mse and inside GPTQ it measured no better: codes
AUTO_MSE_RANGE = "0.8:1.8"
# where W4A4 input scales of the calibrated methods come from: the quantized model's forward (the pass's own), or
# the source model's (a separate calibration pass first, as rtn does)
INPUT_SCALE_SOURCES = ("auto", "source", "quantized")
FORMATS = DIALECT_NAMES
QUEUE_DEPTH = 3
# beside an output cast from an MXFP4 source: how many NVFP4 16-blocks hold the source's values exactly
MXFP4_CAST_NAME = "fp4kit_mxfp4_cast.json"
# bf16 bytes of same-shape groups quantized in one stacked call: on a GPU enough to amortize launches and downloads
# (the host holds only the prefetched groups); on the CPU one group at a time keeps memory at one group
STACK_BYTES = {"cpu": 0, "cuda": 1 << 26}
# source bytes of the jobs in flight on the CPU's worker threads (one larger job still runs, alone)
PARALLEL_BYTES = 1 << 29


@dataclass
class QuantizeOptions:
    scheme: str = "nvfp4a16"
    format: str = DEFAULT_DIALECT
    device: str = "cpu"
    ignore: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    default_ignore: bool = True
    max_shard_bytes: int = 5 * 10**9
    overwrite: bool = False
    exact_fp32_global_scale: bool = False
    # bf16 weights on the CPU through fp4kit's C encode loop (same bytes as the torch ops, ~20x less CPU)
    native_cpu: bool = True
    # W4A4 (scheme nvfp4) calibration; calib None = the small packaged default set
    calib: Path | None = None
    samples: int | None = None  # None: 256, or all the packaged set holds (fewer, said by no warning)
    seq_len: int = 512
    batch_size: int = 8
    moe_input_scales: str = "shared"
    # the calibration forward's compute dtype: auto (the checkpoint's where the device computes it fast, else fp32:
    # fp4kit.quantize.calibrate.compute_dtype), bf16 or fp32
    dtype: str = "auto"
    # quantized sources (FP8 block, INT pack-quantized): dequantize to fp32 (one rounding) or bf16 (the peers' two)
    dequant_dtype: str = "fp32"
    # rtn: round to nearest (llm-compressor's bytes); mse: block scales by squared-error search (importance-weighted
    # by calibration data when a calibration pass runs: scheme nvfp4, or calib given); gptq: GPTQ (calibrated); awq,
    # awq+gptq: activation-aware scales folded into the layers' producers, then activation-weighted mse or GPTQ
    method: str = "rtn"
    gptq_damp: float = 0.01
    gptq_block_size: int = 128
    gptq_min_tokens: int = 32
    gptq_scales: str = "mse"  # GPTQ block scales: mse search on the error-compensated weights, or rtn
    # GPTAQ: weight of the correction toward the float model's layer outputs (fp4kit.quantize.gptq.float_target)
    gptq_asymmetric: float = 0.0
    gptq_act_order: bool = False  # static-group activation order (fp4kit.quantize.gptq._static_act_order)
    gptq_act_quant: bool = False  # W4A4: GPTQ statistics of fake-quantized inputs (the source pass's input scales)
    # the mse search's candidates (mse, gptq's mse block scales, the fallbacks): "LOW:HIGH" (every E4M3 code in that
    # range of the RTN scale, error exponent mse_norm), "codes" (the RTN code and its neighbours, max-to-4, squared
    # error) or "auto" (AUTO_MSE_RANGE for data-free mse, else codes)
    mse_range: str = "auto"
    mse_norm: float = 2.0

    @property
    def mse_span(self) -> str:
        """--mse-range with auto resolved for the method (what the provenance records)."""
        if self.mse_range != "auto":
            return self.mse_range
        return AUTO_MSE_RANGE if self.method == "mse" and not calibrated_method(self) else "codes"

    @property
    def scale_search(self) -> ScaleSearch | None:
        return parse_scale_search(self.mse_span, self.mse_norm)
    input_scales_from: str = "auto"  # quantized, but source for ModelOpt output (see input_scale_source)
    # MXFP4 source groups under rtn: cast to NVFP4 without rounding (fp4kit.nvfp4.cast_mxfp4_group); False: RTN from
    # their exact values (the CLI's explicit --method rtn)
    cast_mxfp4: bool = True
    # an MTP block outside the decoder layers (Qwen hybrids): keep (as published) or quantize its routed experts
    mtp: str = "keep"
    # per-module schemes, REGEX=SCHEME, first match wins (fp4kit.quantize.schemes); the rest get `scheme`
    scheme_for: list[str] = field(default_factory=list)
    # an FP8 release: its own quantization_config with the NVFP4 routed experts declared in it (the family's
    # source_config_moe_key), every other FP8 Linear as stored under the release's names
    source_config: bool = False
    # fp8: per-layer k_scale / v_scale of an FP8 KV cache, calibrated (fp4kit.quantize.kv_cache); None: none
    kv_cache: str | None = None
    command: str | None = None  # the command line that asked for this, recorded in the output (fp4kit_provenance.json)


@dataclass
class QuantizeReport:
    family: str
    quantized_linears: int
    passthrough_tensors: int
    ignored_modules: list[str]
    input_bytes: int
    output_bytes: int
    output_files: list[str]
    seconds: float
    method: str = "rtn"
    fallback_modules: list[str] = field(default_factory=list)  # gptq / weighted mse: quantized by data-free mse
    scheme: str = "nvfp4a16"
    format: str = DEFAULT_DIALECT
    calibration: dict = field(default_factory=dict)  # data, samples, seq_len, tokens used; empty: none
    warnings: list[str] = field(default_factory=list)  # what the options asked for and did not get, and why
    # MXFP4 source: NVFP4 16-blocks cast exactly and re-quantized (outside the range of the group's global scale)
    mxfp4_cast: dict[str, int] = field(default_factory=dict)


def describe(report: QuantizeReport | dict) -> str:
    """Scheme, dialect, method and calibration data of a QuantizeReport (or its dict, as `fp4kit run` keeps it)."""
    get = report.get if isinstance(report, dict) else lambda key, default=None: getattr(report, key, default)
    calibration = get("calibration") or {}
    data = (f"{calibration['samples']} samples x {calibration['seq_len']} tokens = {calibration['tokens']} tokens "
            f"of {calibration['data']}" if calibration else "no calibration data")
    return f"{get('scheme')} {get('format')}, method {get('method')}, {data}"


def input_scale_source(options: QuantizeOptions) -> str:
    """Where calibrated methods take W4A4 input scales from: the pass's own forward of the quantized layers, except
    for a dialect that records exact input scales (ModelOpt's), which it does before that pass has found them."""
    if options.input_scales_from != "auto":
        return options.input_scales_from
    records = options.format in FORMATS and _format_module(options).records_exact_input_scales
    return "source" if records else "quantized"


def scheme_map(options: QuantizeOptions) -> SchemeMap:
    return SchemeMap.parse(options.scheme, options.scheme_for)


def static_inputs(options: QuantizeOptions) -> bool:
    """Whether some module may get a calibrated static input scale (W4A4 NVFP4 or fp8-static): a calibration pass."""
    return options.scheme in STATIC_INPUT_SCHEMES or any(r.scheme in STATIC_INPUT_SCHEMES
                                                         for r in scheme_map(options).rules)


def group_scheme(plan: ModelPlan, group: QuantGroup, options: QuantizeOptions) -> str:
    return plan.scheme_of(group, options.scheme)


def _validate(options: QuantizeOptions) -> None:
    if options.scheme not in SCHEMES:
        raise Fp4kitError(f"unknown scheme {options.scheme!r}; choose one of {', '.join(SCHEMES)}")
    scheme_map(options)
    if options.moe_input_scales not in POLICIES:
        raise Fp4kitError(f"unknown --moe-input-scales {options.moe_input_scales!r}; choose {' or '.join(POLICIES)}")
    if options.method not in METHODS:
        raise Fp4kitError(f"unknown method {options.method!r}; choose one of {', '.join(METHODS)}")
    fp8_static = any(r.scheme == "fp8-static" for r in scheme_map(options).rules)
    if options.method in AWQ_METHODS and static_inputs(options) and (
            input_scale_source(options) == "source" or fp8_static):
        raise Fp4kitError(f"--method {options.method}: its input scales must come from the folded layers' own "
                          "forward, which this output cannot use (--input-scales-from source, ModelOpt's W4A4 exact "
                          "input scales or an fp8-static --scheme-for take them from the source model's pass); use "
                          "--input-scales-from quantized with compressed-tensors output")
    if options.input_scales_from not in INPUT_SCALE_SOURCES:
        raise Fp4kitError(f"unknown input scale source {options.input_scales_from!r}; choose "
                          f"{' or '.join(INPUT_SCALE_SOURCES)}")
    if (options.method != "rtn" and options.scheme == "nvfp4" and options.format in FORMATS
            and _format_module(options).records_exact_input_scales and options.input_scales_from == "quantized"):
        raise Fp4kitError(f"--input-scales-from quantized: {_format_module(options).title} output records its exact "
                          "input scales before the weights are written, and that pass finds them only as it goes; "
                          "use source")
    if options.mtp not in ("keep", "quantize"):
        raise Fp4kitError(f"unknown --mtp {options.mtp!r}; choose keep or quantize")
    if options.mtp == "quantize" and static_inputs(options):
        raise Fp4kitError("--mtp quantize: no calibration forward reaches the MTP block, so its experts get no "
                          "activation scales; quantize them weight-only (--scheme nvfp4a16, no nvfp4 or fp8-static "
                          "--scheme-for)")
    calibration_dtype(options, {})  # a bad --dtype: one line, before any work
    check_kv_cache(options.kv_cache)
    if options.batch_size < 1:
        raise Fp4kitError(f"--batch-size must be at least 1, got {options.batch_size}")
    if not options.gptq_damp > 0:
        raise Fp4kitError(f"--gptq-damp must be positive, got {options.gptq_damp}")
    if not options.gptq_asymmetric >= 0:
        raise Fp4kitError(f"--gptq-asymmetric must be 0 (off) or positive, got {options.gptq_asymmetric}")
    if options.gptq_asymmetric > 0 and options.method != "gptq":
        raise Fp4kitError(f"--gptq-asymmetric applies to --method gptq, not {options.method}")
    if options.gptq_act_order and options.method != "gptq":
        raise Fp4kitError(f"--gptq-act-order applies to --method gptq, not {options.method}")
    if options.gptq_act_quant and (options.method != "gptq" or options.scheme != "nvfp4"
                                   or input_scale_source(options) != "source"):
        raise Fp4kitError("--gptq-act-quant applies to --method gptq --scheme nvfp4 --input-scales-from source")
    if options.gptq_scales not in ("mse", "rtn"):
        raise Fp4kitError(f"unknown --gptq-scales {options.gptq_scales!r}; choose mse or rtn")
    options.scale_search  # noqa: B018 (a bad --mse-range / --mse-norm: one line, before any work)
    if options.gptq_min_tokens < 1:
        raise Fp4kitError(f"--gptq-min-tokens must be at least 1, got {options.gptq_min_tokens}")
    if options.gptq_block_size < 16 or options.gptq_block_size % 16:
        raise Fp4kitError(f"GPTQ block size must be a positive multiple of 16, got {options.gptq_block_size}")
    if options.format not in FORMATS:
        raise Fp4kitError(f"unknown format {options.format!r}; choose one of {', '.join(FORMATS)}")
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise Fp4kitError(f"--device {options.device}: no CUDA device is available")


def _read_job(reader: CheckpointReader, job: QuantGroup | str, device: str = "cpu", fp8_codes: bool = False,
              mxfp4_codes: bool = False) -> object:
    # a quantized source's stored bytes are dequantized on the GPU when quantizing there
    return read_job(reader, job, device if device.startswith("cuda") else None, fp8_codes, mxfp4_codes)


def _quantizes_fp8_codes(options: QuantizeOptions) -> bool:
    """Whether FP8-block weights reach quantize_tensors as their stored codes: the C loop's RTN encode on the CPU
    reads them directly (the same bytes as from their fp32 values, a quarter of the memory traffic)."""
    return options.method == "rtn" and options.native_cpu and torch.device(options.device).type == "cpu"


def _casts_mxfp4(options: QuantizeOptions) -> bool:
    """Whether MXFP4 groups reach quantize_tensors as their stored bytes, to be cast (RTN's place, data-free)."""
    return options.cast_mxfp4 and options.method == "rtn"


_job_bytes = job_bytes


def _format_module(options: QuantizeOptions) -> Dialect:
    return dialect(options.format)


def _fused_output(group: QuantGroup, options: QuantizeOptions) -> tuple[str, str] | None:
    """(experts module, leaf) when the group is written as one fused expert tensor (ModelOpt's)."""
    tensor = group.fused_experts_tensor
    if tensor is None or not _format_module(options).fused_experts:
        return None
    experts, leaf = tensor.rsplit(".", 1)
    return experts, leaf


def _exact_input_scales(plan: ModelPlan, options: QuantizeOptions, input_divs: dict[str, torch.Tensor]) -> dict:
    """Output of a dialect that records exact input scales (ModelOpt's): the safetensors metadata recording
    calibrated input divisors that its fp32 form does not hold faithfully (fp4kit.formats.detect,
    ``EXACT_SCALES_KEY``), so converting to compressed-tensors restores the multiplier that quantizing to
    compressed-tensors writes. Known before writing: calibration runs first."""
    from fp4kit.formats.detect import EXACT_SCALES_KEY, needs_exact_record

    fmt = _format_module(options)
    if not fmt.records_exact_input_scales or not input_divs:
        return {}
    exact = {}
    for group in plan.groups:
        if group_scheme(plan, group, options) != "nvfp4":
            continue
        fused = _fused_output(group, options)
        for c in group.members:
            divisor = input_divs.get(c.linear.module)
            if divisor is None or not bool(needs_exact_record(fmt.name, divisor.double())):
                continue
            name = fmt.fused_scale_names(*fused)[1] if fused else fmt.scale_names(c.linear.module)[1]  # type: ignore
            exact[name] = float(divisor).hex()
    return {EXACT_SCALES_KEY: json.dumps(exact, sort_keys=True)} if exact else {}


def _per_expert(group: QuantGroup, quantized: list[NVFP4Tensor]) -> list[NVFP4Tensor]:
    """Members are ordered expert by expert (gate then up): join each expert's rows into one [N_total, K]."""
    by_expert: dict[int, list[NVFP4Tensor]] = {}
    for c, q in zip(group.members, quantized, strict=True):
        by_expert.setdefault(c.linear.source.expert, []).append(q)  # type: ignore[arg-type]
    return [
        NVFP4Tensor(torch.cat([q.packed for q in qs]), torch.cat([q.block_scale for q in qs]), qs[0].global_scale_div)
        for _, qs in sorted(by_expert.items())
    ]


def _nonfinite_error(groups: list[QuantGroup], weights: list[list[torch.Tensor]]) -> Fp4kitError:
    for group, group_weights in zip(groups, weights, strict=True):
        for c, w in zip(group.members, group_weights, strict=True):
            if not torch.isfinite(nvfp4_cpu.as_tensor(w)).all():
                return Fp4kitError(
                    f"{c.linear.source.tensor}: NaN or Inf in a weight to be quantized ({c.linear.module})"
                )
    return Fp4kitError("NaN or Inf in a weight to be quantized")


def encode_group(
    group: QuantGroup, quantized: list[NVFP4Tensor], options: QuantizeOptions, input_divs: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The output tensors of one quantized group (members in order) in the chosen dialect."""
    fused = _fused_output(group, options)
    if fused is not None:
        per_expert = _per_expert(group, quantized)
        first_of_expert = {c.linear.source.expert: c.linear.module for c in reversed(group.members)}
        inputs = [input_divs.get(first_of_expert[e]) for e in sorted(first_of_expert)]
        return _format_module(options).encode_fused(*fused, per_expert, inputs)  # type: ignore[attr-defined]
    fmt = _format_module(options)
    out: dict[str, torch.Tensor] = {}
    for c, q in zip(group.members, quantized, strict=True):
        out.update(fmt.encode(c.linear.module, q, input_divs.get(c.linear.module)))
    return out


def quantize_tensors(
    group: QuantGroup, weights: list[torch.Tensor], options: QuantizeOptions, input_divs: dict[str, torch.Tensor],
    cast_counts: dict[str, int] | None = None,
) -> dict:
    """``cast_counts``: where an MXFP4 group (its weights fp4kit.nvfp4.Mxfp4Weight) adds its exact and re-quantized
    16-blocks."""
    device = torch.device(options.device)
    if weights and all(isinstance(w, Mxfp4Weight) for w in weights):
        try:
            cast = cast_mxfp4_group(weights, native=options.native_cpu)  # type: ignore[arg-type]
        except NonFiniteError:
            raise Fp4kitError(f"{group.members[0].linear.source.quantized.encoding.scale}: an E8M0 exponent 255 "  # type: ignore[union-attr]
                              "(NaN) in a weight to be quantized") from None
        if cast_counts is not None:
            cast_counts["exact"] = cast_counts.get("exact", 0) + cast.exact_blocks
            cast_counts["requantized"] = cast_counts.get("requantized", 0) + cast.requantized_blocks
        return encode_group(group, cast.tensors, options, input_divs)
    try:
        on_device = [w if isinstance(w, nvfp4_cpu.Fp8BlockWeight) else w.to(device, non_blocking=True)
                     for w in weights]
        if options.method == "mse":
            quantized = quantize_group_mse(on_device, options.exact_fp32_global_scale, native=options.native_cpu,
                                           search=options.scale_search)
        else:
            quantized = quantize_group(on_device, options.exact_fp32_global_scale, options.native_cpu)
    except NonFiniteError:
        raise _nonfinite_error([group], [weights]) from None
    quantized = [NVFP4Tensor(q.packed.cpu(), q.block_scale.cpu(), q.global_scale_div) for q in quantized]
    return encode_group(group, quantized, options, input_divs)


def fp8_dtype(reader: CheckpointReader, linear_source, options: QuantizeOptions) -> torch.dtype:
    """The dtype an FP8 module's weight is quantized in (its scale's, as compressed-tensors keeps it): the source
    weight's, or the dequantization dtype of a quantized source."""
    if linear_source.quantized is not None:
        return torch.float32 if options.dequant_dtype == "fp32" else torch.bfloat16
    return reader.info(linear_source.tensor).dtype


def fp8_group_tensors(group: QuantGroup, weights: list, scheme: str, options: QuantizeOptions,
                      input_divs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An FP8 group's output tensors: each member quantized on its own (compressed-tensors' FP8 schemes have no
    shared scale), on the CPU, in its source dtype."""
    fmt = _format_module(options)
    out: dict[str, torch.Tensor] = {}
    for c, w in zip(group.members, weights, strict=True):
        weight = nvfp4_cpu.as_tensor(w).cpu()
        if c.linear.source.quantized is not None:
            weight = weight.to(torch.float32 if options.dequant_dtype == "fp32" else torch.bfloat16)
        quantized = quantize_fp8(weight, scheme, c.linear.source.tensor)
        out.update(fmt.fp8_encode(c.linear.module, scheme, quantized, input_divs.get(c.linear.module)))
    return out


class GroupBatcher:
    """Groups whose members have one shape signature, gathered on the device and quantized as one stack
    [B, rows, K]: on a GPU a group of one expert is a few MB, and per-group launches and downloads, not the math,
    would set the pace. One pending stack per signature (experts alternate gate/up and down groups); each stack entry
    keeps its own global scale, so the bytes equal group-by-group quantization and, since every output tensor has a
    planned place, the write order does not matter. Groups that cannot stack (members of different K, ModelOpt's
    fused expert tensors) go alone, and so does every group when max_bytes is 0 (the CPU: no copy into a stack)."""

    def __init__(self, options: QuantizeOptions, input_divs: dict[str, torch.Tensor],
                 emit: Callable[[dict[str, torch.Tensor]], None], max_bytes: int, plan: ModelPlan | None = None):
        self.options, self.input_divs, self.emit, self.max_bytes = options, input_divs, emit, max_bytes
        self.plan = plan
        self.device = torch.device(options.device)
        self.pending: dict[tuple, tuple[list[QuantGroup], list[torch.Tensor]]] = {}
        self.cast_counts: dict[str, int] = {}  # MXFP4 groups cast: their 16-blocks, exact and re-quantized

    def alone(self, group: QuantGroup, weights: list[torch.Tensor], cast_counts: dict[str, int]) -> dict:
        """The output tensors of one group quantized by itself (what ``add`` emits for a group it does not stack);
        safe to call from several threads at once, each with its own ``cast_counts``."""
        scheme = group_scheme(self.plan, group, self.options) if self.plan else self.options.scheme
        if scheme in FP8_SCHEMES:
            return fp8_group_tensors(group, weights, scheme, self.options, self.input_divs)
        return quantize_tensors(group, weights, self.options, self.input_divs, cast_counts)

    def count(self, cast_counts: dict[str, int]) -> None:
        for key, value in cast_counts.items():
            self.cast_counts[key] = self.cast_counts.get(key, 0) + value

    def add(self, group: QuantGroup, weights: list[torch.Tensor]) -> None:
        scheme = group_scheme(self.plan, group, self.options) if self.plan else self.options.scheme
        if (scheme in FP8_SCHEMES or not self.max_bytes or len({w.shape[-1] for w in weights}) != 1
                or _fused_output(group, self.options) is not None or isinstance(weights[0], Mxfp4Weight)):
            self.emit(self.alone(group, weights, self.cast_counts))
            return
        signature = (tuple(w.shape for w in weights), weights[0].dtype)
        groups, rows = self.pending.setdefault(signature, ([], []))
        groups.append(group)
        rows.append(torch.cat([w.to(self.device, non_blocking=True) for w in weights]))
        if len(rows) * rows[0].numel() * rows[0].element_size() >= self.max_bytes:
            self._quantize(*self.pending.pop(signature))

    def flush(self) -> None:
        while self.pending:
            self._quantize(*self.pending.pop(next(iter(self.pending))))

    def _quantize(self, groups: list[QuantGroup], rows: list[torch.Tensor]) -> None:
        try:
            stack = torch.stack(rows) if len(rows) > 1 else rows[0].unsqueeze(0)
            if self.options.method == "mse":
                stacked = quantize_stacked_mse(stack, self.options.exact_fp32_global_scale,
                                               search=self.options.scale_search)
            else:
                stacked = quantize_stacked(stack, self.options.exact_fp32_global_scale, self.options.native_cpu)
        except NonFiniteError:
            members = [list(row.split([c.linear.out_features for c in g.members]))
                       for g, row in zip(groups, rows, strict=True)]
            raise _nonfinite_error(groups, members) from None
        packed, block_scale = stacked.packed.cpu(), stacked.block_scale.cpu()
        for b, group in enumerate(groups):
            sizes = [c.linear.out_features for c in group.members]
            quantized = [
                NVFP4Tensor(p, s, stacked.global_scale_div[b])
                for p, s in zip(packed[b].split(sizes), block_scale[b].split(sizes), strict=True)
            ]
            self.emit(encode_group(group, quantized, self.options, self.input_divs))


def output_plan(reader: CheckpointReader, plan: ModelPlan, options: QuantizeOptions,
                kv_attention: list[str] | None = None) -> list:
    """The output's tensors: the plan's jobs, and the KV-cache scales of ``kv_attention``."""
    fmt = _format_module(options)
    planned = [t for attention in kv_attention or [] for t in fmt.kv_planned(attention)]
    for job in plan.jobs:
        if isinstance(job, StoredFp8):
            planned.extend(stored_fp8_planned(reader, job, options))
            continue
        if not isinstance(job, QuantGroup):
            planned.append(planned_passthrough(reader, job))
            continue
        scheme = group_scheme(plan, job, options)
        with_input = scheme in STATIC_INPUT_SCHEMES
        fused = _fused_output(job, options)
        if scheme in FP8_SCHEMES:
            if fused is not None:
                raise Fp4kitError(f"--scheme-for {scheme}: {fmt.title} keeps {plan.family.name}'s routed experts "
                                  f"fused ({fused[0]}), as NVFP4 only; give them an NVFP4 scheme")
            for c in job.members:
                planned.extend(fmt.fp8_planned(c.linear.module, scheme, c.linear.out_features, c.linear.in_features,
                                               fp8_dtype(reader, c.linear.source, options), with_input))
            continue
        if fused is not None:
            first = job.members[0].linear
            num_experts = len({c.linear.source.expert for c in job.members})
            out_features = sum(c.linear.out_features for c in job.members) // num_experts
            planned.extend(fmt.fused_planned(*fused, num_experts, out_features,  # type: ignore[attr-defined]
                                             first.in_features, with_input))
            continue
        for c in job.members:
            planned.extend(fmt.planned(c.linear.module, c.linear.out_features, c.linear.in_features, with_input))
    return planned


def stored_fp8_planned(reader: CheckpointReader, job: StoredFp8, options: QuantizeOptions) -> list:
    """The output tensors of an FP8 Linear kept as stored, in the dialect's FP8 spelling; an error where the
    dialect cannot hold its stored form."""
    fmt = _format_module(options)
    weight, scale = job.tensors
    if options.source_config:  # the release's own tensors under its own config
        return [planned_passthrough(reader, weight), planned_passthrough(reader, scale)]
    info = reader.info(scale)
    if job.scheme is None:
        raise Fp4kitError(f"--scheme-for fp8-source: {scale} {list(info.shape)} scales {weight} "
                          f"{list(reader.info(weight).shape)} in blocks of {job.linear.encoding.block}; {fmt.title} "  # type: ignore[union-attr]
                          "FP8 holds 128x128 blocks or one scale per output channel (fp8-block / fp8-dynamic)")
    if info.dtype == torch.float8_e8m0fnu:
        raise Fp4kitError(f"--scheme-for fp8-source: {scale} is an E8M0 (power-of-two exponent) scale; {fmt.title} "
                          "stores FP8 scales as floats and vLLM 0.33 loads them into float32 parameters, so it has "
                          "no E8M0 form (keep the module dequantized, or re-quantize it with fp8-block)")
    return fmt.fp8_planned(job.linear.module, job.scheme, job.linear.out_features, job.linear.in_features,
                           info.dtype, False)


def passthrough_tensors(job: str, data: object, options: QuantizeOptions) -> dict[str, torch.Tensor]:
    """A passthrough job's output tensors: the tensor read, or an FP8 Linear kept as stored (its weight and scale
    bytes, read as the source holds them) under the dialect's FP8 names."""
    if not isinstance(job, StoredFp8):
        return {job: data}  # type: ignore[dict-item]
    stored: dict[str, torch.Tensor] = data  # type: ignore[assignment]
    if options.source_config:
        return stored
    weight, scale = job.tensors
    n, k = job.linear.out_features, job.linear.in_features
    canonical = Fp8Weight(stored[weight], stored[scale].reshape(fp8_scale_shape(job.scheme, n, k)))  # type: ignore[arg-type]
    return _format_module(options).fp8_encode(job.linear.module, job.scheme, canonical)  # type: ignore[arg-type]


def _calibration_data(src: Path, plan: ModelPlan, options: QuantizeOptions, warn: Callable[[str], None]
                      ) -> tuple[torch.Tensor | None, dict]:
    """The calibration token ids [S, L] when a calibration pass runs (W4A4, or a calibrated method), and their record
    for the report and the output (``calibration`` in fp4kit_routing_stats.json: docs/formats.md)."""
    if not static_inputs(options) and not calibrated_method(options) and options.kv_cache is None:
        if options.calib is not None:
            warn(f"--calib {options.calib}: not used: --scheme nvfp4a16 with --method {options.method} quantizes "
                 "the weights alone, from no data (--method gptq or mse calibrate on it)")
        return None, {}
    from fp4kit.quantize.calib_data import DEFAULT_SET, load_calibration

    vocab_size = int(plan.text_config["vocab_size"])
    token_ids = load_calibration(options.calib, src, vocab_size, options.samples, options.seq_len, warn)
    samples, seq_len = token_ids.shape
    return token_ids, {"data": str(options.calib) if options.calib is not None else f"fp4kit:{DEFAULT_SET}",
                       "samples": samples, "seq_len": seq_len, "tokens": samples * seq_len}


def calibration_dtype(options: QuantizeOptions, config: dict) -> torch.dtype:
    """The compute dtype of the calibration forward (``options.dtype``; auto: from the checkpoint and the device)."""
    from fp4kit.quantize.calibrate import compute_dtype

    return compute_dtype(options.dtype, torch.device(options.device), config)


def _batches(samples: int, batch_size: int, batch_share: tuple[int, int]) -> int:
    rank, world = batch_share
    return len(range(batch_size * rank, samples, batch_size * world))


def _calibrate(
    src: Path, plan: ModelPlan, options: QuantizeOptions, ranks: distributed.Ranks, token_ids: torch.Tensor | None,
    progress: Callable[[int, int], None] | None = None, kv_attention: list[str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[int, list[int]], dict[str, float]]:
    """W4A4 (or ``kv_attention``, the attention modules whose KV-cache amax it records): a layer-streaming
    calibration pass over SRC before the quantization pass (weights are read twice, activations for all samples stay
    in memory, one layer's weights at a time). Under torchrun each rank runs its share of the batches and the
    statistics are combined. Returns the input divisors, the routing counts and the KV-cache amax."""
    if not (static_inputs(options) or kv_attention) or token_ids is None:
        return {}, {}, {}
    from fp4kit.quantize.calibrate import calibrate
    from fp4kit.quantize.kv_cache import kv_name

    modules = {c.linear.module for g in _static_input_groups(plan, options) for c in g.members}
    batches = _batches(token_ids.shape[0], options.batch_size, ranks.batch_share)
    dtype = calibration_dtype(options, plan.config)
    phase = start_phase(progress, "calibrating", None, "batches", f"{token_ids.shape[0]} samples x "
                        f"{token_ids.shape[1]} tokens, {batches} batches through each decoder layer, "
                        f"{_dtype_name(dtype)}")
    result = calibrate(src, token_ids, options.device, options.batch_size, modules, dtype=dtype,
                       batch_share=ranks.batch_share, progress=phase, config=plan.config, family=plan.family,
                       kv_attention=set(kv_attention or []))
    kv_names = [kv_name(a, part) for a in kv_attention or [] for part in ("k", "v")]
    result = ranks.combine_calibration(result, sorted(modules), kv_names)
    return (static_input_scales(plan, options, plan.groups, result.input_amax), result.routing_counts,
            result.kv_amax)


def _static_input_groups(plan: ModelPlan, options: QuantizeOptions,
                         groups: list[QuantGroup] | None = None) -> list[QuantGroup]:
    return [g for g in (plan.groups if groups is None else groups)
            if group_scheme(plan, g, options) in STATIC_INPUT_SCHEMES]


def static_input_scales(plan: ModelPlan, options: QuantizeOptions, groups: list[QuantGroup],
                        input_amax: dict[str, float]) -> dict[str, torch.Tensor]:
    """float64 input divisors of ``groups``' modules that have static input scales: W4A4 NVFP4 ones by the input
    scale policy (fp4kit.quantize.input_scales), fp8-static ones each from its own amax (as llm-compressor's
    per-module observers)."""
    nvfp4 = [g for g in groups if group_scheme(plan, g, options) == "nvfp4"]
    divisors = input_scale_divisors(replace(plan, groups=nvfp4), input_amax, options.moe_input_scales) if nvfp4 \
        else {}
    for group in groups:
        if group_scheme(plan, group, options) == "fp8-static":
            for c in group.members:
                try:
                    divisors[c.linear.module] = fp8_input_scale(input_amax.get(c.linear.module, 0.0))
                except Fp4kitError as exc:
                    raise Fp4kitError(f"{c.linear.module}: {exc}") from None
    return divisors


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def calibrated_method(options: QuantizeOptions) -> bool:
    """gptq and awq, and mse where a calibration pass runs anyway (W4A4) or calibration text is given: the layer
    pass."""
    if options.method == "gptq" or options.method in AWQ_METHODS:
        return True
    return options.method == "mse" and (static_inputs(options) or options.calib is not None)


def _quantize_calibrated(
    src: Path, reader: CheckpointReader, plan: ModelPlan, options: QuantizeOptions,
    source_input_divs: dict[str, torch.Tensor] | None, put: Callable[[dict[str, torch.Tensor]], None],
    progress: Callable[[int, int], None] | None, token_ids: torch.Tensor, kv_attention: list[str] | None = None,
) -> tuple[list[str], dict[int, list[int]], dict[str, float]]:
    """The calibrated methods: passthrough tensors first, then layer by layer the calibration pass quantizes each
    layer's groups (fp4kit.quantize.gptq.LayerQuantizer) and they are written as soon as the layer's input scales are
    known; groups outside the text model's decoder layers last, by data-free mse. FP8 groups are written with the
    passthrough tensors, round to nearest as llm-compressor's FP8 schemes are (fp8-static's input scales then come
    from the source pass: ``source_input_divs``). ``kv_attention``: the attention modules whose KV-cache amax the
    quantized layers' forward records. Returns the modules that fell back to data-free or weighted mse, the routing
    counts and the KV-cache amax."""
    from fp4kit.quantize.calibrate import calibrate_quantized
    from fp4kit.quantize.gptq import GptqOptions, LayerQuantizer

    method = AWQ_METHODS.get(options.method, options.method)
    folder = _awq_folder(reader, plan, options) if options.method in AWQ_METHODS else None

    dtype = calibration_dtype(options, plan.config)
    batches = _batches(token_ids.shape[0], options.batch_size, (0, 1))
    progress = start_phase(progress, "quantizing", None, "layers", f"{options.method} layer by layer: "
                           f"{token_ids.shape[0]} samples x {token_ids.shape[1]} tokens, {batches} batches through "
                           f"each decoder layer, {_dtype_name(dtype)}", main=True)
    # AWQ changes norm and router weights layer by layer: a decoder layer's passthrough tensors wait for its fold
    deferred: dict[int, list[str]] = {}
    layers = int(plan.text_config["num_hidden_layers"])
    for job in plan.jobs:
        if not isinstance(job, QuantGroup):
            layer = plan.family.layer_index(job, plan.text_config) if isinstance(job, str) else None
            if folder is not None and layer is not None and layer < layers:
                deferred.setdefault(layer, []).append(job)
                continue
            put(passthrough_tensors(job, _read_job(reader, job, options.device), options))

    def put_deferred(index: int) -> None:
        for name in deferred.pop(index, []):
            assert folder is not None
            data = folder.folded.pop(name, None)
            put({name: data} if data is not None else
                passthrough_tensors(name, _read_job(reader, name, options.device), options))

    fp8 = [g for g in plan.groups if group_scheme(plan, g, options) in FP8_SCHEMES]
    for group in fp8:
        put(fp8_group_tensors(group, _read_job(reader, group), group_scheme(plan, group, options), options,
                              source_input_divs or {}))
    nvfp4 = [g for g in plan.groups if group_scheme(plan, g, options) not in FP8_SCHEMES]
    by_layer: dict[int, list[QuantGroup]] = {}
    for group in nvfp4:
        if group.layer is not None:
            by_layer.setdefault(group.layer, []).append(group)
    pending: list[tuple[QuantGroup, list[NVFP4Tensor]]] = []
    quantizer = LayerQuantizer(
        reader, by_layer, method, lambda group, quantized: pending.append((group, quantized)),
        torch.device(options.device), options.exact_fp32_global_scale,
        GptqOptions(options.gptq_damp, options.gptq_block_size, options.gptq_scales == "mse", options.gptq_min_tokens,
                    options.scale_search, options.gptq_asymmetric, options.gptq_act_order),
        native=options.native_cpu,
    )
    with_input = static_inputs(options)

    def divisors(groups: list[QuantGroup], input_amax: dict[str, float]) -> dict[str, torch.Tensor]:
        if not with_input:
            return {}
        if source_input_divs is not None:
            return source_input_divs
        return static_input_scales(plan, options, groups, input_amax)

    def on_layer(index: int, result) -> None:
        divs = divisors([g for g, _ in pending], result.input_amax)
        for group, quantized in pending:
            put(encode_group(group, quantized, options, divs))
        pending.clear()
        put_deferred(index)

    modules = {c.linear.module for g in nvfp4 for c in g.members}
    result = calibrate_quantized(src, token_ids, quantizer, options.device, options.batch_size, modules,
                                 full_hessians=method == "gptq", dtype=dtype, on_layer=on_layer,
                                 input_amax=with_input, config=plan.config, family=plan.family, progress=progress,
                                 kv_attention=set(kv_attention or []), prepare_layer=folder,
                                 float_targets=method == "gptq" and options.gptq_asymmetric > 0,
                                 activation_divisors=source_input_divs if options.gptq_act_quant else None)
    for index in sorted(deferred):  # layers the pass did not reach (none: every decoder layer streams)
        put_deferred(index)
    if folder is not None and folder.folded:
        raise Fp4kitError(f"--method {options.method}: folded {sorted(folder.folded)[0]}, which the output does not "
                          "carry as a tensor of its own")
    rest = [g for g in nvfp4 if id(g) not in quantizer.done]
    divs = divisors(rest, result.input_amax)
    fallbacks = list(quantizer.fallbacks)
    for group in rest:
        weights = _read_job(reader, group, options.device)
        try:
            quantized = quantize_group_mse([w.to(options.device) for w in weights], options.exact_fp32_global_scale,
                                           native=options.native_cpu, search=options.scale_search)
        except NonFiniteError:
            raise _nonfinite_error([group], [weights]) from None
        quantized = [NVFP4Tensor(q.packed.cpu(), q.block_scale.cpu(), q.global_scale_div) for q in quantized]
        put(encode_group(group, quantized, options, divs))
        fallbacks.extend(c.linear.module for c in group.members)
    return fallbacks, result.routing_counts, result.kv_amax


def _awq_folder(reader: CheckpointReader, plan: ModelPlan, options: QuantizeOptions):
    """The AWQ fold of ``plan``'s decoder layers (fp4kit.quantize.awq.AwqFolder): it scales only Linears this run
    quantizes to NVFP4."""
    from fp4kit.quantize.awq import AwqFolder, check_family

    check_family(plan.family)
    nvfp4 = {c.linear.module for g in plan.groups if group_scheme(plan, g, options) not in FP8_SCHEMES
             for c in g.members}
    return AwqFolder(act=static_inputs(options), quantized=nvfp4.__contains__,
                     stored_dtype=lambda name: reader.info(name).dtype)


def write_config(dst: Path, config: dict, quantization_config: dict) -> None:
    config = dict(config)
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _write_side_files(work: Path, src: Path, config: dict, plan: ModelPlan, options: QuantizeOptions,
                      routing_counts: dict[int, list[int]], calibration: dict, token_ids: torch.Tensor | None,
                      cast_counts: dict[str, int] | None = None) -> None:
    """Everything but the weights: configs, SRC's tokenizer and the like, routing statistics, the MXFP4 cast's
    block counts, the provenance record and the model card."""
    from fp4kit.quantize.provenance import calibration_record, write_provenance

    fmt = _format_module(options)
    ignore = fmt.exclusions(plan.ignored_modules, [m.linear.module for g in plan.groups for m in g.members]
                            + [job.linear.module for job in plan.stored_fp8])
    if options.source_config:
        side_configs = {}
        quantization_config = {**config["quantization_config"],
                               plan.family.source_config_moe_key: fmt.fp8_release_moe_algo}  # type: ignore[dict-item]
    elif single_nvfp4(plan.schemes.values()) and not plan.stored_fp8:
        scheme = next(iter(set(plan.schemes.values())), options.scheme)
        side_configs = fmt.side_configs(scheme, ignore)
        quantization_config = fmt.quantization_config(scheme, ignore)
    else:
        schemes = config_schemes(plan, options)
        side_configs = fmt.mixed_side_configs(schemes, ignore)
        quantization_config = fmt.mixed_quantization_config(schemes, ignore)
    if options.kv_cache is not None:
        fmt.add_kv_cache(quantization_config, side_configs)
    for name, document in side_configs.items():
        (work / name).write_text(json.dumps(document, indent=2) + "\n")
    write_config(work, config, quantization_config)
    copy_side_files(src, work)
    if routing_counts:
        write_routing_stats(work / ROUTING_STATS_NAME, plan, routing_counts, calibration)
    if cast_counts:
        document = {"source": plan.source.name if plan.source else None, "block": 16,
                    "exact_blocks": cast_counts.get("exact", 0),
                    "requantized_blocks": cast_counts.get("requantized", 0)}
        (work / MXFP4_CAST_NAME).write_text(json.dumps(document, indent=2) + "\n")
    dtype = _dtype_name(calibration_dtype(options, config)) if calibration else None
    write_provenance(work, src, plan, options, calibration_record(calibration, options.calib, token_ids, dtype),
                     options.command)


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    options: QuantizeOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> QuantizeReport:
    """Quantize checkpoint ``src`` into ``dst`` (created atomically). ``progress(done, total)``: bytes quantized, or
    for the calibrated methods (``calibrated_method``) decoder layers.

    Under torchrun every rank calls this and the work is split (fp4kit.quantize.distributed); the bytes are the same."""
    options = options or QuantizeOptions()
    ranks = distributed.ranks(options.device)
    with ranks.together():
        report = _quantize_checkpoint(Path(src), Path(dst), replace(options, device=ranks.device), ranks, progress)
    return report


def _plan(reader: CheckpointReader, config: dict, options: QuantizeOptions) -> ModelPlan:
    """The quantization plan with each module's scheme; modules a rule keeps in bf16 are planned as ignored ones,
    and FP8 modules kept as stored (fp8-source) as ``StoredFp8`` jobs."""
    def build(keep: frozenset[str] = frozenset(), stored: frozenset[str] = frozenset()) -> ModelPlan:
        return build_plan(reader, config, options.ignore, options.targets, options.default_ignore,
                          modelopt_layout=_format_module(options).fused_experts, dequant_dtype=options.dequant_dtype,
                          mtp=options.mtp, keep=keep, stored=stored)

    plan = build()
    smap = scheme_map(options)
    if options.source_config:
        return build(stored=_source_config_stored(plan, smap, options))
    if not smap.rules:
        return plan
    planned = {c.linear.module for g in plan.groups for c in g.members}
    fp8_kept = [m for m, q in (plan.source.linears.items() if plan.source else ())
                if m not in planned and isinstance(q.encoding, Fp8Block) and smap.rule_scheme(m) == STORED]
    schemes = module_schemes(plan.groups, smap, fp8_kept)
    stored = frozenset(fp8_kept) | {m for m, s in schemes.items() if s == STORED}
    kept = frozenset(m for m, s in schemes.items() if s in (KEPT, STORED))
    if kept or stored:
        plan = build(kept, stored)
    plan.schemes = {m: s for m, s in schemes.items() if s not in (KEPT, STORED)}
    return plan


def _kv_attention(reader: CheckpointReader, plan: ModelPlan, options: QuantizeOptions) -> list[str]:
    """The attention modules that get FP8 KV-cache scales (none without --kv-cache)."""
    if options.kv_cache is None:
        return []
    check_kv_cache(options.kv_cache, plan.family)
    attention = kv_cache_attention(reader.names(), int(plan.text_config["num_hidden_layers"]))
    if not attention:
        raise Fp4kitError(f"--kv-cache {options.kv_cache}: found no decoder layer with a self_attn.k_proj, so no "
                          "attention module with a KV cache")
    return attention


def _source_config_stored(plan: ModelPlan, smap: SchemeMap, options: QuantizeOptions) -> frozenset[str]:
    """--source-config: every FP8 Linear the plan leaves unquantized, kept as stored; an error where the output
    would not be the form the family's engine reads (the family's ``source_config_moe_key``)."""
    from fp4kit.families.base import expert_module
    from fp4kit.registry import dialects

    family, fmt = plan.family, _format_module(options)
    if family.source_config_moe_key is None:
        raise Fp4kitError(f"--source-config: no engine reads NVFP4 experts declared in a {family.name} release's own "
                          "config; drop it to write a compressed-tensors or ModelOpt config")
    if fmt.fp8_release_moe_algo is None:
        names = [d.name for d in dialects() if d.fp8_release_moe_algo]
        raise Fp4kitError(f"--source-config: the engine reads the NVFP4 experts in {names[0]}'s tensor names, not "
                          f"{fmt.title}'s; add --format {names[0]}")
    method = (plan.config.get("quantization_config") or {}).get("quant_method")
    if plan.source is None or method != "fp8":
        raise Fp4kitError(f"--source-config: config.json: quantization_config.quant_method is {method!r}; the form "
                          "keeps an FP8 release's own config (quant_method fp8)")
    if smap.rules:
        raise Fp4kitError("--source-config: every Linear but the routed experts stays as the release stores it; "
                          "--scheme-for does not apply")
    planned = set()
    for group in plan.groups:
        for c in group.members:
            if expert_module(c.linear.module, family.grammar) is None:
                raise Fp4kitError(f"--source-config: {c.linear.module} would be NVFP4, but the release's config "
                                  "gives NVFP4 to routed experts only; keep it with --ignore")
            planned.add(c.linear.module)
    for module, linear in plan.source.linears.items():
        if module not in planned and not isinstance(linear.encoding, Fp8Block):
            raise Fp4kitError(f"--source-config: {linear.tensor} ({module}) stays {type(linear.encoding).__name__}, "
                              f"but {family.source_config_moe_key} {fmt.fp8_release_moe_algo} makes the engine read "
                              "every routed expert as NVFP4; quantize it (--mtp quantize for the MTP block's)")
    return frozenset(m for m, linear in plan.source.linears.items()
                     if m not in planned and isinstance(linear.encoding, Fp8Block))


def config_schemes(plan: ModelPlan, options: QuantizeOptions) -> dict[str, str]:
    """Each quantized module's scheme as the config names it: a fused expert tensor (ModelOpt's Llama-4) by its name,
    and fused siblings also under the name vLLM serves them by where its packed-module mapping does not say it."""
    out = {}
    for group in plan.groups:
        scheme = group_scheme(plan, group, options)
        fused = _fused_output(group, options)
        if fused is not None:
            out[".".join(fused)] = scheme
        else:
            modules = [c.linear.module for c in group.members]
            out.update(dict.fromkeys(modules, scheme))
            alias = engine_fused_name(modules)
            if alias is not None:
                out[alias] = scheme
    siblings: dict[str, list[StoredFp8]] = {}
    for job in plan.stored_fp8:
        siblings.setdefault(weight_scale_group(job.linear.module, plan.family.grammar), []).append(job)
    for jobs in siblings.values():
        modules = [j.linear.module for j in jobs]
        out.update({j.linear.module: j.scheme for j in jobs})  # type: ignore[misc]
        alias = engine_fused_name(modules)
        if alias is not None:
            out[alias] = jobs[0].scheme  # type: ignore[assignment]
    return out


def _quantize_checkpoint(
    src: Path, dst: Path, options: QuantizeOptions, ranks: distributed.Ranks,
    progress: Callable[[int, int], None] | None,
) -> QuantizeReport:
    _validate(options)
    start = time.perf_counter()
    config = read_config(src)
    with (ranks.output_directory(dst, src, options.overwrite) as work,
          CheckpointReader(src, pin_memory=options.device.startswith("cuda")) as reader):
        plan = _plan(reader, config, options)
        if options.scheme == "nvfp4" and options.moe_input_scales == "per-expert" and any(
            _fused_output(g, options) for g in plan.groups
        ):
            raise Fp4kitError(f"--moe-input-scales per-expert: ModelOpt's fused {plan.family.name} experts store one "
                              "input scale per layer; use shared")
        kv_attention = _kv_attention(reader, plan, options)
        planned = output_plan(reader, plan, options, kv_attention)
        calibrated = calibrated_method(options)
        if calibrated and ranks.world > 1:
            raise Fp4kitError(f"--method {options.method} runs in one process; start it without torchrun")
        jobs = ranks.assign(plan.jobs, [_job_bytes(reader, job) for job in plan.jobs])
        warnings: list[str] = []

        def warn(text: str) -> None:
            warnings.append(text)
            warn_progress(progress, text)

        token_ids, calibration = _calibration_data(src, plan, options, warn)
        if options.source_config and not static_inputs(options):
            warn("--source-config: vLLM 0.33 runs these NVFP4 experts with NVFP4 activations (ModelOpt's W4A4 MoE "
                 "method) and this output has no input scales: serve it with per-token activation scales "
                 "(docs/serving.md, DeepSeek-V4)")
        fp8_static = "fp8-static" in plan.schemes.values()
        source_scales = not calibrated or (static_inputs(options) and (input_scale_source(options) == "source"
                                                                       or fp8_static))
        input_divs, routing_counts, kv_amax = (
            _calibrate(src, plan, options, ranks, token_ids, progress, [] if calibrated else kv_attention)
            if source_scales else ({}, {}, {}))
        fallbacks: list[str] = []
        input_bytes = sum(info.nbytes for info in reader.tensors.values())
        share_bytes = sum(_job_bytes(reader, job) for job in jobs)  # this rank's; all of input_bytes alone
        done = 0
        metadata = {"producer": "fp4kit", **_exact_input_scales(plan, options, input_divs)}
        writer = ranks.shard_writer(work, planned, options.max_shard_bytes, metadata,
                                    output_plan(reader, replace(plan, jobs=jobs), options,
                                                kv_attention if ranks.main else None))
        background = BackgroundWriter(writer, QUEUE_DEPTH)
        stack_bytes = STACK_BYTES.get(torch.device(options.device).type, 0)
        batcher = GroupBatcher(options, input_divs, background.put, stack_bytes, plan)
        try:
            if calibrated:
                assert token_ids is not None
                fallbacks, pass_counts, kv_amax = _quantize_calibrated(
                    src, reader, plan, options, input_divs if source_scales else None, background.put, progress,
                    token_ids, kv_attention)
                routing_counts = routing_counts or pass_counts
            else:
                progress = start_phase(progress, "quantizing", share_bytes, main=True)
            if kv_attention and ranks.main:
                for attention, (k_scale, v_scale) in kv_scales(kv_attention, kv_amax).items():
                    background.put(_format_module(options).kv_encode(attention, k_scale, v_scale))

            def read(job: QuantGroup | str) -> object:
                encoded = not isinstance(job, QuantGroup) or group_scheme(plan, job, options) not in FP8_SCHEMES
                return _read_job(reader, job, options.device, encoded and _quantizes_fp8_codes(options),
                                 encoded and _casts_mxfp4(options))

            def output(job: QuantGroup | str) -> dict[str, int]:
                """A job read, quantized (a group) and written, on one of the worker threads; its MXFP4 cast counts.
                Every output tensor has its planned place, so the threads write in any order and the same bytes."""
                data, counts = read(job), {}
                tensors = (batcher.alone(job, data, counts) if isinstance(job, QuantGroup)
                           else passthrough_tensors(job, data, options))
                for name, tensor in tensors.items():  # type: ignore[union-attr]
                    writer.write(name, tensor, reader.file_span(tensor))  # the cast's codes: the source's bytes
                return counts

            def cost(job: QuantGroup | str) -> int:
                return _job_bytes(reader, job)

            if not calibrated and stack_bytes:  # on a GPU: groups gathered into stacks, one job at a time
                for job, data in prefetched(jobs, read, QUEUE_DEPTH):
                    if isinstance(job, QuantGroup):
                        batcher.add(job, data)  # type: ignore[arg-type]
                    else:
                        background.put(passthrough_tensors(job, data, options))
                    done += _job_bytes(reader, job)
                    if progress:
                        progress(min(done, share_bytes), share_bytes)
            elif not calibrated:  # on the CPU: reads, C loops and writes release the GIL: whole jobs on a pool
                for job, counts in produced_in_parallel(jobs, output, cpu_workers(), QUEUE_DEPTH, cost,
                                                        PARALLEL_BYTES):
                    batcher.count(counts)
                    done += _job_bytes(reader, job)
                    if progress:
                        progress(min(done, share_bytes), share_bytes)
            batcher.flush()
        finally:
            background.close()
        writer.finish()
        ranks.sync()  # every rank's tensors are in place
        if ranks.main:
            _write_side_files(work, src, config, plan, options, routing_counts, calibration, token_ids,
                              batcher.cast_counts)
    return QuantizeReport(
        family=plan.family.name,
        quantized_linears=sum(len(g.members) for g in plan.groups),
        passthrough_tensors=len(plan.passthrough),
        ignored_modules=plan.ignored_modules,
        input_bytes=input_bytes,
        output_bytes=writer.total_bytes,
        output_files=writer.files,
        seconds=time.perf_counter() - start,
        method=options.method,
        fallback_modules=fallbacks,
        scheme=options.scheme,
        format=options.format,
        calibration=calibration,
        warnings=warnings,
        mxfp4_cast=dict(batcher.cast_counts),
    )


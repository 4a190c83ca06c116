"""The options of `fp4kit quantize`, `layout`, `shard` and `verify`, each declared once.

Three things are derived from these tables: the commands' flags (`derive_command`, used by fp4kit/commands), a
recipe's step keys (`recipe_fields`, used by fp4kit/pipeline/recipe.py) and the keyword arguments of the library's
option records (`library_kwargs`: QuantizeOptions, LayoutOptions, ShardOptions, VerifyOptions). What only wires a run
together stays with its command or step: the paths (SRC, DST, --source, --ep-shards, ...), --overwrite and -q.

Torch-free: a bad option or recipe is refused before torch loads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from fp4kit.errors import Fp4kitError
from fp4kit.io.shard_io import parse_size
from fp4kit.registry import BACKEND_NAMES, DEFAULT_DIALECT, DIALECT_NAMES

REQUIRED: Any = ...  # an option without a default: the command and the recipe both require it
CLI, RECIPE = "cli", "recipe"


@dataclass(frozen=True)
class Option:
    """One option. Its name is the recipe key and the library field (unless ``field`` renames it); its flag is
    ``--name-with-dashes`` unless ``flag`` says otherwise. A bool that defaults to True is ``--name/--no-name``.
    A ``list[int]`` is written ``N,N,...`` on the command line and as a YAML list in a recipe."""

    name: str
    type: Any
    default: Any
    help: str
    flag: str | None = None
    metavar: str | None = None
    show_default: bool = True
    field: str | None = None  # the library record's field, when its name differs
    convert: Callable[[Any], Any] | None = None  # value -> the library field's value
    where: tuple[str, ...] = (CLI, RECIPE)
    minimum: float | None = None  # values below are refused (a recipe says so at its key; the library checks too)
    positive: bool = False  # values <= 0 are refused (as minimum)

    @property
    def flags(self) -> tuple[str, ...]:
        if self.flag is not None:
            return (self.flag,)
        dashed = "--" + self.name.replace("_", "-")
        if self.type is bool and self.default is True:
            return (f"{dashed}/--no-{self.name.replace('_', '-')}",)
        return (dashed,)


def _list_default(option: Option) -> Any:
    return list(option.default) if isinstance(option.default, tuple) else option.default


def _is_int_list(annotation: Any) -> bool:
    return list[int] in (annotation, *get_args(annotation))


MAX_SHARD_SIZE = Option("max_shard_size", str, "5GB", "output shard size, e.g. 5GB", metavar="SIZE",
                        field="max_shard_bytes", convert=parse_size)

QUANTIZE: tuple[Option, ...] = (
    Option("scheme", Literal["nvfp4a16", "nvfp4"], "nvfp4a16", "nvfp4a16 (weight-only) or nvfp4 (W4A4)"),
    Option("format", Literal[DIALECT_NAMES], DEFAULT_DIALECT, "checkpoint dialect"),  # type: ignore[valid-type]
    Option("device", str, "cpu", "where to quantize", metavar="cpu|cuda[:N]"),
    Option("ignore", list[str], (), "regex on module names to keep in bf16 (repeatable)", metavar="REGEX"),
    Option("targets", list[str], (), "regex: quantize only matching modules, e.g. 'experts\\.' (repeatable)",
           metavar="REGEX"),
    Option("default_ignore", bool, True, "keep the family's default ignore list in bf16 (--no-default-ignore "
                                         "drops it)"),
    MAX_SHARD_SIZE,
    Option("exact_fp32_global_scale", bool, False,
           "compute weight global scales in fp32 (default: as llm-compressor, in bf16)"),
    Option("calib", Path | None, None, "calibration text: .jsonl (text or input_ids), .txt or .parquet"),
    Option("samples", int | None, None,
           "calibration samples [default: 256; without --calib, as many as the small packaged set holds]",
           show_default=False, minimum=1),
    Option("seq_len", int, 512, "tokens per calibration sample", minimum=1),
    Option("batch_size", int, 8, "calibration batch size", minimum=1),
    Option("dtype", Literal["auto", "bf16", "fp32"], "auto",
           "compute dtype of the calibration forward: auto (the checkpoint's on a GPU or a CPU with bf16 instructions, "
           "AVX512-BF16 or AMX; else fp32), bf16 or fp32"),
    Option("moe_input_scales", Literal["shared", "per-expert"], "shared",
           "shared: one input scale per layer and projection for all experts (EP-invariant); per-expert: each "
           "expert's own"),
    Option("method", Literal["rtn", "mse", "gptq", "awq", "awq+gptq"] | None, None,
           "rtn: round to nearest (llm-compressor's bytes); mse: block scales by squared-error search (weighted by "
           "calibration activations when calibrating: scheme nvfp4 or --calib); gptq: GPTQ on calibration data; "
           "awq / awq+gptq: activation-aware scales folded into the norms and producing Linears, then weighted mse "
           "/ GPTQ. "
           "Default: rtn, and an MXFP4 source cast to NVFP4 without rounding (any --method re-quantizes it from "
           "its exact values)", show_default=False),
    Option("gptq_damp", float, 0.01, "GPTQ damping, a fraction of the Hessian's mean diagonal", positive=True),
    Option("gptq_min_tokens", int, 32, "GPTQ: routed experts with fewer calibration tokens fall back to mse",
           minimum=1),
    Option("gptq_asymmetric", float, 0.0,
           "GPTQ toward the float model's layer outputs (GPTAQ): weight of the float-target correction, 0 = off, 1 = "
           "the least-squares target; runs the float model's hidden states beside the quantized ones", minimum=0),
    Option("gptq_act_order", bool, False,
           "GPTQ columns in descending activation-energy order (diag H), block scales fixed up front from the "
           "natural-order 16-blocks: the format stays plain"),
    Option("gptq_act_quant", bool, False,
           "W4A4 GPTQ: Hessians (and --gptq-asymmetric's cross terms) of the inputs fake-quantized with the source "
           "pass's input scales (needs --input-scales-from source)"),
    Option("gptq_scales", Literal["mse", "rtn"], "mse",
           "GPTQ block scales: mse (searched on the error-compensated weights) or rtn"),
    Option("mse_range", str, "auto",
           "mse search candidates (mse, gptq's mse block scales): LOW:HIGH, every E4M3 block-scale code within "
           "LOW..HIGH x the block's RTN scale; codes, the RTN FP8 code's neighbours and max-to-4; auto: 0.8:1.8 for "
           "data-free mse, else codes"),
    Option("mse_norm", float, 2.0, "error exponent of the LOW:HIGH search (2: squared error)"),
    Option("input_scales_from", Literal["auto", "quantized", "source"], "auto",
           "gptq/mse W4A4 input scales: quantized (the calibrated pass's forward of the quantized model, the "
           "activations it will serve; no extra pass), source (the source model's forward, a pass of its own, as "
           "rtn) or auto (quantized; source for ModelOpt output)"),
    Option("native", bool, True, "encode bf16 weights on the CPU with fp4kit's C loop (same bytes as torch ops)",
           field="native_cpu"),
    Option("dequant_dtype", Literal["fp32", "bf16"], "fp32",
           "FP8 / INT4 / MXFP4 sources: dequantize to fp32 (one rounding) or bf16 (the peers' two)"),
    Option("mtp", Literal["keep", "quantize"], "keep",
           "an MTP block outside the decoder layers (Qwen3-Next, Qwen3.5/3.6-MoE `mtp.*`): keep it as stored (as "
           "published NVFP4 checkpoints do) or quantize its routed experts (weight-only)"),
    Option("scheme_for", list[str], (),
           "give modules matching REGEX another scheme: nvfp4, nvfp4a16, fp8-dynamic, fp8-block, fp8-static, bf16 "
           "(kept) or fp8-source (an FP8 source's module as stored, also where the ignores keep it); the first "
           "matching rule wins, the rest get --scheme (repeatable)", metavar="REGEX=SCHEME"),
    Option("source_config", bool, False,
           "an FP8 release (DeepSeek-V4): keep its own quantization_config, declare the NVFP4 routed experts in it "
           "and keep every other FP8 Linear as stored under its names, the form vLLM 0.33 serves DeepSeek-V4 with "
           "NVFP4 experts in (with --format modelopt)"),
    Option("kv_cache", Literal["fp8"] | None, None,
           "fp8: calibrate per-layer k_scale / v_scale for vLLM's FP8 KV cache (full-attention layers; calibrates on "
           "--calib, also for weight-only schemes) [default: none]", show_default=False),
)
# where a recipe's default differs from the command's: a recipe is usually the whole job, calibrated W4A4
RECIPE_DEFAULTS = {("quantize", "scheme"): "nvfp4"}

LAYOUT: tuple[Option, ...] = (
    Option("backend", Literal[BACKEND_NAMES], REQUIRED, "the MoE kernel to lay out for"),  # type: ignore[valid-type]
    Option("act_dtype", Literal["bf16", "fp16"], "bf16", "activation dtype the kernel runs with"),
    Option("cutlass_flavor", Literal["flashinfer", "vllm"], "flashinfer", "cutlass only: whose CUTLASS kernel"),
    MAX_SHARD_SIZE,
)

SHARD: tuple[Option, ...] = (
    Option("ep", int, REQUIRED, "expert-parallel size N (TRT-LLM-gen and FlashInfer CUTLASS MoE need N to divide "
                                "the expert count)", minimum=1),
    Option("placement", Literal["linear", "round-robin", "balanced"], "linear",
           "linear (vLLM's), round-robin or balanced (by routing statistics)"),
    Option("stats", Path | None, None, "routing statistics JSON: per-layer token counts per expert (default for "
                                       "balanced: the fp4kit_routing_stats.json of a calibrated quantize in SRC)"),
    Option("max_shard_size", str, "5GB", "safetensors file size, e.g. 5GB", metavar="SIZE", field="max_shard_bytes",
           convert=parse_size),
)

VERIFY: tuple[Option, ...] = (
    Option("source", bool, True, "compare with the BF16 model when the recipe quantizes it", where=(RECIPE,)),
    Option("layers", list[int] | None, None, "MoE layers to check, e.g. 0,3 (default: all)", show_default=False),
    Option("tokens", list[int], (1, 16, 256, 4096), "batch sizes of random hidden states"),
    Option("backend", Literal["auto", "reference", "triton", "flashinfer-cutlass", "flashinfer-trtllm", "marlin"],
           "auto", "the MoE kernel to check against the reference"),
    Option("mode", Literal["w4a16", "w4a4"] | None, None, "default: w4a4 when CKPT has activation scales",
           show_default=False),
    Option("device", str | None, None, "default: cuda when available", metavar="cpu|cuda", show_default=False),
    Option("seed", int, 0, "seed of the random hidden states"),
    Option("tol_kernel", float, 1e-2, "kernel vs reference, relative error", positive=True),
    Option("tol_source", float | None, None,
           "quantized vs BF16 source, relative error (default 0.25 for w4a16, 0.35 for w4a4)", show_default=False,
           positive=True),
    Option("fail_run", bool, True, "a failed check makes `fp4kit run` exit 1 (after writing the summary)",
           where=(RECIPE,)),
)

COMMANDS: dict[str, tuple[Option, ...]] = {"quantize": QUANTIZE, "layout": LAYOUT, "shard": SHARD, "verify": VERIFY}


def recipe_default(command: str, option: Option) -> Any:
    return RECIPE_DEFAULTS.get((command, option.name), _list_default(option))


def library_kwargs(options: tuple[Option, ...], values: dict[str, Any]) -> dict[str, Any]:
    """The library record's keyword arguments for option ``values`` (by option name; a recipe-only option is not a
    library field)."""
    kwargs = {}
    for option in options:
        if CLI not in option.where:
            continue
        value = values[option.name]
        if option.convert:
            value = option.convert(value)
        elif Path in get_args(option.type) and value is not None:  # a recipe's path is a string
            value = Path(value)
        kwargs[option.field or option.name] = value
    return kwargs


def quantize_kwargs(values: dict[str, Any]) -> dict[str, Any]:
    """QuantizeOptions' keyword arguments: no method means rtn, and an MXFP4 source cast exactly rather than rounded
    (an explicit method re-quantizes it)."""
    kwargs = library_kwargs(QUANTIZE, values)
    kwargs["method"], kwargs["cast_mxfp4"] = values["method"] or "rtn", values["method"] is None
    return kwargs


# ---- the command line ----------------------------------------------------------------------------------------------

def parse_ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise Fp4kitError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _cli_parameter(option: Option) -> inspect.Parameter:
    import typer

    annotation, default, metavar = option.type, _list_default(option), option.metavar
    if _is_int_list(annotation):  # N,N,... on the command line
        annotation = str | None if option.default is None else str
        default = None if option.default is None else ",".join(map(str, option.default))
        metavar = metavar or "N,N,..."
    elif get_origin(annotation) is list:  # repeatable; None when not given
        annotation, default = annotation | None, None
    info = typer.Option(*option.flags, help=option.help, metavar=metavar, show_default=option.show_default)
    return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[annotation, info],
                             default=inspect.Parameter.empty if default is REQUIRED else default)


def _cli_value(option: Option, value: Any) -> Any:
    if _is_int_list(option.type):
        return parse_ints(value, option.flags[0])
    if get_origin(option.type) is list and value is None:
        return list(option.default)
    return value


def derive_command(options: tuple[Option, ...]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command function ``f(ARGUMENTS..., *, values, OWN OPTIONS...)``: typer sees the table's options
    (those of the command line) after its arguments, and ``f`` gets them as ``values``, a dict by option name."""
    cli_options = [o for o in options if CLI in o.where]

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "values"]
        arguments = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        rest = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
        parameters = [*arguments, *map(_cli_parameter, cli_options), *rest]

        def command(*args: Any, **kwargs: Any) -> Any:
            values = {o.name: _cli_value(o, kwargs.pop(o.name)) for o in cli_options}
            return func(*args, values=values, **kwargs)

        command.__name__, command.__qualname__, command.__doc__ = func.__name__, func.__qualname__, func.__doc__
        command.__module__ = func.__module__
        command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        return command

    return decorate


# ---- recipes -------------------------------------------------------------------------------------------------------

def recipe_fields(command: str) -> dict[str, Any]:
    """pydantic field definitions (annotation, FieldInfo) of the recipe step that runs ``command``."""
    from pydantic import Field

    fields: dict[str, Any] = {}
    for option in COMMANDS[command]:
        if RECIPE not in option.where:
            continue
        annotation = option.type
        if Path in get_args(annotation):  # a path is a string in YAML
            annotation = str | None
        constraints: dict[str, Any] = {}
        if option.minimum is not None:
            constraints["ge"] = option.minimum
        if option.positive:
            constraints["gt"] = 0
        if float in (annotation, *get_args(annotation)):  # `--set x=1e-2` reads as a string in YAML 1.1
            constraints["strict"] = False
        default = recipe_default(command, option)
        if default is REQUIRED:
            fields[option.name] = (annotation, Field(**constraints))
        elif isinstance(default, list):
            fields[option.name] = (annotation, Field(default_factory=lambda d=default: list(d), **constraints))
        else:
            fields[option.name] = (annotation, Field(default=default, **constraints))
    return fields

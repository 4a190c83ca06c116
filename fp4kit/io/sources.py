"""Source checkpoints that are already quantized, read as the dequantized Linears they encode.

Detected from config.json ``quantization_config`` (docs/sources.md has every format's tensors and upstream sources):

- FP8 block (``quant_method: fp8``, ``weight_block_size: [bm, bn]``; DeepSeek-V3/R1, MiniMax-M2, Qwen3 and GLM FP8
  releases): ``<m>.weight`` F8_E4M3 [N, K] and ``<m>.weight_scale_inv`` F32 [ceil(N/bm), ceil(K/bn)], a dequant
  multiplier per block; the last block of a row or column is partial (transformers' ``finegrained_fp8.py``,
  compressed-tensors' ``FP8BlockDequantizer``).
- compressed-tensors (``quant_method: compressed-tensors``), per config group's format:
  ``pack-quantized`` INT (Kimi-K2-Thinking's INT4): ``<m>.weight_packed`` I32 [N, ceil(K*bits/32)] with the values
  offset by 2^(bits-1) and packed densely from the low bits up, ``<m>.weight_scale`` [N, K/group] (or [N, 1] per
  channel) and ``<m>.weight_shape`` [2] = (N, K) (``compressors/pack_quantized``); symmetric only.
  ``float-quantized`` FP8 (FP8_DYNAMIC and FP8 releases): ``<m>.weight`` F8_E4M3 [N, K], ``<m>.weight_scale`` per
  channel [N, 1], per tensor [1] or per block; read as FP8 blocks of (1, K), (N, K) or the block structure.
  ``mxfp4-pack-quantized``: ``<m>.weight_packed`` U8 [N, K/2] E2M1 codes, ``<m>.weight_scale`` U8 [N, K/32] E8M0.
- gpt-oss as released (``quant_method: mxfp4``): fused expert tensors ``<t>_blocks`` U8 [E, N, K/32, 16] and
  ``<t>_scales`` U8 [E, N, K/32], read as ``<t>`` [E, K, N] (``FusedMxfp4``), sliced per expert by the planner.

Everything else quantized is refused with one line (``detect_source``): another method, format or ModelOpt
algorithm, NVFP4 checkpoints (as sources: ``refuse_nvfp4``), and quantization tensors that the read format does not
consume. Dequantization multiplies in fp32 (exact for INT and MXFP4, and for FP8 with bf16 scales; one fp32 rounding
for FP8 x F32), then casts to the requested dtype: fp32 (NVFP4 then quantizes straight from it: one rounding) or bf16
(the peers' bf16 intermediate: two). Tensors the source kept unquantized are not touched.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.native import nvfp4_cpu
from fp4kit.nvfp4 import unpack_e2m1

DEQUANT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP8_SCALE_SUFFIX = ".weight_scale_inv"
E8M0_SCALE_SUFFIX = ".scale"  # DeepSeek-V4: F8_E8M0 scales of FP8 blocks and of int8-packed FP4 (MXFP4) weights
PACKED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape")


@dataclass(frozen=True)
class Fp8Block:
    """FP8 E4M3 weight with one F32 dequant multiplier per (bm, bn) block."""

    weight: str
    scale: str
    block: tuple[int, int]


@dataclass(frozen=True)
class PackQuantized:
    """Symmetric INT weight packed into int32 words, one scale per group of ``group_size`` inputs (None: per row)."""

    weight: str  # <m>.weight_packed
    scale: str
    shape: str
    num_bits: int
    group_size: int | None


@dataclass(frozen=True)
class Mxfp4:
    """MXFP4 weight: E2M1 codes packed two per byte along K (element 2j in the low nibble) [N, K/2] and one E8M0
    exponent byte per 32 inputs [N, ceil(K/32)], the block's multiplier 2^(byte - 127) (255: NaN)."""

    weight: str  # <m>.weight_packed, or a fused [E, N, K/32, 16] tensor (gpt-oss's ``*_blocks``)
    scale: str
    expert: int | None = None  # of a fused tensor: this expert's [N, K/32, 16] ...
    rows: tuple[int, int, int] | None = None  # ... and of its N rows these (start, stop, step); None: all


@dataclass(frozen=True)
class FusedMxfp4:
    """gpt-oss's MXFP4 experts (``quant_method: mxfp4``): ``<t>_blocks`` U8 [E, N, K/32, 16], the E2M1 code bytes of
    each 32-block (the byte layout of ``Mxfp4``), and ``<t>_scales`` U8 [E, N, K/32] E8M0 exponents. Read as ``<t>``
    [E, K, N], what transformers' ``convert_moe_packed_tensors`` returns and the BF16 form of the family stores."""

    tensor: str  # <t>: the fused tensor as the model holds it
    blocks: str
    scales: str
    experts: int
    rows: int  # N, output features
    cols: int  # K, input features
    dtype: torch.dtype  # what dequantize returns

    @property
    def shape(self) -> tuple[int, int, int]:
        """As the model holds it: [E, K, N]."""
        return (self.experts, self.cols, self.rows)

    def linear(self, module: str, expert: int, rows: tuple[int, int, int] | None) -> QuantizedLinear:
        """One expert's Linear (its rows ``(start, stop, step)`` of the N, e.g. gate's of an interleaved gate/up)."""
        count = self.rows if rows is None else len(range(*rows))
        return QuantizedLinear(module, Mxfp4(self.blocks, self.scales, expert, rows), count, self.cols, self.dtype)


@dataclass(frozen=True)
class QuantizedLinear:
    """One Linear of the source stored quantized: where its tensors are, and its dequantized [N, K]."""

    module: str
    encoding: Fp8Block | PackQuantized | Mxfp4
    out_features: int
    in_features: int
    dtype: torch.dtype  # what dequantize returns

    @property
    def tensor(self) -> str:
        """The tensor that stands for the Linear in plans (exists on disk; its dtype is the stored one)."""
        return self.encoding.weight

    @property
    def tensors(self) -> tuple[str, ...]:
        enc = self.encoding
        return (enc.weight, enc.scale, enc.shape) if isinstance(enc, PackQuantized) else (enc.weight, enc.scale)


@dataclass(frozen=True)
class SourceFormat:
    name: str  # "bf16" (or whatever unquantized dtype), "fp8-block", "int4-pack-quantized", ...
    linears: dict[str, QuantizedLinear] = field(default_factory=dict)  # by module name
    nvfp4: str | None = None  # an NVFP4 checkpoint: its dialect, in words (no Linears read)
    dropped: tuple[str, ...] = ()  # tensors of the source's quantization that the output does not need
    fused: dict[str, FusedMxfp4] = field(default_factory=dict)  # by the fused tensor's name as the model holds it

    @property
    def quantized(self) -> bool:
        return bool(self.linears or self.fused)

    def consumed(self) -> set[str]:
        return ({name for linear in self.linears.values() for name in linear.tensors} | set(self.dropped)
                | {name for f in self.fused.values() for name in (f.blocks, f.scales)})


def dequant_dtype_of(name: str) -> torch.dtype:
    if name not in DEQUANT_DTYPES:
        raise Fp4kitError(f"--dequant-dtype {name!r}: choose {' or '.join(DEQUANT_DTYPES)}")
    return DEQUANT_DTYPES[name]


def detect_source(config: dict, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                  dequant_dtype: str = "fp32", root: Path | None = None) -> SourceFormat:
    """The source's format from config.json and the tensor headers (name -> (dtype, shape)); ``root``: the
    directory, whose ``hf_quant_config.json`` (ModelOpt's) is read too.

    A config without ``quantization_config`` is a plain source; a read format must be consistent with the headers:
    every quantized weight has its scales, of the shapes the format implies. An NVFP4 checkpoint (either dialect)
    comes back with ``nvfp4`` saying so and no Linears (a reader of sources refuses it: ``refuse_nvfp4``). Anything
    else quantized (another method, format or algorithm, or quantization tensors no read format consumes) is an
    Fp4kitError naming the field or tensor."""
    dtype = dequant_dtype_of(dequant_dtype)
    side = _modelopt_side_config(root)
    if side is not None:
        return _nvfp4_or_refuse(side, f"{root}/hf_quant_config.json: quantization.quant_algo", tensors)
    qc = config.get("quantization_config")
    if qc is None:
        _refuse_unread(tensors, set(), "config.json has no quantization_config")
        return SourceFormat(_plain_name(tensors))
    where = "config.json: quantization_config"
    if not isinstance(qc, dict):
        raise Fp4kitError(f"{where}: {type(qc).__name__}, not an object")
    method = qc.get("quant_method")
    if method == "fp8":
        source = _fp8_block_source(qc, tensors, dtype)
    elif method == "compressed-tensors":
        source = _compressed_tensors_source(qc, tensors, dtype)
    elif method == "modelopt":
        return _nvfp4_or_refuse(qc.get("quant_algo"), f"{where}.quant_algo", tensors)
    elif method == "mxfp4":
        source = _fused_mxfp4_source(tensors, dtype)
    else:
        raise Fp4kitError(f"{where}.quant_method: {method!r}; fp4kit reads unquantized sources, fp8 (block-scaled), "
                          "compressed-tensors (pack-quantized, float-quantized, mxfp4-pack-quantized) and mxfp4 "
                          "(gpt-oss)")
    if source.nvfp4 is None:
        _refuse_unread(tensors, source.consumed(), f"the {source.name} source's config does not say how")
    return source


# Tensors that only a quantized checkpoint holds: scales, packed codes, zero points (compressed-tensors, ModelOpt,
# HF fp8, GPTQ/AWQ, MLX), gpt-oss's MXFP4 blocks, KV-cache scales
QUANTIZATION_TENSOR = re.compile(
    r"\.(weight_packed|weight_scale|weight_scale_inv|weight_scale_2|weight_shape|weight_zero_point|weight_global_scale"
    r"|input_global_scale|input_scale|input_zero_point|output_scale|k_scale|v_scale|qweight|qzeros|scales|biases"
    r"|g_idx)$|_(blocks|scales)$")
MXFP4_BLOCKS_SUFFIX, MXFP4_SCALES_SUFFIX = "_blocks", "_scales"
ONE_BYTE = (torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def _refuse_unread(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], consumed: set[str], why: str) -> None:
    """A quantization tensor, or a 1-byte matrix, that the source's read format does not consume: fp4kit cannot say
    what it holds, and copying it into the output would make a checkpoint that looks complete and is wrong."""
    for name, (dtype, shape) in tensors.items():
        if name in consumed:
            continue
        if QUANTIZATION_TENSOR.search(name):
            raise Fp4kitError(f"{name}: a quantization tensor ({dtype}{list(shape)}) that fp4kit does not read; {why} "
                              "to decode it")
        if dtype in ONE_BYTE and len(shape) >= 2:
            raise Fp4kitError(f"{name}: {dtype}{list(shape)}, a quantized tensor that fp4kit does not read; {why} "
                              "to decode it")


def _modelopt_side_config(root: Path | None) -> str | None:
    """hf_quant_config.json's quant_algo ("" when it names none), None without the file."""
    path = None if root is None else Path(root) / "hf_quant_config.json"
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Fp4kitError(f"{path}: not readable JSON ({exc})") from None
    section = data.get("quantization") if isinstance(data, dict) else None
    algo = section.get("quant_algo") if isinstance(section, dict) else None
    return str(algo or "")


def _nvfp4_or_refuse(algo, where: str, tensors) -> SourceFormat:
    if str(algo or "").upper() in ("NVFP4", "W4A16_NVFP4"):
        return SourceFormat("nvfp4 (ModelOpt)", nvfp4="ModelOpt NVFP4")
    if str(algo or "").upper() == "MIXED_PRECISION":  # fp4kit's --scheme-for output: NVFP4 beside FP8 modules
        return SourceFormat("nvfp4 (ModelOpt mixed precision)", nvfp4="ModelOpt mixed-precision NVFP4")
    raise Fp4kitError(f"{where}: {algo!r}; fp4kit reads no ModelOpt source but NVFP4 checkpoints (with fp4kit "
                      "convert / inspect / verify / eval as the quantized side)")


def refuse_nvfp4(source: SourceFormat, root: Path | str) -> SourceFormat:
    """``source`` itself, unless it is an NVFP4 checkpoint: not a source fp4kit quantizes or checks against."""
    if source.nvfp4 is not None:
        raise Fp4kitError(f"{root}: an NVFP4 checkpoint ({source.nvfp4}), not a source fp4kit reads to quantize or to "
                          "check against (fp4kit convert changes an NVFP4 checkpoint's dialect)")
    return source


def read_source(reader, config: dict, dequant_dtype: str = "fp32") -> SourceFormat:
    """The format of the source checkpoint ``reader`` reads (fp4kit.io.checkpoint.CheckpointReader), refusing
    NVFP4 and whatever ``detect_source`` refuses."""
    headers = {n: (i.dtype, i.shape) for n, i in reader.tensors.items()}
    return refuse_nvfp4(detect_source(config, headers, dequant_dtype, reader.root), reader.root)


def _plain_name(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> str:
    counts: dict[str, int] = {}
    for dtype, shape in tensors.values():
        if len(shape) == 2 and dtype.is_floating_point:
            counts[str(dtype).removeprefix("torch.")] = counts.get(str(dtype).removeprefix("torch."), 0) + 1
    return max(counts, key=counts.__getitem__) if counts else "unquantized"


def _fp8_block_source(qc: dict, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                      dtype: torch.dtype) -> SourceFormat:
    """FP8 blocks with ``<m>.weight_scale_inv`` float32 multipliers, or, with ``scale_fmt: ue8m0`` (DeepSeek-V4's
    release), ``<m>.scale`` E8M0 multipliers; beside them DeepSeek-V4 stores its routed experts as MXFP4 under the
    same ``.scale`` name (``E8M0_SCALE_SUFFIX``)."""
    where = "config.json: quantization_config"
    if qc.get("moe_quant_algo"):
        raise Fp4kitError(f"{where}.moe_quant_algo: {qc['moe_quant_algo']!r}: FP8 with routed experts in another "
                          "format (what quantize --source-config writes for vLLM); fp4kit does not read it yet")
    block = qc.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise Fp4kitError(f"{where}: quant_method fp8 with weight_block_size {block!r}; fp4kit reads block-scaled "
                          "FP8 ([rows, cols] of positive integers)")
    if qc.get("fmt", "e4m3") != "e4m3" or qc.get("scale_fmt") not in (None, "float32", "ue8m0"):
        raise Fp4kitError(f"{where}: fmt {qc.get('fmt')!r} scale_fmt {qc.get('scale_fmt')!r}; fp4kit reads e4m3 "
                          "weights with float32 or ue8m0 block scales")
    bm, bn = block
    linears: dict[str, QuantizedLinear] = {}
    mxfp4 = 0
    for name, (sdtype, sshape) in tensors.items():
        suffix = next((s for s in (FP8_SCALE_SUFFIX, E8M0_SCALE_SUFFIX) if name.endswith(s)), None)
        if suffix is None or (suffix == E8M0_SCALE_SUFFIX and sdtype != torch.float8_e8m0fnu):
            continue
        scale_dtype = torch.float32 if suffix == FP8_SCALE_SUFFIX else torch.float8_e8m0fnu
        module = name[: -len(suffix)]
        weight = f"{module}.weight"
        if weight not in tensors:
            raise Fp4kitError(f"{name}: a block scale without its weight {weight}")
        wdtype, wshape = tensors[weight]
        if suffix == E8M0_SCALE_SUFFIX and wdtype == torch.int8 and len(wshape) == 2:
            rows, cols = wshape[0], wshape[1] * 2
            if tuple(sshape) != (rows, math.ceil(cols / 32)):
                raise Fp4kitError(f"{name}: {sdtype}{list(sshape)}, the {weight} {list(wshape)} FP4 weight needs "
                                  f"[{rows}, {math.ceil(cols / 32)}] (one E8M0 exponent per 32 inputs)")
            linears[module] = QuantizedLinear(module, Mxfp4(weight, name), rows, cols, dtype)
            mxfp4 += 1
            continue
        if wdtype != torch.float8_e4m3fn or len(wshape) != 2:
            raise Fp4kitError(f"{weight}: {wdtype}{list(wshape)} beside {name}; FP8-block weights are float8_e4m3fn "
                              "[N, K]" + (" (or int8 [N, K/2] FP4 codes beside E8M0 scales)"
                                          if suffix == E8M0_SCALE_SUFFIX else ""))
        grid = (math.ceil(wshape[0] / bm), math.ceil(wshape[1] / bn))
        if sdtype != scale_dtype or tuple(sshape) != grid:
            raise Fp4kitError(f"{name}: {sdtype}{list(sshape)}, the {list(wshape)} weight in {bm}x{bn} blocks needs "
                              f"{str(scale_dtype).removeprefix('torch.')}{list(grid)}")
        linears[module] = QuantizedLinear(module, Fp8Block(weight, name, (bm, bn)), wshape[0], wshape[1], dtype)
    for name, (sdtype, sshape) in tensors.items():
        if sdtype == torch.float8_e4m3fn and name[: -len(".weight")] not in linears:
            raise Fp4kitError(f"{name}: float8_e4m3fn{list(sshape)} without a {FP8_SCALE_SUFFIX[1:]}")
    scales = " ue8m0" if qc.get("scale_fmt") == "ue8m0" else ""
    return SourceFormat(f"fp8-block {bm}x{bn}{scales}" + (" + mxfp4" if mxfp4 else ""), linears)


# compressed-tensors formats (compressed_tensors/config/base.py CompressionFormat) this module reads
CT_READ = ("pack-quantized", "float-quantized", "mxfp4-pack-quantized")
CT_NVFP4 = "nvfp4-pack-quantized"


def _ct_groups(qc: dict) -> dict[str, tuple[str | None, dict]]:
    """config_groups key -> (its format: the group's own, else the config's; the group)."""
    where = "config.json: quantization_config.config_groups"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise Fp4kitError(f"{where}: missing or empty")
    out = {}
    for key, group in groups.items():
        if not isinstance(group, dict):
            raise Fp4kitError(f"{where}.{key}: {type(group).__name__}, not an object")
        out[key] = (group.get("format") or qc.get("format"), group)
    return out


def _compressed_tensors_source(qc: dict, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                               dtype: torch.dtype) -> SourceFormat:
    where = "config.json: quantization_config.config_groups"
    groups = _ct_groups(qc)
    formats = {fmt for fmt, _ in groups.values()}
    if CT_NVFP4 in formats:
        return SourceFormat("nvfp4 (compressed-tensors)", nvfp4=f"compressed-tensors {CT_NVFP4}")
    for key, (fmt, _) in groups.items():
        if fmt not in CT_READ:
            raise Fp4kitError(f"{where}.{key}.format: {fmt!r}; fp4kit reads compressed-tensors sources in "
                              f"{', '.join(CT_READ)}")
    linears: dict[str, QuantizedLinear] = {}
    names: list[str] = []
    dropped: list[str] = []
    if "pack-quantized" in formats:
        pack = _pack_quantized_source(qc, tensors, dtype)
        linears.update(pack.linears)
        names.append(pack.name)
    if "float-quantized" in formats:
        fp8, kinds, inputs = _float_quantized_linears(groups, tensors, dtype)
        linears.update(fp8)
        names += [f"fp8-{kind}" for kind in sorted(kinds)]
        dropped += inputs
    if "mxfp4-pack-quantized" in formats:
        linears.update(_mxfp4_linears(groups, tensors, dtype))
        names.append("mxfp4")
    return SourceFormat(" + ".join(names), linears, dropped=tuple(dropped))


def _group_for(groups: dict[str, tuple[str | None, dict]], fmt: str, module: str, tensor: str) -> tuple[str, dict]:
    """The first config group of format ``fmt`` that targets ``module`` (its key and weights arguments)."""
    for key, (group_fmt, group) in groups.items():
        if group_fmt == fmt and _targets(tuple(group.get("targets") or ("Linear",)), module):
            weights = group.get("weights")
            if not isinstance(weights, dict):
                raise Fp4kitError(f"config.json: quantization_config.config_groups.{key}.weights: missing")
            return key, weights
    raise Fp4kitError(f"{tensor}: no {fmt} entry of config.json's quantization_config.config_groups targets {module}")


def _float_quantized_linears(groups, tensors, dtype):
    """compressed-tensors float-quantized FP8 (compressors/naive_quantized): ``<m>.weight`` F8_E4M3 [N, K] and
    ``<m>.weight_scale`` a dequant multiplier per channel [N, 1], per tensor [1] (or []) or per block
    [ceil(N/bm), ceil(K/bn)] (strategy block, ``block_structure`` [bm, bn]). A static activation scale
    (``input_scale``) is the source's own serving choice: dropped, the NVFP4 output calibrates its own."""
    where = "config.json: quantization_config.config_groups"
    linears: dict[str, QuantizedLinear] = {}
    kinds: set[str] = set()
    inputs: list[str] = []
    for name, (wdtype, wshape) in tensors.items():
        if not name.endswith(".weight") or wdtype not in ONE_BYTE:
            continue
        module = name[: -len(".weight")]
        key, weights = _group_for(groups, "float-quantized", module, name)
        strategy = weights.get("strategy")
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or wdtype != torch.float8_e4m3fn:
            raise Fp4kitError(f"{where}.{key}.weights: type {weights.get('type')!r} num_bits "
                              f"{weights.get('num_bits')!r} for {name} {wdtype}; fp4kit reads float-quantized FP8 E4M3")
        if not weights.get("symmetric", True) or f"{module}.weight_zero_point" in tensors:
            raise Fp4kitError(f"{where}.{key}.weights: asymmetric (zero points); fp4kit reads symmetric FP8")
        if len(wshape) != 2:
            raise Fp4kitError(f"{name}: {wdtype}{list(wshape)}; float-quantized weights are [N, K]")
        scale = f"{module}.weight_scale"
        if scale not in tensors:
            raise Fp4kitError(f"{name}: {scale} is missing")
        sdtype, sshape = tensors[scale]
        rows, cols = wshape
        if strategy == "channel":
            block, grid = (1, cols), [(rows, 1)]
        elif strategy == "tensor":
            block, grid = (rows, cols), [(1,), (), (1, 1)]
        elif strategy == "block":
            structure = weights.get("block_structure")
            if (not isinstance(structure, list) or len(structure) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in structure)):
                raise Fp4kitError(f"{where}.{key}.weights.block_structure: {structure!r}")
            block = (structure[0], structure[1])
            grid = [(math.ceil(rows / block[0]), math.ceil(cols / block[1]))]
        else:
            raise Fp4kitError(f"{where}.{key}.weights.strategy: {strategy!r}; fp4kit reads float-quantized FP8 per "
                              "channel, tensor or block")
        if not sdtype.is_floating_point or sdtype.itemsize < 2 or tuple(sshape) not in grid:
            raise Fp4kitError(f"{scale}: {sdtype}{list(sshape)}, the {list(wshape)} weight per {strategy} needs a "
                              f"16- or 32-bit float {list(grid[0])}")
        kinds.add(strategy if strategy != "block" else f"block {block[0]}x{block[1]}")
        linears[module] = QuantizedLinear(module, Fp8Block(name, scale, block), rows, cols, dtype)
        inputs += [n for n in (f"{module}.input_scale",) if n in tensors]
    return linears, kinds, inputs


def _mxfp4_linears(groups, tensors, dtype):
    """compressed-tensors mxfp4-pack-quantized (compressors/mxfp4/base.py over nvfp4's packing): ``<m>.weight_packed``
    U8 [N, K/2] and ``<m>.weight_scale`` U8 [N, ceil(K/32)] E8M0 exponents; no global scale."""
    where = "config.json: quantization_config.config_groups"
    linears: dict[str, QuantizedLinear] = {}
    for name, (pdtype, pshape) in tensors.items():
        if not name.endswith(".weight_packed") or pdtype != torch.uint8:
            continue
        module = name[: -len(".weight_packed")]
        key, weights = _group_for(groups, "mxfp4-pack-quantized", module, name)
        if (weights.get("type") != "float" or weights.get("num_bits") != 4 or weights.get("group_size") != 32
                or str(weights.get("scale_dtype") or "torch.uint8") not in ("torch.uint8", "uint8")):
            raise Fp4kitError(f"{where}.{key}.weights: type {weights.get('type')!r} num_bits "
                              f"{weights.get('num_bits')!r} group_size {weights.get('group_size')!r} scale_dtype "
                              f"{weights.get('scale_dtype')!r}; MXFP4 is float, 4 bits, group 32, uint8 E8M0 scales")
        if not weights.get("symmetric", True) or f"{module}.weight_zero_point" in tensors:
            raise Fp4kitError(f"{where}.{key}.weights: asymmetric (zero points); fp4kit reads symmetric MXFP4")
        scale = f"{module}.weight_scale"
        if scale not in tensors:
            raise Fp4kitError(f"{name}: {scale} is missing")
        sdtype, sshape = tensors[scale]
        if len(pshape) != 2:
            raise Fp4kitError(f"{name}: {pdtype}{list(pshape)}; MXFP4 weights are uint8 [N, K/2]")
        rows, cols = pshape[0], pshape[1] * 2
        if sdtype != torch.uint8 or tuple(sshape) != (rows, math.ceil(cols / 32)):
            raise Fp4kitError(f"{scale}: {sdtype}{list(sshape)}, the {name} {list(pshape)} weight needs uint8 "
                              f"[{rows}, {math.ceil(cols / 32)}] (one E8M0 exponent per 32 inputs)")
        linears[module] = QuantizedLinear(module, Mxfp4(name, scale), rows, cols, dtype)
    return linears


def _fused_mxfp4_source(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], dtype: torch.dtype) -> SourceFormat:
    """gpt-oss as released (``quant_method: mxfp4``; transformers' ``integrations/mxfp4.py``, vLLM 0.33's
    ``gpt_oss.py`` ``_load_weights_mxfp4``): every ``<t>_blocks`` with its ``<t>_scales`` is a fused tensor
    ``FusedMxfp4``; which Linears it holds is the family's grammar (fp4kit.quantize.plan splits it)."""
    fused: dict[str, FusedMxfp4] = {}
    for name, (bdtype, bshape) in tensors.items():
        if not name.endswith(MXFP4_BLOCKS_SUFFIX):
            continue
        tensor = name[: -len(MXFP4_BLOCKS_SUFFIX)]
        scales = tensor + MXFP4_SCALES_SUFFIX
        if scales not in tensors:
            raise Fp4kitError(f"{name}: {scales} is missing")
        if bdtype != torch.uint8 or len(bshape) != 4 or bshape[3] != 16:
            raise Fp4kitError(f"{name}: {bdtype}{list(bshape)}; MXFP4 blocks are uint8 [E, N, K/32, 16]")
        sdtype, sshape = tensors[scales]
        if sdtype != torch.uint8 or tuple(sshape) != tuple(bshape[:3]):
            raise Fp4kitError(f"{scales}: {sdtype}{list(sshape)}, the {name} {list(bshape)} blocks need uint8 "
                              f"{list(bshape[:3])} (one E8M0 exponent per 32 inputs)")
        if tensor in tensors:
            raise Fp4kitError(f"{tensor}: stored beside its MXFP4 blocks {name}")
        fused[tensor] = FusedMxfp4(tensor, name, scales, bshape[0], bshape[1], bshape[2] * 32, dtype)
    if not fused:
        raise Fp4kitError(f"config.json: quantization_config.quant_method: mxfp4 without any *{MXFP4_BLOCKS_SUFFIX} "
                          "tensor (gpt-oss's MXFP4 experts)")
    return SourceFormat("mxfp4 (gpt-oss)", fused=fused)


@dataclass(frozen=True)
class _PackScheme:
    targets: tuple[str, ...]
    num_bits: int
    group_size: int | None


def _pack_schemes(qc: dict) -> list[_PackScheme]:
    where = "config.json: quantization_config.config_groups"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise Fp4kitError(f"{where}: missing or empty")
    schemes = []
    for key, group in groups.items():
        if isinstance(group, dict) and (group.get("format") or qc.get("format")) != "pack-quantized":
            continue  # another format of a mixed-precision config: its weights are not read as packed INT
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise Fp4kitError(f"{where}.{key}.weights: missing")
        bits, strategy = weights.get("num_bits"), weights.get("strategy")
        if weights.get("type", "int") != "int" or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise Fp4kitError(f"{where}.{key}.weights: type {weights.get('type')!r} num_bits {bits!r}; "
                              "pack-quantized sources hold 1..8-bit integers")
        if not weights.get("symmetric", True):
            raise Fp4kitError(f"{where}.{key}.weights: asymmetric (zero points); fp4kit reads symmetric "
                              "pack-quantized sources")
        if strategy == "group":
            size = weights.get("group_size")
            if not isinstance(size, int) or size < 1:
                raise Fp4kitError(f"{where}.{key}.weights.group_size: {size!r}")
        elif strategy == "channel":
            size = None
        else:
            raise Fp4kitError(f"{where}.{key}.weights.strategy: {strategy!r}; fp4kit reads group or channel")
        schemes.append(_PackScheme(tuple(group.get("targets") or ("Linear",)), bits, size))
    return schemes


def _targets(targets: tuple[str, ...], module: str) -> bool:
    """compressed-tensors' matching of a module name: "Linear" (every quantized module is one), "re:<regex>"
    (re.match) or the exact name."""
    for target in targets:
        if target == "Linear" or target == module:
            return True
        if target.startswith("re:") and re.match(target[3:], module):
            return True
    return False


def _pack_quantized_source(qc: dict, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                           dtype: torch.dtype) -> SourceFormat:
    schemes = _pack_schemes(qc)
    linears: dict[str, QuantizedLinear] = {}
    for name, (pdtype, pshape) in tensors.items():
        if not name.endswith(".weight_packed") or pdtype == torch.uint8:  # uint8: MXFP4's (or refused unread)
            continue
        module = name[: -len(".weight_packed")]
        scheme = next((s for s in schemes if _targets(s.targets, module)), None)
        if scheme is None:
            raise Fp4kitError(f"{name}: no config_groups entry of config.json targets {module}")
        scale, shape = f"{module}.weight_scale", f"{module}.weight_shape"
        for needed in (scale, shape):
            if needed not in tensors:
                raise Fp4kitError(f"{name}: {needed} is missing")
        if f"{module}.weight_zero_point" in tensors:
            raise Fp4kitError(f"{module}.weight_zero_point: asymmetric pack-quantized weights are not read")
        sdtype, sshape = tensors[scale]
        if pdtype != torch.int32 or len(pshape) != 2:
            raise Fp4kitError(f"{name}: {pdtype}{list(pshape)}, pack-quantized weights are int32 [N, words]")
        if not sdtype.is_floating_point or len(sshape) != 2 or sshape[0] != pshape[0]:
            raise Fp4kitError(f"{scale}: {sdtype}{list(sshape)} does not fit {name} {list(pshape)}")
        if tensors[shape][1] != (2,):
            raise Fp4kitError(f"{shape}: shape {list(tensors[shape][1])}, expected [2]")
        rows = pshape[0]
        if scheme.group_size is None:
            cols = pshape[1] * 32 // scheme.num_bits
            if sshape[1] != 1 or cols * scheme.num_bits != pshape[1] * 32:
                raise Fp4kitError(f"{scale}: per-channel scales {list(sshape)} for {name} {list(pshape)}")
        else:
            cols = sshape[1] * scheme.group_size
            if math.ceil(cols * scheme.num_bits / 32) != pshape[1]:
                raise Fp4kitError(f"{name}: {pshape[1]} words per row, {sshape[1]} groups of {scheme.group_size} "
                                  f"{scheme.num_bits}-bit values need {math.ceil(cols * scheme.num_bits / 32)}")
        encoding = PackQuantized(name, scale, shape, scheme.num_bits, scheme.group_size)
        linears[module] = QuantizedLinear(module, encoding, rows, cols, dtype)
    bits = sorted({lin.encoding.num_bits for lin in linears.values()})  # type: ignore[union-attr]
    return SourceFormat(f"int{'/'.join(map(str, bits)) or '?'}-pack-quantized", linears)


# --- dequantization -------------------------------------------------------------------------------------------


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] e4m3 times its [ceil(N/bm), ceil(K/bn)] block multipliers, in fp32, cast to ``dtype``."""
    rows, cols = weight.shape
    bm, bn = block
    grid_rows, grid_cols = scale_inv.shape
    if weight.device.type == "cpu" and nvfp4_cpu.available():  # one pass in C, the same products
        return nvfp4_cpu.dequantize_fp8_block(weight.view(torch.uint8), scale_inv, block, _E4M3).to(dtype)
    if weight.is_cuda:
        values = weight.to(torch.float32)
    else:  # a table lookup is the same conversion (NaN included), and on the CPU twice as fast as .to()
        values = torch.take(_E4M3.to(weight.device), weight.view(torch.uint8).long())
    padded = (grid_rows * bm, grid_cols * bn) != (rows, cols)
    if padded:  # the last block of a row or column is partial: zeros stand in for the missing elements
        values = torch.nn.functional.pad(values, (0, grid_cols * bn - cols, 0, grid_rows * bm - rows))
    blocks = values.view(grid_rows, bm, grid_cols, bn)
    blocks.mul_(scale_inv.to(torch.float32)[:, None, :, None])
    values = blocks.view(grid_rows * bm, grid_cols * bn)
    if padded:
        values = values[:rows, :cols].contiguous()
    return values.to(dtype)


_E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def unpack_int32(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """[N, words] int32 -> [N, cols] int8: element i is bits [i*b, (i+1)*b) of the row's little-endian bit stream
    of words, stored with an offset of 2^(b-1)."""
    mask = (1 << num_bits) - 1
    if 32 % num_bits == 0:  # no value spans two words: shift each word by every offset at once
        shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device)
        values = ((packed.unsqueeze(-1) >> shifts) & mask).flatten(-2)[:, :cols]
    else:
        words = torch.nn.functional.pad(packed.to(torch.int64) & 0xFFFFFFFF, (0, 1))  # a value may spill over
        start = torch.arange(cols, dtype=torch.int64, device=packed.device) * num_bits
        index, shift = start // 32, start % 32
        values = ((words[:, index] >> shift) | (words[:, index + 1] << (32 - shift))) & mask
    return (values - (1 << (num_bits - 1))).to(torch.int8)


def _byte_table(num_bits: int) -> torch.Tensor:
    """[256, 8/b] float32: the signed values of the 8/b elements a byte holds, lowest bits first."""
    per_byte = 8 // num_bits
    byte = torch.arange(256, dtype=torch.int32)
    shifts = torch.arange(0, 8, num_bits, dtype=torch.int32)
    return (((byte[:, None] >> shifts) & ((1 << num_bits) - 1)) - (1 << (num_bits - 1))).to(torch.float32).view(
        256, per_byte)


_BYTE_TABLES = {bits: _byte_table(bits) for bits in (1, 2, 4, 8)}


def dequantize_pack_quantized(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], num_bits: int,
                              group_size: int | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rows, cols = shape
    if num_bits in _BYTE_TABLES and sys.byteorder == "little":  # the words' bytes in stream order: a table lookup
        table = _BYTE_TABLES[num_bits].to(packed.device)
        codes = packed.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
        values = torch.index_select(table, 0, codes).view(rows, -1)
        values = values[:, :cols].contiguous() if values.shape[1] != cols else values
    else:
        values = unpack_int32(packed, num_bits, cols).to(torch.float32)
    scale = scale.to(torch.float32)
    if group_size is None:
        values.mul_(scale)
    elif cols % group_size == 0:
        values.view(rows, cols // group_size, group_size).mul_(scale.unsqueeze(-1))
    else:
        values.mul_(scale.repeat_interleave(group_size, 1)[:, :cols])
    return values.to(dtype)


def _block_multipliers(scale: torch.Tensor, linear: QuantizedLinear) -> torch.Tensor:
    """An FP8 Linear's multipliers as fp32 [ceil(N/bm), ceil(K/bn)] (a per-tensor scale stored as [1] or [])."""
    bm, bn = linear.encoding.block  # type: ignore[union-attr]
    grid = (math.ceil(linear.out_features / bm), math.ceil(linear.in_features / bn))
    if scale.dtype == torch.float8_e8m0fnu:
        return mxfp4_multipliers(scale.view(torch.uint8)).reshape(grid)
    return scale.to(torch.float32).reshape(grid)


E8M0_NAN = 255


def mxfp4_multipliers(exponents: torch.Tensor) -> torch.Tensor:
    """fp32 2^(e - 127) of E8M0 exponent bytes (e = 0: the subnormal 2^-127), NaN for 255 (OCP MX)."""
    scale = torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents.to(torch.int32) - 127)
    return torch.where(exponents == E8M0_NAN, torch.nan, scale)


def mxfp4_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """MXFP4 codes or exponents as the uint8 bytes the format defines, whatever one-byte dtype stores them
    (DeepSeek-V4: int8 codes, float8_e8m0fnu exponents)."""
    return tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., N, K/2] E2M1 code bytes (element 2j in the low nibble, sign in bit 3) with [..., N, ceil(K/32)] E8M0
    exponents -> [..., N, K] values, exact in fp32 (and in bf16: 2-bit significands, the exponents' range)."""
    values = unpack_e2m1(mxfp4_bytes(packed))
    cols = values.shape[-1]
    scale = mxfp4_multipliers(mxfp4_bytes(exponents)).repeat_interleave(32, dim=-1)[..., :cols]
    return values.mul_(scale).to(dtype)


def stored_mxfp4_bytes(reader, enc: Mxfp4, mapped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 Linear's stored code bytes [N, K/2] and exponent bytes [N, K/32] (``mxfp4_bytes``); of a fused
    tensor, only its expert's are read, and its rows are a strided view (gate's or up's of interleaved rows).
    ``mapped``: the code bytes as a view of the file (CheckpointReader.mapped), for a caller that reads few of them
    and may write them unchanged (the exact cast)."""
    if enc.expert is None:
        packed = reader.mapped(enc.weight) if mapped else reader.read(enc.weight)
        return mxfp4_bytes(packed), mxfp4_bytes(reader.read(enc.scale))
    packed = (reader.mapped(enc.weight, enc.expert, enc.expert + 1) if mapped
              else reader.read_rows(enc.weight, enc.expert, enc.expert + 1, check_finite=False))[0].flatten(-2)
    exponents = reader.read_rows(enc.scale, enc.expert, enc.expert + 1, check_finite=False)[0]
    if enc.rows is not None:
        start, stop, step = enc.rows
        packed, exponents = packed[start:stop:step], exponents[start:stop:step]
    return mxfp4_bytes(packed), mxfp4_bytes(exponents)


def stored_bytes(reader, linear: QuantizedLinear) -> int:
    """Bytes of SRC that the Linear reads (its share of a fused tensor)."""
    enc = linear.encoding
    if isinstance(enc, Mxfp4) and enc.expert is not None:
        infos = (reader.info(enc.weight), reader.info(enc.scale))
        return sum(info.nbytes // (info.shape[0] * info.shape[1]) * linear.out_features for info in infos)
    return sum(reader.info(t).nbytes for t in linear.tensors)


def dequantize_fused(reader, fused: FusedMxfp4, dtype: torch.dtype) -> torch.Tensor:
    """A fused MXFP4 tensor as the model holds it, [E, K, N] in ``dtype``, dequantized one expert at a time."""
    out = torch.empty(fused.shape, dtype=dtype)
    for expert in range(fused.experts):
        packed, exponents = stored_mxfp4_bytes(reader, Mxfp4(fused.blocks, fused.scales, expert))
        out[expert] = dequantize_mxfp4(packed, exponents).t()
    return out


def stored_fp8_block(reader, linear: QuantizedLinear) -> nvfp4_cpu.Fp8BlockWeight | None:
    """An FP8-block Linear planned in fp32 as its stored codes and block multipliers, for the C loop to quantize
    (fp4kit.nvfp4.quantize_group with native: the bytes of quantizing its fp32 dequantization, which is never made), or
    None where that loop does not read it (another format or dtype, no compiler, 16-blocks across two scale
    blocks)."""
    enc = linear.encoding
    if (not isinstance(enc, Fp8Block) or linear.dtype != torch.float32 or enc.block[1] % nvfp4_cpu.BLOCK
            or linear.in_features % nvfp4_cpu.BLOCK or not nvfp4_cpu.available()):
        return None
    return nvfp4_cpu.fp8_block_weight(reader.read(enc.weight, check_finite=False),
                                      _block_multipliers(reader.read(enc.scale, check_finite=False), linear), enc.block,
                                      _E4M3)


def dequantize(reader, linear: QuantizedLinear, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> torch.Tensor:
    """The Linear's [N, K] weight, dequantized to ``dtype`` (default: the planned one) on ``device`` (default: the
    CPU; on a GPU the stored bytes travel, not the fp32 result); non-finite values are kept (quantizing reports
    them)."""
    enc = linear.encoding
    dtype = dtype or linear.dtype

    def read(name: str, check_finite: bool = False) -> torch.Tensor:
        tensor = reader.read(name, check_finite=check_finite)
        return tensor if device is None else tensor.to(device, non_blocking=True)

    if isinstance(enc, Fp8Block):
        return dequantize_fp8_block(read(enc.weight), _block_multipliers(read(enc.scale), linear), enc.block, dtype)
    if isinstance(enc, Mxfp4):
        packed, exponents = stored_mxfp4_bytes(reader, enc)
        if device is not None:
            packed, exponents = packed.to(device, non_blocking=True), exponents.to(device, non_blocking=True)
        return dequantize_mxfp4(packed, exponents, dtype)
    shape = tuple(int(v) for v in reader.read(enc.shape).tolist())
    if shape != (linear.out_features, linear.in_features):
        raise Fp4kitError(f"{enc.shape}: {list(shape)}, but {enc.weight} and {enc.scale} hold "
                          f"[{linear.out_features}, {linear.in_features}]")
    return dequantize_pack_quantized(read(enc.weight, True), read(enc.scale), shape, enc.num_bits, enc.group_size,
                                     dtype)


class DequantizedView:
    """A quantized source read tensor by tensor as the model holds it (for fp4kit.quantize.calibrate's layer loader):
    each quantized Linear's stored tensors stand in as ``<module>.weight``, dequantized in fp32 and cast to ``dtype``
    (the layer's: no module transformers keeps in fp32 is a Linear the sources quantize), on ``device`` when given (the
    stored bytes travel); every other tensor reads as stored. The same interface as CheckpointReader's reads."""

    def __init__(self, reader, source: SourceFormat, dtype: torch.dtype, device: torch.device | str | None = None):
        self.reader, self.source, self.dtype, self.device = reader, source, dtype, device
        self.weights = {f"{m}.weight": linear for m, linear in source.linears.items()}
        self.stored = {t: linear for linear in source.linears.values() for t in linear.tensors}
        self.dropped = set(source.dropped)
        self.fused = source.fused
        self.fused_stored = {t: f for f in source.fused.values() for t in (f.blocks, f.scales)}

    def names(self) -> list[str]:
        names = []
        for name in self.reader.names():
            if name in self.fused_stored:
                if name == self.fused_stored[name].blocks:
                    names.append(self.fused_stored[name].tensor)
            elif name in self.stored:
                if name == self.stored[name].tensor:
                    names.append(f"{self.stored[name].module}.weight")
            elif name not in self.dropped:
                names.append(name)
        return names

    def __contains__(self, name: str) -> bool:
        return name in self.weights or name in self.fused or (
            name in self.reader and name not in self.stored and name not in self.dropped
            and name not in self.fused_stored)

    def info(self, name: str):
        from fp4kit.io.checkpoint import PlannedTensor

        if name in self.fused:
            return PlannedTensor(name, self.dtype, self.fused[name].shape)
        linear = self.weights.get(name)
        if linear is None:
            return self.reader.info(name)
        return PlannedTensor(name, self.dtype, (linear.out_features, linear.in_features))

    def read(self, name: str, check_finite: bool | None = None) -> torch.Tensor:
        from fp4kit.io.checkpoint import require_finite

        fused = self.fused.get(name)
        linear = self.weights.get(name)
        if linear is None and fused is None:
            if name in self.stored or name in self.dropped or name in self.fused_stored:
                raise KeyError(name)
            return self.reader.read(name, check_finite=check_finite)
        if fused is not None:
            weight = dequantize_fused(self.reader, fused, self.dtype)
            weight = weight if self.device is None else weight.to(self.device)
        else:
            weight = dequantize(self.reader, linear, self.dtype, self.device)  # fp32 product, then dtype
        if self.reader.check_finite if check_finite is None else check_finite:
            stored = fused.blocks if fused is not None else linear.tensor
            require_finite(name, weight, self.reader.info(stored).file)
        return weight


def dequantized_view(reader, config: dict, dtype: torch.dtype, device: torch.device | str | None = None):
    """``reader`` itself for an unquantized source, else a DequantizedView of it."""
    source = read_source(reader, config)
    return DequantizedView(reader, source, dtype, device) if source.quantized else reader


def model_dtype(config: dict) -> torch.dtype:
    """The dtype config.json names for the model (``dtype`` or ``torch_dtype``), bf16 when it names none."""
    text = config.get("text_config") or config
    name = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    dtype = getattr(torch, str(name), None) if name else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16


# --- writing sources (fixtures, benchmarks) -------------------------------------------------------------------

FP8_MAX = 448.0
# Linears the published FP8 sources keep in bf16: lm_head and the routers (DeepSeek-V3's files, Qwen3's; MiniMax-M2's
# `block_sparse_moe.gate`, its config's modules_to_not_convert "gate"), and DeepSeek-V3.2's indexer head weights (its
# files store indexer.weights_proj bf16 beside FP8 wq_b and wk)
KEPT_BY_FP8_SOURCES = re.compile(r"(^|\.)lm_head$|(mlp|block_sparse_moe)\.gate$|shared_expert_gate$|(embed|norm)[^.]*$"
                                 r"|indexer\.weights_proj$")


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantization: per block scale_inv = amax / 448 (1 for an all-zero block), q = e4m3(w /
    scale_inv). Returns (e4m3 [N, K], float32 [ceil(N/bm), ceil(K/bn)])."""
    rows, cols = weight.shape
    bm, bn = block
    grid = (math.ceil(rows / bm), math.ceil(cols / bn))
    padded = torch.zeros(grid[0] * bm, grid[1] * bn, dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    blocks = padded.view(grid[0], bm, grid[1], bn)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(grid[0] * bm, grid[1] * bn)[:rows, :cols].contiguous(), scale_inv


def write_fp8_block_copy(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128),
                         max_shard_bytes: int = 5 * 10**9) -> Path:
    """Write unquantized checkpoint SRC as DeepSeek-V3's FP8 release stores it, one tensor at a time: every 2-D
    Linear weight but lm_head and the routers as float8_e4m3fn with ``weight_scale_inv`` float32 per block, config
    ``quant_method: fp8`` with ``weight_block_size``; everything else as it is."""
    from fp4kit.io.checkpoint import CheckpointReader, PlannedTensor, ShardWriter, copy_side_files, read_config

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = read_config(src)
    if isinstance(config.get("quantization_config"), dict):
        raise Fp4kitError(f"{src}/config.json: quantization_config: already quantized")
    with CheckpointReader(src) as reader:
        blocked = {name for name, info in reader.tensors.items() if name.endswith(".weight") and len(info.shape) == 2
                   and info.dtype.is_floating_point and not KEPT_BY_FP8_SOURCES.search(name[: -len(".weight")])}
        planned = []
        for name, info in reader.tensors.items():
            if name not in blocked:
                planned.append(PlannedTensor(name, info.dtype, info.shape))
                continue
            grid = (math.ceil(info.shape[0] / block[0]), math.ceil(info.shape[1] / block[1]))
            planned.append(PlannedTensor(name, torch.float8_e4m3fn, info.shape))
            planned.append(PlannedTensor(name[: -len(".weight")] + FP8_SCALE_SUFFIX, torch.float32, grid))
        writer = ShardWriter(dst, planned, max_shard_bytes, metadata={"format": "pt"})
        for name in reader.names():
            tensor = reader.read(name)
            if name in blocked:
                tensor, scale_inv = quantize_fp8_block(tensor, block)
                writer.write(name[: -len(".weight")] + FP8_SCALE_SUFFIX, scale_inv)
            writer.write(name, tensor)
        writer.finish()
    copy_side_files(src, dst)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst

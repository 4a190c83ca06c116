"""What an NVFP4 checkpoint dialect is: the protocol each dialect module implements, and the reading helpers they share.

A dialect (one module in fp4kit/formats, registered once in fp4kit/registry.py) owns everything about its spelling:
the tensor-name suffixes of each role, how it stores per-tensor scales (multiplier or divisor, as fp32), how its
config declares it and names the scheme, which of its tensors form a quantized module (and the checks of their dtype
and shape), and what it writes: planned tensors, encoded tensors, config.json's ``quantization_config`` and any
other config file. fp4kit/formats/detect.py, convert, quantize and shard ask the registered dialects and never spell
a dialect themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import largest_amax
from fp4kit.nvfp4 import BLOCK, divisor_of

if TYPE_CHECKING:
    from fp4kit.families.base import Family
    from fp4kit.fp8 import Fp8Weight
    from fp4kit.io.checkpoint import CheckpointReader, PlannedTensor
    from fp4kit.nvfp4 import NVFP4Tensor

# the tensors of one quantized Linear, by role: packed E2M1 codes, FP8 block scales, weight global and input scale
ROLES = ("packed", "block", "global", "input")
ROLE_DTYPES = {"packed": torch.uint8, "block": torch.float8_e4m3fn, "global": torch.float32, "input": torch.float32}


@dataclass(frozen=True)
class QuantModule:
    """One quantized Linear [N, K], with the names of its tensors on disk.

    For a fused expert tensor (ModelOpt's Llama-4 experts), ``expert`` is the index along dim 0 and ``rows`` the
    output rows of the expert's canonical [N_total, K] matrix that belong to this Linear (gate or up of gate_up_proj).
    """

    name: str
    packed: str
    block_scale: str
    global_scale: str
    input_scale: str | None
    out_features: int
    in_features: int
    expert: int | None = None
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class Fp8Module:
    """One FP8 Linear [N, K] of a mixed-precision checkpoint (fp4kit.quantize.schemes), with its scheme and the names
    of its tensors on disk: E4M3 weight codes, the weight scale (per channel, per 128x128 block or per tensor) and,
    for fp8-static, the input scale (a divisor)."""

    name: str
    scheme: str  # fp8-dynamic, fp8-block or fp8-static
    weight: str
    scale: str
    input_scale: str | None
    out_features: int
    in_features: int


FP8_SCHEMES = ("fp8-dynamic", "fp8-block", "fp8-static")


def fp8_modules(reader: CheckpointReader, suffixes: dict[str, str],
                scale_shape: Callable[[str, int, int], tuple[int, ...]]) -> list[Fp8Module]:
    """One module per ``<m><suffixes['weight']>`` stored as E4M3 [N, K]; its scheme is the one whose weight scale
    shape (``scale_shape(scheme, N, K)``, the dialect's spelling) the stored scale has, fp8-static exactly when an
    input scale is stored."""
    modules = []
    for name in reader.names():
        if not name.endswith(suffixes["weight"]) or reader.info(name).dtype != torch.float8_e4m3fn:
            continue
        base = name[: -len(suffixes["weight"])]
        shape = reader.info(name).shape
        if len(shape) != 2:
            raise Fp4kitError(f"{name}: shape {list(shape)}, expected a 2-D FP8 weight")
        scale_name, input_name = base + suffixes["scale"], base + suffixes["input"]
        if scale_name not in reader:
            raise Fp4kitError(f"{base}: missing FP8 weight scale tensor {scale_name}")
        for tensor in (scale_name, input_name):
            if tensor in reader and (not reader.info(tensor).dtype.is_floating_point
                                     or reader.info(tensor).dtype.itemsize == 1):
                raise Fp4kitError(f"{tensor}: dtype {reader.info(tensor).dtype}, expected a bf16/fp16/fp32 scale")
        has_input = input_name in reader
        if has_input and reader.info(input_name).shape not in ((), (1,)):
            raise Fp4kitError(f"{input_name}: shape {list(reader.info(input_name).shape)}, expected a single value")
        n, k = shape
        found = [s for s in FP8_SCHEMES
                 if scale_shape(s, n, k) == reader.info(scale_name).shape and (s == "fp8-static") == has_input]
        if not found:
            raise Fp4kitError(f"{scale_name}: shape {list(reader.info(scale_name).shape)} is no FP8 scheme's weight "
                              f"scale of a [{n}, {k}] weight" + (" with an input scale" if has_input else ""))
        modules.append(Fp8Module(base, found[0], name, scale_name, input_name if has_input else None, n, k))
    return modules


def check_tensor(reader: CheckpointReader, module: str, role: str, name: str | None,
                 shape: tuple[int, ...] | None) -> None:
    """``name`` exists with the dtype of ``role`` and, when given, ``shape`` (per-tensor scales: one value)."""
    if name is None or name not in reader:
        raise Fp4kitError(f"{module}: missing {role} scale tensor {name}" if role != "packed"
                          else f"{module}: missing packed weight tensor {name}")
    info = reader.info(name)
    if info.dtype != ROLE_DTYPES[role]:
        raise Fp4kitError(f"{name}: dtype {info.dtype}, expected {ROLE_DTYPES[role]}")
    if shape is not None and info.shape != shape:
        raise Fp4kitError(f"{name}: shape {list(info.shape)}, expected {list(shape)}")
    if role in ("global", "input") and info.shape not in ((), (1,)):
        raise Fp4kitError(f"{name}: shape {list(info.shape)}, expected a single value")


def plain_modules(reader: CheckpointReader, suffixes: dict[str, str], evidence: tuple[str, ...],
                  is_module: Callable[[str], bool] = lambda base: True) -> list[QuantModule]:
    """One module per ``<m>`` that has a tensor ``<m><suffixes[role]>`` for a role in ``evidence`` and passes
    ``is_module``; every role's tensor then checked in dtype and shape."""
    bases: dict[str, None] = {}
    for name in reader.names():
        for role in evidence:
            if name.endswith(suffixes[role]):
                bases.setdefault(name[: -len(suffixes[role])])
                break
    modules = []
    for base in (b for b in bases if is_module(b)):
        names = {role: base + suffix for role, suffix in suffixes.items()}
        check_tensor(reader, base, "packed", names["packed"], None)
        packed = reader.info(names["packed"]).shape
        if len(packed) != 2:
            raise Fp4kitError(f"{names['packed']}: shape {list(packed)}, expected a 2-D packed weight")
        check_tensor(reader, base, "block", names["block"], (packed[0], packed[1] * 2 // BLOCK))
        check_tensor(reader, base, "global", names["global"], None)
        input_name = names["input"] if names["input"] in reader else None
        if input_name:
            check_tensor(reader, base, "input", input_name, None)
        modules.append(QuantModule(base, names["packed"], names["block"], names["global"], input_name,
                                   packed[0], packed[1] * 2))
    return modules


class Dialect:
    """One NVFP4 checkpoint dialect. Subclasses set the class attributes and implement the methods that raise."""

    name: str  # as config.json's quant_method and the CLI spell it
    title: str  # for messages
    suffixes: dict[str, str]  # role (ROLES) -> suffix after the module name
    # "multiplier": per-tensor scales stored as G = 1/D; "divisor": stored as D (fp32 both)
    stores: str
    config_files: tuple[str, ...] = ()  # files beside config.json that hold this dialect's config
    # can keep a family's on-disk fused experts fused (families with Family.modelopt_fused_experts)
    fused_experts: bool = False
    # quantize records calibrated input divisors that this dialect's fp32 form cannot give back exactly
    # (fp4kit.formats.detect.EXACT_SCALES_KEY), so converting its output restores what quantizing writes
    records_exact_input_scales: bool = False
    # the `--quantization` value the serving docs pass to vLLM and SGLang for this dialect (docs/serving.md); None:
    # none passed (the engines read the method from config.json)
    serve_quantization: str | None = None
    # the same for a checkpoint with per-module schemes (fp4kit.quantize.schemes)
    serve_quantization_mixed: str | None = None
    # the algorithm an FP8 release's own config names NVFP4 routed experts written in this dialect's tensor names by
    # (quantize --source-config: vLLM 0.33's DeepseekV4FP8Config reads `moe_quant_algo: NVFP4` and loads the
    # experts through ModelOpt's NVFP4 MoE method); None: no engine reads this dialect's experts so
    fp8_release_moe_algo: str | None = None

    # --- reading ---
    def declared_by(self, method: str, files: dict[str, dict]) -> str | None:
        """What in config.json's quant_method (lowercase) or this dialect's ``config_files`` (parsed) declares the
        checkpoint to be in this dialect, as a phrase for messages; None when nothing does."""
        raise NotImplementedError

    def quantization_section(self, qconfig: dict, files: dict[str, dict]) -> dict:
        """The config section that names the scheme and the ignore list."""
        return qconfig

    def scheme(self, qconfig: dict) -> str:
        """nvfp4 or nvfp4a16 from the declared config (of a mixed-precision one: its NVFP4 modules' scheme, nvfp4a16
        when it has none); an Fp4kitError when it is not NVFP4."""
        raise NotImplementedError

    def is_mixed(self, qconfig: dict) -> bool:
        """Whether the declared config gives modules different schemes (FP8 ones beside NVFP4 ones)."""
        raise NotImplementedError

    def find_fp8_modules(self, reader: CheckpointReader) -> list[Fp8Module]:
        """Every FP8 Linear of a mixed-precision checkpoint, its tensors checked."""
        raise NotImplementedError

    def owns(self, tensor: str) -> bool:
        """Whether a tensor name is one that only this dialect writes (evidence of the dialect without a config)."""
        raise NotImplementedError

    def find_modules(self, reader: CheckpointReader) -> list[QuantModule]:
        """Every quantized module, its tensors checked; an Fp4kitError for a missing or malformed one."""
        raise NotImplementedError

    def load_scale(self, stored: torch.Tensor, producer: str | None) -> torch.Tensor:
        """The float64 divisor a stored per-tensor scale holds (``producer``: the safetensors metadata's)."""
        return divisor_of(stored) if self.stores == "multiplier" else stored.double()

    def store_scale(self, divisor: torch.Tensor) -> torch.Tensor:
        """The fp32 value(s) stored for float64 divisor(s)."""
        raise NotImplementedError

    @property
    def largest_amax(self) -> Callable[[list[float]], float]:
        """Which of several stored scale values has the largest amax: the smallest multiplier, the largest divisor."""
        return largest_amax(self.stores)

    # --- writing ---
    def scale_names(self, module: str) -> tuple[str, str]:
        """(weight global scale, input scale) tensor names of a module."""
        return module + self.suffixes["global"], module + self.suffixes["input"]

    def planned(self, module: str, out_features: int, in_features: int, with_input_scale: bool) -> list[PlannedTensor]:
        raise NotImplementedError

    def encode(self, module: str, weight: NVFP4Tensor, input_scale_div: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def decode(self, module: str, tensors: dict[str, torch.Tensor]) -> tuple[NVFP4Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def quantization_config(self, scheme: str, ignore: list[str]) -> dict:
        """config.json's ``quantization_config``."""
        raise NotImplementedError

    def side_configs(self, scheme: str, ignore: list[str]) -> dict[str, dict]:
        """The ``config_files`` to write beside config.json, by file name."""
        return {}

    def exclusions(self, unquantized: list[str], quantized: list[str]) -> list[str]:
        """The ignore list the configs carry, from the unquantized modules (or patterns) and the quantized ones."""
        return list(unquantized)

    # --- per-module schemes (fp4kit.quantize.schemes): FP8 Linears beside NVFP4 ones ---
    def fp8_planned(self, module: str, scheme: str, out_features: int, in_features: int, dtype: torch.dtype,
                    with_input_scale: bool) -> list[PlannedTensor]:
        """An FP8 Linear's tensors; ``dtype``: the source weight's (compressed-tensors keeps scales in it)."""
        raise NotImplementedError

    def fp8_encode(self, module: str, scheme: str, weight: Fp8Weight, input_scale_div: torch.Tensor | None = None
                   ) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def mixed_quantization_config(self, schemes: dict[str, str], ignore: list[str]) -> dict:
        """config.json's ``quantization_config`` when modules have different schemes (module -> scheme)."""
        raise NotImplementedError

    def mixed_side_configs(self, schemes: dict[str, str], ignore: list[str]) -> dict[str, dict]:
        return {}

    # --- the FP8 KV cache (quantize --kv-cache fp8): per attention module a k_scale and a v_scale, fp32 divisors ---
    kv_suffixes: tuple[str, str] = (".k_scale", ".v_scale")  # after the attention module's name
    kv_scale_shape: tuple[int, ...] = ()

    def kv_scale_names(self, attention: str) -> tuple[str, str]:
        return attention + self.kv_suffixes[0], attention + self.kv_suffixes[1]

    def kv_planned(self, attention: str) -> list[PlannedTensor]:
        from fp4kit.io.checkpoint import PlannedTensor

        return [PlannedTensor(name, torch.float32, self.kv_scale_shape) for name in self.kv_scale_names(attention)]

    def kv_encode(self, attention: str, k_scale: torch.Tensor, v_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        k_name, v_name = self.kv_scale_names(attention)
        return {k_name: k_scale.float().reshape(self.kv_scale_shape),
                v_name: v_scale.float().reshape(self.kv_scale_shape)}

    def find_kv_scales(self, names: list[str]) -> dict[str, tuple[str, str]]:
        """Attention module -> its (k_scale, v_scale) tensor names, for every k_scale among ``names``."""
        found = {}
        for name in names:
            if name.endswith(self.kv_suffixes[0]):
                attention = name[: -len(self.kv_suffixes[0])]
                found[attention] = self.kv_scale_names(attention)
        return found

    def add_kv_cache(self, quantization_config: dict, side_configs: dict[str, dict]) -> None:
        """Declare an FP8 KV cache in the configs (in place)."""
        raise NotImplementedError

    def kv_cache_of(self, qconfig: dict) -> str | None:
        """``fp8`` where the config declares a per-tensor FP8 KV cache, else None (no KV cache, or one fp4kit does
        not read: its scales are then passthrough tensors)."""
        raise NotImplementedError

    def spell_ignore(self, patterns: list[str], unquantized: list[str]) -> list[str]:
        """Another dialect's ignore list (module names, ``re:`` regexes or fnmatch globs) in this dialect's
        spelling; ``unquantized``: the checkpoint's unquantized Linears, for patterns that cannot be respelled."""
        raise NotImplementedError

    def writes_fused(self, family: Family | None) -> bool:
        """Whether this dialect writes the family's routed experts as fused tensors."""
        return self.fused_experts and family is not None and family.modelopt_fused_experts

"""The compressed-tensors dialect ("nvfp4-pack-quantized"), as llm-compressor writes it and vLLM loads it.

Per quantized Linear `<m>`: `<m>.weight_packed` u8 [N, K/2], `<m>.weight_scale` fp8 [N, K/16],
`<m>.weight_global_scale` fp32 [1] (multiplier 448*6/amax) and, for W4A4, `<m>.input_global_scale` fp32 [1]
(multiplier). The config is built with compressed-tensors' own classes so that it always validates.

Importing compressed-tensors costs ~10 CPU seconds (it imports transformers), more than converting a small
checkpoint. The config those classes build for each scheme under the installed version is therefore kept in
fp4kit/data/compressed_tensors_config.json (``write_config_snapshot``) and used while that version is installed;
tests check it against the classes, and under any other version the classes build the config again.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from importlib import metadata, resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.formats.base import Dialect, Fp8Module, QuantModule, fp8_modules, plain_modules
from fp4kit.io.checkpoint import CheckpointReader, PlannedTensor
from fp4kit.nvfp4 import BLOCK, NVFP4Tensor, divisor_of, fp32_multiplier

if TYPE_CHECKING:
    from fp4kit.fp8 import Fp8Weight

NAME = "compressed-tensors"
FORMAT = "nvfp4-pack-quantized"
SUFFIXES = {"packed": ".weight_packed", "block": ".weight_scale", "global": ".weight_global_scale",
            "input": ".input_global_scale"}
SCHEMES = {"nvfp4a16": "NVFP4A16", "nvfp4": "NVFP4"}
# per-module schemes (fp4kit.quantize.schemes) besides NVFP4: compressed-tensors' preset and group format
FP8_SCHEMES = {"fp8-dynamic": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK", "fp8-static": "FP8"}
FP8_FORMAT = "float-quantized"
MIXED_FORMAT = "mixed-precision"
FP8_SUFFIXES = {"weight": ".weight", "scale": ".weight_scale", "input": ".input_scale"}
CONFIG_SNAPSHOT = "compressed_tensors_config.json"


def planned(module: str, out_features: int, in_features: int, with_input_scale: bool) -> list[PlannedTensor]:
    specs = [
        PlannedTensor(module + SUFFIXES["packed"], torch.uint8, (out_features, in_features // 2)),
        PlannedTensor(module + SUFFIXES["block"], torch.float8_e4m3fn, (out_features, in_features // BLOCK)),
        PlannedTensor(module + SUFFIXES["global"], torch.float32, (1,)),
    ]
    if with_input_scale:
        specs.append(PlannedTensor(module + SUFFIXES["input"], torch.float32, (1,)))
    return specs


def encode(module: str, weight: NVFP4Tensor, input_scale_div: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    tensors = {
        module + SUFFIXES["packed"]: weight.packed,
        module + SUFFIXES["block"]: weight.block_scale,
        module + SUFFIXES["global"]: weight.global_scale_mul_fp32.reshape(1),
    }
    if input_scale_div is not None:
        tensors[module + SUFFIXES["input"]] = fp32_multiplier(input_scale_div).reshape(1)
    return tensors


def decode(module: str, tensors: dict[str, torch.Tensor]) -> tuple[NVFP4Tensor, torch.Tensor | None]:
    global_mul = tensors[module + SUFFIXES["global"]].reshape(())
    weight = NVFP4Tensor(
        tensors[module + SUFFIXES["packed"]],
        tensors[module + SUFFIXES["block"]],
        divisor_of(global_mul),
    )
    input_mul = tensors.get(module + SUFFIXES["input"])
    return weight, None if input_mul is None else divisor_of(input_mul.reshape(()))


def is_mixed(qconfig: dict) -> bool:
    return qconfig.get("format") == MIXED_FORMAT


def scheme_of(qconfig: dict) -> str:
    """nvfp4 or nvfp4a16 from a compressed-tensors quantization_config (an error for any format but NVFP4, or, in
    a mixed-precision one, NVFP4 and FP8): of a mixed-precision config, its NVFP4 groups' scheme."""
    groups = list((qconfig.get("config_groups") or {}).values())
    if is_mixed(qconfig):
        formats = {g.get("format") for g in groups} - {FORMAT, FP8_FORMAT}
        if formats:
            raise Fp4kitError(f"compressed-tensors {MIXED_FORMAT} group format {sorted(map(str, formats))[0]!r} is "
                              f"neither NVFP4 ({FORMAT}) nor FP8 ({FP8_FORMAT})")
        groups = [g for g in groups if g.get("format") == FORMAT]
    else:
        formats = {qconfig.get("format")} | {g.get("format") for g in groups}
        formats.discard(None)
        if formats - {FORMAT}:
            raise Fp4kitError(f"compressed-tensors format {sorted(formats - {FORMAT})[0]!r} is not NVFP4 "
                              f"(fp4kit reads {FORMAT}, and {MIXED_FORMAT} of NVFP4 and FP8)")
    with_input = {bool(g.get("input_activations")) for g in groups}
    if len(with_input) > 1:
        raise Fp4kitError("compressed-tensors config groups mix NVFP4 (W4A4) and NVFP4A16 (weight-only): fp4kit reads "
                          "one NVFP4 scheme per checkpoint")
    return "nvfp4" if True in with_input else "nvfp4a16"


_WHOLE_LAYER_GLOB = re.compile(r"(.*\blayers\.\d+)\.\*")


def whole_layers_named(patterns: list[str], unquantized: list[str]) -> list[str]:
    """A ModelOpt glob for a whole kept layer (``<...>.layers.N.*``, what fp4kit's ModelOpt writer spells a layer
    with no quantized module as) replaced by the unquantized modules it names, as compressed-tensors lists them."""
    out: list[str] = []
    for pattern in patterns:
        whole = _WHOLE_LAYER_GLOB.fullmatch(pattern)
        out.extend([n for n in unquantized if n.startswith(whole.group(1) + ".")] if whole else [pattern])
    return out


def ignore_from(patterns: list[str]) -> list[str]:
    """Module names and fnmatch globs (ModelOpt's exclude_modules) as compressed-tensors' names and `re:` regexes."""
    return [p if "*" not in p else "re:" + re.escape(p).replace(r"\*", ".*") for p in patterns]


def quantization_config(scheme: str, ignore: list[str]) -> dict:
    """config.json `quantization_config` for every Linear quantized with `scheme` except the `ignore` modules: what
    ``build_quantization_config`` returns, from the snapshot when it was taken under the installed version."""
    snapshot = _config_snapshot()
    if snapshot is None or snapshot["compressed_tensors"] != _installed_version():
        return build_quantization_config(scheme, ignore)
    config = copy.deepcopy(snapshot["schemes"][SCHEMES[scheme]])
    config["ignore"] = list(ignore)  # in place: the key order, and so config.json's bytes, stay the classes'
    return config


def build_quantization_config(scheme: str, ignore: list[str]) -> dict:
    """The config as compressed-tensors' own classes build it (imports the library)."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    quant_scheme = preset_name_to_scheme(SCHEMES[scheme], ["Linear"])
    quant_scheme.format = FORMAT
    config = QuantizationConfig(
        config_groups={"group_0": quant_scheme},
        format=FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore,
    )
    out = config.model_dump(mode="json")
    out["version"] = compressed_tensors.__version__
    return out


@functools.cache
def _kv_cache_scheme() -> str:
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True,
                            observer="static_minmax")
    return json.dumps(args.model_dump(mode="json"))


def kv_cache_scheme() -> dict:
    """``kv_cache_scheme`` of an FP8 KV cache, built by compressed-tensors' QuantizationArgs as llm-compressor's
    ``QuantizationModifier(kv_cache_scheme=...)`` writes it: per-tensor static E4M3, symmetric, calibrated by the
    running max of the keys / values (``static_minmax``)."""
    return json.loads(_kv_cache_scheme())


def build_mixed_quantization_config(groups: list[tuple[str, list[str]]], ignore: list[str]) -> dict:
    """config.json's ``quantization_config`` for several schemes: one config group per (scheme, targets) in order,
    built by compressed-tensors' own classes as llm-compressor writes a multi-group recipe; the format is
    ``mixed-precision`` when the groups' formats differ."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    config_groups = {}
    for i, (scheme, targets) in enumerate(groups):
        preset = SCHEMES.get(scheme) or FP8_SCHEMES.get(scheme)
        if preset is None:
            raise ValueError(f"no compressed-tensors config group for scheme {scheme!r}")
        quant_scheme = preset_name_to_scheme(preset, list(targets))
        quant_scheme.format = FORMAT if scheme in SCHEMES else FP8_FORMAT
        config_groups[f"group_{i}"] = quant_scheme
    formats = {g.format for g in config_groups.values()}
    config = QuantizationConfig(
        config_groups=config_groups,
        format=formats.pop() if len(formats) == 1 else MIXED_FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore,
    )
    out = config.model_dump(mode="json")
    out["version"] = compressed_tensors.__version__
    return out


def fp8_planned(module: str, scheme: str, out_features: int, in_features: int, dtype: torch.dtype,
                with_input_scale: bool) -> list[PlannedTensor]:
    """An FP8 Linear as compressed-tensors' float-quantized format stores it: E4M3 ``weight``, its scale in the
    source weight's dtype and, for fp8-static, the input scale [1] in that dtype too."""
    from fp4kit.fp8 import fp8_scale_shape

    specs = [PlannedTensor(module + FP8_SUFFIXES["weight"], torch.float8_e4m3fn, (out_features, in_features)),
             PlannedTensor(module + FP8_SUFFIXES["scale"], dtype, fp8_scale_shape(scheme, out_features, in_features))]
    if with_input_scale:
        specs.append(PlannedTensor(module + FP8_SUFFIXES["input"], dtype, (1,)))
    return specs


def fp8_encode(module: str, scheme: str, weight: Fp8Weight, input_scale_div: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
    tensors = {module + FP8_SUFFIXES["weight"]: weight.codes, module + FP8_SUFFIXES["scale"]: weight.scale}
    if input_scale_div is not None:
        tensors[module + FP8_SUFFIXES["input"]] = input_scale_div.to(weight.scale.dtype).reshape(1)
    return tensors


def _generalizations(module: str) -> list[str]:
    """Regexes for ``module``, anchored at both ends, most general first: every layer and expert number as ``\\d+``,
    then every number but the first (the layer's)."""
    escaped = re.escape(module)
    number = r"\\\.\d+(?=\\\.|$)"
    every = re.sub(number, lambda _: r"\.\d+", escaped)
    first = re.search(number, escaped)
    tail = escaped[:first.end()] + re.sub(number, lambda _: r"\.\d+", escaped[first.end():]) if first else every
    return list(dict.fromkeys(f"^{p}$" for p in (every, tail)))


def scheme_targets(schemes: dict[str, str]) -> list[tuple[str, list[str]]]:
    """(scheme, targets) config groups for per-module schemes that vLLM resolves as compressed-tensors does.

    compressed-tensors gives a module its first matching group; vLLM 0.33 tries every group's module-name targets
    before any class target (vllm/model_executor/layers/quantization/compressed_tensors/utils.py,
    ``find_matched_target``), whatever their order. So the targets never overlap: the scheme with the most modules
    takes ``Linear`` as the last group, and every other group lists its modules as regexes with the layer and
    expert numbers generalized (or the expert numbers only), each checked to match none of another scheme's modules
    (an exact name where both would)."""
    by_scheme: dict[str, list[str]] = {}
    for module, scheme in schemes.items():
        by_scheme.setdefault(scheme, []).append(module)
    default = max(by_scheme, key=lambda s: len(by_scheme[s]))
    groups = []
    safe_patterns: set[str] = set()  # known to match no module of another scheme
    unsafe: set[str] = set()
    for scheme, modules in by_scheme.items():
        if scheme == default:
            continue
        others = [m for m, s in schemes.items() if s != scheme]
        targets: list[str] = []
        for module in modules:
            safe = [p for p in _generalizations(module)
                    if p not in unsafe and (p in safe_patterns or not any(re.match(p, m) for m in others))]
            for p in _generalizations(module):
                (safe_patterns if p in safe else unsafe).add(p)
            target = "re:" + safe[0] if safe else module
            if target not in targets:
                targets.append(target)
        groups.append((scheme, targets))
    return [*groups, (default, ["Linear"])]


def mixed_quantization_config(schemes: dict[str, str], ignore: list[str]) -> dict:
    """config.json's ``quantization_config`` for per-module schemes (``schemes``: module -> scheme)."""
    return build_mixed_quantization_config(scheme_targets(schemes), ignore)


def config_snapshot() -> dict:
    """Every scheme's config built by the installed compressed-tensors, as the snapshot file holds it."""
    import compressed_tensors

    return {"compressed_tensors": compressed_tensors.__version__,
            "schemes": {name: build_quantization_config(scheme, []) for scheme, name in SCHEMES.items()}}


def write_config_snapshot(path: Path | None = None) -> Path:
    """(Re)write the snapshot, e.g. after upgrading compressed-tensors; the default path is the packaged one."""
    path = path or Path(__file__).parent.parent / "data" / CONFIG_SNAPSHOT
    path.write_text(json.dumps(config_snapshot(), indent=2) + "\n")
    return path


@functools.cache
def _config_snapshot() -> dict | None:
    try:
        return json.loads(resources.files("fp4kit.data").joinpath(CONFIG_SNAPSHOT).read_text())
    except FileNotFoundError:
        return None


def _installed_version() -> str | None:
    try:
        return metadata.version("compressed-tensors")
    except metadata.PackageNotFoundError:
        return None


class CompressedTensors(Dialect):
    name = NAME
    title = "compressed-tensors"
    suffixes = SUFFIXES
    stores = "multiplier"

    def declared_by(self, method: str, files: dict[str, dict]) -> str | None:
        return "config.json says compressed-tensors" if method == NAME else None

    def scheme(self, qconfig: dict) -> str:
        return scheme_of(qconfig)

    def is_mixed(self, qconfig: dict) -> bool:
        return is_mixed(qconfig)

    def find_fp8_modules(self, reader: CheckpointReader) -> list[Fp8Module]:
        from fp4kit.fp8 import fp8_scale_shape

        return fp8_modules(reader, FP8_SUFFIXES, fp8_scale_shape)

    def owns(self, tensor: str) -> bool:
        return tensor.endswith((SUFFIXES["packed"], SUFFIXES["global"], SUFFIXES["input"]))

    def find_modules(self, reader: CheckpointReader) -> list[QuantModule]:
        # `.weight_scale` also names an FP8 module's scale (a mixed-precision checkpoint): NVFP4 has packed codes
        return plain_modules(reader, SUFFIXES, ("global", "input", "block", "packed"),
                             lambda base: base + SUFFIXES["packed"] in reader)

    def store_scale(self, divisor: torch.Tensor) -> torch.Tensor:
        return fp32_multiplier(divisor)

    kv_scale_shape = (1,)  # llm-compressor's `self_attn.k_scale` [1] (its dtype the model's; fp4kit's fp32)

    def add_kv_cache(self, quantization_config: dict, side_configs: dict[str, dict]) -> None:
        quantization_config["kv_cache_scheme"] = kv_cache_scheme()

    def kv_cache_of(self, qconfig: dict) -> str | None:
        scheme = qconfig.get("kv_cache_scheme")
        per_tensor_fp8 = (isinstance(scheme, dict) and scheme.get("num_bits") == 8 and scheme.get("type") == "float"
                          and scheme.get("strategy") in ("tensor", None) and not scheme.get("dynamic")
                          and scheme.get("symmetric", True))
        return "fp8" if per_tensor_fp8 else None  # any other: its scales stay passthrough tensors

    # writing and reading by module name: the module functions of the same names
    planned = staticmethod(planned)
    encode = staticmethod(encode)
    decode = staticmethod(decode)
    quantization_config = staticmethod(quantization_config)
    fp8_planned = staticmethod(fp8_planned)
    fp8_encode = staticmethod(fp8_encode)
    mixed_quantization_config = staticmethod(mixed_quantization_config)

    def spell_ignore(self, patterns: list[str], unquantized: list[str]) -> list[str]:
        return ignore_from(whole_layers_named(patterns, unquantized))


DIALECT = CompressedTensors()

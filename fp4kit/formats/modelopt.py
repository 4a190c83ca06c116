"""The ModelOpt NVFP4 dialect, as nvidia-modelopt 0.47's HF export writes it and vLLM's `modelopt_fp4` loads it.

Per quantized Linear `<m>`: `<m>.weight` u8 [N, K/2], `<m>.weight_scale` fp8 [N, K/16] (the same bytes as
compressed-tensors), `<m>.weight_scale_2` fp32 0-d *divisor* amax/(448*6) and, for W4A4, `<m>.input_scale` fp32 0-d
divisor. Config: `hf_quant_config.json` {producer, quantization: {quant_algo, kv_cache_quant_algo, group_size,
exclude_modules}} (vLLM requires all four keys; kv_cache_quant_algo may be null) plus config.json
`quantization_config` with quant_method "modelopt" (modelopt/torch/export/convert_hf_config.py).

Llama-4's fused experts stay fused (modelopt/torch/export/unified_export_hf.py, checked against a 0.47 export of
the tiny fixture): `<experts>.gate_up_proj` u8 [E, H/2, 2I] and `<experts>.down_proj` u8 [E, I/2, H] are the
per-expert canonical [N, K/2] tensors transposed (packed along K, which is dim -2 on disk), block scales
`<experts>.gate_up_proj_weight_scale` fp8 [E, H/16, 2I] likewise, and *one* `_weight_scale_2` / `_input_scale`
fp32 0-d scalar for the whole layer (all experts, gate and up together).

Writing fp32 divisors (``fp32_divisor``): a canonical divisor that is exactly fp32 (it came from ModelOpt) is
written as is. One that came from a compressed-tensors multiplier G is 1/G in float64, usually not an fp32 value;
we write the fp32 D closest to 1/G among those whose reciprocal, rounded to fp32, is G again (searching
``DIVISOR_SEARCH_ULPS`` fp32 steps either side of the nearest). Reading D back and converting to compressed-tensors
then restores G bit for bit. Where no such D exists (the upper part of a binade of G, where the divisors are
sparser than the multipliers), the nearest D is written, and G is restored by ``multiplier_behind`` when it is
bf16-valued (fp4kit's and llm-compressor's weight global scales), or by the exact-scales metadata record the writer
adds (fp4kit.formats.detect; quantize does so for calibrated input scales, convert for any scale).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from fp4kit import __version__
from fp4kit.errors import Fp4kitError
from fp4kit.families.grammar import DEFAULT as FUSED_GRAMMAR
from fp4kit.formats.base import Dialect, Fp8Module, QuantModule, check_tensor, fp8_modules, plain_modules
from fp4kit.io.checkpoint import CheckpointReader, PlannedTensor
from fp4kit.nvfp4 import BLOCK, NVFP4Tensor, divisor_of, fp32_multiplier

if TYPE_CHECKING:
    from fp4kit.fp8 import Fp8Weight

NAME = "modelopt"
HF_QUANT_CONFIG = "hf_quant_config.json"

QUANT_ALGOS = {"nvfp4": "NVFP4", "nvfp4a16": "W4A16_NVFP4"}
SCHEMES = {algo: scheme for scheme, algo in QUANT_ALGOS.items()}
# per-module schemes (fp4kit.quantize.schemes) besides NVFP4: their quant_algo in a MIXED_PRECISION config, the names
# vLLM 0.33's modelopt.py LINEAR_ALGOS maps to its FP8 linear methods
FP8_QUANT_ALGOS = {"fp8-dynamic": "FP8_PER_CHANNEL_PER_TOKEN", "fp8-block": "FP8_PB_WO", "fp8-static": "FP8"}
MIXED = "MIXED_PRECISION"
# who wrote the file: fp4kit, not ModelOpt. vLLM reads `producer.name` only from an hf_quant_config.json that
# config.json has no quantization_config beside (its ModelOpt 0.29 fallback); fp4kit writes both, and vLLM takes
# config.json's, whose quant_method says modelopt (tests/test_vllm_loaders.py loads it)
PRODUCER = {"name": "fp4kit", "version": __version__}
DIVISOR_SEARCH_ULPS = 4
SCALAR = ()  # ModelOpt stores per-tensor scales as 0-d tensors

WEIGHT, BLOCK_SCALE, GLOBAL_SCALE, INPUT_SCALE = "weight", "weight_scale", "weight_scale_2", "input_scale"
# ModelOpt reads the family names of its fused experts; every family fp4kit knows fuses them as the default grammar
FUSED_LEAVES = FUSED_GRAMMAR.fused_tensors
SUFFIXES = {"packed": f".{WEIGHT}", "block": f".{BLOCK_SCALE}", "global": f".{GLOBAL_SCALE}",
            "input": f".{INPUT_SCALE}"}
_FUSED_GLOBAL = re.compile(rf"^(?P<experts>.*\.{re.escape(FUSED_GRAMMAR.experts)})\."
                           rf"(?P<leaf>{'|'.join(FUSED_LEAVES)})_{GLOBAL_SCALE}$")


def fp32_divisor(divisor: torch.Tensor) -> torch.Tensor:
    """float64 divisor(s) -> the fp32 value(s) to store; see the module docstring for the rule."""
    divisor = divisor.double()
    nearest = divisor.float()
    if torch.equal(nearest.double(), divisor):
        return nearest
    multiplier = fp32_multiplier(divisor)
    if torch.equal(fp32_multiplier(nearest), multiplier):  # the usual case: the nearest one restores G
        return nearest
    candidates = [nearest]
    up = down = nearest
    for _ in range(DIVISOR_SEARCH_ULPS):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        candidates += [up, down]
    stacked = torch.stack(candidates)
    keeps_multiplier = fp32_multiplier(stacked) == multiplier
    distance = torch.where(keeps_multiplier, (stacked.double() - divisor).abs(), torch.inf)
    best = stacked.gather(0, distance.argmin(0, keepdim=True)).squeeze(0)
    return torch.where(keeps_multiplier.any(0), best, nearest)


def _bf16_valued(values: torch.Tensor) -> torch.Tensor:
    return (values.view(torch.int32) & 0xFFFF) == 0


def multiplier_behind(stored: torch.Tensor) -> torch.Tensor | None:
    """The compressed-tensors multiplier G that fp4kit's writer turned into the stored fp32 divisor D, or None.

    fp4kit writes ``fp32_divisor(1/G)``. Not every fp32 G is the rounded reciprocal of some fp32 D (near a power of
    two the divisors are twice as sparse as the multipliers), and then D is the nearest divisor and fp32(1/D) is
    G's neighbour: reading 1/D back would move G by one ulp. The multipliers that map to D are at most a few ulps
    from fp32(1/D); when exactly one of them is bf16-valued (fp4kit's and llm-compressor's weight global scales are:
    448*6 / amax in bf16), that is the one; else None (read D as it is).
    """
    stored = stored.reshape(()).float()
    if not bool(torch.isfinite(stored)) or float(stored) <= 0:
        return None
    nearest = fp32_multiplier(stored)
    candidates = [nearest]
    up = down = nearest
    for _ in range(DIVISOR_SEARCH_ULPS):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(0.0))
        candidates += [up, down]
    behind = [g for g in candidates if bool(torch.isfinite(g)) and torch.equal(fp32_divisor(divisor_of(g)), stored)
              and torch.equal(fp32_multiplier(g), stored)]
    preferred = [g for g in behind if bool(_bf16_valued(g))]
    return preferred[0] if len(preferred) == 1 else None


def planned(module: str, out_features: int, in_features: int, with_input_scale: bool) -> list[PlannedTensor]:
    specs = [
        PlannedTensor(f"{module}.{WEIGHT}", torch.uint8, (out_features, in_features // 2)),
        PlannedTensor(f"{module}.{BLOCK_SCALE}", torch.float8_e4m3fn, (out_features, in_features // BLOCK)),
        PlannedTensor(f"{module}.{GLOBAL_SCALE}", torch.float32, SCALAR),
    ]
    if with_input_scale:
        specs.append(PlannedTensor(f"{module}.{INPUT_SCALE}", torch.float32, SCALAR))
    return specs


def encode(module: str, weight: NVFP4Tensor, input_scale_div: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    tensors = {
        f"{module}.{WEIGHT}": weight.packed,
        f"{module}.{BLOCK_SCALE}": weight.block_scale,
        f"{module}.{GLOBAL_SCALE}": fp32_divisor(weight.global_scale_div).reshape(SCALAR),
    }
    if input_scale_div is not None:
        tensors[f"{module}.{INPUT_SCALE}"] = fp32_divisor(input_scale_div).reshape(SCALAR)
    return tensors


def decode(module: str, tensors: dict[str, torch.Tensor]) -> tuple[NVFP4Tensor, torch.Tensor | None]:
    weight = NVFP4Tensor(
        tensors[f"{module}.{WEIGHT}"],
        tensors[f"{module}.{BLOCK_SCALE}"],
        tensors[f"{module}.{GLOBAL_SCALE}"].reshape(()).double(),
    )
    input_div = tensors.get(f"{module}.{INPUT_SCALE}")
    return weight, None if input_div is None else input_div.reshape(()).double()


def fp8_scale_shape(scheme: str, out_features: int, in_features: int) -> tuple[int, ...]:
    """An FP8 weight scale's shape as ModelOpt stores it (fp32): 0-d per tensor, [N] per channel, and per 128x128
    block [N/128, 1, K/128, 1] (what vLLM 0.33's ``KFp8Block128`` registers)."""
    from fp4kit.fp8 import fp8_scale_shape as canonical

    shape = canonical(scheme, out_features, in_features)
    if scheme == "fp8-static":
        return SCALAR
    if scheme == "fp8-dynamic":
        return (out_features,)
    return (shape[0], 1, shape[1], 1)


def fp8_planned(module: str, scheme: str, out_features: int, in_features: int, dtype: torch.dtype,
                with_input_scale: bool) -> list[PlannedTensor]:
    scale_shape = fp8_scale_shape(scheme, out_features, in_features)
    specs = [PlannedTensor(f"{module}.{WEIGHT}", torch.float8_e4m3fn, (out_features, in_features)),
             PlannedTensor(f"{module}.{BLOCK_SCALE}", torch.float32, scale_shape)]
    if with_input_scale:
        specs.append(PlannedTensor(f"{module}.{INPUT_SCALE}", torch.float32, SCALAR))
    return specs


def fp8_encode(module: str, scheme: str, weight: Fp8Weight, input_scale_div: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
    n, k = weight.codes.shape
    tensors = {f"{module}.{WEIGHT}": weight.codes,
               f"{module}.{BLOCK_SCALE}": weight.scale.float().reshape(fp8_scale_shape(scheme, n, k))}
    if input_scale_div is not None:
        tensors[f"{module}.{INPUT_SCALE}"] = input_scale_div.to(weight.scale.dtype).float().reshape(SCALAR)
    return tensors


KV_CACHE_FP8 = "FP8"
# config.json's kv_cache_scheme for kv_cache_quant_algo FP8 (modelopt/torch/export/convert_hf_config.py)
KV_CACHE_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}


def layer_entry(scheme: str) -> dict:
    """A module's entry in a MIXED_PRECISION config's ``quantized_layers``."""
    if scheme in QUANT_ALGOS:
        return {"quant_algo": QUANT_ALGOS[scheme], "group_size": BLOCK}
    return {"quant_algo": FP8_QUANT_ALGOS[scheme]}


def mixed_hf_quant_config(schemes: dict[str, str], exclude_modules: list[str]) -> dict:
    """hf_quant_config.json for per-module schemes (``schemes``: module, or fused expert tensor, -> scheme): one
    ``quantized_layers`` entry per module, as ModelOpt's export writes a MIXED_PRECISION model
    (modelopt/torch/export/quant_utils.py, ``process_layer_quant_config``)."""
    return {
        "producer": dict(PRODUCER),
        "quantization": {
            "quant_algo": MIXED,
            "kv_cache_quant_algo": None,
            "quantized_layers": {module: layer_entry(scheme) for module, scheme in schemes.items()},
            "exclude_modules": list(exclude_modules),
        },
    }


def _group_config(entry: dict) -> dict:
    """The compressed-tensors-style config group ModelOpt derives from a quantized_layers entry
    (modelopt/torch/export/convert_hf_config.py)."""
    algo = entry["quant_algo"]
    if algo in SCHEMES:
        numeric = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": entry.get("group_size", BLOCK)}
        return {"input_activations": dict(numeric), "weights": dict(numeric)} if algo == "NVFP4" \
            else {"weights": dict(numeric)}
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return {"input_activations": dict(fp8), "weights": {**fp8, "strategy": "channel"}}
    if algo == "FP8":
        return {"input_activations": dict(fp8), "weights": dict(fp8)}
    return {"quant_algo": algo}  # what ModelOpt writes for an algorithm its converter does not map


def mixed_quantization_config(schemes: dict[str, str], exclude_modules: list[str]) -> dict:
    """config.json's ``quantization_config`` derived from ``mixed_hf_quant_config`` as ModelOpt derives it: one
    config group per distinct layer entry, targeting its modules, and the entries themselves."""
    layers = mixed_hf_quant_config(schemes, exclude_modules)["quantization"]["quantized_layers"]
    by_entry: dict[tuple, list[str]] = {}
    for module, entry in layers.items():
        by_entry.setdefault(tuple(sorted(entry.items())), []).append(module)
    groups = {f"group_{i}": {**_group_config(dict(key)), "targets": sorted(modules)}
              for i, (key, modules) in enumerate(by_entry.items())}
    return {"config_groups": groups, "quantized_layers": layers, "ignore": list(exclude_modules),
            "quant_algo": MIXED, "producer": dict(PRODUCER), "quant_method": "modelopt"}


def fused_names(experts: str, leaf: str) -> dict[str, str]:
    """Tensor names of one fused expert tensor (`leaf`: fused gate-up or down, under module `experts`)."""
    base = f"{experts}.{leaf}"
    return {WEIGHT: base, BLOCK_SCALE: f"{base}_{BLOCK_SCALE}", GLOBAL_SCALE: f"{base}_{GLOBAL_SCALE}",
            INPUT_SCALE: f"{base}_{INPUT_SCALE}"}


def fused_planned(
    experts: str, leaf: str, num_experts: int, out_features: int, in_features: int, with_input_scale: bool
) -> list[PlannedTensor]:
    """The fused layout of [E] Linears [N, K] (gate_up: N = 2I, K = H; down: N = H, K = I)."""
    names = fused_names(experts, leaf)
    specs = [
        PlannedTensor(names[WEIGHT], torch.uint8, (num_experts, in_features // 2, out_features)),
        PlannedTensor(names[BLOCK_SCALE], torch.float8_e4m3fn, (num_experts, in_features // BLOCK, out_features)),
        PlannedTensor(names[GLOBAL_SCALE], torch.float32, SCALAR),
    ]
    if with_input_scale:
        specs.append(PlannedTensor(names[INPUT_SCALE], torch.float32, SCALAR))
    return specs


def shared_scale(what: str, scales: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The one value of per-expert scales that the fused layout stores once; an error when they differ."""
    if all(s is None for s in scales):
        return None
    if any(s is None for s in scales) or any(not torch.equal(s, scales[0]) for s in scales):  # type: ignore[arg-type]
        raise Fp4kitError(f"{what}: experts have different scales, which ModelOpt's fused layout cannot store")
    return scales[0]


def fused_lossless(weights: list[NVFP4Tensor], input_scale_divs: list[torch.Tensor | None]) -> bool:
    """Whether per-expert tensors can be written in the fused layout without changing any value."""
    try:
        shared_scale("", [w.global_scale_div for w in weights])
        shared_scale("", input_scale_divs)
    except Fp4kitError:
        return False
    return True


def encode_fused(
    experts: str, leaf: str, weights: list[NVFP4Tensor], input_scale_divs: list[torch.Tensor | None]
) -> dict[str, torch.Tensor]:
    """Per-expert canonical [N, K] tensors (for gate_up: gate rows then up rows) -> the fused tensors."""
    names = fused_names(experts, leaf)
    global_div = shared_scale(names[GLOBAL_SCALE], [w.global_scale_div for w in weights])
    input_div = shared_scale(names[INPUT_SCALE], input_scale_divs)
    tensors = {
        names[WEIGHT]: torch.stack([w.packed.t() for w in weights]).contiguous(),
        names[BLOCK_SCALE]: torch.stack([w.block_scale.t() for w in weights]).contiguous(),
        names[GLOBAL_SCALE]: fp32_divisor(global_div).reshape(SCALAR),  # type: ignore[arg-type]
    }
    if input_div is not None:
        tensors[names[INPUT_SCALE]] = fp32_divisor(input_div).reshape(SCALAR)
    return tensors


def decode_fused(
    experts: str, leaf: str, tensors: dict[str, torch.Tensor]
) -> tuple[list[NVFP4Tensor], torch.Tensor | None]:
    """The fused tensors -> per-expert canonical [N, K] tensors and the layer's input divisor (or None)."""
    names = fused_names(experts, leaf)
    packed, block_scale = tensors[names[WEIGHT]], tensors[names[BLOCK_SCALE]]
    global_div = tensors[names[GLOBAL_SCALE]].reshape(()).double()
    weights = [
        NVFP4Tensor(packed[e].t().contiguous(), block_scale[e].t().contiguous(), global_div)
        for e in range(packed.shape[0])
    ]
    input_div = tensors.get(names[INPUT_SCALE])
    return weights, None if input_div is None else input_div.reshape(()).double()


def hf_quant_config(scheme: str, exclude_modules: list[str]) -> dict:
    """hf_quant_config.json, with every key vLLM's ModelOptNvFp4Config requires."""
    return {
        "producer": dict(PRODUCER),
        "quantization": {
            "quant_algo": QUANT_ALGOS[scheme],
            "kv_cache_quant_algo": None,
            "group_size": BLOCK,
            "exclude_modules": list(exclude_modules),
        },
    }


def quantization_config(scheme: str, exclude_modules: list[str]) -> dict:
    """config.json `quantization_config` as ModelOpt derives it from hf_quant_config.json."""
    numeric = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK}
    group: dict[str, object] = {"weights": dict(numeric), "targets": ["Linear"]}
    if scheme == "nvfp4":
        group = {"input_activations": dict(numeric), **group}
    return {
        "config_groups": {"group_0": group},
        "ignore": list(exclude_modules),
        "quant_algo": QUANT_ALGOS[scheme],
        "producer": dict(PRODUCER),
        "quant_method": "modelopt",
    }


def is_mixed(qconfig: dict) -> bool:
    return str(qconfig.get("quant_algo", "")).upper() == MIXED


def scheme_of(qconfig: dict) -> str:
    """nvfp4 or nvfp4a16 from hf_quant_config.json's quantization section (an error for any algorithm but NVFP4,
    or, in a MIXED_PRECISION one, NVFP4 and FP8): of a MIXED_PRECISION config, its NVFP4 layers' scheme."""
    algo = str(qconfig.get("quant_algo", "")).upper()
    if algo == MIXED:
        layers = qconfig.get("quantized_layers")
        if not isinstance(layers, dict) or not all(isinstance(e, dict) for e in layers.values()):
            raise Fp4kitError(f"ModelOpt quant_algo {MIXED}: quantized_layers is not a map of module -> entry")
        algos = {str(e.get("quant_algo", "")).upper() for e in layers.values()}
        unknown = algos - set(SCHEMES) - set(FP8_QUANT_ALGOS.values())
        if unknown:
            raise Fp4kitError(f"ModelOpt {MIXED} layer quant_algo {sorted(unknown)[0]!r} is neither NVFP4 "
                              f"({', '.join(SCHEMES)}) nor FP8 ({', '.join(FP8_QUANT_ALGOS.values())})")
        nvfp4 = {SCHEMES[a] for a in algos if a in SCHEMES}
        if len(nvfp4) > 1:
            raise Fp4kitError(f"ModelOpt {MIXED} layers mix NVFP4 (W4A4) and NVFP4A16 (weight-only): fp4kit reads one "
                              "NVFP4 scheme per checkpoint")
        return nvfp4.pop() if nvfp4 else "nvfp4a16"
    if algo not in SCHEMES:
        raise Fp4kitError(f"ModelOpt quant_algo {algo or '?'!r} is not NVFP4 (fp4kit reads {', '.join(SCHEMES)}, and "
                          f"{MIXED} of NVFP4 and FP8)")
    return SCHEMES[algo]


def ignore_from(patterns: list[str], unquantized: list[str]) -> list[str]:
    """compressed-tensors' names and `re:` regexes as ModelOpt's exclude_modules: a regex that is a plain path with
    wildcards becomes a glob; any other is replaced by the ``unquantized`` modules it matches."""
    out: list[str] = []
    for p in patterns:
        if not p.startswith("re:"):
            out.append(p)
            continue
        regex = p[3:]
        core = regex.removeprefix("^").removesuffix("$").replace(r"\.", "").replace(".*", "")
        if not re.search(r"[.\\\[\](){}+?|^$*]", core):
            glob = regex.removeprefix("^").removesuffix("$").replace(".*", "*").replace(r"\.", ".")
            out.append(glob if regex.endswith("$") else glob + "*")
        else:
            out.extend(m for m in unquantized if re.match(regex, m))
    return out


_LAYER_PREFIX = re.compile(r"^(.*?\blayers\.\d+)\.")


def whole_layer_globs(exclude: list[str], quantized: list[str]) -> list[str]:
    """``exclude`` with the modules of each layer that holds no quantized module written as one ``<...>.layers.N.*``
    glob (a kept MTP layer). SGLang reads an exclusion whose last part is an MLA projection name (``q_a_proj``,
    ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``) as that projection of every layer
    (sglang/srt/layers/quantization/modelopt_quant.py, ``is_layer_excluded``): a kept MTP layer listed module by
    module would build every decoder layer's MLA projections unquantized. vLLM matches the glob with fnmatch
    (vllm/model_executor/layers/quantization/modelopt.py, ``is_layer_excluded``)."""
    holding = {m.group(1) for name in quantized if (m := _LAYER_PREFIX.match(name))}
    out: list[str] = []
    for name in exclude:
        m = _LAYER_PREFIX.match(name)
        entry = name if m is None or m.group(1) in holding else m.group(1) + ".*"
        if entry not in out:
            out.append(entry)
    return out


def fused_modules(reader: CheckpointReader) -> list[QuantModule]:
    """The per-expert Linears of every fused expert tensor, each naming its expert and rows."""
    modules = []
    for name in reader.names():
        m = _FUSED_GLOBAL.match(name)
        if not m:
            continue
        experts, leaf = m.group("experts"), m.group("leaf")
        names = fused_names(experts, leaf)
        check_tensor(reader, f"{experts}.{leaf}", "packed", names[WEIGHT], None)
        num_experts, half_k, out_features = reader.info(names[WEIGHT]).shape
        check_tensor(reader, f"{experts}.{leaf}", "block", names[BLOCK_SCALE],
                     (num_experts, half_k * 2 // BLOCK, out_features))
        check_tensor(reader, f"{experts}.{leaf}", "global", names[GLOBAL_SCALE], None)
        input_name = names[INPUT_SCALE] if names[INPUT_SCALE] in reader else None
        gate, up = FUSED_GRAMMAR.w13
        parts = [(gate, (0, out_features // 2)), (up, (out_features // 2, out_features))] \
            if leaf == FUSED_GRAMMAR.fused_gate_up else [(FUSED_GRAMMAR.down, None)]
        for e in range(num_experts):
            for proj, rows in parts:
                n = out_features if rows is None else rows[1] - rows[0]
                modules.append(QuantModule(f"{experts}.{e}.{proj}", names[WEIGHT], names[BLOCK_SCALE],
                                           names[GLOBAL_SCALE], input_name, n, half_k * 2, e, rows))
    return modules


class ModelOpt(Dialect):
    name = NAME
    title = "ModelOpt"
    suffixes = SUFFIXES
    stores = "divisor"
    config_files = (HF_QUANT_CONFIG,)
    fused_experts = True
    records_exact_input_scales = True
    serve_quantization = "modelopt_fp4"
    # vLLM 0.33's ModelOptMixedPrecisionConfig.override_quantization_method picks it for quant_algo MIXED_PRECISION
    serve_quantization_mixed = "modelopt_mixed"
    fp8_release_moe_algo = QUANT_ALGOS["nvfp4"]

    def declared_by(self, method: str, files: dict[str, dict]) -> str | None:
        if files.get(HF_QUANT_CONFIG):
            return f"{HF_QUANT_CONFIG} exists"
        return "config.json says modelopt" if method.startswith(NAME) else None

    def quantization_section(self, qconfig: dict, files: dict[str, dict]) -> dict:
        return (files.get(HF_QUANT_CONFIG) or {}).get("quantization") or qconfig

    def scheme(self, qconfig: dict) -> str:
        return scheme_of(qconfig)

    def is_mixed(self, qconfig: dict) -> bool:
        return is_mixed(qconfig)

    def find_fp8_modules(self, reader: CheckpointReader) -> list[Fp8Module]:
        return fp8_modules(reader, {"weight": f".{WEIGHT}", "scale": f".{BLOCK_SCALE}", "input": f".{INPUT_SCALE}"},
                           fp8_scale_shape)

    def owns(self, tensor: str) -> bool:
        return tensor.endswith(GLOBAL_SCALE)  # `.weight_scale_2`, and the fused `_weight_scale_2`

    def find_modules(self, reader: CheckpointReader) -> list[QuantModule]:
        # `.weight_scale` also names FP8 scales: a module is NVFP4 when it has a scale_2 or an fp8 block scale
        def is_module(base: str) -> bool:
            block = base + SUFFIXES["block"]
            return base + SUFFIXES["global"] in reader or (
                block in reader and reader.info(block).dtype == torch.float8_e4m3fn)

        return fused_modules(reader) + plain_modules(reader, SUFFIXES, ("global", "input", "block"), is_module)

    def load_scale(self, stored: torch.Tensor, producer: str | None) -> torch.Tensor:
        if producer == "fp4kit":
            multiplier = multiplier_behind(stored)  # the multiplier fp4kit wrote this divisor for
            if multiplier is not None:
                return divisor_of(multiplier)
        return stored.double()

    def store_scale(self, divisor: torch.Tensor) -> torch.Tensor:
        return fp32_divisor(divisor)

    # ModelOpt's export names (modelopt/torch/export/quant_utils.py, _KV_CACHE_REPLACEMENTS): fp32 scalars
    kv_suffixes = (".k_proj.k_scale", ".v_proj.v_scale")

    def add_kv_cache(self, quantization_config: dict, side_configs: dict[str, dict]) -> None:
        side_configs[HF_QUANT_CONFIG]["quantization"]["kv_cache_quant_algo"] = KV_CACHE_FP8
        quantization_config["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)

    def kv_cache_of(self, qconfig: dict) -> str | None:
        algo = qconfig.get("kv_cache_quant_algo")
        if algo is None and qconfig.get("kv_cache_scheme") == KV_CACHE_SCHEME:
            algo = KV_CACHE_FP8
        return "fp8" if str(algo).upper() == KV_CACHE_FP8 else None  # any other: its scales stay passthrough

    # writing and reading by module name: the module functions of the same names
    planned = staticmethod(planned)
    encode = staticmethod(encode)
    decode = staticmethod(decode)
    quantization_config = staticmethod(quantization_config)

    def side_configs(self, scheme: str, ignore: list[str]) -> dict[str, dict]:
        return {HF_QUANT_CONFIG: hf_quant_config(scheme, ignore)}

    def exclusions(self, unquantized: list[str], quantized: list[str]) -> list[str]:
        return whole_layer_globs(unquantized, quantized)

    fp8_planned = staticmethod(fp8_planned)
    fp8_encode = staticmethod(fp8_encode)
    mixed_quantization_config = staticmethod(mixed_quantization_config)

    def mixed_side_configs(self, schemes: dict[str, str], ignore: list[str]) -> dict[str, dict]:
        return {HF_QUANT_CONFIG: mixed_hf_quant_config(schemes, ignore)}

    def spell_ignore(self, patterns: list[str], unquantized: list[str]) -> list[str]:
        return ignore_from(patterns, unquantized)

    def fused_scale_names(self, experts: str, leaf: str) -> tuple[str, str]:
        """(weight global scale, input scale) tensor names of a fused expert tensor."""
        names = fused_names(experts, leaf)
        return names[GLOBAL_SCALE], names[INPUT_SCALE]

    # fused expert tensors (fused_experts): the module functions of the same names
    fused_names = staticmethod(fused_names)
    fused_planned = staticmethod(fused_planned)
    encode_fused = staticmethod(encode_fused)


DIALECT = ModelOpt()

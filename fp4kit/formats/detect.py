"""Which NVFP4 dialect and scheme a checkpoint is, and its quantized modules read into canonical form.

Reads compressed-tensors checkpoints (fp4kit's, llm-compressor's `oneshot` and `model_free_ptq`) and ModelOpt ones
(per-module names, and Llama-4's fused expert tensors, which are listed as per-expert modules here). The dialect is
what config.json / hf_quant_config.json declare, checked against the tensor names; anything unusable (unknown or
mixed dialects, a missing scale tensor, a wrong dtype or shape) is an Fp4kitError with one line.

Exact scales: each dialect stores its per-tensor scales as fp32, the multiplier G (compressed-tensors) or the
divisor D (ModelOpt), and the canonical float64 divisor does not always survive a trip through the other form. A
writer that cannot store the canonical value faithfully also records it in the safetensors metadata under
``EXACT_SCALES_KEY`` (JSON: tensor name -> float.hex of the float64 divisor); a reader uses a recorded value only when
it encodes to the fp32 value actually stored, so a tool that edits the tensor without the metadata is not overridden.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp4kit.checkpoint import CheckpointReader, read_config
from fp4kit.errors import Fp4kitError
from fp4kit.families import detect as detect_family
from fp4kit.families.base import Family
from fp4kit.formats import compressed_tensors as ct
from fp4kit.formats import modelopt as mo
from fp4kit.nvfp4 import BLOCK, NVFP4Tensor
from fp4kit.safetensors_files import loads, read_json

CT, MO = "compressed-tensors", "modelopt"
DIALECTS = (CT, MO)
EXACT_SCALES_KEY = "fp4kit.exact_scales"
HF_QUANT_CONFIG = "hf_quant_config.json"

CT_SUFFIXES = {"packed": ".weight_packed", "block": ".weight_scale", "global": ".weight_global_scale",
               "input": ".input_global_scale"}
MO_SUFFIXES = {"packed": ".weight", "block": ".weight_scale", "global": ".weight_scale_2", "input": ".input_scale"}
_FUSED_MO = re.compile(rf"^(?P<experts>.*\.experts)\.(?P<leaf>{'|'.join(mo.FUSED_LEAVES)})_weight_scale_2$")
_DTYPES = {"packed": torch.uint8, "block": torch.float8_e4m3fn, "global": torch.float32, "input": torch.float32}


def stored_scale(dialect: str, divisor: torch.Tensor) -> torch.Tensor:
    """The fp32 value a dialect stores for a float64 divisor."""
    return (1.0 / divisor.double()).float() if dialect == CT else mo.fp32_divisor(divisor)


def decoded_scale(dialect: str, stored: torch.Tensor) -> torch.Tensor:
    return 1.0 / stored.double() if dialect == CT else stored.double()


def needs_exact_record(dialect: str, divisor: torch.Tensor) -> torch.Tensor:
    """Where storing ``divisor`` in ``dialect`` would not give back what either dialect stores for it."""
    back = decoded_scale(dialect, stored_scale(dialect, divisor))
    return torch.stack([stored_scale(d, back) != stored_scale(d, divisor) for d in DIALECTS]).any(0)


@dataclass(frozen=True)
class QuantModule:
    """One quantized Linear [N, K], with the names of its tensors on disk.

    For a ModelOpt fused expert tensor, ``expert`` is the index along dim 0 and ``rows`` the output rows of the
    expert's canonical [N_total, K] matrix that belong to this Linear (gate or up of gate_up_proj).
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


@dataclass
class QuantizedCheckpoint:
    root: Path
    config: dict
    dialect: str
    scheme: str  # nvfp4 (W4A4) or nvfp4a16 (weight-only)
    family: Family | None
    modules: list[QuantModule]
    passthrough: list[str]
    ignore: list[str]  # the source's own ignore / exclude_modules list
    reader: CheckpointReader
    exact_scales: dict[str, float] = field(default_factory=dict)
    _rows: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    _divisors: dict[str, torch.Tensor] = field(default_factory=dict)

    def divisor(self, name: str) -> torch.Tensor:
        """The canonical float64 divisor held by scale tensor ``name``."""
        if name not in self._divisors:
            # a compressed-tensors multiplier of Inf (divisor 0: an expert that saw no calibration token) is a known
            # producer defect that inspect reports and repair and shard replace; NaN never is
            stored = self.reader.read(name, check_finite=False).reshape(())
            if self.reader.check_finite and bool(stored.isnan()):
                raise Fp4kitError(f"{self.reader.info(name).file}: scale tensor {name} is NaN")
            value = decoded_scale(self.dialect, stored)
            if self.dialect == MO and self.reader.metadata.get("producer") == "fp4kit":
                multiplier = mo.multiplier_behind(stored)  # the multiplier fp4kit wrote this divisor for
                if multiplier is not None:
                    value = 1.0 / multiplier.double()
            exact = self.exact_scales.get(name)
            if exact is not None:
                candidate = torch.tensor(exact, dtype=torch.float64)
                if torch.equal(stored_scale(self.dialect, candidate), stored):
                    value = candidate
            self._divisors[name] = value
        return self._divisors[name]

    def read_weight(self, module: QuantModule) -> NVFP4Tensor:
        if module.expert is None:
            packed, block_scale = self.reader.read(module.packed), self.reader.read(module.block_scale)
        else:
            packed, block_scale = self._expert_rows(module.packed, module.expert), self._expert_rows(
                module.block_scale, module.expert)
            if module.rows is not None:
                packed, block_scale = (t[module.rows[0]:module.rows[1]] for t in (packed, block_scale))
        return NVFP4Tensor(packed.contiguous(), block_scale.contiguous(), self.divisor(module.global_scale))

    def read_weight_into(self, module: QuantModule, packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
        """Read the module's packed weight and block scales into ``packed`` / ``block_scale`` (e.g. one expert's
        rows of a stacked layer) and return its global divisor; per-module tensors go straight from the file."""
        if module.expert is None and all(self.reader.info(name).shape == tuple(out.shape) and
                                         self.reader.info(name).dtype == out.dtype
                                         for name, out in ((module.packed, packed), (module.block_scale, block_scale))):
            self.reader.read_into(module.packed, packed)
            self.reader.read_into(module.block_scale, block_scale)
            return self.divisor(module.global_scale)
        weight = self.read_weight(module)
        packed.copy_(weight.packed)
        block_scale.copy_(weight.block_scale)
        return weight.global_scale_div

    def read(self, module: QuantModule) -> tuple[NVFP4Tensor, torch.Tensor | None]:
        input_div = None if module.input_scale is None else self.divisor(module.input_scale)
        return self.read_weight(module), input_div

    def _expert_rows(self, name: str, expert: int) -> torch.Tensor:
        # gate and up of one expert come from the same fused row: keep the last one read per tensor
        key = (name, expert)
        if key not in self._rows:
            self._rows = {k: v for k, v in self._rows.items() if k[0] != name}
            self._rows[key] = self.reader.read_rows(name, expert, expert + 1)[0].t()
        return self._rows[key]

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> QuantizedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _declared(root: Path, config: dict) -> tuple[str | None, dict]:
    qconfig = config.get("quantization_config") or {}
    if not isinstance(qconfig, dict):
        raise Fp4kitError(f"{root / 'config.json'}: quantization_config is not an object")
    method = str(qconfig.get("quant_method", "")).lower()
    hf_path = root / HF_QUANT_CONFIG
    hf_quant = {}
    if hf_path.exists():
        hf_quant = read_json(hf_path, HF_QUANT_CONFIG)
        if not isinstance(hf_quant, dict):
            raise Fp4kitError(f"{hf_path}: not a JSON object")
    if method == CT and hf_quant:
        raise Fp4kitError(f"{root}: mixed dialects: config.json says compressed-tensors but {HF_QUANT_CONFIG} exists")
    if method == CT:
        return CT, qconfig
    if method.startswith(MO) or hf_quant:
        return MO, hf_quant.get("quantization") or qconfig
    if qconfig:
        raise Fp4kitError(f"{root}: unknown quantization method {method or '?'!r}; fp4kit reads NVFP4 "
                          f"compressed-tensors and ModelOpt checkpoints")
    return None, {}


def _evidence(names: list[str]) -> dict[str, str]:
    found = {}
    for name in names:
        if name.endswith((".weight_packed", ".weight_global_scale", ".input_global_scale")):
            found.setdefault(CT, name)
        elif name.endswith("weight_scale_2"):
            found.setdefault(MO, name)
    return found


def _scheme(dialect: str, qconfig: dict, has_input_scales: bool) -> str:
    if not qconfig:
        return "nvfp4" if has_input_scales else "nvfp4a16"
    if dialect == MO:
        algo = str(qconfig.get("quant_algo", "")).upper()
        if algo not in mo.SCHEMES:
            raise Fp4kitError(f"ModelOpt quant_algo {algo or '?'!r} is not NVFP4 "
                              f"(fp4kit reads {', '.join(mo.SCHEMES)})")
        return mo.SCHEMES[algo]
    formats = {qconfig.get("format")} | {g.get("format") for g in (qconfig.get("config_groups") or {}).values()}
    formats.discard(None)
    if formats - {ct.FORMAT}:
        raise Fp4kitError(f"compressed-tensors format {sorted(formats - {ct.FORMAT})[0]!r} is not NVFP4 "
                          f"(fp4kit reads {ct.FORMAT})")
    groups = (qconfig.get("config_groups") or {}).values()
    return "nvfp4" if any(g.get("input_activations") for g in groups) else "nvfp4a16"


def _check(reader: CheckpointReader, module: str, role: str, name: str | None, shape: tuple[int, ...] | None) -> None:
    if name is None or name not in reader:
        raise Fp4kitError(f"{module}: missing {role} scale tensor {name}" if role != "packed"
                          else f"{module}: missing packed weight tensor {name}")
    info = reader.info(name)
    if info.dtype != _DTYPES[role]:
        raise Fp4kitError(f"{name}: dtype {info.dtype}, expected {_DTYPES[role]}")
    if shape is not None and info.shape != shape:
        raise Fp4kitError(f"{name}: shape {list(info.shape)}, expected {list(shape)}")
    if role in ("global", "input") and info.shape not in ((), (1,)):
        raise Fp4kitError(f"{name}: shape {list(info.shape)}, expected a single value")


def _plain_modules(reader: CheckpointReader, suffixes: dict[str, str], skip: set[str]) -> list[QuantModule]:
    bases: dict[str, None] = {}
    for name in reader.names():
        if name in skip:
            continue
        for role in ("global", "input", "block") + (("packed",) if suffixes is CT_SUFFIXES else ()):
            if name.endswith(suffixes[role]):
                bases.setdefault(name[: -len(suffixes[role])])
                break
    if suffixes is MO_SUFFIXES:  # MO's `.weight_scale` also names FP8 scales: only fp8 ones or with a scale_2
        bases = {b: None for b in bases if f"{b}.weight_scale_2" in reader or (
            f"{b}.weight_scale" in reader and reader.info(f"{b}.weight_scale").dtype == torch.float8_e4m3fn)}
    modules = []
    for base in bases:
        names = {role: base + suffix for role, suffix in suffixes.items()}
        _check(reader, base, "packed", names["packed"], None)
        packed = reader.info(names["packed"]).shape
        if len(packed) != 2:
            raise Fp4kitError(f"{names['packed']}: shape {list(packed)}, expected a 2-D packed weight")
        _check(reader, base, "block", names["block"], (packed[0], packed[1] * 2 // BLOCK))
        _check(reader, base, "global", names["global"], None)
        input_name = names["input"] if names["input"] in reader else None
        if input_name:
            _check(reader, base, "input", input_name, None)
        modules.append(QuantModule(base, names["packed"], names["block"], names["global"], input_name,
                                   packed[0], packed[1] * 2))
    return modules


def _fused_modules(reader: CheckpointReader) -> list[QuantModule]:
    modules = []
    for name in reader.names():
        m = _FUSED_MO.match(name)
        if not m:
            continue
        experts, leaf = m.group("experts"), m.group("leaf")
        names = mo.fused_names(experts, leaf)
        _check(reader, f"{experts}.{leaf}", "packed", names[mo.WEIGHT], None)
        num_experts, half_k, out_features = reader.info(names[mo.WEIGHT]).shape
        _check(reader, f"{experts}.{leaf}", "block", names[mo.BLOCK_SCALE],
               (num_experts, half_k * 2 // BLOCK, out_features))
        _check(reader, f"{experts}.{leaf}", "global", names[mo.GLOBAL_SCALE], None)
        input_name = names[mo.INPUT_SCALE] if names[mo.INPUT_SCALE] in reader else None
        parts = [("gate_proj", (0, out_features // 2)), ("up_proj", (out_features // 2, out_features))] \
            if leaf == "gate_up_proj" else [("down_proj", None)]
        for e in range(num_experts):
            for proj, rows in parts:
                n = out_features if rows is None else rows[1] - rows[0]
                modules.append(QuantModule(f"{experts}.{e}.{proj}", names[mo.WEIGHT], names[mo.BLOCK_SCALE],
                                           names[mo.GLOBAL_SCALE], input_name, n, half_k * 2, e, rows))
    return modules


def open_checkpoint(root: str | Path, strict: bool = True) -> QuantizedCheckpoint:
    """Open an NVFP4 checkpoint directory of either dialect (raises Fp4kitError when it is not usable).
    ``strict``: a NaN or Inf value in a tensor read is an error; health checks that report them pass False."""
    root = Path(root)
    config = read_config(root)
    declared, qconfig = _declared(root, config)
    reader = CheckpointReader(root, check_finite=strict)
    try:
        names = reader.names()
        evidence = _evidence(names)
        if len(evidence) == 2:
            raise Fp4kitError(f"{root}: mixed dialects: compressed-tensors tensor {evidence[CT]} and ModelOpt "
                              f"tensor {evidence[MO]}")
        found = next(iter(evidence), None)
        if declared and found and declared != found:
            raise Fp4kitError(f"{root}: mixed dialects: the config says {declared} but tensor {evidence[found]} is "
                              f"{found}")
        dialect = declared or found
        if dialect is None:
            raise Fp4kitError(f"{root}: unknown dialect: no NVFP4 quantization config and no quantized tensors")
        if dialect == CT:
            modules = _plain_modules(reader, CT_SUFFIXES, set())
        else:
            modules = _fused_modules(reader)
            modules += _plain_modules(reader, MO_SUFFIXES, set())
        if not modules:
            raise Fp4kitError(f"{root}: declares {dialect} quantization but holds no quantized tensors")
        scheme = _scheme(dialect, qconfig, any(m.input_scale for m in modules))
        used = {n for m in modules for n in (m.packed, m.block_scale, m.global_scale, m.input_scale) if n}
        ignore = list(qconfig.get("ignore") or qconfig.get("exclude_modules") or [])
        try:
            family: Family | None = detect_family(config)
        except Fp4kitError:
            family = None
        exact = _exact_scales(root, reader.metadata.get(EXACT_SCALES_KEY, "{}"))
        return QuantizedCheckpoint(root, config, dialect, scheme, family, modules,
                                   [n for n in names if n not in used], ignore, reader,
                                   exact)
    except BaseException:
        reader.close()
        raise


def _exact_scales(root: Path, text: str) -> dict[str, float]:
    document = loads(text, root, f"safetensors metadata {EXACT_SCALES_KEY}")
    try:
        assert isinstance(document, dict)
        return {str(k): float.fromhex(v) for k, v in document.items()}
    except (AssertionError, TypeError, ValueError):
        raise Fp4kitError(f"{root}: safetensors metadata {EXACT_SCALES_KEY} is not a map of hex floats") from None

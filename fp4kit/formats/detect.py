"""Which NVFP4 dialect and scheme a checkpoint is, and its quantized modules read into canonical form.

Reads every dialect registered in fp4kit/registry.py (compressed-tensors: fp4kit's, llm-compressor's `oneshot` and
`model_free_ptq`; ModelOpt: per-module names, and Llama-4's fused expert tensors, which are listed as per-expert
modules here), and mixed-precision ones (compressed-tensors ``mixed-precision``, ModelOpt ``MIXED_PRECISION``: FP8
Linears beside the NVFP4 ones, read by the commands that pass ``mixed=True``). The dialect is what its config files
declare, checked against the tensor names; anything unusable (unknown or mixed dialects, a missing scale tensor, a
wrong dtype or shape) is an Fp4kitError with one line.

Exact scales: each dialect stores its per-tensor scales as fp32, the multiplier G (compressed-tensors) or the
divisor D (ModelOpt), and the canonical float64 divisor does not always survive a trip through the other form. A
writer that cannot store the canonical value faithfully also records it in the safetensors metadata under
``EXACT_SCALES_KEY`` (JSON: tensor name -> float.hex of the float64 divisor); a reader uses a recorded value only when
it encodes to the fp32 value actually stored, so a tool that edits the tensor without the metadata is not overridden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.families import detect as detect_family
from fp4kit.families.base import Family
from fp4kit.families.grammar import DEFAULT, ExpertGrammar
from fp4kit.formats.base import Dialect, Fp8Module, QuantModule
from fp4kit.fp8 import Fp8Weight, fp8_scale_shape
from fp4kit.io.checkpoint import CheckpointReader, read_config
from fp4kit.io.safetensors_files import loads, read_json
from fp4kit.nvfp4 import NVFP4Tensor
from fp4kit.registry import dialect, dialects

__all__ = ["EXACT_SCALES_KEY", "Fp8Module", "QuantModule", "QuantizedCheckpoint", "config_files", "decoded_scale",
           "needs_exact_record", "open_checkpoint", "stored_scale"]

EXACT_SCALES_KEY = "fp4kit.exact_scales"


def stored_scale(name: str, divisor: torch.Tensor) -> torch.Tensor:
    """The fp32 value dialect ``name`` stores for a float64 divisor."""
    return dialect(name).store_scale(divisor)


def decoded_scale(name: str, stored: torch.Tensor) -> torch.Tensor:
    """The float64 divisor a value stored by dialect ``name`` holds, as the dialect's own reader sees it."""
    return dialect(name).load_scale(stored, None)


def needs_exact_record(name: str, divisor: torch.Tensor) -> torch.Tensor:
    """Where storing ``divisor`` in dialect ``name`` would not give back what every dialect stores for it."""
    back = decoded_scale(name, stored_scale(name, divisor))
    return torch.stack([d.store_scale(back) != d.store_scale(divisor) for d in dialects()]).any(0)


def config_files() -> tuple[str, ...]:
    """Every registered dialect's config files beside config.json (copied with it by layout and shard)."""
    return tuple(name for d in dialects() for name in d.config_files)


@dataclass
class QuantizedCheckpoint:
    root: Path
    config: dict
    dialect: str  # its registered name (fp4kit.registry)
    scheme: str  # nvfp4 (W4A4) or nvfp4a16 (weight-only): the NVFP4 modules'
    family: Family | None
    modules: list[QuantModule]
    passthrough: list[str]
    ignore: list[str]  # the source's own ignore / exclude_modules list
    reader: CheckpointReader
    exact_scales: dict[str, float] = field(default_factory=dict)
    fp8_modules: list[Fp8Module] = field(default_factory=list)  # a mixed-precision checkpoint's FP8 Linears
    mixed: bool = False  # the config gives modules different schemes
    kv_cache: str | None = None  # the KV-cache scheme the config declares (fp8), or None
    kv_scales: dict[str, tuple[str, str]] = field(default_factory=dict)  # attention -> (k_scale, v_scale) tensors
    _rows: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    _divisors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def grammar(self) -> ExpertGrammar:
        """The family's MoE names (the default grammar when config.json names no family fp4kit knows)."""
        return self.family.grammar if self.family is not None else DEFAULT

    @property
    def format(self) -> Dialect:
        """The dialect object (fp4kit.formats.base.Dialect)."""
        return dialect(self.dialect)

    def read_kv_scales(self, attention: str) -> tuple[torch.Tensor, torch.Tensor]:
        """An attention module's FP8 KV-cache (k_scale, v_scale), fp32 scalars (divisors, as both dialects store
        them)."""
        k_name, v_name = self.kv_scales[attention]
        out = []
        for name in (k_name, v_name):
            scale = self.reader.read(name).float().reshape(())
            if not scale > 0:
                raise Fp4kitError(f"{self.reader.info(name).file}: KV-cache scale {name} is {float(scale)}, not > 0")
            out.append(scale)
        return out[0], out[1]

    def divisor(self, name: str) -> torch.Tensor:
        """The canonical float64 divisor held by scale tensor ``name``."""
        if name not in self._divisors:
            # a compressed-tensors multiplier of Inf (divisor 0: an expert that saw no calibration token) is a known
            # producer defect that inspect reports and repair and shard replace; NaN never is
            stored = self.reader.read(name, check_finite=False).reshape(())
            if self.reader.check_finite and bool(stored.isnan()):
                raise Fp4kitError(f"{self.reader.info(name).file}: scale tensor {name} is NaN")
            value = self.format.load_scale(stored, self.reader.metadata.get("producer"))
            exact = self.exact_scales.get(name)
            if exact is not None:
                candidate = torch.tensor(exact, dtype=torch.float64)
                if torch.equal(self.format.store_scale(candidate), stored):
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

    def module_schemes(self) -> dict[str, str]:
        """Every quantized Linear -> its scheme (nvfp4 / nvfp4a16 / fp8-dynamic / fp8-block / fp8-static)."""
        return {**{m.name: self.scheme for m in self.modules}, **{m.name: m.scheme for m in self.fp8_modules}}

    def read_fp8(self, module: Fp8Module) -> tuple[Fp8Weight, torch.Tensor | None]:
        """An FP8 Linear's weight (its scale in the canonical shape, ``fp8.fp8_scale_shape``, and the stored dtype;
        ``Fp8Weight.dequantize`` is exact) and its float64 input divisor (fp8-static) or None."""
        scale = self.reader.read(module.scale).reshape(fp8_scale_shape(module.scheme, module.out_features,
                                                                       module.in_features))
        weight = Fp8Weight(self.reader.read(module.weight), scale)
        input_div = None if module.input_scale is None else self.reader.read(module.input_scale).reshape(()).double()
        return weight, input_div

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


def _declared(root: Path, config: dict) -> tuple[Dialect | None, dict]:
    """The dialect the config files declare, and its quantization section."""
    qconfig = config.get("quantization_config") or {}
    if not isinstance(qconfig, dict):
        raise Fp4kitError(f"{root / 'config.json'}: quantization_config is not an object")
    method = str(qconfig.get("quant_method", "")).lower()
    files = {}
    for name in config_files():
        if (root / name).exists():
            files[name] = read_json(root / name, name)
            if not isinstance(files[name], dict):
                raise Fp4kitError(f"{root / name}: not a JSON object")
    declared = [(d, why) for d in dialects() if (why := d.declared_by(method, files))]
    if len(declared) > 1:
        raise Fp4kitError(f"{root}: mixed dialects: {declared[0][1]} but {declared[1][1]}")
    if declared:
        return declared[0][0], declared[0][0].quantization_section(qconfig, files)
    if qconfig:
        raise Fp4kitError(f"{root}: unknown quantization method {method or '?'!r}; fp4kit reads NVFP4 "
                          f"{' and '.join(d.title for d in dialects())} checkpoints")
    return None, {}


def _evidence(names: list[str]) -> dict[str, str]:
    """Dialect name -> the first tensor that only that dialect writes, in registration order."""
    found: dict[str, str] = {}
    for name in names:
        for d in dialects():
            if d.owns(name):
                found.setdefault(d.name, name)
                break
    return {d.name: found[d.name] for d in dialects() if d.name in found}


def open_checkpoint(root: str | Path, strict: bool = True, reader: CheckpointReader | None = None,
                    modules_required: bool = True, mixed: bool = False) -> QuantizedCheckpoint:
    """Open an NVFP4 checkpoint directory of any registered dialect (raises Fp4kitError when it is not usable).
    ``strict``: a NaN or Inf value in a tensor read is an error; health checks that report them pass False.
    ``modules_required`` False: a directory whose quantized modules are all elsewhere (a layout's MoE layers in
    kernel form, when only the routed experts were quantized) opens with none.
    ``reader``: a reader of ``root`` the caller already holds open (``strict`` is then its own); the checkpoint
    closes it.
    ``mixed``: the caller reads mixed-precision checkpoints (their FP8 modules); without it one is an Fp4kitError."""
    root = Path(root)
    config = read_config(root)
    declared, qconfig = _declared(root, config)
    reader = CheckpointReader(root, check_finite=strict) if reader is None else reader
    try:
        names = reader.names()
        evidence = _evidence(names)
        if len(evidence) > 1:
            (first, a), (second, b) = list(evidence.items())[:2]
            raise Fp4kitError(f"{root}: mixed dialects: {dialect(first).title} tensor {a} and "
                              f"{dialect(second).title} tensor {b}")
        found = next(iter(evidence), None)
        if declared and found and declared.name != found:
            raise Fp4kitError(f"{root}: mixed dialects: the config says {declared.name} but tensor {evidence[found]} "
                              f"is {found}")
        fmt = declared or (dialect(found) if found else None)
        if fmt is None:
            raise Fp4kitError(f"{root}: unknown dialect: no NVFP4 quantization config and no quantized tensors")
        is_mixed = bool(qconfig) and fmt.is_mixed(qconfig)
        if is_mixed and not mixed:
            raise Fp4kitError(f"{root}: a mixed-precision {fmt.title} checkpoint (FP8 modules beside NVFP4 ones): this "
                              "command reads single-scheme NVFP4 checkpoints only")
        modules = fmt.find_modules(reader)
        fp8 = fmt.find_fp8_modules(reader) if is_mixed else []
        if not modules and not fp8 and modules_required:
            raise Fp4kitError(f"{root}: declares {fmt.name} quantization but holds no quantized tensors")
        if qconfig:
            scheme = fmt.scheme(qconfig)
        else:
            scheme = "nvfp4" if any(m.input_scale for m in modules) else "nvfp4a16"
        used = {n for m in modules for n in (m.packed, m.block_scale, m.global_scale, m.input_scale) if n}
        used |= {n for m in fp8 for n in (m.weight, m.scale, m.input_scale) if n}
        kv_cache = fmt.kv_cache_of(qconfig) if qconfig else None
        kv_scales = fmt.find_kv_scales(names) if kv_cache else {}
        if not kv_scales:  # declared without scales: vLLM caches with scale 1 (inspect --engine vllm says so)
            kv_cache = None
        used |= {n for pair in kv_scales.values() for n in pair}
        ignore = list(qconfig.get("ignore") or qconfig.get("exclude_modules") or [])
        try:
            family: Family | None = detect_family(config)
        except Fp4kitError:
            family = None
        exact = _exact_scales(root, reader.metadata.get(EXACT_SCALES_KEY, "{}"))
        return QuantizedCheckpoint(root, config, fmt.name, scheme, family, modules,
                                   [n for n in names if n not in used], ignore, reader,
                                   exact, fp8, is_mixed, kv_cache=kv_cache, kv_scales=kv_scales)
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

"""`fp4kit_layout.json`, the manifest of a layout checkpoint (docs/layouts.md, "Layout checkpoints"): written by
fp4kit.layouts.directory, read by fp4kit.layouts.runtime.

The float64 scales that ``undo`` needs are stored as lists of hexadecimal floats (Python ``float.hex``, C99 ``%a``,
read back with ``float.fromhex`` / ``strtod``), so they survive any JSON parser bit for bit.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from fp4kit import __version__
from fp4kit.errors import Fp4kitError
from fp4kit.families.activation import SILU
from fp4kit.formats.detect import QuantizedCheckpoint
from fp4kit.io.checkpoint import DTYPE_NAMES, PlannedTensor
from fp4kit.io.safetensors_files import read_json
from fp4kit.layouts import LayoutMeta
from fp4kit.registry import BACKEND_NAMES, backend

FORMAT, VERSION = "fp4kit-layout", 1
MANIFEST = "fp4kit_layout.json"
SCALE_KEYS = ("w13_global_scale_div", "w2_global_scale_div", "input_scale_div13", "input_scale_div2")

_VERSION_IN_KERNEL = re.compile(r"\((?:flashinfer-python|vLLM) (?P<version>[0-9][\w.]*)")
# the gated activation between the two GEMMs, on GEMM1's output split into gate (rows 0..I-1 of w13) and up
# (rows I..2I-1), each plus its expert bias where the layer has one (fp4kit.families.activation)
ACTIVATION_FORMULAS = {
    "silu": "silu(gate) * up",
    "swiglu_oai": "g = min(gate, limit); u = min(max(up, -limit), limit); (u + 1) * g * sigmoid(alpha * g)",
    "silu_clamped": "g = min(gate, limit); u = min(max(up, -limit), limit); silu(g) * u",
}
FORMULA_NOTATION = ("per expert e: D_w13 = w13_global_scale_div[e], D_w2 = w2_global_scale_div[e], D_a13 = see "
                    "D_a13, D_a2 = input_scale_div2[e] (float64 divisors); fp32(x) rounds to nearest "
                    "fp32; then fp32 arithmetic, left to right; B = 119 for bfloat16, 7 for float16 activations")


def kernel_target(name: str, options: dict[str, object]) -> dict[str, str]:
    """The manifest's ``kernel``: function, library, version (from the backend's kernel description), description."""
    kernel = backend(name).manifest_kernel(options)
    version = _VERSION_IN_KERNEL.search(kernel["description"])
    return {"function": kernel["function"], "library": kernel["library"],
            "version": version["version"] if version else "unknown", "description": kernel["description"]}


def _hex(values: torch.Tensor | None) -> list[str] | None:
    return None if values is None else [float(v).hex() for v in values.double().tolist()]


def layer_entry(experts: str, planned: dict[str, PlannedTensor], meta: LayoutMeta) -> dict:
    """One MoE layer's record: its tensors, true and padded sizes, and the exact scales ``undo`` needs."""
    hidden, inter = meta.hidden_size, meta.intermediate_size
    padded_hidden, padded_inter = backend(meta.backend).padded_sizes(hidden, inter)
    return {
        "module": experts,
        "num_experts": meta.num_experts,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "padded_hidden_size": padded_hidden,
        "padded_intermediate_size": padded_inter,
        "tensors": {arg: {"name": t.name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)}
                    for arg, t in planned.items()},
        "scales": {"w13_global_scale_div": _hex(meta.w13_global_scale_div),
                   "w2_global_scale_div": _hex(meta.w2_global_scale_div),
                   "input_scale_div13": _hex(meta.input_scale_div13),
                   "input_scale_div2": _hex(meta.input_scale_div2)},
        "options": dict(meta.options),
    }


def activation_record(ckpt: QuantizedCheckpoint) -> dict:
    """The experts' activation: its kind, constants and formula (the family's, from config.json)."""
    family = ckpt.family
    activation = family.activation(family.text_config(ckpt.config)) if family is not None else SILU
    record: dict[str, object] = {"kind": activation.kind, "formula": ACTIVATION_FORMULAS[activation.kind]}
    if activation.kind != "silu":
        record |= {"alpha": activation.alpha, "limit": activation.limit}
    return record


def biases_record(ckpt: QuantizedCheckpoint, experts: str) -> dict | None:
    """The stored expert biases of a layer (gpt-oss's ``gate_up_proj_bias`` [E, 2I], ``down_proj_bias`` [E, H]),
    which the layout keeps under their own names, as stored; None for a layer without them."""
    grammar, reader = ckpt.grammar, ckpt.reader
    leaves = zip(("w13", "w2"), grammar.fused_tensors, strict=True)
    names = {arg: grammar.fused_tensor(experts, f"{leaf}_bias") for arg, leaf in leaves}
    if not all(name in reader for name in names.values()):
        return None
    order = ("gate and up interleaved along 2I (even = gate, odd = up), as the source stores them; the kernel "
             "tensors hold gate rows, then up rows" if grammar.interleaved else "gate then up along 2I")
    record = {}
    for arg, name in names.items():
        info = reader.info(name)
        record[arg] = {"name": name, "dtype": DTYPE_NAMES[info.dtype], "shape": list(info.shape)}
    record["w13"]["order"] = order
    record["added_to"] = "w13: GEMM1's output before the activation; w2: GEMM2's output, before the routing weight"
    return record


def manifest(name: str, options: dict[str, object], act_dtype: torch.dtype, ckpt: QuantizedCheckpoint,
             layers: dict[str, dict]) -> dict:
    """The manifest of a layout by backend ``name`` with layout ``options`` (its ``layout_options``)."""
    kernel = backend(name).manifest_kernel(options)
    layers = {key: {**entry, "biases": biases_record(ckpt, entry["module"])} for key, entry in layers.items()}
    return {
        "format": FORMAT,
        "version": VERSION,
        "producer": {"name": "fp4kit", "version": __version__},
        "backend": name,
        "kernel": kernel_target(name, options),
        "act_dtype": str(act_dtype).removeprefix("torch."),
        "options": dict(kernel.get("options", {})),
        "source": {"dialect": ckpt.dialect, "scheme": ckpt.scheme,
                   "family": ckpt.family.name if ckpt.family else None},
        "tensor_name": "<module>.<argument>",
        "scalar_formulas": {"notation": FORMULA_NOTATION, "D_a13": kernel["gate_up_input_divisor"],
                            **kernel["scalar_formulas"]},
        "activation": activation_record(ckpt),
        "layers": dict(sorted(layers.items(), key=lambda item: int(item[0]))),
    }


def read_manifest(root: str | Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.exists():
        raise Fp4kitError(f"{root}: no {MANIFEST}; is it the output of `fp4kit layout`?")
    document = read_json(path, "layout manifest")
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise Fp4kitError(f"{path}: not an fp4kit layout manifest (format must be {FORMAT!r})")
    if document.get("version") != VERSION:
        raise Fp4kitError(f"{path}: manifest version {document.get('version')!r}; this fp4kit reads {VERSION}")
    if not isinstance(document.get("layers"), dict) or document.get("backend") not in BACKEND_NAMES \
            or document.get("act_dtype") not in ("bfloat16", "float16"):
        raise Fp4kitError(f"{path}: manifest lacks a valid backend, act_dtype or layers table")
    return document


def layer_record(document: dict, layer: int) -> dict:
    entry = document["layers"].get(str(layer))
    if entry is None:
        known = ", ".join(sorted(document["layers"], key=int)) or "none"
        raise Fp4kitError(f"no MoE layer {layer} in this layout (layers: {known})")
    return entry


def _scales(values: object, name: str, num_experts: int) -> torch.Tensor | None:
    if values is None and name.startswith("input"):
        return None
    if not isinstance(values, list) or len(values) != num_experts:
        raise Fp4kitError(f"layout manifest: scales.{name} must be a list of {num_experts} hex floats")
    try:
        return torch.tensor([float.fromhex(v) for v in values], dtype=torch.float64)
    except (TypeError, ValueError):
        raise Fp4kitError(f"layout manifest: scales.{name} holds a value that is not a hex float") from None


def stored_options(document: dict) -> dict[str, object]:
    """The layout options (the backend's ``layout_options``) a manifest was written with."""
    act_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[document["act_dtype"]]
    options = document.get("options") or {}
    return backend(document["backend"]).layout_options(act_dtype, str(options.get("flavor", "flashinfer")))


def layer_meta(document: dict, entry: dict) -> LayoutMeta:
    """The LayoutMeta that ``fp4kit.layouts.<backend>.undo`` needs for this layer."""
    try:
        num_experts = int(entry["num_experts"])
        scales = [_scales(entry["scales"].get(key), key, num_experts) for key in SCALE_KEYS]
        return LayoutMeta(document["backend"], int(entry["hidden_size"]), int(entry["intermediate_size"]),
                          scales[0], scales[1], scales[2], scales[3], dict(entry.get("options") or {}))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise Fp4kitError(f"layout manifest: layer record {entry.get('module', '?') if isinstance(entry, dict) else ''}"
                          f" is malformed ({exc!r})") from None

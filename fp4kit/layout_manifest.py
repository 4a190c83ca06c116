"""`fp4kit_layout.json`, the manifest of a layout checkpoint (docs/layouts.md, "Layout checkpoints"): written by
fp4kit.layout, read by fp4kit.runtime.

The float64 scales that ``undo`` needs are stored as lists of hexadecimal floats (Python ``float.hex``, C99 ``%a``,
read back with ``float.fromhex`` / ``strtod``), so they survive any JSON parser bit for bit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from fp4kit import __version__
from fp4kit.checkpoint import DTYPE_NAMES, PlannedTensor
from fp4kit.errors import Fp4kitError
from fp4kit.formats.detect import QuantizedCheckpoint
from fp4kit.layouts import LayoutMeta, cutlass, marlin, trtllm

FORMAT, VERSION = "fp4kit-layout", 1
MANIFEST = "fp4kit_layout.json"
SCALE_KEYS = ("w13_global_scale_div", "w2_global_scale_div", "input_scale_div13", "input_scale_div2")

# (library on PyPI, function), per backend and CUTLASS flavor; the version comes from the backend's KERNEL text
KERNEL_FUNCTIONS = {
    ("trtllm", None): ("flashinfer-python", "flashinfer.fused_moe.trtllm_fp4_block_scale_moe"),
    ("cutlass", "flashinfer"): ("flashinfer-python", "flashinfer.fused_moe.cutlass_fused_moe"),
    ("cutlass", "vllm"): ("vllm", "vllm.model_executor.layers.fused_moe.cutlass_moe.cutlass_moe_fp4"),
    ("marlin", None): ("vllm", "vllm.model_executor.layers.fused_moe.fused_marlin_moe.fused_marlin_moe"),
}
_VERSION_IN_KERNEL = re.compile(r"\((?:flashinfer-python|vLLM) (?P<version>[0-9][\w.]*)")

_W4A4 = {"w13_alpha": "fp32(D_w13) * fp32(D_a13)", "a13_gscale": "1 / fp32(D_a13)",
         "w2_alpha": "fp32(D_w2) * fp32(D_a2)", "a2_gscale": "1 / fp32(D_a2)"}
# FlashInfer's kernels quantize the hidden states once, before routing: one gate/up input scale for all experts
_SHARED_A13 = ("max over the layer's experts of input_scale_div13 (the kernel quantizes the hidden states once for "
               "all experts; options.collapsed_input_scales13 counts the experts whose own scale this replaces)")
_PER_EXPERT_A13 = "input_scale_div13[e]"
GATE_UP_INPUT_DIVISOR = {("trtllm", None): _SHARED_A13, ("cutlass", "flashinfer"): _SHARED_A13,
                         ("cutlass", "vllm"): _PER_EXPERT_A13, ("marlin", None): "unused (W4A16)"}
SCALAR_FORMULAS: dict[tuple[str, str | None], dict[str, str]] = {
    ("trtllm", None): {
        "output1_scale_gate_scalar": _W4A4["w13_alpha"],
        "output1_scale_scalar": f"({_W4A4['w13_alpha']}) * (1 / fp32(D_a2))",
        "output2_scale_scalar": _W4A4["w2_alpha"],
    },
    ("cutlass", "flashinfer"): {"fc1_dequant_scale": _W4A4["w13_alpha"], "fc1_act_global_scale": _W4A4["a13_gscale"],
                                "fc2_dequant_scale": _W4A4["w2_alpha"], "fc2_act_global_scale": _W4A4["a2_gscale"]},
    ("cutlass", "vllm"): {"w1_alphas": _W4A4["w13_alpha"], "a1_gscale": _W4A4["a13_gscale"],
                          "w2_alphas": _W4A4["w2_alpha"], "a2_gscale": _W4A4["a2_gscale"]},
    ("marlin", None): {"global_scale1": "fp32(D_w13) * 2^B / options.w13_scale_factor",
                       "global_scale2": "fp32(D_w2) * 2^B / options.w2_scale_factor"},
}
FORMULA_NOTATION = ("per expert e: D_w13 = w13_global_scale_div[e], D_w2 = w2_global_scale_div[e], D_a13 = see "
                    "D_a13, D_a2 = input_scale_div2[e] (float64 divisors); fp32(x) rounds to nearest "
                    "fp32; then fp32 arithmetic, left to right; B = 119 for bfloat16, 7 for float16 activations")


def _flavor_key(backend: str, flavor: str) -> tuple[str, str | None]:
    return (backend, flavor if backend == "cutlass" else None)


def kernel_target(backend: str, flavor: str) -> dict[str, str]:
    kernel = cutlass.KERNEL[flavor] if backend == "cutlass" else {"trtllm": trtllm, "marlin": marlin}[backend].KERNEL
    library, function = KERNEL_FUNCTIONS[_flavor_key(backend, flavor)]
    version = _VERSION_IN_KERNEL.search(kernel)
    return {"function": function, "library": library, "version": version["version"] if version else "unknown",
            "description": kernel}


def _hex(values: torch.Tensor | None) -> list[str] | None:
    return None if values is None else [float(v).hex() for v in values.double().tolist()]


def layer_entry(experts: str, planned: dict[str, PlannedTensor], meta: LayoutMeta) -> dict:
    """One MoE layer's record: its tensors, true and padded sizes, and the exact scales ``undo`` needs."""
    hidden, inter = meta.hidden_size, meta.intermediate_size
    padded_hidden, padded_inter = trtllm.padded_sizes(hidden, inter) if meta.backend == "trtllm" else (hidden, inter)
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


def manifest(backend: str, flavor: str, act_dtype: torch.dtype, ckpt: QuantizedCheckpoint,
             layers: dict[str, dict]) -> dict:
    key = _flavor_key(backend, flavor)
    return {
        "format": FORMAT,
        "version": VERSION,
        "producer": {"name": "fp4kit", "version": __version__},
        "backend": backend,
        "kernel": kernel_target(backend, flavor),
        "act_dtype": str(act_dtype).removeprefix("torch."),
        "options": {"flavor": flavor} if backend == "cutlass" else {},
        "source": {"dialect": ckpt.dialect, "scheme": ckpt.scheme,
                   "family": ckpt.family.name if ckpt.family else None},
        "tensor_name": "<module>.<argument>",
        "scalar_formulas": {"notation": FORMULA_NOTATION, "D_a13": GATE_UP_INPUT_DIVISOR[key], **SCALAR_FORMULAS[key]},
        "layers": dict(sorted(layers.items(), key=lambda item: int(item[0]))),
    }


def read_manifest(root: str | Path) -> dict:
    path = Path(root) / MANIFEST
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise Fp4kitError(f"{root}: no {MANIFEST}; is it the output of `fp4kit layout`?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Fp4kitError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise Fp4kitError(f"{path}: not an fp4kit layout manifest (format must be {FORMAT!r})")
    if document.get("version") != VERSION:
        raise Fp4kitError(f"{path}: manifest version {document.get('version')!r}; this fp4kit reads {VERSION}")
    if not isinstance(document.get("layers"), dict) or document.get("backend") not in ("trtllm", "cutlass", "marlin") \
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

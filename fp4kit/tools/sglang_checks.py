"""`fp4kit inspect --engine sglang`: what SGLang loads without complaint but then builds or serves wrongly.

Each check cites the SGLang source it comes from (paths in the sglang 0.5.23 package). Findings name the tensor or
module; what depends on how SGLang is started (the MoE runner backend) is a note, not a problem.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from fp4kit.families.base import expert_module, group_experts
from fp4kit.formats.detect import QuantizedCheckpoint
from fp4kit.formats.modelopt import HF_QUANT_CONFIG
from fp4kit.formats.modelopt import NAME as MO

VERSION = "0.5.23"
_Q = "sglang/srt/layers/quantization"
SOURCES = {
    "sglang_excluded_module": f"{_Q}/modelopt_quant.py (ModelOptQuantConfig.is_layer_excluded: an exclude_modules "
                              "pattern whose last part is q_a_proj, q_b_proj, kv_a_proj_with_mqa or kv_b_proj "
                              "excludes that projection in every layer; a pattern also matches any one dotted "
                              "part of a module name; excluded modules are built unquantized)",
    "sglang_gate_up_global_scale": f"{_Q}/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4_moe.py, "
                                   "compressed_tensors_w4a16_nvfp4_moe.py (w13 keeps w1's global scale: [:, 0]), "
                                   f"{_Q}/modelopt_quant.py (ModelOptNvFp4FusedMoEMethod: the Marlin path keeps "
                                   "w13_weight_scale_2[:, 0]; Marlin is the default below sm100)",
    "sglang_w4a16_moe_backend": f"{_Q}/modelopt_quant.py (ModelOptNvFp4FusedMoEMethod serves W4A16_NVFP4 experts "
                                "too: its input scales start at 1.0 and every backend but Marlin quantizes the "
                                "activations with them)",
}

Report = Callable[[str, str, str], None]


def _glob(pattern: str) -> re.Pattern[str]:
    """An exclude_modules entry as SGLang compiles it: '.' literal, '*' any run of characters, the rest as regex
    syntax, matched in full."""
    return re.compile(".*".join(part.replace(".", r"\.") for part in pattern.split("*")))


FUSED_PARTS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def excluded_by(module: str, exclude_modules: list[str]) -> str | None:
    """The exclude_modules entry SGLang's ModelOpt config excludes ``module`` by (None: it is quantized)."""
    names = [module] + ([module.removeprefix("language_model.")] if module.startswith("language_model.") else [])
    for pattern in exclude_modules:
        compiled = _glob(pattern)
        if any(compiled.fullmatch(name) or any(compiled.fullmatch(part) for part in name.split("."))
               for name in names):
            return pattern
        tail = pattern.rsplit(".", 1)[-1]
        if tail in FUSED_PARTS and any(tail in name.rsplit(".", 1)[-1] for name in names):
            return pattern
    return None


def modelopt_exclude_modules(ckpt: QuantizedCheckpoint) -> list[str]:
    """The exclude list SGLang reads: config.json's quantization_config (``ignore``, else ``modules_to_not_convert``
    or ``exclude_modules``) when it has a quant_algo, else hf_quant_config.json's ``quantization.exclude_modules``."""
    qconfig = ckpt.config.get("quantization_config") or {}
    if qconfig.get("quant_algo") is not None:
        return list(qconfig.get("ignore", qconfig.get("modules_to_not_convert", qconfig.get("exclude_modules", []))))
    path = ckpt.root / HF_QUANT_CONFIG
    document = json.loads(path.read_text()) if path.is_file() else {}
    return list((document.get("quantization") or {}).get("exclude_modules") or [])


def sglang_checks(ckpt: QuantizedCheckpoint, scales: dict[str, tuple[float, float | None]], report: Report,
                  note: Callable[[str], None]) -> None:
    """``scales``: module -> (weight divisor, input divisor or None), as fp4kit.tools.inspect reads them."""
    if ckpt.dialect == MO:
        _excluded(ckpt, report)
        if ckpt.scheme == "nvfp4a16" and any(expert_module(m.name, ckpt.grammar) for m in ckpt.modules):
            note("SGLang serves these W4A16 experts correctly only with `--moe-runner-backend marlin` (the default "
                 "below sm100): its other MoE backends run them as W4A4 with activation scales of 1.0 "
                 f"[{SOURCES['sglang_w4a16_moe_backend']}]")
    _gate_up(scales, report, ckpt)


def _excluded(ckpt: QuantizedCheckpoint, report: Report) -> None:
    exclude = modelopt_exclude_modules(ckpt)
    seen: set[str] = set()
    for m in ckpt.modules:
        expert = expert_module(m.name, ckpt.grammar)
        # routed experts are one FusedMoE module in SGLang, asked by the experts container's name
        name = expert.experts if expert else m.name
        if name in seen:
            continue
        seen.add(name)
        if pattern := excluded_by(name, exclude):
            report("sglang_excluded_module", name, f"stored NVFP4 but SGLang's exclude rules match {pattern!r}: it "
                                                   f"builds the module unquantized and cannot load the packed weight")


def _gate_up(scales: dict[str, tuple[float, float | None]], report: Report, ckpt: QuantizedCheckpoint) -> None:
    grammar = ckpt.grammar
    gate, up = grammar.w13
    for experts, members in group_experts(scales.items(), grammar).items():
        for e, projs in sorted(members.items()):
            if gate in projs and up in projs and projs[gate][0] != projs[up][0]:
                ratio = projs[up][0] / projs[gate][0] if projs[gate][0] else float("inf")
                where = "every backend" if ckpt.dialect != MO else "the Marlin backend"
                report("sglang_gate_up_global_scale", grammar.expert_linear(experts, e, up),
                       f"weight global scale differs from {gate}'s (ratio {ratio:.4g}); SGLang ({where}) dequantizes "
                       f"{up} with {gate}'s")

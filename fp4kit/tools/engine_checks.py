"""`fp4kit inspect --engine vllm`: what a serving engine loads without complaint but then serves wrongly.

Each check cites the engine source it comes from (paths in the vLLM 0.33.0 package); ``ENGINES`` lists the engines
inspect checks and their versions (SGLang's checks: fp4kit/tools/sglang_checks.py; TensorRT-LLM's:
fp4kit/tools/trtllm_checks.py). Findings name the tensor or
module. Streaming: one module's tensors at a time; the packed weights
are read only for the zero-block-scale check (the one check that needs the codes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy
import torch

from fp4kit.families.base import ATTENTION_QUERY_RE, group_experts, layer_of, routed_expert
from fp4kit.families.grammar import ExpertGrammar
from fp4kit.formats.detect import QuantizedCheckpoint
from fp4kit.formats.modelopt import HF_QUANT_CONFIG
from fp4kit.formats.modelopt import NAME as MO
from fp4kit.tools.trtllm_checks import ENGINE as TRTLLM

VERSION = "0.33.0"
_Q = "vllm/model_executor/layers/quantization"
SOURCES = {
    "vllm_w4a4_input_scale": f"{_Q}/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py, {_Q}/modelopt.py "
                             "(the activation global scale is 1 / input scale, used as is)",
    "vllm_gate_up_global_scale": f"{_Q}/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_w4a4_nvfp4.py"
                                 f", {_Q}/modelopt.py (w13 keeps w1's global scale: [:, 0]; Marlin too)",
    "vllm_per_expert_input_scale": f"{_Q}/utils/flashinfer_fp4_moe.py (prepare_nvfp4_moe_layer_for_fi_or_cutlass: "
                                   "FlashInfer TRT-LLM / CUTLASS quantize the hidden states once, with the max)",
    "vllm_mtp_layer": "vllm/model_executor/models/glm4_moe_mtp.py (the drafter builds layers num_hidden_layers.. "
                      "and loads them by name, unquantized as the exports ship them); qwen3_next_mtp.py, "
                      "qwen3_5_mtp.py (the `mtp.*` block: `mtp.fc` forced unquantized under ModelOpt)",
    "vllm_kv_cache_scale": f"{_Q}/kv_cache.py (BaseKVCacheMethod: without k_scale / v_scale the scales default to "
                           "1.0)",
    "vllm_zero_block_scale": f"{_Q}/utils/nvfp4_emulation_utils.py (dequantize: codes times block scale; a zero "
                             "scale zeroes the block)",
    "vllm_pre_quant_scale": f"{_Q}/modelopt.py (ModelOptNvFp4LinearMethod has no pre_quant_scale parameter: the "
                            "smoothing is not applied)",
}

Report = Callable[[str, str, str], None]


def engines() -> dict[str, tuple[str, dict[str, str]]]:
    """Engine name -> (the version its checks were read in, check -> the source file it cites)."""
    from fp4kit.tools import sglang_checks, trtllm_checks

    return {"vllm": (VERSION, SOURCES), "sglang": (sglang_checks.VERSION, sglang_checks.SOURCES),
            trtllm_checks.ENGINE: (trtllm_checks.VERSION, trtllm_checks.SOURCES)}


ENGINES = ("vllm", "sglang", TRTLLM)


def _finite_positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def vllm_checks(ckpt: QuantizedCheckpoint, scales: dict[str, tuple[float, float | None]], report: Report) -> None:
    """``scales``: module -> (weight divisor, input divisor or None), as fp4kit.tools.inspect reads them."""
    _input_scales(ckpt, scales, report)
    _experts(scales, report, ckpt.grammar)
    _mtp(ckpt, report)
    _kv_cache(ckpt, report)
    _zero_block_scales(ckpt, report)
    for name in ckpt.passthrough:
        if name.endswith("pre_quant_scale"):
            report("vllm_pre_quant_scale", name, "ModelOpt activation smoothing tensor that vLLM does not apply: "
                                                 "the weights were quantized for smoothed inputs")


def _input_scales(ckpt: QuantizedCheckpoint, scales: dict[str, tuple[float, float | None]], report: Report) -> None:
    if ckpt.scheme != "nvfp4":
        return
    for m in ckpt.modules:
        input_div = scales[m.name][1]
        if not _finite_positive(input_div):
            what = "no input scale" if m.input_scale is None else f"input scale (as divisor) {input_div}"
            report("vllm_w4a4_input_scale", m.input_scale or m.name,
                   f"W4A4 module with {what}: vLLM quantizes its activations with 1 / that")


def _experts(scales: dict[str, tuple[float, float | None]], report: Report, grammar: ExpertGrammar) -> None:
    layers = group_experts(scales.items(), grammar)
    gate, up = grammar.w13
    for experts, members in layers.items():
        for e, projs in sorted(members.items()):
            if gate in projs and up in projs and projs[gate][0] != projs[up][0]:
                ratio = projs[up][0] / projs[gate][0] if projs[gate][0] else float("inf")
                report("vllm_gate_up_global_scale", grammar.expert_linear(experts, e, up),
                       f"weight global scale differs from {gate}'s (ratio {ratio:.4g}); vLLM dequantizes {up} "
                       f"with {gate}'s")
        gate_up = {projs[p][1] for projs in members.values() for p in grammar.w13
                   if p in projs and projs[p][1] is not None}
        if len(gate_up) > 1:
            report("vllm_per_expert_input_scale", f"{experts}.*.{gate}",
                   f"{len(gate_up)} different gate/up input scales over {len(members)} experts; vLLM's FlashInfer "
                   f"backends quantize the hidden states once with the largest (`fp4kit convert --repair` shares one)")


def _mtp(ckpt: QuantizedCheckpoint, report: Report) -> None:
    if ckpt.family is None:
        return
    if ckpt.family.mtp_prefix is not None:
        _mtp_block(ckpt, ckpt.family.mtp_prefix, report)
        return
    text = ckpt.family.text_config(ckpt.config)
    count = int(text.get("num_nextn_predict_layers") or 0)
    if not count:
        return
    first = int(text["num_hidden_layers"])
    names = list(ckpt.reader.tensors)
    for layer in range(first, first + count):
        held = [n for n in names if layer_of(n) == layer]
        if not held:
            report("vllm_mtp_layer", f"layers.{layer}", f"config.json declares num_nextn_predict_layers = {count} "
                                                        f"but the checkpoint has no layer {layer}: the drafter would "
                                                        f"run on uninitialized weights")
        for m in ckpt.modules:
            if layer_of(m.name) == layer:
                report("vllm_mtp_layer", m.name, "MTP layer module stored quantized; the drafter expects the "
                                                 "exported bf16 weights")


def _mtp_block(ckpt: QuantizedCheckpoint, prefix: str, report: Report) -> None:
    """An MTP block outside the decoder layers: only its routed experts may be stored quantized (`--mtp quantize`);
    the drafter reads the rest as the exports ship them."""
    for m in ckpt.modules:
        if m.name.startswith(prefix) and routed_expert(m.name, ckpt.family.grammar) is None:
            report("vllm_mtp_layer", m.name, "MTP module stored quantized; the drafter expects the exported bf16 "
                                             "weights")


def _kv_cache_declared(ckpt: QuantizedCheckpoint) -> str | None:
    qconfig = ckpt.config.get("quantization_config") or {}
    if qconfig.get("kv_cache_scheme"):
        return "quantization_config.kv_cache_scheme"
    if ckpt.dialect == MO and (ckpt.root / HF_QUANT_CONFIG).is_file():
        algo = (json.loads((ckpt.root / HF_QUANT_CONFIG).read_text()).get("quantization") or {}).get(
            "kv_cache_quant_algo")
        if algo:
            return f"{HF_QUANT_CONFIG} kv_cache_quant_algo {algo}"
    return None


def _kv_cache(ckpt: QuantizedCheckpoint, report: Report) -> None:
    declared = _kv_cache_declared(ckpt)
    if declared is None:
        return
    names = set(ckpt.reader.tensors)
    attentions = sorted({match["attn"] for n in names if (match := ATTENTION_QUERY_RE.match(n.rsplit(".", 1)[0]))})
    for attn in attentions:
        for kind in ("k", "v"):
            candidates = (f"{attn}.{kind}_scale", f"{attn}.{kind}_proj.{kind}_scale", f"{attn}.attn.{kind}_scale")
            if not any(c in names for c in candidates):
                report("vllm_kv_cache_scale", f"{attn}.{kind}_scale", f"{declared} declares a quantized KV cache "
                                                                      f"but there is no {kind}_scale tensor")


def _zero_block_scales(ckpt: QuantizedCheckpoint, report: Report) -> None:
    for m in ckpt.modules:
        weight = ckpt.read_weight(m)
        zero = (weight.block_scale.view(torch.uint8) & 0x7F) == 0  # +0 and -0
        if not bool(zero.any()):
            continue
        codes = weight.packed.reshape(*weight.block_scale.shape, -1).numpy()
        nonzero_codes = numpy.bitwise_and(codes, 0x77).any(axis=-1)  # magnitudes of both nibbles
        lost = int((torch.from_numpy(nonzero_codes) & zero).sum())
        if lost:
            report("vllm_zero_block_scale", m.block_scale, f"{lost} blocks have non-zero codes but an FP8 block "
                                                           f"scale of 0 (underflow): they dequantize to zeros")

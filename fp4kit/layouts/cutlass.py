"""CUTLASS NVFP4 grouped-GEMM layout (W4A4, sm100/sm120): FlashInfer ``cutlass_fused_moe`` or vLLM ``cutlass_moe_fp4``.

Facts (checked in flashinfer-python 0.7.2.post1 ``fused_moe/prepare.py::prepare_cutlass_nvfp4_weights``,
``data/csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu`` and vLLM's
``flashinfer_cutlass_moe.py`` / ``cutlass_moe.py``):

- Packed weights keep their bytes; only the w13 row order changes: FlashInfer wants [w3; w1], vLLM [w1; w3].
- Block scales are 128x4-swizzled per expert, [E, pad128(N), pad4(K/16)].
- FlashInfer's binding checks dtypes: weights int64 views of the packed bytes, block scales int32 views
  ([E, N, K/16/4]), scalars fp32 with act globals either 0-d or [E]. vLLM takes uint8 weights and fp8 scales.
- Gated GEMM1 needs I % 64 == 0 (its scale rows are alignToSfDim(I, 64) * 2); the expand kernel reads the
  activation scales with rows padded to 64, so H % 64 == 0.
- Per-expert fp32 scalars, as vLLM computes them: g1_alpha = D_w13 * D_a13, g2_alpha = D_w2 * D_a2,
  a1_gscale = 1 / D_a13, a2_gscale = 1 / D_a2 (each divisor first rounded to fp32). FlashInfer's kernel quantizes
  the hidden states once for all experts, so there D_a13 is the layer's largest gate/up input divisor (as vLLM
  0.33's ``prepare_nvfp4_moe_layer_for_fi_or_cutlass``); vLLM's own ``cutlass_moe_fp4`` quantizes per expert and
  keeps each expert's. D_a2 stays per expert in both (the down input is quantized per expert).
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.layouts import (
    PER_EXPERT_A13,
    SHARED_A13,
    W4A4_FORMULAS,
    LayoutMeta,
    alignment_problems,
    canonical,
    check_divisible,
    check_expert_parallel,
    check_input_scales,
    collapsed_input_scales,
    destination,
    fp32,
    moe_sizes,
    placed,
    require_equal,
    require_shape,
    shared_input_divisor,
)
from fp4kit.layouts import describe as _describe
from fp4kit.layouts.swizzle import swizzle_128x4, swizzle_padding_is_zero, swizzled_shape, unswizzle_128x4
from fp4kit.nvfp4 import BLOCK, NVFP4Tensor

KERNEL = {
    "flashinfer": "flashinfer.fused_moe.cutlass_fused_moe NVFP4 (flashinfer-python 0.7.2.post1)",
    "vllm": "vllm cutlass_moe_fp4 (vLLM 0.33)",
}
BACKEND = "cutlass"
W4A4 = True
# (library on PyPI, function) per flavor
FUNCTIONS = {
    "flashinfer": ("flashinfer-python", "flashinfer.fused_moe.cutlass_fused_moe"),
    "vllm": ("vllm", "vllm.model_executor.layers.fused_moe.cutlass_moe.cutlass_moe_fp4"),
}
# FlashInfer's cutlass binding reads the NVFP4 quant_scales list in this order (flashinfer_cutlass_fused_moe_binding.cu)
QUANT_SCALES = ("fc1_act_global_scale", "fc1_weight_block_scale", "fc1_dequant_scale",
                "fc2_act_global_scale", "fc2_weight_block_scale", "fc2_dequant_scale")
Flavor = Literal["flashinfer", "vllm"]
GATED_I_ALIGNMENT = 64
HIDDEN_ALIGNMENT = 64

# kernel argument names per flavor: (w13 weights, w13 block scales, g1 alpha, a1 multiplier, and the same for w2)
_NAMES = {
    "flashinfer": ("fc1_expert_weights", "fc1_weight_block_scale", "fc1_dequant_scale", "fc1_act_global_scale",
                   "fc2_expert_weights", "fc2_weight_block_scale", "fc2_dequant_scale", "fc2_act_global_scale"),
    "vllm": ("w1_fp4", "w1_blockscale", "w1_alphas", "a1_gscale", "w2_fp4", "w2_blockscale", "w2_alphas", "a2_gscale"),
}
# dtypes each kernel reads the packed weights and block scales as
_DTYPES = {"flashinfer": (torch.int64, torch.int32), "vllm": (torch.uint8, torch.float8_e4m3fn)}


def check_shapes(num_experts: int, hidden: int, intermediate: int, ep: int = 1, flavor: Flavor = "flashinfer",
                 **options: object) -> None:
    _check_flavor(flavor)
    check_divisible("intermediate size I", intermediate, GATED_I_ALIGNMENT,
                    "the CUTLASS gated MoE GEMM1 needs I % 64 == 0")
    check_divisible("hidden size H", hidden, HIDDEN_ALIGNMENT,
                    "the CUTLASS NVFP4 MoE reads activation scales in rows padded to 64")
    check_expert_parallel(num_experts, ep, "CUTLASS fused MoE")


def layout_options(act_dtype: torch.dtype, flavor: str) -> dict[str, object]:
    _check_flavor(flavor)
    return {"flavor": flavor}


def shape_problems(hidden: int, intermediate: int) -> list[str]:
    return alignment_problems([("I", intermediate, GATED_I_ALIGNMENT), ("H", hidden, HIDDEN_ALIGNMENT)])


def padded_sizes(hidden: int, intermediate: int) -> tuple[int, int]:
    return hidden, intermediate


def manifest_kernel(options: dict[str, object]) -> dict[str, object]:
    flavor = str(options["flavor"])
    library, function = FUNCTIONS[flavor]
    names = dict(zip(("g1", "a1", "g2", "a2"), _NAMES[flavor][2:4] + _NAMES[flavor][6:8], strict=True))
    return {"library": library, "function": function, "description": KERNEL[flavor],
            "gate_up_input_divisor": SHARED_A13 if flavor == "flashinfer" else PER_EXPERT_A13,
            "scalar_formulas": {names["g1"]: W4A4_FORMULAS["w13_alpha"], names["a1"]: W4A4_FORMULAS["a13_gscale"],
                                names["g2"]: W4A4_FORMULAS["w2_alpha"], names["a2"]: W4A4_FORMULAS["a2_gscale"]},
            "options": {"flavor": flavor}}


def kernel_arguments(tensors: dict[str, torch.Tensor], meta: LayoutMeta, document: dict, entry: dict,
                     root: str | os.PathLike, device: str | torch.device) -> dict[str, object]:
    """FlashInfer ``cutlass_fused_moe``'s layer arguments, or vLLM ``cutlass_moe_fp4``'s (its parameter names are the
    tensor names)."""
    if "fc1_expert_weights" not in tensors:
        return dict(tensors)
    return {
        "fc1_expert_weights": tensors["fc1_expert_weights"],
        "fc2_expert_weights": tensors["fc2_expert_weights"],
        "quant_scales": [tensors[name] for name in QUANT_SCALES],
        "output_dtype": {"bfloat16": torch.bfloat16, "float16": torch.float16}[document["act_dtype"]],
    }


def _check_flavor(flavor: str) -> None:
    if flavor not in _NAMES:
        raise Fp4kitError(f"unknown CUTLASS flavor {flavor!r}: use 'flashinfer' or 'vllm'.")


def _swap_halves(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    first, second = rows.chunk(2, dim=1)
    if out is None:
        return torch.cat([second, first], dim=1)
    return torch.cat([second, first], dim=1, out=out.view(rows.dtype).view(rows.shape))


def _scalars(meta: LayoutMeta) -> tuple[torch.Tensor, ...]:
    if meta.input_scale_div13 is None or meta.input_scale_div2 is None:
        raise Fp4kitError("CUTLASS NVFP4 MoE is W4A4: it needs the gate/up and down input scales.")
    input13 = meta.input_scale_div13
    if meta.options.get("flavor", "flashinfer") == "flashinfer":
        input13 = shared_input_divisor(input13)
    return (fp32(meta.w13_global_scale_div) * fp32(input13), 1.0 / fp32(input13),
            fp32(meta.w2_global_scale_div) * fp32(meta.input_scale_div2), 1.0 / fp32(meta.input_scale_div2))


def describe(w13: NVFP4Tensor, w2: NVFP4Tensor, input_scale_div13: torch.Tensor | None,
             input_scale_div2: torch.Tensor | None, flavor: Flavor = "flashinfer") -> LayoutMeta:
    _check_flavor(flavor)
    collapsed = collapsed_input_scales(input_scale_div13) if flavor == "flashinfer" else 0
    return _describe(BACKEND, w13, w2, input_scale_div13, input_scale_div2, flavor=flavor,
                     collapsed_input_scales13=collapsed)


def transform(w13: NVFP4Tensor, w2: NVFP4Tensor, input_scale_div13: torch.Tensor | None,
              input_scale_div2: torch.Tensor | None, flavor: Flavor = "flashinfer",
              out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    num_experts, hidden, intermediate = moe_sizes(w13, w2)
    check_input_scales(num_experts, input_scale_div13, input_scale_div2)
    check_shapes(num_experts, hidden, intermediate, flavor=flavor)
    meta = describe(w13, w2, input_scale_div13, input_scale_div2, flavor)
    weight_dtype, scale_dtype = _DTYPES[flavor]
    w13_name, s13_name, g1_name, a1_name, w2_name, s2_name, g2_name, a2_name = _NAMES[flavor]
    packed13, scales13 = w13.packed, w13.block_scale
    if flavor == "flashinfer":
        packed13, scales13 = _swap_halves(packed13, destination(out, w13_name)), _swap_halves(scales13)
    g1_alpha, a1_gscale, g2_alpha, a2_gscale = _scalars(meta)
    values = {
        w13_name: packed13.contiguous().view(weight_dtype),
        s13_name: swizzle_128x4(scales13, out=destination(out, s13_name)).view(scale_dtype),
        g1_name: g1_alpha, a1_name: a1_gscale,
        w2_name: w2.packed.contiguous().view(weight_dtype),
        s2_name: swizzle_128x4(w2.block_scale, out=destination(out, s2_name)).view(scale_dtype),
        g2_name: g2_alpha, a2_name: a2_gscale,
    }
    return {name: placed(out, name, value) for name, value in values.items()}


def undo(tensors: dict[str, torch.Tensor], meta: LayoutMeta) -> tuple[NVFP4Tensor, NVFP4Tensor, torch.Tensor | None,
                                                                       torch.Tensor | None]:
    flavor = str(meta.options.get("flavor", "flashinfer"))
    _check_flavor(flavor)
    num_experts, hidden, intermediate = meta.num_experts, meta.hidden_size, meta.intermediate_size
    weight_dtype, scale_dtype = _DTYPES[flavor]
    w13_name, s13_name, g1_name, a1_name, w2_name, s2_name, g2_name, a2_name = _NAMES[flavor]
    per_byte = torch.empty((), dtype=weight_dtype).element_size()
    per_scale = torch.empty((), dtype=scale_dtype).element_size()
    rows13, cols13 = swizzled_shape(2 * intermediate, hidden // BLOCK)
    rows2, cols2 = swizzled_shape(hidden, intermediate // BLOCK)
    require_shape(w13_name, tensors, weight_dtype, (num_experts, 2 * intermediate, hidden // 2 // per_byte))
    require_shape(w2_name, tensors, weight_dtype, (num_experts, hidden, intermediate // 2 // per_byte))
    require_shape(s13_name, tensors, scale_dtype, (num_experts, rows13, cols13 // per_scale))
    require_shape(s2_name, tensors, scale_dtype, (num_experts, rows2, cols2 // per_scale))
    for name, value in zip((g1_name, a1_name, g2_name, a2_name), _scalars(meta), strict=True):
        require_equal(name, tensors[name], value)
    for name, rows, cols in ((s13_name, 2 * intermediate, hidden // BLOCK), (s2_name, hidden, intermediate // BLOCK)):
        if not swizzle_padding_is_zero(tensors[name].view(torch.uint8), rows, cols):
            raise Fp4kitError(f"{name} has non-zero bytes in its swizzle padding.")

    packed13 = tensors[w13_name].contiguous().view(torch.uint8)
    scales13 = unswizzle_128x4(tensors[s13_name].view(torch.uint8), 2 * intermediate, hidden // BLOCK)
    if flavor == "flashinfer":
        packed13, scales13 = _swap_halves(packed13), _swap_halves(scales13)
    scales2 = unswizzle_128x4(tensors[s2_name].view(torch.uint8), hidden, intermediate // BLOCK)
    w13 = canonical(packed13, scales13.view(torch.float8_e4m3fn), meta.w13_global_scale_div)
    w2 = canonical(tensors[w2_name].contiguous().view(torch.uint8), scales2.view(torch.float8_e4m3fn),
                   meta.w2_global_scale_div)
    return w13, w2, meta.input_scale_div13, meta.input_scale_div2

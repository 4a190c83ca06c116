"""TRT-LLM-gen shuffled layout for FlashInfer's ``trtllm_fp4_block_scale_moe`` (NVFP4 W4A4, sm100 family).

Facts (checked in flashinfer-python 0.7.2.post1 ``fused_moe/prepare.py::prepare_trtllm_fp4_weights``,
``fused_moe/core.py``, ``utils.py::get_shuffle_matrix_a_row_indices`` and vLLM's
``flashinfer_fp4_moe.py::prepare_static_weights_for_trtllm_fp4_moe``):

- GEMM1 rows are [w3; w1] (up first). I is padded to 64, w1 and w3 separately, with zero bytes. GEMM1's K (the
  hidden states' width) is H padded to 256; GEMM2's rows are H padded to 128 only: called with
  ``valid_hidden_size`` = H, the 0.7.2 launcher sizes GEMM2's N and the FC2 weights and scales at
  roundUp(valid_hidden_size, 128) (``core.py::_infer_trtllm_moe_output_hidden_size``,
  ``trtllm_fused_moe_kernel_launcher.cu::moe_hidden_size_output``, TRT-LLM's ``output_hidden_size``; GPT-OSS:
  hidden states 3072 wide, FC2 2944 rows, output 2880), and it requires that to be <= the padded hidden size.
  With H % 256 == 0 both are H. The kernel is called with ``intermediate_size`` = padded I,
  ``valid_hidden_size`` = H and ``valid_intermediate_size`` = I (see :func:`call_arguments`).
- GEMM1 rows are interleaved for the fused gated activation (out[2i] = in[i], out[2i+1] = in[M/2 + i]), then every
  32-row block is shuffled for the transposed-output epilogue (epilogue_tile_m = 128):
  out[32b + d] = in[32b + (d % 8) * 4 + d // 8]. GEMM2 rows get only the 32-row shuffle.
- Block scales get the same row permutation, then the 128x4 swizzle; they are handed over as float8_e4m3fn
  reshaped to [E, rows, K/16] (the swizzled buffer has exactly that many bytes once padded).
- Per local expert fp32 scalars, as vLLM computes them: output1_scale_gate_scalar = D_w13 * D_a13,
  output1_scale_scalar = that * (1 / D_a2), output2_scale_scalar = D_w2 * D_a2. The kernel quantizes the hidden
  states once for all experts, so D_a13 is the layer's largest gate/up input divisor (as vLLM 0.33 does;
  ``describe`` counts the experts whose own scale that replaces); the down projection's input is quantized per
  expert inside the kernel (with output1_scale_scalar), so D_a2 stays per expert.
"""

from __future__ import annotations

import os

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.layouts import (
    SHARED_A13,
    W4A4_FORMULAS,
    LayoutMeta,
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
    require_zero,
    shared_input_divisor,
)
from fp4kit.layouts import describe as _describe
from fp4kit.layouts.swizzle import round_up, swizzle_128x4, unswizzle_128x4
from fp4kit.nvfp4 import BLOCK, NVFP4Tensor

KERNEL = ("flashinfer.fused_moe.trtllm_fp4_block_scale_moe (flashinfer-python 0.7.2.post1, epilogue_tile_m=128; "
          "GEMM1 K = H padded to 256, GEMM2 rows = H padded to 128, I padded to 64)")
BACKEND = "trtllm"
W4A4 = True
LIBRARY, FUNCTION = "flashinfer-python", "flashinfer.fused_moe.trtllm_fp4_block_scale_moe"
EPILOGUE_TILE_M = 128
SHUFFLE_BLOCK = 32
HIDDEN_ALIGNMENT = 256  # GEMM1's K: the width the hidden states are padded to
GEMM2_ROW_ALIGNMENT = 128  # GEMM2's N (FC2 rows) when valid_hidden_size is given: roundUp(H, 128)
INTERMEDIATE_ALIGNMENT = 64


# flashinfer.tllm_enums.RoutingMethodType, per fp4kit routing kind (and renormalize)
ROUTING_METHOD = {("softmax_topk", True): 4, ("softmax_topk", False): 0, ("sigmoid_grouped_topk", True): 2,
                  ("llama4_sigmoid_top1", True): 3, ("llama4_sigmoid_top1", False): 3}


def check_shapes(num_experts: int, hidden: int, intermediate: int, ep: int = 1, **options: object) -> None:
    check_divisible("hidden size H", hidden, BLOCK, "NVFP4 has one FP8 scale per 16 elements")
    check_divisible("intermediate size I", intermediate, BLOCK, "NVFP4 has one FP8 scale per 16 elements")
    check_expert_parallel(num_experts, ep, "TRT-LLM-gen MoE")


def layout_options(act_dtype: torch.dtype, flavor: str) -> dict[str, object]:
    if act_dtype != torch.bfloat16:
        raise Fp4kitError("trtllm_fp4_block_scale_moe always outputs bfloat16: use --act-dtype bf16")
    return {}


def shape_problems(hidden: int, intermediate: int) -> list[str]:
    return []  # pads H (256 for GEMM1's K, 128 for GEMM2's rows) and I (64) itself


def manifest_kernel(options: dict[str, object]) -> dict[str, object]:
    return {"library": LIBRARY, "function": FUNCTION, "description": KERNEL, "gate_up_input_divisor": SHARED_A13,
            "scalar_formulas": {
                "output1_scale_gate_scalar": W4A4_FORMULAS["w13_alpha"],
                "output1_scale_scalar": f"({W4A4_FORMULAS['w13_alpha']}) * (1 / fp32(D_a2))",
                "output2_scale_scalar": W4A4_FORMULAS["w2_alpha"]}}


def padded_sizes(hidden: int, intermediate: int) -> tuple[int, int]:
    """(GEMM1's K, padded I): the hidden states' width and the intermediate size the kernel is called with."""
    return round_up(hidden, HIDDEN_ALIGNMENT), round_up(intermediate, INTERMEDIATE_ALIGNMENT)


def gemm2_rows(hidden: int) -> int:
    """GEMM2's N, the FC2 rows per expert: roundUp(valid_hidden_size, 128), as the 0.7.2 launcher sizes them."""
    return round_up(hidden, GEMM2_ROW_ALIGNMENT)


def call_arguments(meta: LayoutMeta, ep_rank: int = 0) -> dict[str, int]:
    """The integer arguments of ``trtllm_fp4_block_scale_moe`` that go with these tensors (meta holds one rank)."""
    _, padded_intermediate = padded_sizes(meta.hidden_size, meta.intermediate_size)
    return {
        "intermediate_size": padded_intermediate,
        "valid_hidden_size": meta.hidden_size,
        "valid_intermediate_size": meta.intermediate_size,
        "local_expert_offset": ep_rank * meta.num_experts,
        "local_num_experts": meta.num_experts,
    }


def gated_interleave_rows(num_rows: int) -> torch.Tensor:
    """Source row of every destination row: out[2i] = in[i], out[2i+1] = in[num_rows/2 + i]."""
    return torch.arange(num_rows).reshape(2, num_rows // 2).T.reshape(-1)


def shuffle_rows(num_rows: int) -> torch.Tensor:
    """Source row of every destination row: out[32b + d] = in[32b + (d % 8) * 4 + d // 8]."""
    if num_rows % SHUFFLE_BLOCK:
        raise Fp4kitError(f"{num_rows} rows cannot be shuffled in blocks of {SHUFFLE_BLOCK}.")
    within = torch.arange(SHUFFLE_BLOCK)
    source_in_block = (within % 8) * 4 + within // 8
    blocks = torch.arange(num_rows // SHUFFLE_BLOCK).unsqueeze(1) * SHUFFLE_BLOCK
    return (blocks + source_in_block).reshape(-1)


def w13_rows(num_rows: int) -> torch.Tensor:
    return gated_interleave_rows(num_rows)[shuffle_rows(num_rows)]


def _pad(tensor: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    as_bytes = tensor.view(torch.uint8)
    padded = as_bytes.new_zeros((as_bytes.shape[0], rows, cols))
    padded[:, : as_bytes.shape[1], : as_bytes.shape[2]] = as_bytes
    return padded


def _up_gate(tensor: torch.Tensor, intermediate: int, padded_i: int, padded_cols: int) -> torch.Tensor:
    """[gate; up] bytes [E, 2I, C] -> [up; gate] with each half zero-padded to [padded_i, padded_cols]."""
    gate, up = tensor[:, :intermediate], tensor[:, intermediate:]
    return torch.cat([_pad(up, padded_i, padded_cols), _pad(gate, padded_i, padded_cols)], dim=1)


def _gemm1_source(tensor: torch.Tensor, intermediate: int, padded_i: int,
                  padded_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(source bytes, rows) such that GEMM1's rows are ``source[:, rows]``: without padding the [up; gate] swap is
    folded into the row index, so the only copy is the final gather."""
    rows = w13_rows(2 * padded_i)
    as_bytes = tensor.view(torch.uint8)
    if padded_i == intermediate and as_bytes.shape[2] == padded_cols:
        return as_bytes, (rows + intermediate) % (2 * intermediate)  # [up; gate] row r is [gate; up] row r +- I
    return _up_gate(as_bytes, intermediate, padded_i, padded_cols), rows


def _padded(tensor: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    as_bytes = tensor.view(torch.uint8)
    return as_bytes if as_bytes.shape[1:] == (rows, cols) else _pad(as_bytes, rows, cols)


def _scalars(meta: LayoutMeta) -> dict[str, torch.Tensor]:
    if meta.input_scale_div13 is None or meta.input_scale_div2 is None:
        raise Fp4kitError("trtllm_fp4_block_scale_moe is W4A4: it needs the gate/up and down input scales.")
    gate_scalar = fp32(meta.w13_global_scale_div) * fp32(shared_input_divisor(meta.input_scale_div13))
    return {
        "output1_scale_scalar": gate_scalar * (1.0 / fp32(meta.input_scale_div2)),
        "output1_scale_gate_scalar": gate_scalar,
        "output2_scale_scalar": fp32(meta.w2_global_scale_div) * fp32(meta.input_scale_div2),
    }


def describe(w13: NVFP4Tensor, w2: NVFP4Tensor, input_scale_div13: torch.Tensor | None,
             input_scale_div2: torch.Tensor | None) -> LayoutMeta:
    return _describe(BACKEND, w13, w2, input_scale_div13, input_scale_div2,
                     collapsed_input_scales13=collapsed_input_scales(input_scale_div13))


def transform(w13: NVFP4Tensor, w2: NVFP4Tensor, input_scale_div13: torch.Tensor | None,
              input_scale_div2: torch.Tensor | None,
              out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    num_experts, hidden, intermediate = moe_sizes(w13, w2)
    check_input_scales(num_experts, input_scale_div13, input_scale_div2)
    check_shapes(num_experts, hidden, intermediate)
    padded_h, padded_i = padded_sizes(hidden, intermediate)
    rows_h = gemm2_rows(hidden)
    rows2 = shuffle_rows(rows_h)
    weights13, rows13 = _gemm1_source(w13.packed, intermediate, padded_i, padded_h // 2)
    scales13, scale_rows13 = _gemm1_source(w13.block_scale, intermediate, padded_i, padded_h // BLOCK)
    meta = describe(w13, w2, input_scale_div13, input_scale_div2)
    return {
        "gemm1_weights": _gather_rows(weights13, rows13, destination(out, "gemm1_weights")),
        "gemm1_weights_scale": swizzle_128x4(scales13, scale_rows13, destination(out, "gemm1_weights_scale"))
        .view(torch.float8_e4m3fn),
        "gemm2_weights": _gather_rows(_padded(w2.packed, rows_h, padded_i // 2), rows2,
                                      destination(out, "gemm2_weights")),
        "gemm2_weights_scale": swizzle_128x4(_padded(w2.block_scale, rows_h, padded_i // BLOCK), rows2,
                                             destination(out, "gemm2_weights_scale")).view(torch.float8_e4m3fn),
        **{name: placed(out, name, value) for name, value in _scalars(meta).items()},
    }


def _gather_rows(source: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return source.index_select(1, rows)
    return torch.index_select(source, 1, rows, out=out.view(torch.uint8))


def _crop(name: str, padded: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    require_zero(name, padded[:, rows:])
    require_zero(name, padded[:, :rows, cols:])
    return padded[:, :rows, :cols]


def undo(tensors: dict[str, torch.Tensor], meta: LayoutMeta) -> tuple[NVFP4Tensor, NVFP4Tensor, torch.Tensor | None,
                                                                       torch.Tensor | None]:
    num_experts, hidden, intermediate = meta.num_experts, meta.hidden_size, meta.intermediate_size
    padded_h, padded_i = padded_sizes(hidden, intermediate)
    rows_h = gemm2_rows(hidden)
    expected = {
        "gemm1_weights": (torch.uint8, (num_experts, 2 * padded_i, padded_h // 2)),
        "gemm1_weights_scale": (torch.float8_e4m3fn, (num_experts, 2 * padded_i, padded_h // BLOCK)),
        "gemm2_weights": (torch.uint8, (num_experts, rows_h, padded_i // 2)),
        "gemm2_weights_scale": (torch.float8_e4m3fn, (num_experts, rows_h, padded_i // BLOCK)),
    }
    for name, (dtype, shape) in expected.items():
        require_shape(name, tensors, dtype, shape)
    for name, value in _scalars(meta).items():
        require_equal(name, tensors[name], value)

    back13 = torch.argsort(w13_rows(2 * padded_i))
    back2 = torch.argsort(shuffle_rows(rows_h))

    def gate_up(name: str, shuffled: torch.Tensor, cols: int) -> torch.Tensor:
        up_gate = shuffled.view(torch.uint8)[:, back13]
        up = _crop(name, up_gate[:, :padded_i], intermediate, cols)
        gate = _crop(name, up_gate[:, padded_i:], intermediate, cols)
        return torch.cat([gate, up], dim=1)

    scales13 = unswizzle_128x4(tensors["gemm1_weights_scale"], 2 * padded_i, padded_h // BLOCK)
    scales2 = unswizzle_128x4(tensors["gemm2_weights_scale"], rows_h, padded_i // BLOCK)
    w13 = canonical(gate_up("gemm1_weights", tensors["gemm1_weights"], hidden // 2),
                    gate_up("gemm1_weights_scale", scales13, hidden // BLOCK).view(torch.float8_e4m3fn),
                    meta.w13_global_scale_div)
    w2 = canonical(_crop("gemm2_weights", tensors["gemm2_weights"][:, back2], hidden, intermediate // 2),
                   _crop("gemm2_weights_scale", scales2.view(torch.uint8)[:, back2], hidden, intermediate // BLOCK)
                   .view(torch.float8_e4m3fn), meta.w2_global_scale_div)
    return w13, w2, meta.input_scale_div13, meta.input_scale_div2


def _routing_bias(root: str | os.PathLike, experts: str) -> torch.Tensor | None:
    """The router's selection bias (GLM's `<moe>.gate.e_score_correction_bias`, MiniMax's beside the gate), which the
    TRT-LLM-gen router takes."""
    from fp4kit.families import detect
    from fp4kit.io.checkpoint import CheckpointReader, read_config

    name = detect(read_config(root)).grammar.router_bias_name(experts)
    with CheckpointReader(root) as reader:
        return reader.read(name) if name in reader else None


def _routing(root: str | os.PathLike) -> dict[str, object]:
    from fp4kit.families import detect
    from fp4kit.io.checkpoint import read_config

    config = read_config(root)
    try:
        family = detect(config)
        spec = family.routing(family.text_config(config))
    except (Fp4kitError, KeyError, TypeError, ValueError):
        return {}
    grouped = spec.kind == "sigmoid_grouped_topk"
    method = ROUTING_METHOD.get((spec.kind, spec.renormalize))
    if method is None:
        raise Fp4kitError(f"TRT-LLM-gen routing has no method for {spec.kind} with renormalize={spec.renormalize}")
    return {"top_k": spec.top_k, "n_group": spec.n_group if grouped else None,
            "topk_group": spec.topk_group if grouped else None,
            "routed_scaling_factor": spec.routed_scaling_factor if grouped else None, "routing_method_type": method}


def kernel_arguments(tensors: dict[str, torch.Tensor], meta: LayoutMeta, document: dict, entry: dict,
                     root: str | os.PathLike, device: str | torch.device) -> dict[str, object]:
    """``trtllm_fp4_block_scale_moe``'s layer arguments (fp4kit/layouts/runtime.py says which)."""
    bias = _routing_bias(root, entry["module"])
    return {
        **tensors,
        "routing_bias": None if bias is None else bias.to(device),
        "gemm1_bias": None, "gemm1_alpha": None, "gemm1_beta": None, "gemm1_clamp_limit": None, "gemm2_bias": None,
        "num_experts": meta.num_experts,
        **call_arguments(meta, ep_rank=0),
        **_routing(root),
    }

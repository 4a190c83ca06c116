"""Marlin layout for vLLM's ``fused_marlin_moe`` with NVFP4 weights (W4A16: dequantized in the kernel, sm75+).

Facts (checked in vLLM 0.33.0 ``marlin_utils_fp4.py`` (prepare_nvfp4_moe_layer_for_marlin,
nvfp4_marlin_process_scales, nvfp4_marlin_process_global_scale, _nvfp4_compute_scale_factor), ``marlin_utils.py``
(get_scale_perms, marlin_permute_scales), ``marlin_utils_test.py`` (marlin_permute_weights, marlin_weights,
get_weight_perm) and ``csrc/moe/marlin_moe_wna16/ops.cu``):

- Weights: the packed [N, K/2] bytes viewed as int32 and transposed are GPTQ's [K/8, N]; ``gptq_marlin_repack``
  turns them into [K/16, 2N] int32: 16x16 tiles laid out tile-row by tile-row, each 1024 codes permuted by a
  fixed permutation (``get_weight_perm(4)``, whose groups of 8 are interleaved [0, 2, 4, 6, 1, 3, 5, 7]), then
  packed 8 codes per int32, code i at bits 4i.
- Block scales: transposed to [K/16, N], permuted in groups of 64 (an 8x8 transpose), every 4 swapped
  [0, 2, 1, 3], times 2^7 and, for bf16, a power-of-two factor f shared by all experts of the projection that lifts
  the largest non-zero scale to <= 448 (f = 2^floor(log2(448 / max)), 1 when max = 448; fp16: f = 1), re-encoded
  as the high byte of (fp16 bits << 1): sign dropped, 5-bit exponent, 3-bit mantissa. Scaled values below 2 (their
  top exponent bit would be lost) are stored as 0: such a block dequantizes to zero. ``describe`` counts them
  (``w13_zeroed_scales`` / ``w2_zeroed_scales``), and ``undo`` gives them back as 0.
- Global scale: fp32 divisor D times 2^119 (bf16 activations) or 2^7 (fp16), divided by f; fp32 [E].
- The MoE kernel's thread tiles need n % 128 == 0 and k % 64 == 0 for every GEMM (vLLM
  ``check_moe_marlin_supports_layer``; ``ops.cu`` thread configs): H % 128 == 0 and I % 64 == 0.
"""

from __future__ import annotations

import math
import os

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.layouts import (
    LayoutMeta,
    alignment_problems,
    canonical,
    check_divisible,
    check_input_scales,
    destination,
    fp32,
    moe_sizes,
    placed,
    require_equal,
    require_shape,
)
from fp4kit.layouts import describe as _describe
from fp4kit.nvfp4 import BLOCK, NVFP4Tensor, pack_codes, unpack_codes

KERNEL = "vllm fused_marlin_moe / moe_wna16_marlin_gemm, float4_e2m1f weights (vLLM 0.33)"
BACKEND = "marlin"
W4A4 = False  # W4A16: the kernel dequantizes the weights and runs on the activations as they are
LIBRARY, FUNCTION = "vllm", "vllm.model_executor.layers.fused_moe.fused_marlin_moe.fused_marlin_moe"
TILE = 16
N_ALIGNMENT = 128
K_ALIGNMENT = 64
# exponent bias of the activation dtype minus FP4's (2^(e-1) - 2^1), minus the 2^7 folded into the scales
_GLOBAL_EXPONENT = {torch.bfloat16: 126 - 7, torch.float16: 14 - 7}
_ENCODING_LIMIT = 65536.0  # first scale * f * 2^7 that fp16 cannot hold
_LARGEST_SCALED = 448.0 * 2**7  # the largest FP8 scale times 2^7: what vLLM lifts the largest scale to
_SMALLEST_ENCODED = 2.0  # scaled values below this are stored as 0 (their S0E5M3 byte would lose its top bit)
_CHUNK_BYTES = 1 << 21  # experts repacked / encoded per step: the working set stays in cache
_FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)  # every FP8 byte


def check_shapes(num_experts: int, hidden: int, intermediate: int, ep: int = 1, **options: object) -> None:
    check_divisible("hidden size H", hidden, N_ALIGNMENT, "Marlin MoE needs n % 128 == 0 for the down GEMM")
    check_divisible("intermediate size I", intermediate, K_ALIGNMENT, "Marlin MoE needs k % 64 == 0 for the down GEMM")
    if ep < 1 or ep > num_experts:
        raise Fp4kitError(f"ep = {ep} must be between 1 and the number of experts {num_experts}.")


def scalar_type_id(exponent: int, mantissa: int, signed: bool, bias: int, finite_values_only: bool,
                   nan_repr: int) -> int:
    """vLLM's ``ScalarType.id``: the fields packed into one int64 (vllm/scalar_type.py), as its custom ops take."""
    fields = ((exponent, 8), (mantissa, 8), (int(signed), 1), (bias, 32), (int(finite_values_only), 1), (nan_repr, 8))
    value = offset = 0
    for member, width in fields:
        value |= (member & ((1 << width) - 1)) << offset
        offset += width
    return value


# scalar_types.float4_e2m1f = ScalarType.float_(2, 1, finite_values_only=True, NanRepr.NONE = 0)
FLOAT4_E2M1F_ID = scalar_type_id(2, 1, True, 0, True, 0)


def layout_options(act_dtype: torch.dtype, flavor: str) -> dict[str, object]:
    return {"act_dtype": act_dtype}


def shape_problems(hidden: int, intermediate: int) -> list[str]:
    return alignment_problems([("H", hidden, N_ALIGNMENT), ("I", intermediate, K_ALIGNMENT)])


def padded_sizes(hidden: int, intermediate: int) -> tuple[int, int]:
    return hidden, intermediate


def manifest_kernel(options: dict[str, object]) -> dict[str, object]:
    return {"library": LIBRARY, "function": FUNCTION, "description": KERNEL, "gate_up_input_divisor": "unused (W4A16)",
            "scalar_formulas": {"global_scale1": "fp32(D_w13) * 2^B / options.w13_scale_factor",
                                "global_scale2": "fp32(D_w2) * 2^B / options.w2_scale_factor"}}


def kernel_arguments(tensors: dict[str, torch.Tensor], meta: LayoutMeta, document: dict, entry: dict,
                     root: str | os.PathLike, device: str | torch.device) -> dict[str, object]:
    """vLLM ``fused_marlin_moe``'s layer arguments."""
    return {**tensors, "bias1": None, "bias2": None, "quant_type_id": FLOAT4_E2M1F_ID,
            "global_num_experts": meta.num_experts}


def weight_permutation() -> torch.Tensor:
    """The 1024-entry Marlin permutation: position -> source offset in a 16-row strip of 64 tiled codes."""
    thread = torch.arange(32).reshape(32, 1, 1, 1)
    column_block = torch.arange(4).reshape(1, 4, 1, 1)
    half = torch.arange(2).reshape(1, 1, 2, 1)
    row = 2 * (thread % 4) + torch.tensor([0, 1, 8, 9])  # [32, 1, 1, 4]
    source = 16 * row + thread // 4 + 8 * half + 256 * column_block
    return source.reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)


def scale_permutation() -> torch.Tensor:
    """Groups of 64 scales are read as an 8x8 transpose: position 8i + j holds source i + 8j."""
    return torch.arange(64).reshape(8, 8).T.reshape(-1)


_PAIR_SWAP = torch.tensor([0, 2, 1, 3])  # its own inverse


def repack_weights(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed [E, N, K/2] uint8 -> Marlin [E, K/16, 2N] int32 (N % 64 == 0, K % 16 == 0), into ``out`` if given
    (contiguous int32 [E, K/16, 2N], 8-byte aligned).

    Equal to tiling the codes and applying :func:`weight_permutation` (what :func:`unpack_weights` inverts), done
    on 8-byte lanes instead of unpacked codes. Write n = 64c + 32u + 16v + 8h + a (u, v: the 16-column tile in a
    64-column chunk; h: which half of the tile) and the lane of row n in strip s (8 bytes, codes k = 16s .. 16s+15)
    as bytes (j, b), byte 4j + b holding codes 16s + 8j + 2b (low nibble) and 16s + 8j + 2b + 1. Marlin's int32
    at [s, 128c + 16a + 4b + 2u + v] holds four bytes, low first: the low nibbles of bytes (0, b) and (1, b) of row
    h = 0, the same of row h = 1, then the high nibbles of h = 0 and of h = 1 (low nibble from byte (0, b)).
    So every 64 output bytes of one (s, c, a) are a fixed rearrangement of 8 input lanes: move nibbles and bytes
    within and between the lanes of rows v, h with masked shifts (delta swaps), after which the lanes of rows
    (v, h, u) hold the output bytes of (b // 2, b % 2, u); then gather them in that order (one copy).
    """
    experts, size_n, half_k = packed.shape
    strips, chunks = half_k // 8, size_n // 64
    packed = packed.contiguous() if packed.storage_offset() % 8 == 0 else packed.clone()  # int64 view alignment
    lanes_in = packed.view(torch.int64).view(experts, chunks, 2, 2, 2, 8, strips)  # e, c, u, v, h, a, s
    if out is None:
        out = torch.empty(experts, strips, 2 * size_n, dtype=torch.int32)
    lanes_out = out.view(torch.int64).view(experts, strips, chunks, 8, 2, 2, 2)  # e, s, c, a, v, h, u
    step = max(1, min(experts, _CHUNK_BYTES // max(1, size_n * half_k)))
    # the swaps run in the source's row order, where the lanes they pair are long contiguous runs
    scratch, shifted = (torch.empty(step, chunks, 2, 2, 2, 8, strips, dtype=torch.int64) for _ in range(2))
    shifted_half = torch.empty(step, chunks, 2, 2, 8, strips, dtype=torch.int64)
    for start in range(0, experts, step):
        count = min(step, experts - start)
        source, lanes, tmp, half = lanes_in[start:start + count], scratch[:count], shifted[:count], shifted_half[:count]
        # within each lane: the high nibble of byte (0, b) <-> the low nibble of byte (1, b)
        torch.bitwise_right_shift(source, 28, out=tmp).bitwise_xor_(source).bitwise_and_(0xF0F0F0F0)
        torch.bitwise_xor(source, tmp, out=lanes).bitwise_xor_(tmp.bitwise_left_shift_(28))
        # row bit v <-> byte bit 2, then v <-> byte bit 1, then h <-> byte bit 0
        _exchange(lanes[:, :, :, 0], lanes[:, :, :, 1], 32, 0x00000000FFFFFFFF, half)
        _exchange(lanes[:, :, :, 0], lanes[:, :, :, 1], 16, 0x0000FFFF0000FFFF, half)
        _exchange(lanes[:, :, :, :, 0], lanes[:, :, :, :, 1], 8, 0x00FF00FF00FF00FF, half)
        lanes_out[start:start + count].copy_(lanes.permute(0, 6, 1, 5, 3, 4, 2))
    return out


def _exchange(low: torch.Tensor, high: torch.Tensor, shift: int, mask: int, tmp: torch.Tensor) -> None:
    """Swap the bytes of ``low`` outside ``mask`` with the bytes of ``high`` inside it (``shift`` bits apart)."""
    torch.bitwise_right_shift(low, shift, out=tmp).bitwise_xor_(high).bitwise_and_(mask)
    high.bitwise_xor_(tmp)
    low.bitwise_xor_(tmp.bitwise_left_shift_(shift))


def unpack_weights(marlin: torch.Tensor, size_n: int, size_k: int) -> torch.Tensor:
    """Inverse of :func:`repack_weights`."""
    experts = marlin.shape[0]
    codes = unpack_codes(marlin.contiguous().view(torch.uint8)).reshape(experts, -1, 1024)
    tiled = codes[..., torch.argsort(weight_permutation())]
    tiled = tiled.reshape(experts, size_k // TILE, size_n // TILE, TILE, TILE).permute(0, 1, 3, 2, 4)
    return pack_codes(tiled.reshape(experts, size_k, size_n).transpose(1, 2).contiguous())


def scale_histogram(block_scale: torch.Tensor) -> torch.Tensor:
    """int64 [256]: how often each FP8 byte value occurs in ``block_scale`` (the rules below need only this)."""
    return torch.bincount(block_scale.view(torch.uint8).reshape(-1), minlength=256)


def _present(block_scale: torch.Tensor) -> torch.Tensor:
    return scale_histogram(block_scale) > 0


def factor_from_histogram(histogram: torch.Tensor, act_dtype: torch.dtype) -> float:
    """vLLM 0.33's ``_nvfp4_compute_scale_factor``: the power of two f that lifts the *largest* non-zero scale * 2^7
    to at most 448 * 2^7, f = 2^floor(log2(448 * 2^7 / max)) when max < 448 * 2^7, else 1; fp16 keeps f = 1."""
    values = _FP8_VALUES.to(torch.float64) * 2**7
    nonzero = values[(histogram > 0) & (values > 0)]
    if act_dtype == torch.float16 or nonzero.numel() == 0 or float(nonzero.max()) >= _LARGEST_SCALED:
        return 1.0
    return 2.0 ** math.floor(math.log2(_LARGEST_SCALED / float(nonzero.max())))


def zeroed_from_histogram(histogram: torch.Tensor, factor: float) -> int:
    """How many non-zero scales vLLM's ``nvfp4_marlin_process_scales`` sets to 0 (those with s * f * 2^7 < 2)."""
    values = _FP8_VALUES.to(torch.float64) * (factor * 2**7)
    return int(histogram[(values > 0) & (values < _SMALLEST_ENCODED)].sum())


def scale_factor(block_scale: torch.Tensor, act_dtype: torch.dtype) -> float:
    """The factor f of one projection (all experts together), as vLLM chooses it."""
    return factor_from_histogram(scale_histogram(block_scale), act_dtype)


def zeroed_scales(block_scale: torch.Tensor, factor: float) -> int:
    return zeroed_from_histogram(scale_histogram(block_scale), factor)


def encode_scales(block_scale: torch.Tensor, factor: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 [E, N, K/16] -> Marlin [E, K/16, N] S0E5M3 bytes (as float8_e4m3fn, the dtype the kernel checks), into
    ``out`` if given (contiguous, 8-byte aligned).

    The encoding depends on the byte alone, so it is a 256-entry table. The byte permutation: scales [n, g] to
    [g, n], each 64 n read as an 8x8 transpose, every 4 swapped [0, 2, 1, 3]; with n = 64q + 32j + 16m0 + 8m1 + i
    the destination order is (g, q, i, j, m1, m0). It is gathered in the order (g, q, i, j, m0, m1), where the 8
    bytes of one (g, q, i) are rows 8 apart, and m0 / m1 are then swapped inside each 8-byte lane. A few experts at
    a time, so the int32 gather indices stay in cache.
    """
    present, codes = _present(block_scale), torch.arange(256)
    if bool(present[(codes >= 0x80) | ((codes & 0x7F) == 0x7F)].any()):
        raise Fp4kitError("Marlin re-encodes block scales without a sign: negative, -0 or NaN FP8 scales cannot "
                          "be stored.")
    values = _FP8_VALUES.to(torch.float64) * (factor * 2**7)
    if bool((values[present] >= _ENCODING_LIMIT).any()):
        raise Fp4kitError(f"block scales span too wide a range for Marlin: scale * {factor:g} * 2^7 overflows fp16.")
    table = (values.to(torch.float16).view(torch.int16).to(torch.int32) >> 7).to(torch.uint8)
    table[values < _SMALLEST_ENCODED] = 0  # as vLLM: marlin_scales[marlin_scales < 2] = 0
    experts, size_n, groups = block_scale.shape
    source = block_scale.view(torch.uint8).reshape(experts, size_n // 64, 8, 8, groups)  # e, q, (j, m0, m1), i, g
    if out is None:
        out = torch.empty(experts, groups, size_n, dtype=torch.float8_e4m3fn)
    out_bytes = out.view(torch.uint8).view(experts, -1)
    step = max(1, min(experts, _CHUNK_BYTES // max(1, 4 * size_n * groups)))
    gathered = torch.empty(step, groups, size_n // 64, 8, 8, dtype=torch.int32)
    tmp = torch.empty(step * groups * size_n // 8, dtype=torch.int64)
    for start in range(0, experts, step):
        count = min(step, experts - start)
        indices = gathered[:count]
        indices.copy_(source[start:start + count].permute(0, 4, 1, 3, 2))
        chunk = out_bytes[start:start + count].view(-1)
        torch.index_select(table, 0, indices.view(-1), out=chunk)
        lanes, shifted = chunk.view(torch.int64), tmp[:chunk.numel() // 8]
        # bytes 1 <-> 2 and 5 <-> 6 of every lane: (j, m0, m1) -> (j, m1, m0)
        torch.bitwise_right_shift(lanes, 8, out=shifted).bitwise_xor_(lanes).bitwise_and_(0x0000FF000000FF00)
        lanes.bitwise_xor_(shifted).bitwise_xor_(shifted.bitwise_left_shift_(8))
    return out


def decode_scales(marlin_scales: torch.Tensor, factor: float) -> torch.Tensor:
    """Inverse of :func:`encode_scales`."""
    experts, groups, size_n = marlin_scales.shape
    fp16_bits = (marlin_scales.contiguous().view(torch.uint8).to(torch.int32) << 7).to(torch.int16)
    values = fp16_bits.view(torch.float16).to(torch.float64) / (factor * 2**7)
    values = values.reshape(experts, -1, 4)[..., _PAIR_SWAP].reshape(experts, -1, 64)
    values = values[..., torch.argsort(scale_permutation())].reshape(experts, groups, size_n).transpose(1, 2)
    return values.to(torch.float8_e4m3fn).contiguous()


def _global_scale(divisor: torch.Tensor, act_dtype: torch.dtype, factor: float) -> torch.Tensor:
    scale = fp32(divisor) * 2.0 ** _GLOBAL_EXPONENT[act_dtype] / factor
    if not bool(torch.isfinite(scale).all()):
        raise Fp4kitError("a weight global scale times 2^119 overflows fp32; Marlin cannot hold it.")
    return scale


def _act_dtype(name: object) -> torch.dtype:
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise Fp4kitError(f"Marlin NVFP4 runs with bfloat16 or float16 activations, not {name}.")
    return dtype


def describe(w13: NVFP4Tensor, w2: NVFP4Tensor, input_scale_div13: torch.Tensor | None,
             input_scale_div2: torch.Tensor | None, act_dtype: torch.dtype = torch.bfloat16) -> LayoutMeta:
    dtype = _act_dtype(act_dtype)
    histogram13, histogram2 = scale_histogram(w13.block_scale), scale_histogram(w2.block_scale)
    factor13, factor2 = factor_from_histogram(histogram13, dtype), factor_from_histogram(histogram2, dtype)
    return _describe(BACKEND, w13, w2, input_scale_div13, input_scale_div2, act_dtype=str(dtype).removeprefix("torch."),
                     w13_scale_factor=factor13, w2_scale_factor=factor2,
                     w13_zeroed_scales=zeroed_from_histogram(histogram13, factor13),
                     w2_zeroed_scales=zeroed_from_histogram(histogram2, factor2))


def transform(w13: NVFP4Tensor, w2: NVFP4Tensor, input_scale_div13: torch.Tensor | None,
              input_scale_div2: torch.Tensor | None, act_dtype: torch.dtype = torch.bfloat16,
              out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    num_experts, hidden, intermediate = moe_sizes(w13, w2)
    check_input_scales(num_experts, input_scale_div13, input_scale_div2)
    check_shapes(num_experts, hidden, intermediate)
    meta = describe(w13, w2, input_scale_div13, input_scale_div2, act_dtype)
    dtype, factor13, factor2 = _act_dtype(meta.options["act_dtype"]), meta.options["w13_scale_factor"], \
        meta.options["w2_scale_factor"]
    return {
        "w1": repack_weights(w13.packed, destination(out, "w1")),
        "w2": repack_weights(w2.packed, destination(out, "w2")),
        "w1_scale": encode_scales(w13.block_scale, float(factor13), destination(out, "w1_scale")),
        "w2_scale": encode_scales(w2.block_scale, float(factor2), destination(out, "w2_scale")),
        "global_scale1": placed(out, "global_scale1", _global_scale(w13.global_scale_div, dtype, float(factor13))),
        "global_scale2": placed(out, "global_scale2", _global_scale(w2.global_scale_div, dtype, float(factor2))),
    }


def undo(tensors: dict[str, torch.Tensor], meta: LayoutMeta) -> tuple[NVFP4Tensor, NVFP4Tensor, torch.Tensor | None,
                                                                       torch.Tensor | None]:
    num_experts, hidden, intermediate = meta.num_experts, meta.hidden_size, meta.intermediate_size
    dtype = _act_dtype(meta.options["act_dtype"])
    factor13, factor2 = float(meta.options["w13_scale_factor"]), float(meta.options["w2_scale_factor"])
    require_shape("w1", tensors, torch.int32, (num_experts, hidden // TILE, 2 * 2 * intermediate))
    require_shape("w2", tensors, torch.int32, (num_experts, intermediate // TILE, 2 * hidden))
    require_shape("w1_scale", tensors, torch.float8_e4m3fn, (num_experts, hidden // BLOCK, 2 * intermediate))
    require_shape("w2_scale", tensors, torch.float8_e4m3fn, (num_experts, intermediate // BLOCK, hidden))
    require_equal("global_scale1", tensors["global_scale1"], _global_scale(meta.w13_global_scale_div, dtype, factor13))
    require_equal("global_scale2", tensors["global_scale2"], _global_scale(meta.w2_global_scale_div, dtype, factor2))
    w13 = canonical(unpack_weights(tensors["w1"], 2 * intermediate, hidden),
                    decode_scales(tensors["w1_scale"], factor13), meta.w13_global_scale_div)
    w2 = canonical(unpack_weights(tensors["w2"], hidden, intermediate), decode_scales(tensors["w2_scale"], factor2),
                   meta.w2_global_scale_div)
    return w13, w2, meta.input_scale_div13, meta.input_scale_div2

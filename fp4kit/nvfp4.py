"""The canonical NVFP4 tensor and its math (README.md; compressed-tensors' NVFP4 quantization is the reference).

One form everywhere inside fp4kit: E2M1 codes packed two per byte along K (low nibble first), FP8 E4M3 block
scales over 16 consecutive K elements, and one per-tensor global scale kept in *divisor* form D = amax / (448*6)
as a float64 scalar. float64 matters: the compressed-tensors multiplier G and the ModelOpt divisor D are both fp32,
and 1/(1/G) in fp32 is not G for ~20% of bf16-valued G; holding D = 1/G in float64 lets either dialect be written
back byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4kit.native import nvfp4_cpu

BLOCK = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
GLOBAL_NUMERATOR = FP8_MAX * FP4_MAX  # 2688
# compressed-tensors replaces an all-zero block's scale by this (its fp8 "eps"); we do the same.
ZERO_BLOCK_SCALE = 0.125

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _rne_boundaries() -> torch.Tensor:
    # code(|x|) = number of boundaries strictly below |x|. Midpoints that round *up* to the even code
    # (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0) are shifted one ulp down so that "strictly below" includes them.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
    down = torch.nextafter(mids, torch.zeros_like(mids))
    round_up = torch.tensor([False, True, False, True, False, True, False])
    return torch.where(round_up, down, mids)


_BOUNDARIES = _rne_boundaries()
_BOUNDARY_VALUES = tuple(_BOUNDARIES.tolist())
_E2M1_TABLE = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES), dtype=torch.float32)


def fp32_multiplier(divisor: torch.Tensor) -> torch.Tensor:
    """The multiplier G = 1/D of float64 divisor(s) D, rounded once to fp32: compressed-tensors' stored form, and
    what kernels multiply by."""
    return (1.0 / divisor.double()).float()


def divisor_of(multiplier: torch.Tensor) -> torch.Tensor:
    """The canonical float64 divisor D = 1/G of multiplier(s) G."""
    return 1.0 / multiplier.double()


@dataclass
class NVFP4Tensor:
    """A quantized weight [..., N, K]: packed codes, FP8 block scales, float64 divisor global scale."""

    packed: torch.Tensor  # uint8 [..., N, K/2]
    block_scale: torch.Tensor  # float8_e4m3fn [..., N, K/16]
    global_scale_div: torch.Tensor  # float64, 0-d, or [B] for a stack [B, N, K] of separately scaled tensors

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def global_scale_mul_fp32(self) -> torch.Tensor:
        """The compressed-tensors multiplier G = 1/D, rounded once to fp32."""
        return fp32_multiplier(self.global_scale_div)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = unpack_e2m1(self.packed)
        global_mul = _per_leading_index(self.global_scale_mul_fp32.to(self.packed.device), self.block_scale.dim())
        scale = self.block_scale.to(torch.float32) / global_mul
        values = values.unflatten(-1, (-1, BLOCK)) * scale.unsqueeze(-1)
        return values.flatten(-2).to(dtype)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by their scale) to E2M1 codes: RNE, saturating at +-6, sign in bit 3.

    Negative values that round to zero keep their sign (code 8); -0.0 itself becomes +0, as in compressed-tensors.
    The magnitude code is the number of rounding boundaries strictly below |x|: seven compares into a uint8
    accumulator, about 3x faster on CPU than torch.bucketize.
    """
    negative = torch.lt(x, 0).view(torch.uint8)
    magnitude = x.abs()
    codes = torch.zeros_like(magnitude, dtype=torch.uint8)
    for boundary in _BOUNDARY_VALUES:
        codes.add_(torch.gt(magnitude, boundary).view(torch.uint8))
    return codes.bitwise_or_(negative.bitwise_left_shift_(3))


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> bytes [..., K/2]; element 2j in the low nibble."""
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (sign in bit 3)."""
    return _E2M1_TABLE.to(codes.device)[codes.long()]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    return e2m1_values(unpack_codes(packed))


def global_scale_mul(amax: torch.Tensor, exact_fp32: bool = False) -> torch.Tensor:
    """The multiplier G = 448*6 / amax as llm-compressor computes it: in amax's dtype (bf16 for bf16 weights),
    then widened to fp32. ``exact_fp32`` computes it in fp32 instead. Where the quotient overflows (an all-zero
    tensor, or amax below ~1e-35) G is 1, as compressed-tensors does. Elementwise: a [B] amax gives B multipliers."""
    if exact_fp32:
        amax = amax.to(torch.float32)
    amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    return torch.nan_to_num(GLOBAL_NUMERATOR / amax, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)


def divisor_from_amax(amax: float) -> float:
    """The per-tensor divisor D = amax / (448*6) of a tensor whose largest magnitude is ``amax`` (an activation's, in
    float64: calibrated input scales); 1 (multiplier 1, compressed-tensors' own fallback) where amax is not
    positive."""
    return amax / GLOBAL_NUMERATOR if amax > 0 else 1.0


def amax_of_divisor(divisor: float) -> float:
    """The largest magnitude a per-tensor divisor D covers without clipping: 448*6 * D."""
    return divisor * GLOBAL_NUMERATOR


def _per_leading_index(global_scale: torch.Tensor, ndim: int) -> torch.Tensor:
    """A 0-d or [B] global scale shaped to broadcast against an ``ndim``-d tensor (0-d becomes [1, ..., 1]: a
    0-d fp32 tensor would not promote a bf16 operand to fp32)."""
    return global_scale.reshape(*global_scale.shape, *[1] * (ndim - global_scale.dim()))


class NonFiniteError(ValueError):
    """A weight to be quantized holds NaN or Inf."""


def block_amax(weight: torch.Tensor, native: bool = False) -> torch.Tensor:
    """max |x| over each 16-block along K, in the weight's dtype; raises NonFiniteError on NaN/Inf.
    ``native``: through fp4kit's C loop where it handles the weight (bf16 or fp32 on the CPU), same values."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"last dimension {weight.shape[-1]} is not a multiple of {BLOCK}")
    if native and nvfp4_cpu.handles(weight):
        return _native_block_amax(weight)[0]
    amax = weight.unflatten(-1, (-1, BLOCK)).abs().amax(dim=-1)
    if not torch.isfinite(amax).all():  # amax propagates NaN and Inf: one check on 1/16 of the data
        raise NonFiniteError("weight holds NaN or Inf")
    return amax


def _native_block_amax(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax, tensor_amax, nonfinite = nvfp4_cpu.block_amax(weight)
    if nonfinite:
        raise NonFiniteError("weight holds NaN or Inf")
    return amax, tensor_amax


def encode_blocks(blocks: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes of blocks [..., K/16, 16] divided by their per-block divisor [..., K/16] (fp32 math)."""
    scaled = blocks.to(torch.float32) / divisor.unsqueeze(-1)
    return pack_codes(e2m1_codes(scaled.flatten(-2)))


def quantize(
    weight: torch.Tensor,
    global_mul: torch.Tensor,
    amax_per_block: torch.Tensor | None = None,
    native: bool = False,
) -> NVFP4Tensor:
    """Quantize [..., N, K] (K % 16 == 0) with a given fp32 multiplier global scale G: one (0-d), or one per
    leading index ([B]) of a stack [B, N, K].

    Math as compressed-tensors: s = fp8(G * (amax_blk / 6)) with amax_blk / 6 in the weight's dtype,
    q = rne(x / (fp32(s) / G)) in fp32. All-zero blocks get s = 0.125. ``native``: bf16 and fp32 weights on the CPU
    go through fp4kit's C loop (fp4kit.native.nvfp4_cpu), which computes the same bytes.
    """
    if amax_per_block is None:
        amax_per_block = block_amax(weight, native)
    global_shape = global_mul.shape
    if native and nvfp4_cpu.handles(weight) and amax_per_block.dtype == weight.dtype:
        return _quantize_native(weight, global_mul.to(torch.float32).cpu(), amax_per_block.contiguous())
    global_mul = _per_leading_index(global_mul.to(device=weight.device, dtype=torch.float32), amax_per_block.dim())
    return _encode_with_scales(weight, global_mul, rtn_block_scale(amax_per_block, global_mul), global_shape)


def rtn_block_scale(amax_per_block: torch.Tensor, global_mul: torch.Tensor) -> torch.Tensor:
    """fp32 values of the round-to-nearest FP8 block scales fp8(G * (amax_blk / 6)), amax_blk / 6 in amax's dtype;
    0.125 for all-zero blocks. ``global_mul`` fp32, broadcastable against the amax."""
    scale = torch.clamp(global_mul * (amax_per_block / FP4_MAX), -FP8_MAX, FP8_MAX)
    block_scale_f32 = scale.to(torch.float8_e4m3fn).to(torch.float32)
    return torch.where(block_scale_f32 == 0, ZERO_BLOCK_SCALE, block_scale_f32)


def _encode_with_scales(weight: torch.Tensor, global_mul: torch.Tensor, block_scale_f32: torch.Tensor,
                        global_shape: torch.Size) -> NVFP4Tensor:
    divisor = block_scale_f32 / global_mul
    packed = encode_blocks(weight.unflatten(-1, (-1, BLOCK)), divisor)
    return NVFP4Tensor(packed, block_scale_f32.to(torch.float8_e4m3fn),
                       divisor_of(global_mul.cpu()).reshape(global_shape))


def _quantize_native(weight: torch.Tensor, global_mul: torch.Tensor, amax: torch.Tensor) -> NVFP4Tensor:
    """quantize() through the C loop: one call per global scale (a 0-d G, or one per entry of a stack)."""
    if global_mul.dim() == 0:
        packed, block_scale = nvfp4_cpu.encode(weight, amax, float(global_mul))
    else:
        parts = [nvfp4_cpu.encode(w, a, float(g)) for w, a, g in zip(weight, amax, global_mul, strict=True)]
        packed, block_scale = torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])
    return NVFP4Tensor(packed, block_scale, divisor_of(global_mul))


def quantize_group(
    weights: list[torch.Tensor | nvfp4_cpu.Fp8BlockWeight], exact_fp32: bool = False, native: bool = False
) -> list[NVFP4Tensor]:
    """Quantize tensors that a kernel fuses (gate+up, q+k+v) with one shared global scale. A member may be an
    FP8-block weight as stored (nvfp4_cpu.Fp8BlockWeight): quantized as its fp32 values."""
    if native and all(nvfp4_cpu.handles(w) for w in weights):
        # the C loop returns each member's amax with its block amaxes: no torch reduction between the two passes
        amaxes, tensor_amaxes = zip(*(_native_block_amax(w) for w in weights), strict=True)
        global_mul = global_scale_mul(max(tensor_amaxes, key=float), exact_fp32)
        return [_quantize_native(w, global_mul, a) for w, a in zip(weights, amaxes, strict=True)]
    weights = [nvfp4_cpu.as_tensor(w) for w in weights]
    amaxes = [block_amax(w) for w in weights]
    global_mul = global_scale_mul(torch.stack([a.amax() for a in amaxes]).amax(), exact_fp32)
    return [quantize(w, global_mul, a) for w, a in zip(weights, amaxes, strict=True)]


def quantize_stacked(
    stack: torch.Tensor, exact_fp32: bool = False, native: bool = False
) -> NVFP4Tensor:
    """Quantize a stack [B, N, K] of independent groups (each group's members concatenated along N) in one pass:
    entry b gets the global scale of stack[b] alone, and the same bytes as ``quantize_group`` on its members."""
    amax = block_amax(stack, native)
    global_mul = global_scale_mul(amax.flatten(1).amax(dim=1), exact_fp32)
    return quantize(stack, global_mul, amax, native)


# --- activations (W4A4): quantized per 16-block at run time with a static global scale ---

def block_scale_input(amax_per_block: torch.Tensor, global_mul: torch.Tensor) -> torch.Tensor:
    """amax_blk / 6 · G_a in fp32, the value rounded to the FP8 block scale. The divisor is a tensor on amax's device:
    CUDA torch turns a division by a Python number into a multiplication by its reciprocal, which is not amax / 6
    in the last bit, and activations often sit exactly on an FP8 rounding tie (the kernel divides exactly)."""
    return amax_per_block / torch.tensor(FP4_MAX, device=amax_per_block.device) * global_mul


def fake_quantize_activation(x: torch.Tensor, global_div: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize fp32 activations [..., K] per 16-block with a static divisor global scale D_a (0-d), the
    way the W4A4 kernels quantize a GEMM's input at run time: block scale s = fp8(amax_blk / 6 · G_a) with the
    static multiplier G_a = fp32(1 / D_a), codes = rne_e2m1(x / (s / G_a)), an all-zero block gives zeros."""
    global_mul = fp32_multiplier(global_div).to(x.device)
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    amax_per_block = blocks.abs().amax(dim=-1, keepdim=True)
    block_scale = torch.clamp(block_scale_input(amax_per_block, global_mul), max=FP8_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn).float()
    divisor = block_scale / global_mul
    safe_divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    values = e2m1_values(e2m1_codes(blocks / safe_divisor))
    dequantized = torch.where(divisor > 0, values * block_scale / global_mul, torch.zeros_like(values))
    return dequantized.flatten(-2)


# --- MXFP4 -> NVFP4 without rounding -------------------------------------------------------------------------

MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# the powers of two FP8 E4M3 holds exactly: 2^-9 (its smallest subnormal) .. 2^8 (256; 448 is not a power of two)
E4M3_POW2_MIN, E4M3_POW2_MAX = -9, 8
# the global multiplier 2^m must be a normal fp32 value, and so must its divisor 2^-m (ModelOpt stores that)
GLOBAL_POW2_MIN, GLOBAL_POW2_MAX = -126, 126
_MAGNITUDE_BITS = 0x7777777777777777  # of the 16 E2M1 codes in 8 bytes (the sign bits left out: -0 is zero)


@dataclass
class Mxfp4Weight:
    """An MXFP4 weight as stored: E2M1 codes packed two per byte along K, element 2j in the low nibble (the byte
    layout of NVFP4Tensor.packed) [N, K/2], and one E8M0 exponent byte per 32 inputs [N, ceil(K/32)]: the block's
    values are its codes times 2^(byte - 127)."""

    packed: torch.Tensor
    exponents: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    def dequantize(self) -> torch.Tensor:
        """The exact fp32 values (NaN where the exponent byte is 255)."""
        scale = torch.ldexp(torch.ones_like(self.exponents, dtype=torch.float32),
                            self.exponents.to(torch.int32) - E8M0_BIAS)
        scale = torch.where(self.exponents == E8M0_NAN, torch.nan, scale)
        values = unpack_e2m1(self.packed)
        return values.mul_(scale.repeat_interleave(MX_BLOCK, dim=-1)[..., : values.shape[-1]])


@dataclass
class CastResult:
    tensors: list[NVFP4Tensor]
    exact_blocks: int  # NVFP4 16-blocks holding the source's codes, with the source's values
    requantized_blocks: int  # 16-blocks whose scale the E4M3 range left by the global scale cannot hold


def _check_mxfp4(weight: Mxfp4Weight) -> None:
    if weight.packed.dim() != 2 or weight.packed.shape[1] % (BLOCK // 2):
        raise ValueError(f"MXFP4 code bytes {list(weight.packed.shape)}: [N, K/2] with K a multiple of {BLOCK}")
    rows, cols = weight.shape
    if tuple(weight.exponents.shape) != (rows, -(-cols // MX_BLOCK)):
        raise ValueError(f"MXFP4 exponents {list(weight.exponents.shape)} for a weight {[rows, cols]}: one per "
                         f"{MX_BLOCK} inputs")


def _mx_block_exponents(weight: Mxfp4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(the exponent k of each MXFP4 32-block [N, ceil(K/32)] as int32, whether the block holds a nonzero code)."""
    if bool((weight.exponents == E8M0_NAN).any()):
        raise NonFiniteError("MXFP4 exponent 255 (NaN)")
    k = weight.exponents.to(torch.int32) - E8M0_BIAS
    if weight.packed.numel() == 0:
        return k, torch.zeros(k.shape, dtype=torch.bool)
    words = weight.packed.contiguous().view(torch.int64)  # a 16-block is 8 bytes: one int64
    if words.shape[-1] % 2:  # a last 32-block of 16 inputs
        words = torch.nn.functional.pad(words, (0, 1))
    pairs = words.view(words.shape[0], -1, 2)
    return k, ((pairs[..., 0] | pairs[..., 1]) & _MAGNITUDE_BITS).ne(0)


def _block16_nonzero(weight: Mxfp4Weight) -> torch.Tensor:
    """Whether each 16-block [N, K/16] holds a nonzero code (its nibbles' magnitude bits under one mask)."""
    return (weight.packed.contiguous().view(torch.int64) & _MAGNITUDE_BITS).ne(0)


def _global_exponent(top: int | None) -> int:
    """The m of the global multiplier 2^m when the largest nonzero block's exponent is k = ``top`` (None: no nonzero
    block): that block gets the scale 2^8, so no block is above E4M3's range (that one would saturate at 448 and
    clip), and every block within 17 binades of it is exact; smaller ones are re-quantized as RTN would."""
    if top is None:
        return 0
    return max(GLOBAL_POW2_MIN, min(GLOBAL_POW2_MAX, E4M3_POW2_MAX - top))


def mxfp4_global_exponent(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The m of the global multiplier 2^m for blocks of exponents k (``parts``: each member's k and which of its
    blocks are nonzero; ``_global_exponent``)."""
    lowest = torch.iinfo(torch.int32).min
    tops = [int(torch.where(nonzero, k, lowest).max()) for k, nonzero in parts if k.numel()]
    top = max(tops, default=lowest)
    return _global_exponent(None if top == lowest else top)


def _e4m3_pow2_bytes(j: torch.Tensor) -> torch.Tensor:
    """The E4M3 bytes of 2^j for int32 j in [-9, 8]: exponent field j + 7 for normals (j >= -6), the mantissa bit
    j + 9 of a subnormal below."""
    return torch.where(j >= -6, (j + 7) << 3, 1 << (j + 9).clamp(min=0)).to(torch.uint8)


def _per_16(per_32: torch.Tensor, blocks: int) -> torch.Tensor:
    """[N, G] per 32-block -> [N, blocks] per 16-block (each value twice; a last half block once)."""
    rows = per_32.shape[0]
    pairs = per_32.unsqueeze(-1).expand(rows, per_32.shape[1], MX_BLOCK // BLOCK)
    return pairs.reshape(rows, per_32.shape[1] * (MX_BLOCK // BLOCK))[:, :blocks]


def _requantize(weight: Mxfp4Weight, scale: torch.Tensor, redo: torch.Tensor, global_mul: torch.Tensor,
                divisor: torch.Tensor) -> NVFP4Tensor:
    """The cast weight with its 16-blocks ``redo`` re-quantized by RTN from their exact values; ``scale``: the cast's
    E4M3 block-scale bytes [N, K/16]."""
    count = int(redo.sum())
    packed = weight.packed.clone()
    values = weight.dequantize().unflatten(-1, (-1, BLOCK))[redo]  # [count, 16], exact
    redo_scale = rtn_block_scale(values.abs().amax(-1), global_mul)
    packed.unflatten(-1, (-1, BLOCK // 2))[redo] = encode_blocks(values, redo_scale / global_mul).view(count, -1)
    scale = scale.clone()
    scale[redo] = redo_scale.to(torch.float8_e4m3fn).view(torch.uint8)
    return NVFP4Tensor(packed, scale.view(torch.float8_e4m3fn), divisor)


def _cast_one(weight: Mxfp4Weight, k: torch.Tensor, nonzero: torch.Tensor, m: int,
              global_mul: torch.Tensor) -> tuple[NVFP4Tensor, int]:
    """One member of cast_mxfp4_group with torch ops: its NVFP4 tensor and how many 16-blocks were re-quantized."""
    blocks = weight.shape[-1] // BLOCK
    divisor = torch.tensor(2.0**-m, dtype=torch.float64)
    j = k + m
    outside = (j < E4M3_POW2_MIN) | (j > E4M3_POW2_MAX)  # above only where m was clamped
    scale = _per_16(_e4m3_pow2_bytes(j.clamp(E4M3_POW2_MIN, E4M3_POW2_MAX)), blocks)
    if not bool((nonzero & outside).any()):  # every block exact: the codes as stored, powers of two as scales
        return NVFP4Tensor(weight.packed, scale.view(torch.float8_e4m3fn), divisor), 0
    redo = _block16_nonzero(weight) & _per_16(outside, blocks)
    return _requantize(weight, scale, redo, global_mul, divisor), int(redo.sum())


def _cast_native(weights: list[Mxfp4Weight]) -> list[tuple[NVFP4Tensor, int]]:
    """cast_mxfp4_group's tensors through fp4kit's C loop: the same bytes, the codes read only where their being
    zero decides something (the blocks at the largest exponents, and blocks below E4M3's range)."""
    tops = [nvfp4_cpu.mxfp4_top(w.packed, w.exponents) for w in weights]
    if -2 in tops:
        raise NonFiniteError("MXFP4 exponent 255 (NaN)")
    m = _global_exponent(max(tops) - E8M0_BIAS if max(tops, default=-1) >= 0 else None)
    global_mul = torch.tensor(2.0**m, dtype=torch.float32)
    divisor = torch.tensor(2.0**-m, dtype=torch.float64)
    out = []
    for weight in weights:
        scale, redo, count = nvfp4_cpu.mxfp4_cast_scales(weight.packed, weight.exponents, m)
        if count:
            out.append((_requantize(weight, scale, redo, global_mul, divisor), count))
        else:  # the codes as stored, powers of two as scales
            out.append((NVFP4Tensor(weight.packed, scale.view(torch.float8_e4m3fn), divisor), 0))
    return out


def cast_mxfp4_group(weights: list[Mxfp4Weight], native: bool = False) -> CastResult:
    """NVFP4 of MXFP4 tensors a kernel fuses, under one power-of-two global scale 2^-m (multiplier 2^m): each 32-block
    of codes x 2^k becomes two 16-blocks with the same code bytes and block scale 2^(k + m), which dequantize to
    exactly the source's values wherever 2^(k + m) is an E4M3 power of two (2^-9 .. 2^8; the largest block at 2^8).
    Any other 16-block holding a nonzero code is re-quantized (RTN under the same global scale) from its exact
    values, and counted; an all-zero block keeps its codes under the nearest such scale. No arithmetic touches the
    codes: they are the source's bytes. ``native``: through fp4kit's C loop where it reads the weights (on the CPU),
    the same bytes."""
    for weight in weights:
        _check_mxfp4(weight)
    if native and weights and all(nvfp4_cpu.handles_mxfp4(w.packed, w.exponents) for w in weights):
        results = _cast_native(weights)
    else:
        parts = [_mx_block_exponents(w) for w in weights]
        m = mxfp4_global_exponent(parts)
        global_mul = torch.tensor(2.0**m, dtype=torch.float32)
        results = [_cast_one(w, k, nonzero, m, global_mul) for w, (k, nonzero) in zip(weights, parts, strict=True)]
    tensors = [tensor for tensor, _ in results]
    requantized = sum(count for _, count in results)
    exact = sum(tensor.block_scale.numel() for tensor in tensors) - requantized
    return CastResult(tensors, exact, requantized)

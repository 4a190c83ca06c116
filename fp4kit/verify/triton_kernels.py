"""Triton kernels of fp4kit's fused NVFP4 MoE (imported lazily by `fp4kit.verify.triton_moe`, which documents them).

Packed FP4 and FP8 block scales arrive as raw uint8 and are decoded with integer arithmetic, so the same code runs
compiled on a GPU and under TRITON_INTERPRET=1 on a CPU. A packed byte holds elements 2j (low nibble) and 2j+1
(high nibble) of one 16-block, so each GEMM runs as two dots over K/2: even activations x low nibbles, odd x high.
The interpreter (triton 3.6) truncates fp32 -> bf16 and mis-computes bf16 dots, so with EMULATE_BF16 the MMA
operands are rounded to bf16 precision by bit arithmetic (ties to even) and multiplied as fp32: the same products.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1_value(code):
    """E2M1 codes (int32, sign in bit 3) -> fp32: 2·|v| = m for exponent 0, else (2 + m) << (exponent - 1)."""
    magnitude = code & 7
    exponent = magnitude >> 1
    mantissa = magnitude & 1
    twice = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
    value = twice.to(tl.float32) * 0.5
    return tl.where((code & 8) != 0, -value, value)


# Decode 4 packed bytes (one register, $4) into the 4 low-nibble and 4 high-nibble values times their block scales
# ($5, $6: bf16x2 scales of bytes 0,1 and 2,3), as bf16x2 pairs: low $0,$1 and high $2,$3. Each nibble's sign goes to
# bit 15 and its 3 magnitude bits to bits 6-8 of a bf16, which then holds value · 2^-126 exactly (0.5 lands on a
# subnormal, which bf16x2 arithmetic keeps); one multiply by 2^126 and one by the scale finish it, both exact.
_DEQUANT_PTX = tl.constexpr("""
{
.reg .b32 t<2>, a, b, k;
mov.b32 k, 0x7E807E80;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shl.b32 a, t0, 6;
shl.b32 b, t0, 12;
and.b32 b, b, 0x80008000;
lop3.b32 $0, a, 0x01C001C0, b, 0xEA;
mul.rn.bf16x2 $0, $0, k;
mul.rn.bf16x2 $0, $0, $5;
shl.b32 a, t1, 6;
shl.b32 b, t1, 12;
and.b32 b, b, 0x80008000;
lop3.b32 $1, a, 0x01C001C0, b, 0xEA;
mul.rn.bf16x2 $1, $1, k;
mul.rn.bf16x2 $1, $1, $6;
shl.b32 a, t0, 2;
shl.b32 b, t0, 8;
and.b32 b, b, 0x80008000;
lop3.b32 $2, a, 0x01C001C0, b, 0xEA;
mul.rn.bf16x2 $2, $2, k;
mul.rn.bf16x2 $2, $2, $5;
shl.b32 a, t1, 2;
shl.b32 b, t1, 8;
and.b32 b, b, 0x80008000;
lop3.b32 $3, a, 0x01C001C0, b, 0xEA;
mul.rn.bf16x2 $3, $3, k;
mul.rn.bf16x2 $3, $3, $6;
}
""")


# `_DEQUANT_PTX` for weights in the pre-shuffled layout (`triton_moe.shuffle_packed`): each aligned 4-byte word of a
# row holds the 8 codes of elements 8w..8w+7 with their bits placed so that output register r is one or a few shifts
# of the word under the mask 0x81C081C0 (sign at bit 15, magnitude at bits 6-8 of each bf16 half):
# $0 = (e0, e2) = q & M, $1 = (e4, e6) = (q << 3) & M, $2 = (e1, e3) = (q << 6) & M, and $3 = (e5, e7) gathered by
# three shifts. 11 bit operations per word instead of 18; the two multiplies per register are unchanged.
_SHUFFLED_BITS_PTX = """
and.b32 $0, $4, 0x81C081C0;
shl.b32 a, $4, 3;
and.b32 $1, a, 0x81C081C0;
shl.b32 a, $4, 6;
and.b32 $2, a, 0x81C081C0;
shr.b32 a, $4, 3;
shr.b32 b, $4, 7;
shl.b32 c, $4, 1;
and.b32 a, a, 0x01800180;
lop3.b32 a, b, 0x00400040, a, 0xEA;
lop3.b32 $3, c, 0x80008000, a, 0xEA;
"""
_DEQUANT_SHUFFLED_PTX = tl.constexpr(
    "{\n.reg .b32 a, b, c, k;\nmov.b32 k, 0x7E807E80;"
    + _SHUFFLED_BITS_PTX
    + "".join(f"mul.rn.bf16x2 ${r}, ${r}, k;\nmul.rn.bf16x2 ${r}, ${r}, ${5 + r % 2};\n" for r in range(4))
    + "}"
)
# The same with the 2^126 multiply folded into the block scale: $5, $6 hold s · 2^119 (exact in bf16, s <= 448 =
# 1.75 · 2^8), so the weights come out as e2m1 · s · 2^-7 (>= 2^-17, exact) and the epilogue multiplies alpha by 2^7.
# One multiply per register instead of two. The accumulator is the current one times 2^-7 exactly (each product and
# partial sum scaled by a power of two), so the outputs are the same unless partial sums fall below 2^-119.
_DEQUANT_SHUFFLED_FOLDED_PTX = tl.constexpr(
    "{\n.reg .b32 a, b, c;"
    + _SHUFFLED_BITS_PTX
    + "".join(f"mul.rn.bf16x2 ${r}, ${r}, ${5 + r % 2};\n" for r in range(4))
    + "}"
)
_FOLD_SCALE = tl.constexpr(2.0**119)  # the block scale's factor when the decode bias is folded
_FOLD_ALPHA = tl.constexpr(2.0**7)  # and the epilogue's

_SIGN_MAGNITUDE_MASK = tl.constexpr(0x81C081C0 - (1 << 32))  # as an int32


@triton.jit
def _bf16_halves(register):
    """int32 holding two bf16 bit patterns -> their values as fp32 (low half, high half)."""
    low = (register << 16).to(tl.float32, bitcast=True)
    high = (register & -65536).to(tl.float32, bitcast=True)
    return low, high


@triton.jit
def _decode_shuffled(packed, scale, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, FOLD_BIAS: tl.constexpr):
    """`_DEQUANT_SHUFFLED_PTX` (FOLD_BIAS: `_DEQUANT_SHUFFLED_FOLDED_PTX`) in integer and fp32 arithmetic (the
    interpreter's path): packed u8 [ROWS, BLOCK_K/2]
    in the shuffled layout, scale fp32 [ROWS, BLOCK_K/16] -> (even, odd) fp32 [ROWS, BLOCK_K/2], the same values as
    `_e2m1_value(code) * scale` on the unshuffled codes. The bf16 bit patterns hold value · 2^-126 (0.5 an fp32
    subnormal, kept by the interpreter's numpy); times 2^126, then the scale: both exact."""
    bytes4 = tl.reshape(packed.to(tl.int32), (ROWS, BLOCK_K // 8, 4))
    word = tl.sum(bytes4 << (tl.arange(0, 4) * 8)[None, None, :], axis=2)  # disjoint bits: the sum is the OR
    r0 = word & _SIGN_MAGNITUDE_MASK
    r1 = (word << 3) & _SIGN_MAGNITUDE_MASK
    r2 = (word << 6) & _SIGN_MAGNITUDE_MASK
    r3 = ((word >> 3) & 0x01800180) | ((word >> 7) & 0x00400040) | ((word << 1) & (0x80008000 - (1 << 32)))
    word_scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (ROWS, BLOCK_K // 16, 2)), (ROWS, BLOCK_K // 8))
    e0, e2 = _bf16_halves(r0)
    e4, e6 = _bf16_halves(r1)
    e1, e3 = _bf16_halves(r2)
    e5, e7 = _bf16_halves(r3)
    # [ROWS, W, register, half] flattened: even j = 4w + 2·register + half
    even = (tl.join(tl.join(e0, e4), tl.join(e2, e6)) * 8.507059173023462e37) * word_scale[:, :, None, None]
    odd = (tl.join(tl.join(e1, e5), tl.join(e3, e7)) * 8.507059173023462e37) * word_scale[:, :, None, None]
    if FOLD_BIAS:  # the values `_DEQUANT_SHUFFLED_FOLDED_PTX` makes: times 2^-7, exactly
        even = even * (1.0 / _FOLD_ALPHA)
        odd = odd * (1.0 / _FOLD_ALPHA)
    return tl.reshape(even, (ROWS, BLOCK_K // 2)), tl.reshape(odd, (ROWS, BLOCK_K // 2))


@triton.jit
def _e4m3_value(byte):
    """FP8 E4M3FN bytes (int32) -> fp32; subnormals explicit so that no flush-to-zero can touch them."""
    exponent = (byte >> 3) & 15
    mantissa = byte & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    return tl.where((byte & 128) != 0, -value, value)


@triton.jit
def _e4m3_value_bits(byte):
    """The same values as `_e4m3_value` in three operations: E4M3's exponent and mantissa bits placed in an fp32's
    make it hold value · 2^-120 (E4M3 subnormals become fp32 subnormals, exactly), and one multiply by 2^120 restores
    it exactly (PTX mul.f32 without .ftz keeps subnormal inputs; so does the interpreter's numpy)."""
    bits = ((byte & 128) << 24) | ((byte & 127) << 20)
    return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36


@triton.jit
def _round_e4m3(x):
    """Non-negative fp32 -> nearest E4M3 value (ties to even, saturating at 448), by the add-and-subtract trick."""
    x = tl.minimum(x, 448.0)
    exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    # 1.5 · 2^(exponent + 20): its ulp is the E4M3 spacing 2^(exponent - 3) of x's binade.
    magic = (((exponent + 147) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    return (x + magic) - magic


@triton.jit
def _round_e2m1(v):
    """fp32 -> nearest E2M1 value (ties to even, saturating at ±6)."""
    magnitude = tl.minimum(tl.abs(v), 6.0)
    magic = tl.where(magnitude < 2.0, 0.5, tl.where(magnitude < 4.0, 1.0, 2.0)) * 12582912.0  # spacing · 1.5·2^23
    rounded = (magnitude + magic) - magic
    return tl.where(v < 0, -rounded, rounded)


@triton.jit
def _to_mma(x, EMULATE_BF16: tl.constexpr):
    """fp32 -> MMA operand: bf16 on a GPU; under the interpreter fp32 holding the bf16-rounded (RNE) value."""
    if EMULATE_BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _mma(a, w, acc, EMULATE_BF16: tl.constexpr):
    """accᵀ + w · aᵀ with fp32 accumulation, acc kept transposed [N, M]: the dequantized weights are the left
    operand, which Triton can feed to the tensor cores from registers."""
    if EMULATE_BF16:
        return tl.dot(w, tl.trans(a), acc, input_precision="ieee")
    else:
        return tl.dot(w, tl.trans(a), acc)


@triton.jit
def _load(ptrs, mask, EVEN_K: tl.constexpr, other):
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def _fake_quant_blocks(x3, block_amax, global_mul):
    """x3 [R, NB, W] fp32 with its 16-block amax [R, NB] -> e2m1(q)·s, the exact bf16 product, without 1/G.

    Divisions are IEEE (div_rn), as in torch: Triton's `/` is approximate on GPUs, and activations hold many exact
    ties (G_a comes from the amax of the same bf16 tensor), which an approximate quotient rounds the other way."""
    block_scale = _round_e4m3(tl.math.div_rn(block_amax, tl.full(block_amax.shape, 6.0, tl.float32)) * global_mul)
    divisor = tl.math.div_rn(block_scale, tl.full(block_scale.shape, 1.0, tl.float32) * global_mul)
    safe_divisor = tl.where(divisor > 0, divisor, 1.0)
    values = _round_e2m1(tl.math.div_rn(x3, tl.broadcast_to(safe_divisor[:, :, None], x3.shape)))
    values = values * block_scale[:, :, None]
    return tl.where(divisor[:, :, None] > 0, values, 0.0)


@triton.jit
def _dequant_pair(
    packed,
    scale_bytes,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    FAST: tl.constexpr,
    BIT_SCALES: tl.constexpr = False,
    SHUFFLED: tl.constexpr = False,
    FOLD_BIAS: tl.constexpr = False,
):
    """packed u8 [ROWS, BLOCK_K/2] + scale u8 [ROWS, BLOCK_K/16] -> (even, odd) MMA operands, no global scale.
    e2m1 · e4m3 has at most 5 significant bits: exact in bf16. BIT_SCALES: `_e4m3_value_bits` (same values).
    SHUFFLED: the packed bytes are in `triton_moe.shuffle_packed`'s layout (same values). FOLD_BIAS (with SHUFFLED):
    the values times 2^-7, which the caller undoes by multiplying alpha by `_FOLD_ALPHA`."""
    if BIT_SCALES:
        scale = _e4m3_value_bits(scale_bytes.to(tl.int32))
    else:
        scale = _e4m3_value(scale_bytes.to(tl.int32))
    if SHUFFLED and not FAST:
        even, odd = _decode_shuffled(packed, scale, ROWS, BLOCK_K, FOLD_BIAS)
        return _to_mma(even, EMULATE_BF16), _to_mma(odd, EMULATE_BF16)
    if FAST:
        if SHUFFLED and FOLD_BIAS:
            scale = scale * _FOLD_SCALE
        scale = tl.reshape(
            tl.broadcast_to(scale.to(tl.bfloat16)[:, :, None], (ROWS, BLOCK_K // 16, 8)), (ROWS, BLOCK_K // 2)
        )
        # pack=4 hands the asm 4 consecutive bytes of a row; the shuffled decode needs them to be one aligned word
        # (the dot-operand layout's groups of 4 along K are: the GPU tests compare both layouts bit for bit)
        return tl.inline_asm_elementwise(
            (_DEQUANT_SHUFFLED_FOLDED_PTX if FOLD_BIAS else _DEQUANT_SHUFFLED_PTX) if SHUFFLED else _DEQUANT_PTX,
            "=r,=r,=r,=r,r,r,r",
            [packed, scale],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        codes = packed.to(tl.int32)
        even = tl.reshape(_e2m1_value(codes & 15), (ROWS, BLOCK_K // 16, 8)) * scale[:, :, None]
        odd = tl.reshape(_e2m1_value(codes >> 4), (ROWS, BLOCK_K // 16, 8)) * scale[:, :, None]
        return (
            _to_mma(tl.reshape(even, (ROWS, BLOCK_K // 2)), EMULATE_BF16),
            _to_mma(tl.reshape(odd, (ROWS, BLOCK_K // 2)), EMULATE_BF16),
        )


@triton.jit
def _gate_up_sums(
    x_ptr,
    x_row,  # int64 [BLOCK_M] input row of each M row
    pairs,
    pair_valid,
    routing_weight_ptr,
    w_ptr,
    w_scale_ptr,
    expert,
    offs_n,  # int [BLOCK_N] intermediate columns (gate rows; up rows are I further)
    hidden_size,
    inter_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BIT_SCALES: tl.constexpr,
    ALIGNED_SCALES: tl.constexpr,
    SHUFFLED: tl.constexpr,
    FOLD_BIAS: tl.constexpr,
):
    """GEMM1's K loop: raw fp32 gate and up sums [BLOCK_N, BLOCK_M] (transposed) of x rows against the block
    scaled w1 and w3 rows of one expert, without the global scale (times 2^-7 with SHUFFLED and FOLD_BIAS)."""
    n_valid = offs_n < inter_size
    offs_j = tl.arange(0, BLOCK_K // 2)
    offs_s = tl.arange(0, BLOCK_K // 16)
    half_k = hidden_size // 2
    scale_k = hidden_size // 16
    if ALIGNED_SCALES:
        half_k = tl.multiple_of(half_k, BLOCK_K // 2)
        scale_k = tl.multiple_of(scale_k, BLOCK_K // 16)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + x_row[:, None] * hidden_size + offs_k[None, :]
    gate_rows = w_ptr + expert * (2 * inter_size * half_k) + offs_n[:, None].to(tl.int64) * half_k + offs_j[None, :]
    up_rows = gate_rows + inter_size * half_k
    gate_scales = (
        w_scale_ptr + expert * (2 * inter_size * scale_k) + offs_n[:, None].to(tl.int64) * scale_k + offs_s[None, :]
    )
    up_scales = gate_scales + inter_size * scale_k
    if SCALE_INPUT:
        routing_weight = tl.load(routing_weight_ptr + pairs, mask=pair_valid, other=0.0)
    acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        j_valid = (k0 // 2 + offs_j) < half_k
        s_valid = (k0 // 16 + offs_s) < scale_k
        x_mask = pair_valid[:, None] & ((k0 + offs_k) < hidden_size)[None, :]
        x = tl.load(x_rows + k0, mask=x_mask, other=0.0).to(tl.float32)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
        if SCALE_INPUT:
            x_even = x_even * routing_weight[:, None]
            x_odd = x_odd * routing_weight[:, None]
        a_even = _to_mma(x_even, EMULATE_BF16)
        a_odd = _to_mma(x_odd, EMULATE_BF16)
        w_mask = n_valid[:, None] & j_valid[None, :]
        ws_mask = n_valid[:, None] & s_valid[None, :]
        acc_gate = _dequant_mma(
            gate_rows + k0 // 2, gate_scales + k0 // 16, w_mask, ws_mask, a_even, a_odd, acc_gate,
            BLOCK_N, BLOCK_K, EMULATE_BF16, FAST_DEQUANT, EVEN_K, BIT_SCALES, SHUFFLED, FOLD_BIAS,
        )  # fmt: skip
        acc_up = _dequant_mma(
            up_rows + k0 // 2, up_scales + k0 // 16, w_mask, ws_mask, a_even, a_odd, acc_up,
            BLOCK_N, BLOCK_K, EMULATE_BF16, FAST_DEQUANT, EVEN_K, BIT_SCALES, SHUFFLED, FOLD_BIAS,
        )  # fmt: skip
    return acc_gate, acc_up


@triton.jit
def _dequant_mma(
    w_ptrs,
    scale_ptrs,
    w_mask,
    scale_mask,
    a_even,
    a_odd,
    acc,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BIT_SCALES: tl.constexpr,
    SHUFFLED: tl.constexpr,
    FOLD_BIAS: tl.constexpr,
):
    """One K step of one weight tile: load its packed codes and block scales, decode, accumulate against the even and
    odd activation halves."""
    w_even, w_odd = _dequant_pair(
        _load(w_ptrs, w_mask, EVEN_K, 0),
        _load(scale_ptrs, scale_mask, EVEN_K, 0),
        ROWS,
        BLOCK_K,
        EMULATE_BF16,
        FAST_DEQUANT,
        BIT_SCALES,
        SHUFFLED,
        FOLD_BIAS,
    )
    acc = _mma(a_even, w_even, acc, EMULATE_BF16)
    return _mma(a_odd, w_odd, acc, EMULATE_BF16)


@triton.jit
def _gated(gate, up, act_alpha, act_limit, ACT: tl.constexpr):
    """The expert activation (`fp4kit.families.activation`, ACT its ACTIVATION_CODES entry): silu(gate) * up
    (0), gpt-oss's clamped (up + 1) * gate * sigmoid(alpha * gate) (1), or silu(gate) * up of the clamped halves,
    DeepSeek-V4's (2)."""
    if ACT == 1:
        gate = tl.minimum(gate, act_limit)
        up = tl.minimum(tl.maximum(up, -act_limit), act_limit)
        return (up + 1.0) * (gate / (1.0 + tl.exp(-(gate * act_alpha))))
    if ACT == 2:
        gate = tl.minimum(gate, act_limit)
        up = tl.minimum(tl.maximum(up, -act_limit), act_limit)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _swiglu(
    acc_gate,
    acc_up,
    alpha_ptr,
    out_gmul_ptr,
    bias_ptr,  # fp32 [E, 2I] gate then up biases (HAS_BIAS)
    act_alpha,
    act_limit,
    expert,
    offs_n,  # [BLOCK_N] the intermediate columns of this tile
    inter_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    W4A4: tl.constexpr,
    FOLD_BIAS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
):
    """GEMM1's epilogue: global scale, the biases, the activation, and in W4A4 the intermediate quantized per 16
    columns with the static activation global scale of GEMM2 (exact e2m1·s values): fp32 [BLOCK_M, BLOCK_N].
    Columns past I get no bias, so that their intermediate stays 0 (the sliced kernel relies on it)."""
    alpha = tl.load(alpha_ptr + expert)
    if FOLD_BIAS:
        alpha = alpha * _FOLD_ALPHA
    gate = tl.trans(acc_gate) * alpha
    up = tl.trans(acc_up) * alpha
    if HAS_BIAS:
        n_valid = offs_n < inter_size
        row = bias_ptr + expert.to(tl.int64) * (2 * inter_size)
        gate += tl.load(row + offs_n, mask=n_valid, other=0.0)[None, :]
        up += tl.load(row + inter_size + offs_n, mask=n_valid, other=0.0)[None, :]
    inter = _gated(gate, up, act_alpha, act_limit, ACT)
    if W4A4:
        out_gmul = tl.load(out_gmul_ptr + expert)
        inter3 = tl.reshape(inter, (BLOCK_M, BLOCK_N // 16, 16))
        inter3 = _fake_quant_blocks(inter3, tl.max(tl.abs(inter3), axis=2), out_gmul)
        inter = tl.reshape(inter3, (BLOCK_M, BLOCK_N))
    return inter


@triton.jit
def pair_input_kernel(
    x_ptr,  # bf16/fp32 [T, H]
    routing_weight_ptr,  # fp32 [P]
    ids_ptr,  # int [P] expert of each pair
    act_gmul_ptr,  # fp32 [E] G_a13
    out_ptr,  # bf16 [P, H] out (fp32 holding bf16 values under EMULATE_BF16)
    top_k,
    hidden_size,
    num_experts,
    BLOCK_K: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """W4A4: each (token, slot) pair's GEMM1 input quantized per 16-block with its expert's static activation global
    scale (Llama-4: times the routing weight first), once, instead of in every N tile of GEMM1: exact e2m1·s values.
    Rows of pairs that no expert takes are quantized with expert 0's scale and never read."""
    pair = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    valid = offs < hidden_size
    expert = tl.load(ids_ptr + pair).to(tl.int32)
    expert = tl.where((expert >= 0) & (expert < num_experts), expert, 0)
    x = tl.load(x_ptr + (pair // top_k) * hidden_size + offs, mask=valid, other=0.0).to(tl.float32)
    if SCALE_INPUT:
        x = x * tl.load(routing_weight_ptr + pair)
    x3 = tl.reshape(x, (1, BLOCK_K // 16, 16))
    x3 = _fake_quant_blocks(x3, tl.max(tl.abs(x3), axis=2), tl.load(act_gmul_ptr + expert))
    tl.store(out_ptr + pair * hidden_size + offs, _to_mma(tl.reshape(x3, (BLOCK_K,)), EMULATE_BF16), mask=valid)


@triton.jit
def align_kernel(
    ids_ptr,  # int32 or int64 [P] expert id of each (token, slot) pair
    local_ptr,  # int8 [E] 1 for experts this rank computes (read when HAS_LOCAL)
    sorted_pairs_ptr,  # int32 [max_padded] out: pair ids grouped by expert, padded with P
    block_expert_ptr,  # int32 [max_blocks] out: expert of each BLOCK_M block, -1 past the end
    cursor_ptr,  # int32 [E_PAD] scratch
    num_padded_ptr,  # int32 [1] out: rows used in sorted_pairs
    num_pairs,
    num_experts,
    max_padded,
    max_blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_LOCAL: tl.constexpr,
):
    bins = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=num_experts).to(tl.int32)
        expert = tl.where((expert >= 0) & (expert < num_experts), expert, num_experts)
        if HAS_LOCAL:
            is_local = tl.load(local_ptr + expert, mask=expert < num_experts, other=0)
            expert = tl.where(is_local != 0, expert, num_experts)
        counts += tl.histogram(expert, E_PAD)
    counts = tl.where(bins < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(cursor_ptr + bins, padded_end - padded)
    tl.store(num_padded_ptr, total)
    for block0 in range(0, max_blocks, 64):
        blocks = block0 + tl.arange(0, 64)
        first_row = blocks * BLOCK_M
        expert_of_block = tl.sum((padded_end[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        expert_of_block = tl.where(first_row < total, expert_of_block, -1)
        tl.store(block_expert_ptr + blocks, expert_of_block, mask=blocks < max_blocks)
    for start in range(0, max_padded, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs, mask=offs < max_padded)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=num_experts).to(tl.int32)
        expert = tl.where((expert >= 0) & (expert < num_experts), expert, num_experts)
        if HAS_LOCAL:
            is_local = tl.load(local_ptr + expert, mask=expert < num_experts, other=0)
            expert = tl.where(is_local != 0, expert, num_experts)
        take = expert < num_experts
        # Order inside an expert's rows is free: every output row depends on its own input row only.
        row = tl.atomic_add(cursor_ptr + expert, 1, mask=take)
        tl.store(sorted_pairs_ptr + row, offs, mask=take)


# How a program finds its pairs (the GROUPING constexpr of the GEMM kernels)
PER_PAIR = tl.constexpr(0)  # program row p owns pair p alone (row 0 of its M tile), no grouping launch
ALIGNED = tl.constexpr(1)  # an `align_kernel` block of BLOCK_M pairs of one expert


@triton.jit
def _owned_pairs(
    pid_m,
    ids_ptr,
    local_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    BLOCK_M: tl.constexpr,
    GROUPING: tl.constexpr,
    HAS_LOCAL: tl.constexpr,
):
    """(expert, pairs [BLOCK_M], active) of program row pid_m (see PER_PAIR, ALIGNED); pairs past the end are
    num_pairs. Inactive: a block past the padded end, or a pair of no (local) expert: the program has nothing to do."""
    rows_m = tl.arange(0, BLOCK_M)
    if GROUPING == ALIGNED:
        active = pid_m * BLOCK_M < tl.load(num_padded_ptr)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + rows_m)
    else:
        expert = tl.load(ids_ptr + pid_m).to(tl.int64)
        active = (expert >= 0) & (expert < num_experts)
        if HAS_LOCAL:
            active = active & (tl.load(local_ptr + expert, mask=active, other=0) != 0)
        pairs = tl.where(rows_m == 0, pid_m, num_pairs)
    return expert, pairs, active


@triton.jit
def gemm1_swiglu_kernel(
    x_ptr,  # bf16/fp32 [T, H]; W4A4: [P, H] each pair's quantized input from `pair_input_kernel`
    routing_weight_ptr,  # fp32 [P]
    ids_ptr,  # int [P] expert of each pair (PER_PAIR)
    local_ptr,  # int8 [E] 1 for experts this rank computes (PER_PAIR with HAS_LOCAL)
    sorted_pairs_ptr,
    block_expert_ptr,
    num_padded_ptr,
    w_ptr,  # u8 [E, 2I, H/2], rows [w1; w3]
    w_scale_ptr,  # u8 [E, 2I, H/16]
    alpha_ptr,  # fp32 [E]: 1/G_w (W4A16) or 1/(G_w·G_a) (W4A4)
    out_gmul_ptr,  # fp32 [E] G_a2: the intermediate is stored fake-quantized (W4A4)
    inter_ptr,  # bf16 [P, I]
    bias13_ptr,  # fp32 [E, 2I] (HAS_BIAS)
    act_alpha,  # the activation's constants (swiglu_oai, silu_clamped)
    act_limit,
    num_pairs,
    top_k,
    hidden_size,
    inter_size,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    W4A4: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K, so that loads vectorize
    BIT_SCALES: tl.constexpr = False,  # FP8 block scales decoded by `_e4m3_value_bits`
    ALIGNED_SCALES: tl.constexpr = False,  # K/16 % (BLOCK_K/16) == 0: scale rows load as vectors
    SHUFFLED: tl.constexpr = False,  # packed weights in `triton_moe.shuffle_packed`'s layout
    FOLD_BIAS: tl.constexpr = False,  # with SHUFFLED: the decode's 2^126 folded into the scales (`_dequant_pair`)
    GROUPING: tl.constexpr = ALIGNED,  # how program_id(0) finds its pairs (`_owned_pairs`)
    HAS_LOCAL: tl.constexpr = False,  # with PER_PAIR: skip pairs of experts local_ptr marks 0
    HAS_BIAS: tl.constexpr = False,  # gpt-oss: w13's output biases
    ACT: tl.constexpr = 0,  # the expert activation's code (`_gated`)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, pairs, active = _owned_pairs(
        pid_m, ids_ptr, local_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts,
        BLOCK_M, GROUPING, HAS_LOCAL,
    )  # fmt: skip
    if active.to(tl.int32) == 0:
        return
    pair_valid = pairs < num_pairs
    # W4A4 reads each pair's own quantized input row (`pair_input_kernel`), W4A16 its token's
    x_row = pairs.to(tl.int64) if W4A4 else (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < inter_size
    acc_gate, acc_up = _gate_up_sums(
        x_ptr, x_row, pairs, pair_valid, routing_weight_ptr, w_ptr, w_scale_ptr, expert, offs_n, hidden_size,
        inter_size, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_INPUT and not W4A4, EMULATE_BF16, FAST_DEQUANT,
        EVEN_K, BIT_SCALES, ALIGNED_SCALES, SHUFFLED, SHUFFLED and FOLD_BIAS,
    )  # fmt: skip
    inter = _swiglu(acc_gate, acc_up, alpha_ptr, out_gmul_ptr, bias13_ptr, act_alpha, act_limit, expert, offs_n,
                    inter_size, BLOCK_M, BLOCK_N, W4A4, SHUFFLED and FOLD_BIAS, HAS_BIAS, ACT)  # fmt: skip
    out_ptrs = inter_ptr + pairs[:, None].to(tl.int64) * inter_size + offs_n[None, :]
    tl.store(out_ptrs, _to_mma(inter, EMULATE_BF16), mask=pair_valid[:, None] & n_valid[None, :])


@triton.jit
def gemm2_combine_kernel(
    inter_ptr,  # bf16 [P, I]
    routing_weight_ptr,  # fp32 [P]
    ids_ptr,  # int [P] expert of each pair (PER_PAIR)
    local_ptr,  # int8 [E] 1 for experts this rank computes (PER_PAIR with HAS_LOCAL)
    sorted_pairs_ptr,
    block_expert_ptr,
    num_padded_ptr,
    w_ptr,  # u8 [E, H, I/2]
    w_scale_ptr,  # u8 [E, H, I/16]
    alpha_ptr,  # fp32 [E]: 1/G_w2 (W4A16) or 1/(G_w2·G_a2) (W4A4)
    pair_out_ptr,  # fp32 [P, H]
    out_ptr,  # fp32 [T, H]: each token's sum over its k slots (COMBINE)
    count_ptr,  # int32 [T, cdiv(H, BLOCK_N)]: zero on entry and on exit (COMBINE)
    bias2_ptr,  # fp32 [E, H] (HAS_BIAS)
    num_pairs,
    top_k,
    hidden_size,
    inter_size,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K, so that loads vectorize
    BIT_SCALES: tl.constexpr = False,  # FP8 block scales decoded by `_e4m3_value_bits`
    ALIGNED_SCALES: tl.constexpr = False,  # K/16 % (BLOCK_K/16) == 0: scale rows load as vectors
    SHUFFLED: tl.constexpr = False,  # packed weights in `triton_moe.shuffle_packed`'s layout
    FOLD_BIAS: tl.constexpr = False,  # with SHUFFLED: the decode's 2^126 folded into the scales (`_dequant_pair`)
    COMBINE: tl.constexpr = False,  # sum each token's k slots into out_ptr in this launch (`_sum_slots_when_last`)
    GROUPING: tl.constexpr = ALIGNED,  # how program_id(0) finds its pairs (`_owned_pairs`)
    HAS_LOCAL: tl.constexpr = False,  # with PER_PAIR: skip pairs of experts local_ptr marks 0
    HAS_BIAS: tl.constexpr = False,  # gpt-oss: w2's output biases
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, pairs, active = _owned_pairs(
        pid_m, ids_ptr, local_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts,
        BLOCK_M, GROUPING, HAS_LOCAL,
    )  # fmt: skip
    if active.to(tl.int32) == 0:
        return
    pair_valid = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < hidden_size
    offs_j = tl.arange(0, BLOCK_K // 2)
    offs_s = tl.arange(0, BLOCK_K // 16)
    half_k = inter_size // 2
    scale_k = inter_size // 16
    if ALIGNED_SCALES:
        half_k = tl.multiple_of(half_k, BLOCK_K // 2)
        scale_k = tl.multiple_of(scale_k, BLOCK_K // 16)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = inter_ptr + pairs[:, None].to(tl.int64) * inter_size + offs_k[None, :]
    w_rows = w_ptr + expert * (hidden_size * half_k) + offs_n[:, None].to(tl.int64) * half_k + offs_j[None, :]
    w_scales = w_scale_ptr + expert * (hidden_size * scale_k) + offs_n[:, None].to(tl.int64) * scale_k + offs_s[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        j_valid = (k0 // 2 + offs_j) < half_k
        s_valid = (k0 // 16 + offs_s) < scale_k
        k_valid = (k0 + offs_k) < inter_size
        a = tl.load(a_rows + k0, mask=pair_valid[:, None] & k_valid[None, :], other=0.0)
        if EMULATE_BF16:
            a = a.to(tl.float32)
        a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
        w_even, w_odd = _dequant_pair(
            _load(w_rows + k0 // 2, n_valid[:, None] & j_valid[None, :], EVEN_K, 0),
            _load(w_scales + k0 // 16, n_valid[:, None] & s_valid[None, :], EVEN_K, 0),
            BLOCK_N,
            BLOCK_K,
            EMULATE_BF16,
            FAST_DEQUANT,
            BIT_SCALES,
            SHUFFLED,
            SHUFFLED and FOLD_BIAS,
        )
        acc = _mma(a_even, w_even, acc, EMULATE_BF16)
        acc = _mma(a_odd, w_odd, acc, EMULATE_BF16)
    alpha = tl.load(alpha_ptr + expert)
    if SHUFFLED and FOLD_BIAS:
        alpha = alpha * _FOLD_ALPHA
    acc = tl.trans(acc) * alpha
    if HAS_BIAS:
        bias = tl.load(bias2_ptr + expert.to(tl.int64) * hidden_size + offs_n, mask=n_valid, other=0.0)
        acc += bias[None, :]
    if not SCALE_INPUT:
        acc = acc * tl.load(routing_weight_ptr + pairs, mask=pair_valid, other=0.0)[:, None]
    out_ptrs = pair_out_ptr + pairs[:, None].to(tl.int64) * hidden_size + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=pair_valid[:, None] & n_valid[None, :])
    if COMBINE:
        _sum_slots_when_last(
            pair_out_ptr, out_ptr, count_ptr, pairs, pair_valid, offs_n, n_valid, pid_n, tl.num_programs(1),
            num_pairs, top_k, hidden_size, BLOCK_M, BLOCK_N, 1, not EMULATE_BF16,
        )  # fmt: skip


@triton.jit
def _fence_gpu():
    """This thread's earlier global writes become visible GPU-wide before its later ones (CUDA's __threadfence)."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _arrive(counters, mask, FENCE: tl.constexpr):
    """Count this program's finished tile in at each counter (where mask): returns the counts before, so the program
    that brings a counter to its total knows it is the last and reduces what all of them stored. This program's
    stores are visible GPU-wide first (FENCE on a GPU: each thread's fence, then the barrier; the interpreter runs
    programs one after another). The last program reads the others' stores with .cg loads (at L2, never a stale L1
    line)."""
    if FENCE:
        _fence_gpu()
    tl.debug_barrier()
    return tl.atomic_add(counters, 1, mask=mask, sem="acq_rel", scope="gpu")


@triton.jit
def _sum_slots_when_last(
    pair_out_ptr,  # fp32 [SPLITS, P, H]
    out_ptr,
    count_ptr,
    pairs,
    pair_valid,
    offs_n,
    n_valid,
    pid_n,
    num_tiles,
    num_pairs,
    top_k,
    hidden_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    FENCE: tl.constexpr,
):
    """The sum over each token's k slots (and K slices) in GEMM2's launch, deterministically: one counter per token
    and N tile; the program that completes a token's count sums its rows in (slice, slot) order, writes the output
    row and resets the counter for the next call. No further launch, and the same sum whichever program comes last.
    Every pair must be computed by some program (ids in [0, E), no expert mask)."""
    token = pairs // top_k
    counters = count_ptr + token.to(tl.int64) * num_tiles + pid_n
    last = pair_valid & (_arrive(counters, pair_valid, FENCE) == top_k * SPLITS - 1)
    if tl.max(last.to(tl.int32), 0) != 0:
        mask = last[:, None] & n_valid[None, :]
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for split in range(SPLITS):
            rows = split * num_pairs + token.to(tl.int64) * top_k
            for slot in range(top_k):
                total += tl.load(pair_out_ptr + (rows + slot)[:, None] * hidden_size + offs_n[None, :], mask=mask,
                                 other=0.0, cache_modifier=".cg")  # fmt: skip
        tl.store(out_ptr + token[:, None].to(tl.int64) * hidden_size + offs_n[None, :], total, mask=mask)
        tl.store(counters, tl.zeros([BLOCK_M], dtype=tl.int32), mask=last)


@triton.jit
def fused_slice_kernel(
    x_ptr,  # bf16/fp32 [T, H]; W4A4: [P, H] from `pair_input_kernel`
    routing_weight_ptr,  # fp32 [P]
    ids_ptr,  # int [P] expert of each pair (PER_PAIR)
    local_ptr,  # int8 [E] 1 for experts this rank computes (PER_PAIR with HAS_LOCAL)
    sorted_pairs_ptr,  # from `align_kernel` (ALIGNED)
    block_expert_ptr,
    num_padded_ptr,
    w13_ptr,  # u8 [E, 2I, H/2], rows [w1; w3]
    w13_scale_ptr,  # u8 [E, 2I, H/16]
    alpha13_ptr,  # fp32 [E]
    out_gmul_ptr,  # fp32 [E] G_a2 (W4A4)
    w2_ptr,  # u8 [E, S, H, BLOCK_I/2]: the columns of each slice of w2, row after row (`slice_columns`)
    w2_scale_ptr,  # u8 [E, S, H, BLOCK_I/16]
    alpha2_ptr,  # fp32 [E]
    out_ptr,  # fp32 [S, P, H]: each slice's share of each pair's output
    bias13_ptr,  # fp32 [E, 2I] (HAS_BIAS)
    bias2_ptr,  # fp32 [E, H] (HAS_BIAS): in slice 0's share
    act_alpha,
    act_limit,
    num_pairs,
    top_k,
    hidden_size,
    inter_size,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,  # intermediate columns per program: GEMM1's N tile and GEMM2's whole K
    BLOCK_N: tl.constexpr,  # w2 rows per step of the GEMM2 loop
    BLOCK_K: tl.constexpr,  # GEMM1's K step
    GROUPING: tl.constexpr,  # how program_id(0) finds its pairs (`_owned_pairs`)
    HAS_LOCAL: tl.constexpr,
    SCALE_INPUT: tl.constexpr,
    W4A4: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
    EVEN_K: tl.constexpr,  # H % BLOCK_K == 0
    EVEN_N: tl.constexpr,  # H % BLOCK_N == 0
    BIT_SCALES: tl.constexpr,
    ALIGNED_SCALES: tl.constexpr,
    SHUFFLED: tl.constexpr,
    FOLD_BIAS: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
    ACT: tl.constexpr = 0,
):
    """Both GEMMs in one launch for few tokens: the program owning intermediate columns [i0, i0 + BLOCK_I) of its
    pairs computes them whole (gate and up over all of H, SwiGLU), then their product with the same columns of w2,
    written as this slice's share of each pair's output: no intermediate tensor, no second launch, and S times the
    programs of a per-expert GEMM2. The shares are summed (over slices and top-k slots) by the caller."""
    pid_m = tl.program_id(0)
    pid_i = tl.program_id(1)
    expert, pairs, active = _owned_pairs(
        pid_m, ids_ptr, local_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts,
        BLOCK_M, GROUPING, HAS_LOCAL,
    )  # fmt: skip
    if active.to(tl.int32) == 0:
        return
    pair_valid = pairs < num_pairs
    x_row = pairs.to(tl.int64) if W4A4 else (pairs // top_k).to(tl.int64)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    acc_gate, acc_up = _gate_up_sums(
        x_ptr, x_row, pairs, pair_valid, routing_weight_ptr, w13_ptr, w13_scale_ptr, expert, offs_i, hidden_size,
        inter_size, BLOCK_M, BLOCK_I, BLOCK_K, SCALE_INPUT and not W4A4, EMULATE_BF16, FAST_DEQUANT,
        EVEN_K, BIT_SCALES, ALIGNED_SCALES, SHUFFLED, SHUFFLED and FOLD_BIAS,
    )  # fmt: skip
    inter = _swiglu(acc_gate, acc_up, alpha13_ptr, out_gmul_ptr, bias13_ptr, act_alpha, act_limit, expert, offs_i,
                    inter_size, BLOCK_M, BLOCK_I, W4A4, SHUFFLED and FOLD_BIAS, HAS_BIAS, ACT)  # fmt: skip
    # columns past I: zero gate and up sums and no bias, an intermediate of 0, against zero-padded w2 columns
    a_even, a_odd = tl.split(tl.reshape(_to_mma(inter, EMULATE_BF16), (BLOCK_M, BLOCK_I // 2, 2)))
    num_slices = tl.cdiv(inter_size, BLOCK_I)
    tile = (expert * num_slices + pid_i) * hidden_size
    offs_r = tl.arange(0, BLOCK_N)
    w2_rows = w2_ptr + tile * (BLOCK_I // 2) + offs_r[:, None] * (BLOCK_I // 2) + tl.arange(0, BLOCK_I // 2)[None, :]
    w2_scales = (
        w2_scale_ptr + tile * (BLOCK_I // 16) + offs_r[:, None] * (BLOCK_I // 16) + tl.arange(0, BLOCK_I // 16)[None, :]
    )
    alpha2 = tl.load(alpha2_ptr + expert)
    if SHUFFLED and FOLD_BIAS:
        alpha2 = alpha2 * _FOLD_ALPHA
    if not SCALE_INPUT:
        routing_weight = tl.load(routing_weight_ptr + pairs, mask=pair_valid, other=0.0)
    out_rows = out_ptr + (pid_i * num_pairs + pairs[:, None]).to(tl.int64) * hidden_size + offs_r[None, :]
    for n0 in range(0, hidden_size, BLOCK_N):
        r_valid = (n0 + offs_r) < hidden_size
        w_even, w_odd = _dequant_pair(
            _load(w2_rows + n0 * (BLOCK_I // 2), r_valid[:, None], EVEN_N, 0),
            _load(w2_scales + n0 * (BLOCK_I // 16), r_valid[:, None], EVEN_N, 0),
            BLOCK_N,
            BLOCK_I,
            EMULATE_BF16,
            FAST_DEQUANT,
            BIT_SCALES,
            SHUFFLED,
            SHUFFLED and FOLD_BIAS,
        )
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc = _mma(a_even, w_even, acc, EMULATE_BF16)
        acc = _mma(a_odd, w_odd, acc, EMULATE_BF16)
        share = tl.trans(acc) * alpha2
        if HAS_BIAS:
            bias = tl.load(bias2_ptr + expert.to(tl.int64) * hidden_size + n0 + offs_r, mask=r_valid, other=0.0)
            share += tl.where(pid_i == 0, bias, 0.0)[None, :]
        if not SCALE_INPUT:
            share = share * routing_weight[:, None]
        tl.store(out_rows + n0, share, mask=pair_valid[:, None] & r_valid[None, :])

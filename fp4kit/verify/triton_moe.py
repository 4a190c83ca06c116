"""fp4kit's own fused NVFP4 MoE kernel in Triton: runs on any CUDA GPU Triton supports (sm80+, including the sm90
H200, which has no FP4 tensor cores) and on a CPU under TRITON_INTERPRET=1 (docs/verify_kernel_notes.md).

Two-GEMM path (the default but for 2-4 tokens): up to three launches and one reduction (one token: two launches).
1. `align_kernel` (one program): groups the T·k (token, slot) pairs by expert into BLOCK_M-row blocks, padding each
   expert's rows to a multiple of BLOCK_M; writes the expert of each block. No host synchronisation.
2. `gemm1_swiglu_kernel`: per block, [x] · [w1; w3]ᵀ of its expert with in-kernel dequantization of the packed FP4
   codes and FP8 block scales, the global scale applied once after fp32 accumulation, SwiGLU in the epilogue;
   Llama-4 multiplies each input row by its routing weight first.
3. `gemm2_combine_kernel`: w2 the same way, then times the routing weight (not for Llama-4) into per-pair rows,
   summed over the k slots of each token in fp32: after the launch, or in it by the last program to finish each
   token's tile (`KernelConfig.fused_combine`, the default at one token).

Sliced path (`KernelConfig.slice_i`): `fused_slice_kernel` computes, per (pair or block of pairs, slice of the
intermediate columns), the slice of SwiGLU(x·[w1; w3]ᵀ) over all of H and its product with the same columns of w2
(stored slice by slice, `slice_columns`); the slices' shares are summed in fp32 after. One launch (two with grouping).

Modes. W4A16: bf16 activations, bf16 MMA of exact e2m1·s weight products, fp32 accumulation. W4A4 emulation: the
input of each GEMM is quantized per 16-block with a static per-expert activation global scale as NVFP4 kernels do
(s = fp8(amax/6 · G_a), rne_e2m1(x / (s / G_a))): GEMM1's once per (token, slot) pair by `pair_input_kernel`,
GEMM2's in GEMM1's epilogue; the exact e2m1·s products go through the bf16 MMA, and 1/(G_w·G_a) is applied after
accumulation: equal to the Blackwell kernels up to summation order. The reference is
`fp4kit.verify.reference.moe_reference` on the dequantized weights (``activation_global_div`` for W4A4).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fp4kit.errors import Fp4kitError
from fp4kit.families.activation import SILU, ExpertActivation
from fp4kit.families.routing import RoutingSpec
from fp4kit.nvfp4 import BLOCK, NVFP4Tensor, fp32_multiplier


@dataclass(frozen=True)
class KernelConfig:
    block_m: int = 16
    block_n1: int = 32  # GEMM1 output columns per program (for each of gate and up)
    block_n2: int = 32
    block_k: int = 128
    num_warps: int = 2
    num_stages: int = 3
    fast_dequant: bool = True  # PTX nibble decode on a GPU (integer math under the interpreter regardless)
    # FP8 block scales decoded by placing their bits in an fp32 (3 ops instead of ~15), and their rows loaded as
    # vectors where K/16 is a multiple of BLOCK_K/16: same values, fewer instructions per weight byte
    fast_scales: bool = True
    # Packed weights pre-shuffled once per layer (`shuffle_packed`, cached on the `TritonMoeWeights`) so that the
    # nibble decode needs 11 bit operations per 4 bytes instead of 18: same values. Only for num_warps < 4
    # (mma.sync); configs with more warps use the plain layout.
    shuffled: bool = True
    # With shuffled: the decode's 2^126 multiply folded into the block scales (s · 2^119) and alpha (· 2^7): one
    # bf16x2 multiply per output register instead of two; outputs equal unless fp32 partial sums fall below 2^-119
    fold_bias: bool = True
    # > 0: both GEMMs in one launch (`fused_slice_kernel`), each program owning this many intermediate columns of
    # its pairs; the per-slice shares of the output are summed after. For few tokens: no intermediate tensor, one
    # launch instead of two, and H / BLOCK_N2 times fewer GEMM2 programs that each stream a long run of w2.
    slice_i: int = 0
    # How programs find their pairs: "align" (blocks of one expert's pairs grouped by `align_kernel`, one launch) or
    # "pair" (one pair per program, no grouping launch: for batches whose pairs rarely share an expert, e.g. one token)
    grouping: str = "align"
    # Two-GEMM path: the reductions in the GEMM launches, by the last program to finish a tile (`_arrive`): the sum over
    # each token's k slots in GEMM2's (not with an expert mask); no torch reduction
    fused_combine: bool = False


DECODE_CONFIG = KernelConfig()
# one token: its k pairs have k distinct experts, so no grouping launch (H200: its ~5 µs was a fifth of the total),
# and the k-slot sum in GEMM2's launch (H200: 19.9 -> 18.9 µs for Qwen3-30B-A3B, 50.8 -> 50.2 for Qwen3-235B-A22B)
ONE_TOKEN_CONFIG = KernelConfig(grouping="pair", fused_combine=True)
# two or more rows per expert on average: 64-row N tiles reuse each K step's activation fragments over twice the
# weight bytes (H200: 50-55% of copy bandwidth at 64 tokens against 47-53% with 32 rows; at 16 tokens and below 32
# rows are as fast or faster)
DECODE_WIDE_CONFIG = KernelConfig(block_n1=64, block_n2=64)
# 2-4 tokens (pairs rarely share an expert): both GEMMs in one launch, one pair per program, no grouping launch
# (H200, docs/verify_kernel_notes.md: 27-52% of copy bandwidth against 24-46% for the two-GEMM path)
SLICED_CONFIG = KernelConfig(block_n2=256, block_k=256, slice_i=64, grouping="pair")
PREFILL_CONFIG = KernelConfig(block_m=128, block_n1=64, block_n2=128, block_k=128, num_warps=4, num_stages=3)


def default_config(num_pairs: int, num_experts: int, top_k: int = 1) -> KernelConfig:
    """Few rows per expert: small M tiles, long K tiles, many programs to keep HBM busy; else MMA-sized tiles. The
    boundaries are the H200 measurements of docs/verify_kernel_notes.md (one token: the two-GEMM path, 10% faster
    there for Qwen3-30B-A3B and 4% slower for Qwen3-235B-A22B)."""
    if num_pairs > 16 * num_experts:
        return PREFILL_CONFIG
    if num_pairs <= top_k:
        return ONE_TOKEN_CONFIG
    if num_pairs <= num_experts // 4:
        return SLICED_CONFIG
    return DECODE_WIDE_CONFIG if num_pairs >= 2 * num_experts else DECODE_CONFIG


# Where `shuffle_packed` puts the sign, e1, e0 and mantissa bits of element e (of the 8 in a 4-byte word): the bit
# of the word that `_DEQUANT_SHUFFLED_PTX` moves to bf16 bits 15, 8, 7, 6 of its output register's half.
SHUFFLE_BITS = (
    (15, 8, 7, 6),  # e0: register 0, low half (q & M)
    (9, 2, 1, 0),  # e1: register 2, low half ((q << 6) & M)
    (31, 24, 23, 22),  # e2: register 0, high half
    (25, 18, 17, 16),  # e3: register 2, high half
    (12, 5, 4, 3),  # e4: register 1, low half ((q << 3) & M)
    (14, 11, 10, 13),  # e5: register 3, low half (sign << 1, exponent >> 3, mantissa >> 7)
    (28, 21, 20, 19),  # e6: register 1, high half
    (30, 27, 26, 29),  # e7: register 3, high half
)


def slice_columns(t: Tensor, width: int) -> Tensor:
    """[E, R, C] -> [E, S, R, width], S = ceil(C / width): each expert's columns [s·width, (s+1)·width) of all R rows
    stored contiguously (the last slice zero-padded), so that `fused_slice_kernel` streams a slice of w2 (packed
    bytes or block scales) in one run. Words of the shuffled layout stay whole when width is a multiple of 4."""
    num_experts, rows, cols = t.shape
    num_slices = -(-cols // width)
    if cols % width:
        padded = t.new_zeros(num_experts, rows, num_slices * width)
        padded[..., :cols] = t
        t = padded
    return t.view(num_experts, rows, num_slices, width).permute(0, 2, 1, 3).contiguous()


def shuffle_packed(packed: Tensor) -> Tensor:
    """Packed FP4 u8 [..., K/2] (element 2j in the low nibble of byte j) -> the same shape in the layout of
    `_DEQUANT_SHUFFLED_PTX`: each aligned 4-byte word (elements 8w..8w+7 of a row, little-endian) has the bits of its
    8 codes permuted as `SHUFFLE_BITS` says. Words never cross rows or 16-blocks, so tiles, masks and block scales
    are unchanged. Done once per layer, in chunks of the leading dimension to bound the int64 temporaries."""
    if packed.shape[-1] % 4:
        raise Fp4kitError(f"packed rows of {packed.shape[-1]} bytes are not whole 4-byte words")
    out = torch.empty_like(packed)
    flat_in, flat_out = packed.reshape(-1, packed.shape[-1]), out.view(-1, packed.shape[-1])
    rows_per_chunk = max(1, (1 << 24) // packed.shape[-1])
    byte_shift = torch.arange(0, 32, 8, device=packed.device, dtype=torch.int64)
    for start in range(0, flat_in.shape[0], rows_per_chunk):
        chunk = flat_in[start : start + rows_per_chunk].to(torch.int64).view(-1, packed.shape[-1] // 4, 4)
        word = (chunk << byte_shift).sum(dim=-1)
        shuffled = torch.zeros_like(word)
        for element, positions in enumerate(SHUFFLE_BITS):
            for bit, position in zip((3, 2, 1, 0), positions, strict=True):
                shuffled |= ((word >> (4 * element + bit)) & 1) << position
        shuffled_bytes = (shuffled[..., None] >> byte_shift) & 255
        flat_out[start : start + rows_per_chunk] = shuffled_bytes.to(torch.uint8).view(-1, packed.shape[-1])
    return out


@dataclass(frozen=True)
class TritonMoeWeights:
    """Expert weights as the kernel reads them: uint8 views of the canonical NVFP4 tensors plus fp32 per-expert
    scalars. ``alpha13`` / ``alpha2`` are 1/G_w (W4A16) or 1/(G_w·G_a) (W4A4); ``act13_gmul`` / ``act2_gmul`` are
    the activation multipliers G_a = fp32(1/D_a), present only in W4A4 mode; ``bias13`` / ``bias2`` and
    ``activation``: gpt-oss's experts (`fp4kit.verify.reference.moe_reference`'s)."""

    w13_packed: Tensor  # u8 [E, 2I, H/2]
    w13_scale: Tensor  # u8 [E, 2I, H/16]
    w2_packed: Tensor  # u8 [E, H, I/2]
    w2_scale: Tensor  # u8 [E, H, I/16]
    alpha13: Tensor  # fp32 [E]
    alpha2: Tensor  # fp32 [E]
    act13_gmul: Tensor | None = None
    act2_gmul: Tensor | None = None
    bias13: Tensor | None = None  # fp32 [E, 2I], gate then up
    bias2: Tensor | None = None  # fp32 [E, H]
    activation: ExpertActivation = SILU
    _cache: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # not carried by replace()

    def shuffled_packed(self) -> tuple[Tensor, Tensor]:
        """(w13, w2) packed weights in `shuffle_packed`'s layout, built on first use and kept with these weights."""
        if "shuffled" not in self._cache:
            self._cache["shuffled"] = (shuffle_packed(self.w13_packed), shuffle_packed(self.w2_packed))
        return self._cache["shuffled"]

    def sliced_w2(self, block_i: int, shuffled: bool) -> tuple[Tensor, Tensor]:
        """(packed, block scales) of w2 in `slice_columns`' layout for slices of block_i intermediate columns, built on
        first use and kept with these weights."""
        key = ("w2_slices", block_i, shuffled)
        if key not in self._cache:
            packed = self.shuffled_packed()[1] if shuffled else self.w2_packed
            self._cache[key] = (slice_columns(packed, block_i // 2), slice_columns(self.w2_scale, block_i // 16))
        return self._cache[key]

    def counters(self, name: str, rows: int, tiles: int, device: torch.device) -> Tensor:
        """int32 [rows, tiles] zeros for `KernelConfig.fused_combine`, kept with these weights: the kernels leave them
        zero again, so calls (and CUDA-graph replays) reuse them; calls on one weights object must not overlap."""
        key = ("counters", name, rows, tiles, str(device))
        if key not in self._cache:
            self._cache[key] = torch.zeros(rows, tiles, dtype=torch.int32, device=device)
        return self._cache[key]

    @property
    def num_experts(self) -> int:
        return self.w13_packed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_packed.shape[2] * 2

    @property
    def inter_size(self) -> int:
        return self.w2_packed.shape[2] * 2

    @property
    def w4a4(self) -> bool:
        return self.act13_gmul is not None

    def epilogue_arguments(self) -> tuple[tuple, dict]:
        """(bias13, bias2, act_alpha, act_limit) and the HAS_BIAS / ACT constexprs of the kernels' epilogues; a bias
        pointer that is never read is any fp32 tensor."""
        code = ACTIVATION_CODES[self.activation.kind]
        bias13 = self.alpha13 if self.bias13 is None else self.bias13
        bias2 = self.alpha2 if self.bias2 is None else self.bias2
        limit = self.activation.limit if code else 0.0
        return (bias13, bias2, float(self.activation.alpha), float(limit)), {"HAS_BIAS": self.bias13 is not None,
                                                                             "ACT": code}

    @classmethod
    def from_nvfp4(
        cls,
        w13: NVFP4Tensor,
        w2: NVFP4Tensor,
        activation_global_div: tuple[Tensor, Tensor] | None = None,
        device: torch.device | str | None = None,
        *,
        activation: ExpertActivation = SILU,
        biases: tuple[Tensor, Tensor] | None = None,
    ) -> TritonMoeWeights:
        """Stacked experts: w13 [E, 2I, H] (rows [w1; w3]) and w2 [E, H, I], each with a float64 [E] divisor;
        ``biases`` (b13 [E, 2I], b2 [E, H]) and ``activation``: gpt-oss's."""
        num_experts, two_inter, hidden = w13.shape
        if w2.shape != (num_experts, hidden, two_inter // 2):
            raise Fp4kitError(f"w2 {w2.shape} does not match w13 {w13.shape}: expected [E, H, I]")
        device = torch.device(device) if device is not None else w13.packed.device

        def multiplier(divisor: Tensor) -> Tensor:
            return fp32_multiplier(divisor.reshape(num_experts))

        def raw(t: Tensor) -> Tensor:
            return t.contiguous().view(torch.uint8).to(device)

        w_mul13, w_mul2 = multiplier(w13.global_scale_div), multiplier(w2.global_scale_div)
        act13 = act2 = None
        if activation_global_div is None:
            alpha13, alpha2 = 1.0 / w_mul13.double(), 1.0 / w_mul2.double()
        else:
            act13, act2 = (multiplier(d) for d in activation_global_div)
            alpha13 = 1.0 / (w_mul13.double() * act13.double())
            alpha2 = 1.0 / (w_mul2.double() * act2.double())
            act13, act2 = act13.to(device), act2.to(device)
        return cls(
            raw(w13.packed),
            raw(w13.block_scale),
            raw(w2.packed),
            raw(w2.block_scale),
            alpha13.to(torch.float32).to(device),
            alpha2.to(torch.float32).to(device),
            act13,
            act2,
            *(() if biases is None else _biases(biases, num_experts, two_inter, hidden, device)),
            activation=activation,
        )


def _biases(biases: tuple[Tensor, Tensor], num_experts: int, two_inter: int, hidden: int,
            device: torch.device) -> tuple[Tensor, Tensor]:
    bias13, bias2 = biases
    if bias13.shape != (num_experts, two_inter) or bias2.shape != (num_experts, hidden):
        raise Fp4kitError(f"expert biases {list(bias13.shape)} and {list(bias2.shape)} do not fit "
                          f"[{num_experts}, {two_inter}] and [{num_experts}, {hidden}]")
    return bias13.to(device, torch.float32).contiguous(), bias2.to(device, torch.float32).contiguous()


def triton_interpreter_active() -> bool:
    """Whether @triton.jit functions run under Triton's interpreter in this process."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if "triton.language" not in sys.modules:
        return True
    import triton.language as tl

    # a compiled-mode JITFunction here means triton.language was imported before TRITON_INTERPRET=1 was set
    return type(getattr(tl, "zeros", None)).__name__ != "JITFunction"


def _interpreted(hidden: Tensor) -> bool:
    """True under TRITON_INTERPRET=1 on a CPU tensor; raises where the kernel cannot run at all."""
    if hidden.device.type == "cuda":
        return False
    if not triton_interpreter_active():
        raise Fp4kitError("the Triton MoE kernel needs a CUDA device, or TRITON_INTERPRET=1 set before triton was "
                          "first imported to run on a CPU")
    return True


def _clamp_block(block: int, dim: int, minimum: int) -> int:
    return max(minimum, min(block, 1 << (dim - 1).bit_length()))


def fused_moe(
    hidden: Tensor,
    weights: Tensor,
    ids: Tensor,
    moe_weights: TritonMoeWeights,
    spec: RoutingSpec,
    expert_mask: Tensor | None = None,
    config: KernelConfig | None = None,
) -> Tensor:
    """Routed-expert output fp32 [T, H] for hidden [T, H] (bf16 or fp32), weights fp32 [T, k], ids int64 [T, k]
    (from `fp4kit.families.routing.route`: ids must lie in [0, E)). ``expert_mask`` (bool [E]) computes only local
    experts."""
    from fp4kit.verify import triton_kernels as kernels

    emulate_bf16 = _interpreted(hidden)
    num_tokens, hidden_size = hidden.shape
    top_k = ids.shape[1]
    num_experts, inter_size = moe_weights.num_experts, moe_weights.inter_size
    if hidden_size != moe_weights.hidden_size or hidden_size % BLOCK or inter_size % BLOCK:
        raise Fp4kitError(f"hidden {list(hidden.shape)} does not fit experts H={moe_weights.hidden_size}")
    num_pairs = num_tokens * top_k
    cfg = config or default_config(num_pairs, num_experts, top_k)
    flat_ids = ids.reshape(-1).contiguous()
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    x = hidden.contiguous()
    if moe_weights.w4a4:
        x = torch.empty(num_pairs, hidden_size, dtype=torch.float32 if emulate_bf16 else torch.bfloat16,
                        device=hidden.device)  # fmt: skip
        kernels.pair_input_kernel[(num_pairs, _cdiv(hidden_size, 256))](
            hidden.contiguous(), flat_weights, flat_ids, moe_weights.act13_gmul, x, top_k, hidden_size, num_experts,
            BLOCK_K=256, SCALE_INPUT=spec.scales_input, EMULATE_BF16=emulate_bf16, num_warps=4,
        )  # fmt: skip
    run = _sliced if cfg.slice_i else _two_gemms
    return run(x, flat_weights, flat_ids, moe_weights, spec, expert_mask, cfg, num_tokens, top_k, emulate_bf16)


GROUPINGS = {"pair": 0, "align": 1}  # triton_kernels.PER_PAIR, ALIGNED
# the kernels' ACT constexpr per expert activation kind (triton_kernels._gated)
ACTIVATION_CODES = {"silu": 0, "swiglu_oai": 1, "silu_clamped": 2}


def _grouping(flat_ids: Tensor, expert_mask: Tensor | None, num_experts: int, cfg: KernelConfig):
    """How the kernels find each program's pairs (`KernelConfig.grouping`): the (ids, local, sorted_pairs,
    block_expert, num_padded) pointers, their constexprs and the grid's row count. "align" runs `align_kernel`."""
    from fp4kit.verify import triton_kernels as kernels

    if cfg.grouping not in GROUPINGS:
        raise Fp4kitError(f"unknown kernel grouping {cfg.grouping!r}: expected one of {sorted(GROUPINGS)}")
    device, num_pairs = flat_ids.device, flat_ids.numel()
    has_local = expert_mask is not None
    local = expert_mask.to(device=device, dtype=torch.int8) if has_local else flat_ids
    if cfg.grouping == "pair":
        # the MMA's minimum M tile, one real row; the grouping pointers are never read
        flags = {"BLOCK_M": 16, "GROUPING": GROUPINGS["pair"], "HAS_LOCAL": has_local}
        return (flat_ids, local, flat_ids, flat_ids, flat_ids), flags, num_pairs
    block_m = cfg.block_m
    max_blocks = num_pairs // block_m + min(num_pairs, num_experts)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    e_pad = 1 << num_experts.bit_length()  # one spare bin for pairs that no local expert takes
    cursor = torch.empty(e_pad, dtype=torch.int32, device=device)
    kernels.align_kernel[(1,)](
        flat_ids, local, sorted_pairs, block_expert, cursor, num_padded,
        num_pairs, num_experts, max_blocks * block_m, max_blocks,
        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=1024, HAS_LOCAL=has_local, num_warps=4,
    )  # fmt: skip
    flags = {"BLOCK_M": block_m, "GROUPING": GROUPINGS["align"], "HAS_LOCAL": has_local}
    return (flat_ids, local, sorted_pairs, block_expert, num_padded), flags, max_blocks


def _decode_flags(cfg: KernelConfig, emulate_bf16: bool) -> dict:
    return {"EMULATE_BF16": emulate_bf16, "FAST_DEQUANT": cfg.fast_dequant and not emulate_bf16,
            "BIT_SCALES": cfg.fast_scales, "SHUFFLED": _shuffled(cfg), "FOLD_BIAS": cfg.fold_bias}  # fmt: skip


def _shuffled(cfg: KernelConfig) -> bool:
    # The shuffled decode takes 4 consecutive bytes of a row as one aligned word: true of the 8-bit dot operand of
    # mma.sync (kWidth 4), which is all Triton uses below 4 warps; wgmma's (sm90, 4+ warps) has kWidth 2.
    return cfg.shuffled and cfg.num_warps < 4


def _sliced(x, flat_weights, flat_ids, moe_weights, spec, expert_mask, cfg, num_tokens, top_k, emulate_bf16):
    """`fused_slice_kernel` and the sum of its per-slice shares."""
    from fp4kit.verify import triton_kernels as kernels

    num_pairs, hidden_size = flat_ids.numel(), moe_weights.hidden_size
    num_experts, inter_size = moe_weights.num_experts, moe_weights.inter_size
    block_i = _clamp_block(cfg.slice_i, inter_size, 32)  # GEMM2's K: two dots of at least 16
    block_n = _clamp_block(cfg.block_n2, hidden_size, 16)
    block_k = _clamp_block(cfg.block_k, hidden_size, 32)
    num_slices = _cdiv(inter_size, block_i)
    w2_packed, w2_scale = moe_weights.sliced_w2(block_i, _shuffled(cfg))
    w13_packed = moe_weights.shuffled_packed()[0] if _shuffled(cfg) else moe_weights.w13_packed
    device = x.device
    owners, grouping, grid_m = _grouping(flat_ids, expert_mask, num_experts, cfg)
    alloc = torch.zeros if expert_mask is not None else torch.empty  # rows of other ranks' pairs are not written
    shares = alloc(num_slices, num_pairs, hidden_size, dtype=torch.float32, device=device)
    epilogue, epilogue_flags = moe_weights.epilogue_arguments()
    kernels.fused_slice_kernel[(grid_m, num_slices)](
        x, flat_weights, *owners, w13_packed, moe_weights.w13_scale, moe_weights.alpha13,
        moe_weights.act2_gmul if moe_weights.w4a4 else moe_weights.alpha13,
        w2_packed, w2_scale, moe_weights.alpha2, shares, *epilogue,
        num_pairs, top_k, hidden_size, inter_size, num_experts, **epilogue_flags,
        **grouping, BLOCK_I=block_i, BLOCK_N=block_n, BLOCK_K=block_k, SCALE_INPUT=spec.scales_input,
        W4A4=moe_weights.w4a4,
        EVEN_K=hidden_size % block_k == 0, EVEN_N=hidden_size % block_n == 0,
        ALIGNED_SCALES=cfg.fast_scales and hidden_size % block_k == 0, **_decode_flags(cfg, emulate_bf16),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return shares.view(num_slices, num_tokens, top_k, hidden_size).sum(dim=(0, 2))


def _two_gemms(x, flat_weights, flat_ids, moe_weights, spec, expert_mask, cfg, num_tokens, top_k, emulate_bf16):
    """align, GEMM1 + SwiGLU, GEMM2 + routing weight, then the sum over the k slots."""
    from fp4kit.verify import triton_kernels as kernels

    num_pairs, hidden_size = flat_ids.numel(), moe_weights.hidden_size
    num_experts, inter_size = moe_weights.num_experts, moe_weights.inter_size
    device = x.device
    owners, grouping, max_blocks = _grouping(flat_ids, expert_mask, num_experts, cfg)
    block_n1 = _clamp_block(cfg.block_n1, inter_size, 16)
    block_k1 = _clamp_block(cfg.block_k, hidden_size, 32)
    inter = torch.empty(num_pairs, inter_size, dtype=torch.bfloat16, device=device)
    no_scale = moe_weights.alpha13  # any fp32 tensor: never read in W4A16 mode
    shuffled = _shuffled(cfg)
    w13_packed, w2_packed = moe_weights.shuffled_packed() if shuffled else (moe_weights.w13_packed,
                                                                            moe_weights.w2_packed)  # fmt: skip
    num_tiles1 = _cdiv(inter_size, block_n1)
    (bias13, bias2, act_alpha, act_limit), epilogue_flags = moe_weights.epilogue_arguments()
    kernels.gemm1_swiglu_kernel[(max_blocks, num_tiles1)](
        x, flat_weights, *owners, w13_packed, moe_weights.w13_scale, moe_weights.alpha13,
        moe_weights.act2_gmul if moe_weights.w4a4 else no_scale,
        inter, bias13, act_alpha, act_limit, num_pairs, top_k, hidden_size, inter_size, num_experts,
        **epilogue_flags,
        **grouping, BLOCK_N=block_n1, BLOCK_K=block_k1, SCALE_INPUT=spec.scales_input,
        W4A4=moe_weights.w4a4,
        EVEN_K=hidden_size % block_k1 == 0, ALIGNED_SCALES=cfg.fast_scales and hidden_size % block_k1 == 0,
        **_decode_flags(cfg, emulate_bf16), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    block_n2 = _clamp_block(cfg.block_n2, hidden_size, 16)
    block_k2 = _clamp_block(cfg.block_k, inter_size, 32)
    alloc = torch.zeros if expert_mask is not None else torch.empty  # rows of other ranks' pairs are not written
    pair_out = alloc(num_pairs, hidden_size, dtype=torch.float32, device=device)
    num_tiles2 = _cdiv(hidden_size, block_n2)
    combine = cfg.fused_combine and expert_mask is None
    out, counts = pair_out, flat_ids  # never touched unless combine
    if combine:
        out = torch.empty(num_tokens, hidden_size, dtype=torch.float32, device=device)
        counts = moe_weights.counters("gemm2", num_tokens, num_tiles2, device)
    kernels.gemm2_combine_kernel[(max_blocks, num_tiles2)](
        inter, flat_weights, *owners, w2_packed, moe_weights.w2_scale, moe_weights.alpha2, pair_out, out, counts,
        bias2, num_pairs, top_k, hidden_size, inter_size, num_experts, HAS_BIAS=epilogue_flags["HAS_BIAS"],
        **grouping, BLOCK_N=block_n2, BLOCK_K=block_k2, SCALE_INPUT=spec.scales_input,
        EVEN_K=inter_size % block_k2 == 0, ALIGNED_SCALES=cfg.fast_scales and inter_size % block_k2 == 0,
        COMBINE=combine, **_decode_flags(cfg, emulate_bf16), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    if combine:
        return out
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


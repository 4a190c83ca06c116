"""fp4kit's Triton fused NVFP4 MoE against `moe_reference` on the same quantized (then dequantized) weights.

Runs compiled on a CUDA GPU, else under TRITON_INTERPRET=1 on tiny shapes (the interpreter is slow: each case
below costs about a second on one core).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Before anything imports triton: the interpreter switch is read when triton and the kernels are first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from fp4kit.errors import Fp4kitError  # noqa: E402
from fp4kit.families.routing import RoutingSpec, route  # noqa: E402
from fp4kit.verify.reference import dequantize_experts, moe_reference, quantize_experts  # noqa: E402
from fp4kit.verify.triton_moe import KernelConfig, TritonMoeWeights, fused_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Large tiles: fewer interpreted programs; H and I below are not multiples of them, so the tails are exercised.
CONFIG = KernelConfig(block_m=16, block_n1=64, block_n2=128, block_k=128, num_warps=4, num_stages=2)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm().clamp_min(1e-30))


def _setup(seed: int, num_tokens: int, num_experts: int, hidden_size: int, inter_size: int):
    generator = torch.Generator().manual_seed(seed)
    w13 = quantize_experts(torch.randn(num_experts, 2 * inter_size, hidden_size, generator=generator) * 0.1)
    w2 = quantize_experts(torch.randn(num_experts, hidden_size, inter_size, generator=generator) * 0.1)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    return w13, w2, hidden, logits


def _activation_divisors(num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    amax13 = 2.0 + 3.0 * torch.rand(num_experts, generator=generator, dtype=torch.float64)
    amax2 = 0.05 + 0.3 * torch.rand(num_experts, generator=generator, dtype=torch.float64)
    return amax13 / 2688, amax2 / 2688


CASES = [
    # (spec, tokens, hidden, inter)
    (RoutingSpec("softmax_topk", 8, 2), 5, 64, 32),
    (RoutingSpec("sigmoid_grouped_topk", 8, 3, True, 4, 2, 2.5), 7, 96, 48),
    (RoutingSpec("llama4_sigmoid_top1", 4, 1), 6, 80, 32),
]


def _routed_case(seed: int, spec: RoutingSpec, num_tokens: int, hidden_size: int, inter_size: int, w4a4: bool):
    """(fused_moe's positional arguments on DEVICE, the fp32 reference output) for one routed random case."""
    w13, w2, hidden, logits = _setup(seed, num_tokens, spec.num_experts, hidden_size, inter_size)
    bias = torch.randn(spec.num_experts) * 0.1 if spec.kind == "sigmoid_grouped_topk" else None
    weights, ids = route(logits, spec, bias)
    divisors = _activation_divisors(spec.num_experts, 7) if w4a4 else None
    expected = moe_reference(
        hidden, weights, ids, dequantize_experts(w13), dequantize_experts(w2), spec, activation_global_div=divisors
    )
    moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, divisors, device=DEVICE)
    return (hidden.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), moe_weights, spec), expected


@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
@pytest.mark.parametrize(("spec", "num_tokens", "hidden_size", "inter_size"), CASES)
def test_kernel_matches_reference(spec: RoutingSpec, num_tokens: int, hidden_size: int, inter_size: int, w4a4: bool):
    args, expected = _routed_case(len(spec.kind) * 10 + int(w4a4), spec, num_tokens, hidden_size, inter_size, w4a4)
    got = fused_moe(*args, config=CONFIG).cpu()
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # W4A16 rounds the intermediate (and Llama-4's scaled input) to bf16; W4A4's operands are exact in bf16.
    assert _relative_error(got, expected) < (1e-4 if w4a4 else 6e-3)


def test_expert_mask_ranks_sum_to_full_output() -> None:
    spec = RoutingSpec("softmax_topk", 8, 2)
    w13, w2, hidden, logits = _setup(11, 6, 8, 64, 32)
    weights, ids = (t.to(DEVICE) for t in route(logits, spec))
    moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, device=DEVICE)
    hidden = hidden.to(DEVICE)
    full = fused_moe(hidden, weights, ids, moe_weights, spec, config=CONFIG)
    owner = torch.arange(8, device=DEVICE) % 2
    per_rank = [fused_moe(hidden, weights, ids, moe_weights, spec, owner == rank, CONFIG) for rank in range(2)]
    torch.testing.assert_close(sum(per_rank), full, rtol=1e-5, atol=1e-6)


def test_nan_router_rows_do_not_disturb_valid_rows() -> None:
    """Padding rows with NaN hidden states and router logits, routed by `route` (distinct ids)."""
    spec = RoutingSpec("softmax_topk", 8, 3)
    w13, w2, hidden, logits = _setup(12, 6, 8, 64, 32)
    hidden[1] = float("nan")
    logits[1] = float("nan")
    logits[4, 2] = float("inf")
    weights, ids = route(logits, spec)
    assert len(set(ids[1].tolist())) == 3
    moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, device=DEVICE)
    got = fused_moe(hidden.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), moe_weights, spec, config=CONFIG).cpu()
    expected = moe_reference(hidden, weights, ids, dequantize_experts(w13), dequantize_experts(w2), spec)
    valid = [0, 2, 3, 4, 5]
    assert bool(torch.isfinite(got[valid]).all())
    assert _relative_error(got[valid], expected[valid]) < 6e-3


def test_align_groups_every_pair_once() -> None:
    from fp4kit.verify import triton_kernels

    generator = torch.Generator().manual_seed(13)
    num_experts, block_m = 6, 4
    ids = torch.randint(0, num_experts, (37,), generator=generator, dtype=torch.int32)
    num_pairs = ids.numel()
    max_blocks = num_pairs // block_m + num_experts
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=DEVICE)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=DEVICE)
    num_padded = torch.empty(1, dtype=torch.int32, device=DEVICE)
    cursor = torch.empty(8, dtype=torch.int32, device=DEVICE)
    triton_kernels.align_kernel[(1,)](
        ids.to(DEVICE), ids.to(DEVICE), sorted_pairs, block_expert, cursor, num_padded,
        num_pairs, num_experts, max_blocks * block_m, max_blocks,
        BLOCK_M=block_m, E_PAD=8, CHUNK=16, HAS_LOCAL=False,
    )  # fmt: skip
    sorted_pairs, block_expert = sorted_pairs.cpu(), block_expert.cpu()
    used = int(num_padded.item())
    counts = torch.bincount(ids.long(), minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    rows = sorted_pairs[:used].view(-1, block_m)
    real = rows[rows < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    for block, expert in zip(rows, block_expert[: used // block_m], strict=True):
        members = block[block < num_pairs].long()
        assert len(members) > 0 and bool((ids[members] == expert).all())
    assert bool((block_expert[used // block_m :] == -1).all())


def test_cpu_without_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = RoutingSpec("softmax_topk", 4, 1)
    w13, w2, hidden, logits = _setup(14, 2, 4, 32, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    weights, ids = route(logits, spec)
    with pytest.raises(Fp4kitError, match="CUDA"):
        fused_moe(hidden, weights, ids, TritonMoeWeights.from_nvfp4(w13, w2), spec)


def _run_ptx(body: str, registers: dict[str, int]) -> dict[str, int]:
    """A tiny interpreter for the PTX subset of `_DEQUANT_PTX` (bf16x2 products computed exactly, then rounded)."""

    def value(token: str) -> int:
        return registers[token] if token in registers else int(token, 0)

    def bf16_pair(word: int) -> torch.Tensor:
        halves = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16)
        return halves.view(torch.bfloat16).double()

    for line in body.strip().splitlines():
        op, _, rest = line.strip().rstrip(";").partition(" ")
        if op in ("{", "}", "") or op.startswith(".reg"):
            continue
        dst, *src = (token.strip() for token in rest.split(","))
        if op == "mov.b32":
            registers[dst] = value(src[0])
        elif op == "prmt.b32":
            source = [(value(src[0]) >> (8 * i)) & 0xFF for i in range(4)] + [
                (value(src[1]) >> (8 * i)) & 0xFF for i in range(4)
            ]
            registers[dst] = sum(source[(value(src[2]) >> (4 * i)) & 7] << (8 * i) for i in range(4))
        elif op == "shl.b32":
            registers[dst] = (value(src[0]) << value(src[1])) & 0xFFFFFFFF
        elif op == "shr.b32":
            registers[dst] = value(src[0]) >> value(src[1])
        elif op == "and.b32":
            registers[dst] = value(src[0]) & value(src[1])
        elif op == "lop3.b32":
            a, b, c, lut = (value(token) for token in src)
            registers[dst] = sum(
                ((lut >> ((((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1))) & 1) << i for i in range(32)
            )
        elif op == "mul.rn.bf16x2":
            product = (bf16_pair(value(src[0])) * bf16_pair(value(src[1]))).to(torch.bfloat16).view(torch.int16)
            registers[dst] = (int(product[0]) & 0xFFFF) | ((int(product[1]) & 0xFFFF) << 16)
        else:
            raise AssertionError(f"unexpected PTX instruction {op}")
    return registers


def test_ptx_decode_matches_e2m1_table_times_scale() -> None:
    """The GPU-only PTX decode, emulated on the CPU: 4 packed bytes -> e2m1 values times their FP8 block scales, exact
    (subnormal e4m3 scales and the bf16 subnormal that 0.5 passes through included). The H200 run also compared it
    bit for bit against the integer decode (docs/verify_kernel_notes.md)."""
    from fp4kit.nvfp4 import E2M1_MAGNITUDES
    from fp4kit.verify.triton_kernels import _DEQUANT_PTX

    table = list(E2M1_MAGNITUDES) + [-v for v in E2M1_MAGNITUDES]
    generator = torch.Generator().manual_seed(15)
    scales = torch.tensor([0.001953125, 0.013671875, 0.5, 1.0, 4.5, 64.0, 448.0, 13.0])

    def bf16_word(low: float, high: float) -> int:
        bits = torch.tensor([low, high]).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
        return int(bits[0]) | (int(bits[1]) << 16)

    for _ in range(40):
        packed = [int(b) for b in torch.randint(0, 256, (4,), generator=generator)]
        scale = [float(s) for s in scales[torch.randint(0, len(scales), (4,), generator=generator)]]
        word = packed[0] | packed[1] << 8 | packed[2] << 16 | packed[3] << 24
        out = _run_ptx(_DEQUANT_PTX.value, {"$4": word, "$5": bf16_word(*scale[:2]), "$6": bf16_word(*scale[2:])})
        low_nibbles = [table[b & 15] * s for b, s in zip(packed, scale, strict=True)]
        high_nibbles = [table[b >> 4] * s for b, s in zip(packed, scale, strict=True)]
        expected = [low_nibbles[:2], low_nibbles[2:], high_nibbles[:2], high_nibbles[2:]]
        for register, pair in zip(("$0", "$1", "$2", "$3"), expected, strict=True):
            assert out[register] == bf16_word(*pair)


@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_fast_scales_are_bit_identical(w4a4: bool) -> None:
    """`KernelConfig.fast_scales` (FP8 scale bits placed in an fp32 and multiplied by 2^120, vector scale loads)
    gives the integer decode's output bit for bit, with every finite E4M3 byte (subnormals, 0, both signs) used as a
    block scale somewhere, on a shape whose K is a multiple of BLOCK_K (the aligned-scale path) and one that is not."""
    from dataclasses import replace

    spec = RoutingSpec("softmax_topk", 4, 2)
    for hidden_size, inter_size in ((128, 128), (80, 48)):
        w13, w2, hidden, logits = _setup(21, 6, spec.num_experts, hidden_size, inter_size)
        finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
        for tensor in (w13, w2):
            raw = tensor.block_scale.view(torch.uint8).reshape(-1)
            raw[: min(len(raw), len(finite))] = finite[: len(raw)]
        weights, ids = route(logits, spec)
        divisors = _activation_divisors(spec.num_experts, 7) if w4a4 else None
        moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, divisors, device=DEVICE)
        args = (hidden.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), moe_weights, spec)
        config = replace(CONFIG, block_k=64, fast_dequant=False, fast_scales=False)
        plain = fused_moe(*args, config=config)
        fast = fused_moe(*args, config=replace(config, fast_scales=True))
        assert torch.equal(plain.isnan(), fast.isnan())
        assert torch.equal(plain.nan_to_num(), fast.nan_to_num())


def test_shuffle_packed_is_a_bit_permutation_of_each_word() -> None:
    """Each of the 32 bits of a word lands on a distinct bit of the same word: one-hot words stay one-hot, and no two
    inputs share an output bit."""
    from fp4kit.verify.triton_moe import shuffle_packed

    one_hot = torch.zeros(32, 4, dtype=torch.uint8)
    for bit in range(32):
        one_hot[bit, bit // 8] = 1 << (bit % 8)
    out = shuffle_packed(one_hot.view(32, 1, 4)).view(32, 4).to(torch.int64)
    words = out[:, 0] | out[:, 1] << 8 | out[:, 2] << 16 | out[:, 3] << 24
    assert all(int(w).bit_count() == 1 for w in words)
    assert len({int(w) for w in words}) == 32


def test_shuffled_ptx_decode_matches_e2m1_table_times_scale() -> None:
    """The GPU-only decode of the pre-shuffled layout, emulated: random rows of 4 bytes shuffled by
    `shuffle_packed`, decoded by `_DEQUANT_SHUFFLED_PTX` into the even and odd element pairs, equal to the e2m1
    table times the block scale element by element (fails if any bit of `SHUFFLE_BITS` or of the PTX is off)."""
    from fp4kit.nvfp4 import E2M1_MAGNITUDES
    from fp4kit.verify.triton_kernels import _DEQUANT_SHUFFLED_FOLDED_PTX, _DEQUANT_SHUFFLED_PTX
    from fp4kit.verify.triton_moe import shuffle_packed

    table = list(E2M1_MAGNITUDES) + [-v for v in E2M1_MAGNITUDES]
    generator = torch.Generator().manual_seed(16)
    scales = torch.tensor([0.001953125, 0.013671875, 0.5, 1.0, 4.5, 64.0, 448.0, 13.0])

    def bf16_word(low: float, high: float) -> int:
        bits = torch.tensor([low, high]).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
        return int(bits[0]) | (int(bits[1]) << 16)

    packed_rows = torch.randint(0, 256, (200, 4), generator=generator, dtype=torch.uint8)
    packed_rows[:16, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code in both nibbles of a byte
    shuffled_rows = shuffle_packed(packed_rows)
    assert not torch.equal(shuffled_rows, packed_rows)
    for packed_row, shuffled_row in zip(packed_rows.tolist(), shuffled_rows.tolist(), strict=True):
        scale = float(scales[torch.randint(0, len(scales), (1,), generator=generator)])
        word = shuffled_row[0] | shuffled_row[1] << 8 | shuffled_row[2] << 16 | shuffled_row[3] << 24
        # plain, and folded: scale operand s · 2^119, values e2m1 · s · 2^-7
        for ptx, scale_in, factor in ((_DEQUANT_SHUFFLED_PTX, scale, 1.0),
                                      (_DEQUANT_SHUFFLED_FOLDED_PTX, scale * 2.0**119, 2.0**-7)):  # fmt: skip
            out = _run_ptx(ptx.value, {"$4": word, "$5": bf16_word(scale_in, scale_in),
                                       "$6": bf16_word(scale_in, scale_in)})  # fmt: skip
            even = [table[b & 15] * scale * factor for b in packed_row]
            odd = [table[b >> 4] * scale * factor for b in packed_row]
            for register, pair in zip(("$0", "$1", "$2", "$3"), (even[:2], even[2:], odd[:2], odd[2:]), strict=True):
                assert out[register] == bf16_word(*pair)


@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_shuffled_weights_are_bit_identical(w4a4: bool) -> None:
    """`KernelConfig.shuffled` (pre-shuffled packed weights, cached on the weights object) gives the current
    kernel's output bit for bit, with and without fast_scales and fold_bias, on a K that is a multiple of BLOCK_K and
    one that is not (masked tail words)."""
    from dataclasses import replace

    spec = RoutingSpec("softmax_topk", 4, 2)
    for hidden_size, inter_size in ((128, 128), (80, 48)):
        w13, w2, hidden, logits = _setup(22, 6, spec.num_experts, hidden_size, inter_size)
        weights, ids = route(logits, spec)
        divisors = _activation_divisors(spec.num_experts, 7) if w4a4 else None
        moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, divisors, device=DEVICE)
        args = (hidden.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), moe_weights, spec)
        config = replace(CONFIG, block_k=64, num_warps=2, fast_scales=False, shuffled=False, fold_bias=False)
        plain = {}  # per warp count: on sm90 4 warps may take wgmma, which sums in another order than mma.sync
        variants = [(2, False, False), (2, True, True), (1, True, False), (4, True, True)]
        for num_warps, fast_scales, fold_bias in variants:  # 4 warps: the plain layout (wgmma's operand on sm90)
            if num_warps not in plain:
                plain[num_warps] = fused_moe(*args, config=replace(config, num_warps=num_warps))
            variant = replace(config, num_warps=num_warps, shuffled=True, fast_scales=fast_scales, fold_bias=fold_bias)
            shuffled = fused_moe(*args, config=variant)
            assert torch.equal(plain[num_warps].isnan(), shuffled.isnan())
            assert torch.equal(plain[num_warps].nan_to_num(), shuffled.nan_to_num())
        assert moe_weights.shuffled_packed() is moe_weights.shuffled_packed()


SLICED = KernelConfig(block_n2=32, block_k=64, num_warps=2, slice_i=32)


@pytest.mark.parametrize("grouping", ["align", "pair"])
@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
@pytest.mark.parametrize(("spec", "num_tokens", "hidden_size", "inter_size"), CASES)
def test_sliced_kernel_matches_reference_and_two_gemms(
    spec: RoutingSpec, num_tokens: int, hidden_size: int, inter_size: int, w4a4: bool, grouping: str
) -> None:
    """`KernelConfig.slice_i`: both GEMMs in one launch per intermediate slice (I = 48 leaves a zero-padded half
    slice, H = 80 and 96 a partial last w2 row tile), pairs grouped by expert or one per program: the reference's
    output, and the two-GEMM kernel's up to the order of GEMM2's fp32 sums."""
    from dataclasses import replace

    args, expected = _routed_case(len(spec.kind) + 3 * int(w4a4), spec, num_tokens, hidden_size, inter_size, w4a4)
    two_gemms = fused_moe(*args, config=replace(SLICED, slice_i=0)).cpu()
    got = fused_moe(*args, config=replace(SLICED, grouping=grouping)).cpu()
    assert _relative_error(got, expected) < (1e-4 if w4a4 else 6e-3)
    assert _relative_error(got, two_gemms) < 1e-5


@pytest.mark.parametrize("grouping", ["align", "pair"])
def test_sliced_kernel_expert_mask_and_nan_rows(grouping: str) -> None:
    """EP ranks of the sliced kernel sum to the full output; NaN router rows (distinct ids from `route`) leave the
    valid rows as the reference computes them."""
    from dataclasses import replace

    spec = RoutingSpec("softmax_topk", 8, 3)
    w13, w2, hidden, logits = _setup(24, 6, 8, 64, 64)
    hidden[1] = float("nan")
    logits[1] = float("nan")
    logits[4, 2] = float("inf")
    weights, ids = route(logits, spec)
    moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, device=DEVICE)
    config = replace(SLICED, grouping=grouping)
    args = (hidden.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), moe_weights, spec)
    full = fused_moe(*args, config=config)
    owner = torch.arange(8, device=DEVICE) % 2
    per_rank = [fused_moe(*args, owner == rank, config) for rank in range(2)]
    valid = [0, 2, 3, 4, 5]
    torch.testing.assert_close(sum(per_rank)[valid], full[valid], rtol=1e-5, atol=1e-6)
    expected = moe_reference(hidden, weights, ids, dequantize_experts(w13), dequantize_experts(w2), spec)
    assert bool(torch.isfinite(full[valid]).all())
    assert _relative_error(full.cpu()[valid], expected[valid]) < 6e-3


def test_slice_columns_stores_each_slice_contiguously() -> None:
    from fp4kit.verify.triton_moe import slice_columns

    t = torch.arange(2 * 3 * 10, dtype=torch.int64).view(2, 3, 10)
    sliced = slice_columns(t, 4)
    assert sliced.shape == (2, 3, 3, 4) and sliced.is_contiguous()
    for slice_index in range(3):
        width = min(4, 10 - 4 * slice_index)
        assert torch.equal(sliced[:, slice_index, :, :width], t[:, :, 4 * slice_index : 4 * slice_index + width])
        assert bool((sliced[:, slice_index, :, width:] == 0).all())


@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_two_gemms_groupings_and_fused_combine(w4a4: bool) -> None:
    """The two-GEMM path with one pair per program (no `align_kernel`), with the k-slot sum in GEMM2's launch or after
    it: the aligned kernel's output, with NaN router rows, Llama-4's scaled input, and EP ranks that sum to the full
    output."""
    from dataclasses import replace

    for spec, hidden_size, inter_size in ((RoutingSpec("softmax_topk", 8, 3), 64, 48),
                                          (RoutingSpec("llama4_sigmoid_top1", 4, 1), 80, 32)):  # fmt: skip
        w13, w2, hidden, logits = _setup(25, 5, spec.num_experts, hidden_size, inter_size)
        hidden[1] = float("nan")
        logits[1] = float("nan")
        weights, ids = route(logits, spec)
        divisors = _activation_divisors(spec.num_experts, 7) if w4a4 else None
        moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, divisors, device=DEVICE)
        args = (hidden.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), moe_weights, spec)
        config = replace(CONFIG, num_warps=2, block_k=64, block_n2=32)
        aligned = fused_moe(*args, config=config).cpu()
        valid = [0, 2, 3, 4]
        for grouping, fused_combine in (("pair", False), ("pair", True), ("align", True)):
            variant = replace(config, grouping=grouping, fused_combine=fused_combine)
            got = fused_moe(*args, config=variant).cpu()
            assert bool(torch.isfinite(got[valid]).all())
            torch.testing.assert_close(got[valid], aligned[valid], rtol=1e-6, atol=1e-7)
            owner = torch.arange(spec.num_experts, device=DEVICE) % 2
            per_rank = [fused_moe(*args, owner == rank, variant).cpu() for rank in range(2)]
            torch.testing.assert_close(sum(per_rank)[valid], got[valid], rtol=1e-5, atol=1e-6)


def test_fused_combine_leaves_its_counters_at_zero() -> None:
    """fused_combine on 40 tokens (3 aligned blocks per expert, 320 pairs): GEMM2's counters are zero again after a
    call, so a second call (here on other tokens) is right too."""
    from dataclasses import replace

    spec = RoutingSpec("softmax_topk", 8, 8)
    w13, w2, hidden, logits = _setup(26, 40, 8, 64, 32)
    weights, ids = route(logits, spec)
    moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, device=DEVICE)
    dense13, dense2 = dequantize_experts(w13), dequantize_experts(w2)
    config = replace(CONFIG, num_warps=2, block_k=32, block_n1=32, block_n2=16, fused_combine=True)
    for flip in (False, True):
        tokens = hidden.flip(0) if flip else hidden
        got = fused_moe(tokens.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), moe_weights, spec, config=config)
        expected = moe_reference(tokens, weights, ids, dense13, dense2, spec)
        assert _relative_error(got.cpu(), expected) < 6e-3
    counters = {k[1]: v for k, v in moe_weights._cache.items() if k[0] == "counters"}
    assert sorted(counters) == ["gemm2"] and not any(bool(v.any()) for v in counters.values())


GPT_OSS_CONFIGS = {
    "two-gemms": CONFIG,
    "sliced": KernelConfig(block_n2=64, block_k=64, slice_i=32, grouping="pair"),
    "fused-combine": KernelConfig(block_m=16, block_n1=32, block_n2=64, block_k=32, num_warps=4, fused_combine=True),
}


@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_deepseek_v4_clamped_swiglu_matches_reference(w4a4: bool) -> None:
    """DeepSeek-V4's experts (silu of the clamped gate times the clamped up) in the kernel, against the reference
    (whose activation tests/test_deepseek_v4.py checks against transformers' DeepseekV4Experts)."""
    from fp4kit.families.activation import silu_clamped

    spec, hidden_size, inter_size = RoutingSpec("sqrtsoftplus_topk", 8, 2), 64, 32
    w13, w2, hidden, logits = _setup(23, 5, 8, hidden_size, inter_size)
    hidden = (hidden.float() * 12).to(torch.bfloat16)  # gate and up sums beyond the clamp
    weights, ids = route(logits, spec)
    activation = silu_clamped(2.0)
    divisors = (torch.full((8,), 40 / 2688, dtype=torch.float64), torch.full((8,), 400 / 2688, dtype=torch.float64))
    divisors = divisors if w4a4 else None
    dense13, dense2 = dequantize_experts(w13), dequantize_experts(w2)
    assert bool((hidden.float() @ dense13[0].T).abs().max() > 2)
    expected = moe_reference(hidden, weights, ids, dense13, dense2, spec, activation_global_div=divisors,
                             activation=activation)
    silu = moe_reference(hidden, weights, ids, dense13, dense2, spec, activation_global_div=divisors)
    moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, divisors, device=DEVICE, activation=activation)
    got = fused_moe(hidden.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), moe_weights, spec, config=CONFIG).cpu()
    error = _relative_error(got, expected)
    assert error < (1e-4 if w4a4 else 6e-3), error
    assert _relative_error(silu, expected) > 0.1  # the test would see a kernel that ignored the clamp


@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
@pytest.mark.parametrize("config", list(GPT_OSS_CONFIGS))
def test_gpt_oss_activation_and_biases_match_reference(config: str, w4a4: bool) -> None:
    """gpt-oss's experts (clamped SwiGLU with (up + 1), w13 and w2 output biases) in every kernel path, against the
    reference that matches transformers' GptOssMLP (tests/test_reference_moe.py); EP ranks sum to the whole."""
    from fp4kit.families.activation import swiglu_oai

    spec, hidden_size, inter_size = RoutingSpec("topk_softmax", 8, 2), 64, 32
    w13, w2, hidden, logits = _setup(21, 5, 8, hidden_size, inter_size)
    hidden = (hidden.float() * 12).to(torch.bfloat16)  # gate and up sums beyond the clamp at 7
    generator = torch.Generator().manual_seed(22)
    biases = (torch.randn(8, 2 * inter_size, generator=generator), torch.randn(8, hidden_size, generator=generator))
    weights, ids = route(logits, spec)
    activation = swiglu_oai()
    divisors = (torch.full((8,), 40 / 2688, dtype=torch.float64), torch.full((8,), 400 / 2688, dtype=torch.float64))
    divisors = divisors if w4a4 else None
    dense13, dense2 = dequantize_experts(w13), dequantize_experts(w2)
    assert bool((hidden.float() @ dense13[0].T).abs().max() > 7)
    expected = moe_reference(hidden, weights, ids, dense13, dense2, spec, activation_global_div=divisors,
                             activation=activation, biases=biases)
    silu = moe_reference(hidden, weights, ids, dense13, dense2, spec, activation_global_div=divisors)
    moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, divisors, device=DEVICE, activation=activation, biases=biases)
    args = (hidden.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), moe_weights, spec)
    cfg = GPT_OSS_CONFIGS[config]
    got = fused_moe(*args, config=cfg).cpu()
    error = _relative_error(got, expected)
    assert error < (1e-4 if w4a4 else 6e-3), error
    assert _relative_error(silu, expected) > 0.1  # the test would see a kernel that ignored activation or biases
    owner = torch.arange(8, device=DEVICE) % 2
    per_rank = [fused_moe(*args, owner == rank, cfg).cpu() for rank in range(2)]
    torch.testing.assert_close(sum(per_rank), got, rtol=1e-5, atol=1e-4)

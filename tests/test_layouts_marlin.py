"""Marlin NVFP4 layout: exact inverse, and equality with an independent implementation of vLLM's reference.

Sources: docs/layouts.md; vLLM ``model_executor/layers/quantization/utils/marlin_utils_test.py`` (get_weight_perm,
marlin_permute_weights, marlin_weights: the pure-python reference of ``gptq_marlin_repack``),
``marlin_utils.py`` (get_scale_perms, marlin_permute_scales), ``marlin_utils_fp4.py``
(prepare_moe_fp4_layer_for_marlin: qweight = packed.view(int32).T; nvfp4_marlin_process_scales,
_nvfp4_compute_scale_factor, nvfp4_marlin_process_global_scale) and ``csrc/moe/marlin_moe_wna16/ops.cu``
(b_scales must be float8_e4m3fn [E, K/16, N]; b_q_weight [E, K/16, 2N]; thread tiles) and
``marlin_utils.py::check_moe_marlin_supports_layer`` (hidden % 128, intermediate % 64).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4kit.errors import Fp4kitError
from fp4kit.layouts import marlin
from fp4kit.nvfp4 import NVFP4Tensor, quantize_group

SHAPES = [(1, 128, 64), (2, 128, 128), (3, 128, 192), (2, 256, 64)]


def random_layer(experts: int, hidden: int, intermediate: int, seed: int, scale_bytes: tuple[int, int] = (0, 0x7E)):
    generator = torch.Generator().manual_seed(seed)

    def tensor(rows: int, cols: int) -> NVFP4Tensor:
        packed = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, generator=generator)
        scales = torch.randint(scale_bytes[0], scale_bytes[1] + 1, (experts, rows, cols // 16), dtype=torch.uint8,
                               generator=generator)
        divisor = torch.rand(experts, dtype=torch.float64, generator=generator) + 1e-6
        return NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), divisor)

    return tensor(2 * intermediate, hidden), tensor(hidden, intermediate), None, None


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def reference_weight_perm() -> np.ndarray:
    """get_weight_perm(num_bits=4, is_a_8bit=False) as marlin_utils_test.py defines it."""
    order: list[int] = []
    for i in range(32):
        lane = []
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1):
                lane.append(16 * row + i // 4 + 8 * block)
        for j in range(4):
            order.extend(p + 256 * j for p in lane)
    return np.array(order).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].ravel()


def reference_marlin_weights(packed: torch.Tensor) -> torch.Tensor:
    """One expert's packed [N, K/2] bytes -> GPTQ int32 [K/8, N] -> codes [K, N] -> marlin_weights(...)."""
    size_n, size_k = packed.shape[0], packed.shape[1] * 2
    gptq = packed.contiguous().view(torch.int32).T.numpy().astype(np.uint32)  # [K/8, N]
    codes = np.zeros((size_k, size_n), dtype=np.uint32)
    for nibble in range(8):
        codes[nibble::8] = (gptq >> (4 * nibble)) & 0xF
    tiles = codes.reshape(size_k // 16, 16, size_n // 16, 16).transpose(0, 2, 1, 3).reshape(size_k // 16, -1)
    permuted = tiles.reshape(-1, 1024)[:, reference_weight_perm()].reshape(tiles.shape)
    result = np.zeros((permuted.shape[0], permuted.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        result |= permuted[:, i::8] << (4 * i)
    return torch.from_numpy(result.astype(np.int32))


def reference_scale_factor(block_scale: torch.Tensor, act_dtype: torch.dtype) -> float:
    if act_dtype == torch.half:
        return 1.0
    scaled = block_scale.to(act_dtype).float() * 2**7
    nonzero = scaled[scaled > 0]
    if nonzero.numel() and nonzero.max() < 448 * 2**7:
        return (448 * 2**7 / nonzero.max()).log2().floor().exp2().item()
    return 1.0


def visible_scales(block_scale: torch.Tensor, factor: float) -> torch.Tensor:
    """The block scales the Marlin kernel sees: those with s * f * 2^7 < 2 are stored as 0."""
    small = block_scale.to(torch.float64) * factor * 2**7 < 2
    return torch.where(small, torch.zeros_like(block_scale.view(torch.uint8)), block_scale.view(torch.uint8)).view(
        torch.float8_e4m3fn)


def reference_marlin_scales(block_scale: torch.Tensor, factor: float, act_dtype: torch.dtype) -> torch.Tensor:
    """One expert's FP8 [N, K/16] -> marlin_permute_scales -> nvfp4_marlin_process_scales, in fp16 like vLLM."""
    size_n = block_scale.shape[0]
    scales = block_scale.T.to(act_dtype)
    perm = [i + 8 * j for i in range(8) for j in range(8)]
    scales = scales.reshape(-1, 64)[:, perm].reshape(-1, size_n).to(torch.half)
    scales = scales.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(scales.shape[0], -1)
    if factor > 1:
        scales = (scales.float() * factor).to(torch.half)
    scales = scales * 2**7
    scales[scales < 2] = 0
    shifted = scales.view(torch.int16) << 1
    return shifted.view(torch.float8_e4m3fn)[:, 1::2].contiguous()


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("experts, hidden, intermediate", SHAPES)
def test_equals_vllm_reference(experts: int, hidden: int, intermediate: int, act_dtype: torch.dtype) -> None:
    # scale bytes 1..0x30: subnormals down to 2^-9 and a largest scale of 0.5, so bf16 lifts it by f = 2^9 (nothing
    # zeroed) while fp16 keeps f = 1 and zeroes the scales below 2^-6
    w13, w2, _, _ = random_layer(experts, hidden, intermediate, seed=hidden + intermediate, scale_bytes=(1, 0x30))
    ours = marlin.transform(w13, w2, None, None, act_dtype=act_dtype)
    exponent = 119 if act_dtype == torch.bfloat16 else 7
    for name, tensor, index in (("w1", w13, "1"), ("w2", w2, "2")):
        factor = reference_scale_factor(tensor.block_scale, act_dtype)
        assert factor == (512.0 if act_dtype == torch.bfloat16 else 1.0)
        for e in range(experts):
            assert torch.equal(ours[name][e], reference_marlin_weights(tensor.packed[e]))
            assert same_bytes(ours[f"{name}_scale"][e], reference_marlin_scales(tensor.block_scale[e], factor,
                                                                                 act_dtype))
        expected_global = tensor.global_scale_div.to(torch.float32) * 2.0**exponent / factor
        assert same_bytes(ours[f"global_scale{index}"], expected_global)


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("experts, hidden, intermediate", SHAPES)
def test_round_trip(experts: int, hidden: int, intermediate: int, act_dtype: torch.dtype) -> None:
    ranges = [(1, 0x30), (0x08, 0x7E), (0, 0)] if act_dtype == torch.bfloat16 else [(0, 0x7E), (0, 0)]
    for seed, scale_bytes in enumerate(ranges):
        w13, w2, _, _ = random_layer(experts, hidden, intermediate, seed, scale_bytes)
        if scale_bytes == (0, 0):  # adversarial: all-zero scales, every code -0
            w13.packed.fill_(0x88)
        s13 = torch.rand(experts, dtype=torch.float64)
        tensors = marlin.transform(w13, w2, s13, None, act_dtype=act_dtype)
        meta = marlin.describe(w13, w2, s13, None, act_dtype)
        back13, back2, back_s13, back_s2 = marlin.undo(tensors, meta)
        for ours, theirs, key in ((back13, w13, "w13"), (back2, w2, "w2")):
            factor = meta.options[f"{key}_scale_factor"]
            expected = visible_scales(theirs.block_scale, factor)
            zeroed = int((expected.view(torch.uint8) != theirs.block_scale.view(torch.uint8)).sum())
            assert meta.options[f"{key}_zeroed_scales"] == zeroed
            assert same_bytes(ours.packed, theirs.packed) and same_bytes(ours.block_scale, expected)
            assert same_bytes(ours.global_scale_div, theirs.global_scale_div)
        assert same_bytes(back_s13, s13) and back_s2 is None


def test_round_trip_real_quantized_weights() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(2, 3 * 64, 128, generator=generator).to(torch.bfloat16)
    weights[:, :, :32] = 0  # all-zero blocks get the 0.125 scale
    gate_up = [quantize_group([w[:128]])[0] for w in weights]
    down = [quantize_group([w[128:].reshape(128, 64)])[0] for w in weights]

    def stack(parts: list[NVFP4Tensor]) -> NVFP4Tensor:
        return NVFP4Tensor(torch.stack([p.packed for p in parts]), torch.stack([p.block_scale for p in parts]),
                           torch.stack([p.global_scale_div for p in parts]))

    w13, w2 = stack(gate_up), stack(down)
    back13, back2, _, _ = marlin.undo(marlin.transform(w13, w2, None, None), marlin.describe(w13, w2, None, None))
    assert same_bytes(back13.packed, w13.packed) and same_bytes(back13.block_scale, w13.block_scale)
    assert same_bytes(back2.packed, w2.packed) and same_bytes(back2.block_scale, w2.block_scale)


def test_wide_scale_range_zeroes_the_smallest_and_counts_them() -> None:
    w13, w2, _, _ = random_layer(1, 128, 64, seed=1, scale_bytes=(1, 0x30))
    w13.block_scale.view(torch.uint8)[0, 0, 0] = 0x7E  # 448 next to 2^-9: f = 1, scales below 2^-6 become 0
    meta = marlin.describe(w13, w2, None, None, act_dtype=torch.bfloat16)
    assert meta.options["w13_scale_factor"] == 1.0 and meta.options["w2_scale_factor"] == 512.0
    below = int((w13.block_scale.to(torch.float64) * 2**7 < 2).sum() - (w13.block_scale.to(torch.float64) == 0).sum())
    assert meta.options["w13_zeroed_scales"] == below > 0 and meta.options["w2_zeroed_scales"] == 0
    back13, _, _, _ = marlin.undo(marlin.transform(w13, w2, None, None), meta)
    assert same_bytes(back13.block_scale, visible_scales(w13.block_scale, 1.0))
    w2.block_scale.view(torch.uint8)[0, 0, 0] = 0x80  # -0
    with pytest.raises(Fp4kitError, match="sign"):
        marlin.transform(w13, w2, None, None, act_dtype=torch.float16)


def test_undo_checks_global_scale_and_shapes() -> None:
    w13, w2, _, _ = random_layer(2, 128, 64, seed=2, scale_bytes=(8, 0x40))
    meta = marlin.describe(w13, w2, None, None)
    tensors = marlin.transform(w13, w2, None, None)
    tensors["global_scale2"] = tensors["global_scale2"] * 2
    with pytest.raises(Fp4kitError, match="global_scale2"):
        marlin.undo(tensors, meta)
    tensors = marlin.transform(w13, w2, None, None)
    tensors["w1"] = tensors["w1"][:1]
    with pytest.raises(Fp4kitError, match="w1 is"):
        marlin.undo(tensors, meta)


def test_check_shapes() -> None:
    marlin.check_shapes(128, 2048, 768)
    with pytest.raises(Fp4kitError, match="hidden size H = 2112"):
        marlin.check_shapes(128, 2112, 768)  # a multiple of 64 but not of 128
    with pytest.raises(Fp4kitError, match="intermediate size I = 96"):
        marlin.check_shapes(128, 2048, 96)
    with pytest.raises(Fp4kitError, match="bfloat16 or float16"):
        marlin.describe(*random_layer(1, 128, 64, seed=0)[:2], None, None, act_dtype=torch.float32)


def test_repack_of_a_view_at_any_byte_offset() -> None:
    w13 = random_layer(2, 128, 64, seed=11)[0]
    shifted = torch.empty(w13.packed.numel() + 1, dtype=torch.uint8)
    shifted[1:] = w13.packed.reshape(-1)
    view = shifted[1:].view(w13.packed.shape)  # storage offset 1: no int64 view of it exists
    expected = torch.stack([reference_marlin_weights(expert) for expert in w13.packed])
    assert torch.equal(marlin.repack_weights(view), expected)

"""NVFP4 numerics against compressed-tensors' own functions (the math llm-compressor uses), bit for bit.

Reference: compressed_tensors/quantization/utils/helpers.py (generate_gparam, calculate_qparams),
compressed_tensors/quantization/lifecycle/forward_helpers.py (_quantize), compressors/nvfp4/helpers.py (pack).
"""

import pytest
import torch

from fp4kit.nvfp4 import (
    E2M1_MAGNITUDES,
    e2m1_codes,
    global_scale_mul,
    pack_codes,
    quantize,
    quantize_group,
    quantize_stacked,
    unpack_codes,
    unpack_e2m1,
)


def ct_reference(weight: torch.Tensor, global_absmax: torch.Tensor | None = None):
    """What llm-compressor stores for a bf16 weight: (packed, block scale, global multiplier)."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                            scale_dtype=torch.float8_e4m3fn)
    amax = weight.abs().amax() if global_absmax is None else global_absmax
    gscale = generate_gparam(-amax.reshape(1), amax.reshape(1))
    blocks = weight.unflatten(-1, (-1, 16))
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gscale)
    q = ct_quantize(weight, scale, None, args, global_scale=gscale)
    return pack_fp4_to_uint8(q), scale.to(torch.float8_e4m3fn), gscale


def adversarial(kind: str, gen: torch.Generator) -> torch.Tensor:
    n, k = 48, 128
    w = torch.randn(n, k, generator=gen)
    if kind == "zeros_blocks":
        w[::3, :16] = 0
        w[5] = 0
        w[9, 16:40] = -0.0
    elif kind == "outlier":
        w *= 1e-3
        w[7, 33] = 1e4
    elif kind == "denormal":
        w[: n // 2] *= 1e-38
    elif kind == "ties":
        # Multiples of 1/4 of each block's max: many land exactly on E2M1 rounding midpoints.
        w = torch.randint(-24, 25, (n, k), generator=gen).float() / 4
        w[:, ::16] = 6.0
    elif kind == "range":
        w *= torch.logspace(-6, 6, n).unsqueeze(1)
    elif kind == "all_zero":
        w = torch.zeros(n, k)
    elif kind == "vanishing":  # 2688 / amax overflows: the global scale falls back to 1
        w *= 1e-37
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["normal", "zeros_blocks", "outlier", "denormal", "ties", "range", "all_zero",
                                  "vanishing"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_quantize_matches_compressed_tensors(kind, seed, native):
    w = adversarial(kind, torch.Generator().manual_seed(seed))
    packed, scale, gscale = ct_reference(w)
    q = quantize_group([w], native=native)[0]
    assert torch.equal(q.global_scale_mul_fp32.reshape(1), gscale)
    assert torch.equal(q.block_scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(q.packed, packed)


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_fused_group_shares_global_scale_like_compressed_tensors(native):
    gen = torch.Generator().manual_seed(5)
    gate = torch.randn(32, 64, generator=gen).bfloat16()
    up = (3 * torch.randn(32, 64, generator=gen)).bfloat16()
    q_gate, q_up = quantize_group([gate, up], native=native)
    assert torch.equal(q_gate.global_scale_div, q_up.global_scale_div)
    amax = torch.maximum(gate.abs().amax(), up.abs().amax())
    for w, q in ((gate, q_gate), (up, q_up)):
        packed, scale, _ = ct_reference(w, amax)
        assert torch.equal(q.packed, packed)
        assert torch.equal(q.block_scale.view(torch.uint8), scale.view(torch.uint8))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_stacked_groups_equal_group_by_group(seed, native):
    """Each entry of a stack keeps its own global scale: groups of very different range side by side (one all
    zero, one denormal, one with an outlier) give the bytes quantize_group gives each alone."""
    gen = torch.Generator().manual_seed(seed)
    kinds = ["normal", "zeros_blocks", "outlier", "denormal", "ties", "range", "vanishing"]
    groups = [[adversarial(kind, gen)[:16], adversarial(kind, gen)[16:48]] for kind in kinds]
    groups.append([torch.zeros(16, 128, dtype=torch.bfloat16), torch.zeros(32, 128, dtype=torch.bfloat16)])
    groups.append([torch.zeros(16, 128, dtype=torch.bfloat16), adversarial("normal", gen)[:32]])
    stacked = quantize_stacked(torch.stack([torch.cat(g) for g in groups]), native=native)
    assert stacked.global_scale_div.shape == (len(groups),)
    for b, group in enumerate(groups):
        for q, rows in zip(quantize_group(group), (slice(0, 16), slice(16, 48)), strict=True):
            assert torch.equal(stacked.global_scale_div[b], q.global_scale_div)
            assert torch.equal(stacked.packed[b, rows], q.packed)
            assert torch.equal(stacked.block_scale[b, rows].view(torch.uint8), q.block_scale.view(torch.uint8))
    dense = stacked.dequantize()
    assert torch.isfinite(dense).all()
    for b, group in enumerate(groups):
        assert torch.equal(dense[b], torch.cat([q.dequantize() for q in quantize_group(group)]))


def test_e2m1_rounding_ties_to_even_and_saturation():
    x = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, 7.0, 1e30, -0.25, -0.0, -5.0, -6.5])
    expected = [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7, 8, 0, 14, 15]
    assert e2m1_codes(x).tolist() == expected


def test_e2m1_codes_are_nearest_value_on_random_inputs():
    x = (torch.rand(100_000) * 14 - 7).float()
    codes = e2m1_codes(x)
    values = unpack_e2m1(pack_codes(codes))
    table = torch.tensor(E2M1_MAGNITUDES)
    nearest_err = (x.abs().clamp(max=6).unsqueeze(1) - table).abs().min(1).values
    assert torch.allclose((values.abs() - x.abs().clamp(max=6)).abs(), nearest_err)
    assert torch.equal(torch.signbit(values), torch.signbit(x))


def test_pack_unpack_inverse_on_every_byte():
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    assert torch.equal(pack_codes(unpack_codes(every_byte)), every_byte)
    assert unpack_codes(torch.tensor([0x21], dtype=torch.uint8)).tolist() == [1, 2]  # low nibble first


def test_dequantize_within_nvfp4_error_band():
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    q = quantize_group([w])[0]
    rel = ((q.dequantize() - w.float()).norm() / w.float().norm()).item()
    assert 0.05 < rel < 0.15


def test_exact_fp32_global_scale_option():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    amax = w.abs().amax()
    assert global_scale_mul(amax, exact_fp32=True).item() == pytest.approx(2688.0 / amax.float().item(), rel=1e-7)
    assert global_scale_mul(amax).item() == (2688.0 / amax).item()  # bf16, as llm-compressor


def test_quantize_rejects_unaligned_k():
    with pytest.raises(ValueError):
        quantize(torch.ones(4, 24), torch.tensor(1.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    w = adversarial("range", torch.Generator().manual_seed(9))
    cpu = quantize_group([w])[0]
    gpu = quantize_group([w.cuda()])[0]
    assert torch.equal(cpu.packed, gpu.packed.cpu())
    assert torch.equal(cpu.block_scale.view(torch.uint8), gpu.block_scale.view(torch.uint8).cpu())

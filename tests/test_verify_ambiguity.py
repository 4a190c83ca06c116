"""`fp4kit.verify.ambiguity` and the W4A4 kernel check built on it (`checks.ambiguous_rows_check`): a rounding that sits
on a boundary may flip between correct computations and is reported as ambiguous; the same error elsewhere, a gross
error in an ambiguous row, or a systematic error fails."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fp4kit.families.routing import RoutingSpec, route
from fp4kit.nvfp4 import fake_quantize_activation
from fp4kit.verify.ambiguity import ACCUMULATION_EPS, quantization_flips, w4a4_flip_bound
from fp4kit.verify.checks import ambiguous_rows_check
from fp4kit.verify.reference import moe_reference

TOL = 1e-2
SPEC = RoutingSpec("softmax_topk", 2, 1)


def _tie_layer() -> tuple[torch.Tensor, ...]:
    """Two tokens, one expert each, H = I = 16, every value exact: x = [2, 0, ...] (G_a13 = 3: scale 1, x̂ = x),
    gate = 64 for every column (silu(64) = 64 in fp32), so the intermediate is 128·w3[:, 0]: [24, h1, 4, ...] with
    G_a2 = 1, i.e. block scale 4 and E2M1 unit 4. Expert 0 has h1 = 10, exactly the 2.5 tie (RNE: 2 -> 8); expert 1
    has h1 = 10.8 (2.7 -> 3, far from any boundary)."""
    hidden = torch.zeros(2, 16)
    hidden[:, 0] = 2.0
    w13 = torch.zeros(2, 32, 16)
    w13[:, :16, 0] = 32.0
    up = torch.full((2, 16), 4.0 / 128)
    up[:, 0] = 24.0 / 128
    up[0, 1], up[1, 1] = 10.0 / 128, 10.8 / 128
    w13[:, 16:, 0] = up
    w2 = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))
    weights, ids = torch.ones(2, 1), torch.tensor([[0], [1]])
    divisors = (torch.full((2,), 1 / 3, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
    return hidden, weights, ids, w13, w2, divisors


def test_the_tie_layer_is_exact():
    hidden, weights, ids, w13, w2, divisors = _tie_layer()
    inter = F.silu(F.linear(fake_quantize_activation(hidden, divisors[0][0]), w13[0]))[:, :16]
    assert inter[0, 0] == 64.0
    quantized = fake_quantize_activation(F.linear(hidden, w13[0])[:, 16:] * 64, divisors[1][0])
    assert quantized[0, :3].tolist() == [24.0, 8.0, 4.0]


def test_a_one_ulp_flip_on_a_tie_is_ambiguous_and_passes():
    hidden, weights, ids, w13, w2, divisors = _tie_layer()
    expected = moe_reference(hidden, weights, ids, w13, w2, SPEC, activation_global_div=divisors)
    nudged = w13.clone()
    nudged[0, 17, 0] = torch.nextafter(nudged[0, 17, 0], torch.tensor(1.0))  # the intermediate one ulp above 10
    got = moe_reference(hidden, weights, ids, nudged, w2, SPEC, activation_global_div=divisors)
    row_error = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert row_error[0] > 0.05 and row_error[1] == 0  # one E2M1 step (8 -> 12) moved token 0's whole row
    ambiguous, bound = w4a4_flip_bound(hidden, weights, ids, w13, w2, SPEC, divisors)
    assert ambiguous.tolist() == [True, False]
    torch.testing.assert_close(bound[0], 4.0 * w2[0, :, 1].norm())  # exactly one step of 4 through w2's column
    passed, detail = ambiguous_rows_check(got, expected, ambiguous, bound, TOL)
    assert passed, detail
    assert detail.startswith("1 of 2 rows with ambiguous activation rounding") and "1 rows differ (1 of them" in detail
    # a gross error in the ambiguous row is more than one flip can explain
    gross = got.clone()
    gross[0] += 2 * (got[0] - expected[0])
    assert not ambiguous_rows_check(gross, expected, ambiguous, bound, TOL)[0]


def test_the_same_error_on_an_unambiguous_row_fails():
    hidden, weights, ids, w13, w2, divisors = _tie_layer()
    expected = moe_reference(hidden, weights, ids, w13, w2, SPEC, activation_global_div=divisors)
    ambiguous, bound = w4a4_flip_bound(hidden, weights, ids, w13, w2, SPEC, divisors)
    got = expected.clone()
    got[1] += 4.0 * w2[0, :, 1]  # one step's worth of error on token 1, whose rounding is far from any boundary
    passed, detail = ambiguous_rows_check(got, expected, ambiguous, bound, TOL)
    assert not passed, detail


def test_elements_and_block_scales_near_boundaries():
    x = torch.tensor([[24.0, 10.0, 10.8, 4.0] + [0.0] * 12])
    delta = torch.full_like(x, 1e-4)
    ambiguous, change = quantization_flips(x, delta, torch.tensor(1.0, dtype=torch.float64))
    assert ambiguous.tolist() == [True] and change[0, :4].tolist() == [0.0, 4.0, 0.0, 0.0]
    assert not quantization_flips(x, torch.zeros_like(x), torch.tensor(1.0, dtype=torch.float64))[0].item()
    # amax 25.5: amax/6 = 4.25, the FP8 midpoint between 4 and 4.5: the whole block may take either scale
    x[0, 0] = 25.5
    ambiguous, change = quantization_flips(x, delta, torch.tensor(1.0, dtype=torch.float64))
    assert ambiguous.item() and bool((change[0, :4] > 0).all())
    low, high = (fake_quantize_activation(x, torch.tensor(d, dtype=torch.float64)) for d in (1.0, 1.0 - 1e-6))
    assert bool(((low - high).abs() <= change).all())  # both roundings of the block lie within the change bound


def _random_layer(seed: int, tokens: int = 128, experts: int = 4, hidden_size: int = 64, inter: int = 32):
    generator = torch.Generator().manual_seed(seed)
    spec = RoutingSpec("softmax_topk", experts, 2)
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    w13 = torch.randn(experts, 2 * inter, hidden_size, generator=generator) * 0.2
    w2 = torch.randn(experts, hidden_size, inter, generator=generator) * 0.2
    weights, ids = route(torch.randn(tokens, experts, generator=generator), spec)
    divisors = (torch.full((experts,), 5.0 / 2688, dtype=torch.float64),
                torch.full((experts,), 3.0 / 2688, dtype=torch.float64))
    return generator, spec, hidden, weights, ids, w13, w2, divisors


def _noisy_gemm1(generator, spec, hidden, weights, ids, w13, w2, divisors, noise, scale=1.0):
    """The W4A4 reference with every GEMM1 output moved by up to ``noise``·Σ|x̂||w| (another summation order)."""
    out = torch.zeros_like(hidden)
    for expert in torch.unique(ids).tolist():
        token_idx, slot = torch.where(ids == expert)
        x = fake_quantize_activation(hidden[token_idx], divisors[0][expert])
        gate_up = F.linear(x, w13[expert])
        spread = noise * F.linear(x.abs(), w13[expert].abs())
        gate, up = (gate_up + spread * (2 * torch.rand(gate_up.shape, generator=generator) - 1)).chunk(2, dim=-1)
        inter = fake_quantize_activation(F.silu(gate) * up, divisors[1][expert])
        out.index_add_(0, token_idx, F.linear(inter, w2[expert]) * weights[token_idx, slot, None] * scale)
    return out


def test_perturbations_within_the_accumulation_bound_always_pass():
    """Soundness: GEMM1 noise up to the bound's own assumption flips roundings, and every row that moves is
    ambiguous and within its bound."""
    flipped = 0
    for seed in range(4):
        generator, spec, hidden, weights, ids, w13, w2, divisors = _random_layer(seed)
        expected = moe_reference(hidden, weights, ids, w13, w2, spec, activation_global_div=divisors)
        ambiguous, bound = w4a4_flip_bound(hidden, weights, ids, w13, w2, spec, divisors)
        got = _noisy_gemm1(generator, spec, hidden, weights, ids, w13, w2, divisors, ACCUMULATION_EPS)
        differ = (got - expected).norm(dim=-1) > 1e-6 * expected.norm(dim=-1)
        flipped += int(differ.sum())
        assert not bool((differ & ~ambiguous).any())
        passed, detail = ambiguous_rows_check(got, expected, ambiguous, bound, TOL)
        assert passed, detail
    assert flipped > 0  # the noise did flip roundings


def test_a_systematic_error_fails():
    generator, spec, hidden, weights, ids, w13, w2, divisors = _random_layer(0)
    expected = moe_reference(hidden, weights, ids, w13, w2, spec, activation_global_div=divisors)
    ambiguous, bound = w4a4_flip_bound(hidden, weights, ids, w13, w2, spec, divisors)
    assert 0 < int(ambiguous.sum()) < len(ambiguous) // 2
    for broken in (
        _noisy_gemm1(generator, spec, hidden, weights, ids, w13, w2, divisors, 0.0, scale=1.02),  # a scale 2% off
        # w1 and w3 swapped
        moe_reference(hidden, weights, ids, w13.roll(w13.shape[1] // 2, 1), w2, spec, activation_global_div=divisors),
    ):
        passed, detail = ambiguous_rows_check(broken, expected, ambiguous, bound, TOL)
        assert not passed, detail
    assert math.isclose(float(bound[~ambiguous].abs().max()), 0.0)


def _reciprocal_flip_amaxes(global_mul: torch.Tensor) -> torch.Tensor:
    """bf16 block amaxes whose FP8 block scale differs between amax / 6 and amax · fp32(1/6), the multiplication
    CUDA torch substitutes for a division by a Python number."""
    magnitudes = torch.arange(0x3000, 0x4700, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    exact = torch.clamp((magnitudes.double() / 6).float() * global_mul, max=448)
    by_reciprocal = torch.clamp((magnitudes * torch.tensor(1 / 6, dtype=torch.float32)) * global_mul, max=448)
    differ = exact.to(torch.float8_e4m3fn).float() != by_reciprocal.to(torch.float8_e4m3fn).float()
    return magnitudes[differ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_activation_block_scale_divides_exactly(device):
    """The reference's activation block scale is fp8(fl(amax / 6) · G_a) on every device, as the kernel computes it:
    on blocks whose amax makes a multiplication by fp32(1/6) round to the other FP8 value."""
    global_mul = torch.tensor(2688 / 12.25, dtype=torch.float32)
    amaxes = _reciprocal_flip_amaxes(global_mul)
    assert 10 <= len(amaxes) < 200  # the search finds the adversarial blocks, and only those
    x = torch.zeros(len(amaxes), 16)
    x[:, 3] = amaxes
    got = fake_quantize_activation(x.to(device), (1.0 / global_mul.double())).cpu()
    block_scale = torch.clamp((amaxes.double() / 6).float() * global_mul, max=448).to(torch.float8_e4m3fn).float()
    unit = block_scale / global_mul
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    expected = codes[(amaxes / unit).unsqueeze(-1).sub(codes).abs().argmin(dim=-1)] * block_scale / global_mul
    # one FP8 step moves a value by >= 1/16; the last bit of the dequantization's own division may differ by device
    torch.testing.assert_close(got[:, 3], expected, rtol=1e-6, atol=0)


def test_gpt_oss_perturbations_within_the_accumulation_bound_always_pass():
    """The same soundness for gpt-oss's experts: biases on both GEMMs and the clamped (up + 1) SwiGLU, with gate and
    up sums large enough that the clamp at 7 bites."""
    from fp4kit.families.activation import swiglu_oai

    activation, flipped = swiglu_oai(), 0
    for seed in range(4):
        generator, spec, hidden, weights, ids, w13, w2, _ = _random_layer(seed)
        hidden = hidden * 6
        biases = (torch.randn(4, 64, generator=generator), torch.randn(4, 64, generator=generator))
        divisors = (torch.full((4,), 30.0 / 2688, dtype=torch.float64),
                    torch.full((4,), 60.0 / 2688, dtype=torch.float64))
        expected = moe_reference(hidden, weights, ids, w13, w2, spec, activation_global_div=divisors,
                                 activation=activation, biases=biases)
        ambiguous, bound = w4a4_flip_bound(hidden, weights, ids, w13, w2, spec, divisors, activation=activation,
                                           biases=biases)
        got = torch.zeros_like(hidden)
        for expert in torch.unique(ids).tolist():
            token_idx, slot = torch.where(ids == expert)
            x = fake_quantize_activation(hidden[token_idx], divisors[0][expert])
            gate_up = F.linear(x, w13[expert], biases[0][expert])
            spread = ACCUMULATION_EPS * F.linear(x.abs(), w13[expert].abs())
            gate, up = (gate_up + spread * (2 * torch.rand(gate_up.shape, generator=generator) - 1)).chunk(2, dim=-1)
            assert seed or bool((gate.abs() > 7).any())
            inter = fake_quantize_activation(activation(gate, up), divisors[1][expert])
            out = F.linear(inter, w2[expert], biases[1][expert])
            got.index_add_(0, token_idx, out * weights[token_idx, slot, None])
        differ = (got - expected).norm(dim=-1) > 1e-6 * expected.norm(dim=-1)
        flipped += int(differ.sum())
        assert not bool((differ & ~ambiguous).any())
        passed, detail = ambiguous_rows_check(got, expected, ambiguous, bound, TOL)
        assert passed, detail
    assert flipped > 0

"""CUTLASS NVFP4 layout (FlashInfer ``cutlass_fused_moe`` and vLLM ``cutlass_moe_fp4``): exact inverse, row order,
kernel dtypes, scalars.

Sources: docs/layouts.md; flashinfer-python 0.7.2.post1 ``fused_moe/prepare.py::prepare_cutlass_nvfp4_weights`` (H % 64,
swizzled [E, pad128(N), pad4(K/16)] scales), ``data/csrc/fused_moe/cutlass_backend/
flashinfer_cutlass_fused_moe_binding.cu`` (quant_scales order and dtypes: fp32 act globals 0-d or [E], int32 block
scales [E, alignToSfDim(I, 64) * 2, H / 64]); vLLM ``flashinfer_cutlass_moe.py`` (weights viewed as int64, [w3; w1]
via ``reorder_w1w3_to_w3w1``), ``cutlass_moe.py::cutlass_moe_fp4`` (argument names, [w1; w3]).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4kit.errors import Fp4kitError
from fp4kit.layouts import cutlass
from fp4kit.nvfp4 import NVFP4Tensor

SHAPES = [(2, 64, 64), (3, 192, 128), (1, 320, 192), (4, 128, 64)]


def random_layer(experts: int, hidden: int, intermediate: int, seed: int):
    generator = torch.Generator().manual_seed(seed)

    def tensor(rows: int, cols: int) -> NVFP4Tensor:
        packed = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, generator=generator)
        scales = torch.randint(0, 256, (experts, rows, cols // 16), dtype=torch.uint8, generator=generator)
        divisor = torch.rand(experts, dtype=torch.float64, generator=generator) + 1e-7
        return NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), divisor)

    scales = torch.rand(2, experts, dtype=torch.float64, generator=generator) * 100 + 1e-9
    return tensor(2 * intermediate, hidden), tensor(hidden, intermediate), scales[0], scales[1]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def unswizzled_by_formula(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Read scale (r, c) of every expert at its 128x4 byte offset, independently of fp4kit.layouts.swizzle."""
    flat = swizzled.contiguous().view(torch.uint8).reshape(swizzled.shape[0], -1)
    padded_cols = -(-cols // 4) * 4
    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(cols).unsqueeze(0)
    offset = ((r // 128) * (padded_cols // 4) + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    return flat[:, offset.reshape(-1)].reshape(-1, rows, cols)


@pytest.mark.parametrize("flavor", ["flashinfer", "vllm"])
@pytest.mark.parametrize("experts, hidden, intermediate", SHAPES)
def test_round_trip(flavor: str, experts: int, hidden: int, intermediate: int) -> None:
    for seed in range(2):
        w13, w2, s13, s2 = random_layer(experts, hidden, intermediate, seed)
        if seed == 1:  # adversarial: every code -0, every scale NaN, and an all-zero expert
            for t in (w13.packed, w13.block_scale.view(torch.uint8), w2.packed, w2.block_scale.view(torch.uint8)):
                t.fill_(0xFF)
                t[0].zero_()
        tensors = cutlass.transform(w13, w2, s13, s2, flavor=flavor)
        back13, back2, back_s13, back_s2 = cutlass.undo(tensors, cutlass.describe(w13, w2, s13, s2, flavor=flavor))
        for ours, theirs in ((back13, w13), (back2, w2)):
            assert same_bytes(ours.packed, theirs.packed) and same_bytes(ours.block_scale, theirs.block_scale)
            assert same_bytes(ours.global_scale_div, theirs.global_scale_div)
        assert same_bytes(back_s13, s13) and same_bytes(back_s2, s2)


@settings(max_examples=20, deadline=None, database=None)
@given(flavor=st.sampled_from(["flashinfer", "vllm"]), experts=st.integers(1, 3), hidden_blocks=st.integers(1, 6),
       intermediate_blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_round_trip_property(flavor: str, experts: int, hidden_blocks: int, intermediate_blocks: int,
                             seed: int) -> None:
    w13, w2, s13, s2 = random_layer(experts, 64 * hidden_blocks, 64 * intermediate_blocks, seed)
    tensors = cutlass.transform(w13, w2, s13, s2, flavor=flavor)
    back13, back2, _, _ = cutlass.undo(tensors, cutlass.describe(w13, w2, s13, s2, flavor=flavor))
    assert same_bytes(back13.packed, w13.packed) and same_bytes(back13.block_scale, w13.block_scale)
    assert same_bytes(back2.packed, w2.packed) and same_bytes(back2.block_scale, w2.block_scale)


@pytest.mark.parametrize("experts, hidden, intermediate", SHAPES)
def test_flashinfer_flavor_layout(experts: int, hidden: int, intermediate: int) -> None:
    w13, w2, s13, s2 = random_layer(experts, hidden, intermediate, seed=3)
    ours = cutlass.transform(w13, w2, s13, s2, flavor="flashinfer")
    weights13 = ours["fc1_expert_weights"]
    assert weights13.dtype == torch.int64 and ours["fc1_weight_block_scale"].dtype == torch.int32
    # the binding's check: [E, alignToSfDim(I, 64) * 2, alignToSfDim(H, 64) / 16 / 4] int32
    assert ours["fc1_weight_block_scale"].shape == (experts, 2 * intermediate, hidden // 64)
    assert ours["fc2_weight_block_scale"].shape == (experts, -(-hidden // 128) * 128, intermediate // 64)
    as_bytes = weights13.view(torch.uint8)
    assert torch.equal(as_bytes[:, :intermediate], w13.packed[:, intermediate:])  # w3 (up) first
    assert torch.equal(as_bytes[:, intermediate:], w13.packed[:, :intermediate])
    scales13 = unswizzled_by_formula(ours["fc1_weight_block_scale"], 2 * intermediate, hidden // 16)
    raw13 = w13.block_scale.view(torch.uint8)
    assert torch.equal(scales13, torch.cat([raw13[:, intermediate:], raw13[:, :intermediate]], dim=1))
    scales2 = unswizzled_by_formula(ours["fc2_weight_block_scale"], hidden, intermediate // 16)
    assert torch.equal(scales2, w2.block_scale.view(torch.uint8))
    assert torch.equal(ours["fc2_expert_weights"].view(torch.uint8), w2.packed)


def test_vllm_flavor_layout() -> None:
    w13, w2, s13, s2 = random_layer(2, 192, 128, seed=4)
    ours = cutlass.transform(w13, w2, s13, s2, flavor="vllm")
    assert set(ours) == {"w1_fp4", "w1_blockscale", "w1_alphas", "a1_gscale", "w2_fp4", "w2_blockscale", "w2_alphas",
                         "a2_gscale"}
    assert torch.equal(ours["w1_fp4"], w13.packed)  # [w1; w3] kept
    assert ours["w1_blockscale"].dtype == torch.float8_e4m3fn and ours["w1_blockscale"].shape == (2, 256, 12)
    assert torch.equal(unswizzled_by_formula(ours["w1_blockscale"], 256, 12), w13.block_scale.view(torch.uint8))
    assert torch.equal(unswizzled_by_formula(ours["w2_blockscale"], 192, 8), w2.block_scale.view(torch.uint8))


def test_swizzled_scales_match_flashinfer_cpu_helper() -> None:
    pytest.importorskip("flashinfer")
    from flashinfer.experimental.kimi_k3_fp8_projection.cake_backend import swizzle_sf_128x4

    w13, w2, s13, s2 = random_layer(2, 320, 192, seed=6)
    ours = cutlass.transform(w13, w2, s13, s2, flavor="vllm")
    for e in range(2):
        assert torch.equal(ours["w2_blockscale"][e].view(torch.uint8).reshape(-1),
                           swizzle_sf_128x4(w2.block_scale[e].view(torch.uint8)))


def test_scalars_as_vllm_computes_them() -> None:
    w13, w2, s13, s2 = random_layer(3, 64, 64, seed=8)
    ours = cutlass.transform(w13, w2, s13, s2, flavor="flashinfer")
    shared13 = s13.max().expand(3).float()  # FlashInfer quantizes the hidden states once: the layer's largest
    assert same_bytes(ours["fc1_dequant_scale"], w13.global_scale_div.float() * shared13)
    assert same_bytes(ours["fc1_act_global_scale"], 1.0 / shared13)
    assert same_bytes(ours["fc2_dequant_scale"], w2.global_scale_div.float() * s2.float())
    assert same_bytes(ours["fc2_act_global_scale"], 1.0 / s2.float())
    vllm = cutlass.transform(w13, w2, s13, s2, flavor="vllm")  # vLLM's cutlass_moe_fp4 quantizes per expert
    assert same_bytes(vllm["w1_alphas"], w13.global_scale_div.float() * s13.float())
    assert same_bytes(vllm["a1_gscale"], 1.0 / s13.float())
    assert same_bytes(vllm["a2_gscale"], ours["fc2_act_global_scale"])


def test_undo_rejects_a_mismatched_meta_or_padding() -> None:
    w13, w2, s13, s2 = random_layer(1, 64, 64, seed=9)
    tensors = cutlass.transform(w13, w2, s13, s2)
    with pytest.raises(Fp4kitError, match="fc1_dequant_scale"):
        cutlass.undo(tensors, cutlass.describe(w13, w2, s13 * 2, s2))
    tensors["fc2_weight_block_scale"].view(torch.uint8)[0, 100:].fill_(1)  # H = 64: rows 64..127 are padding
    with pytest.raises(Fp4kitError, match="padding"):
        cutlass.undo(tensors, cutlass.describe(w13, w2, s13, s2))
    with pytest.raises(Fp4kitError, match="input scales"):
        cutlass.transform(w13, w2, None, s2)


def test_check_shapes() -> None:
    cutlass.check_shapes(128, 2048, 768, ep=8)
    with pytest.raises(Fp4kitError, match="I % 64"):
        cutlass.check_shapes(128, 2048, 96)
    with pytest.raises(Fp4kitError, match="hidden size H = 2080"):
        cutlass.check_shapes(128, 2080, 768)
    with pytest.raises(Fp4kitError, match="divisible by ep = 3"):
        cutlass.check_shapes(128, 2048, 768, ep=3)
    with pytest.raises(Fp4kitError, match="flavor"):
        cutlass.check_shapes(128, 2048, 768, flavor="sglang")  # type: ignore[arg-type]

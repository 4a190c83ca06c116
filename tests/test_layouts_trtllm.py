"""TRT-LLM-gen shuffled layout: exact inverse, and byte-identical with FlashInfer's own CPU preparation helpers.

Sources: docs/layouts.md; flashinfer-python 0.7.2.post1 ``fused_moe/prepare.py::prepare_trtllm_fp4_weights`` (the
[up; gate] order, epilogue_tile_m 128, the scale reshape), ``fused_moe/core.py``
(``_maybe_get_cached_w3_w1_permute_indices``, ``get_w2_permute_indices_with_cache``,
``reorder_rows_for_gated_act_gemm``), ``quantization/fp4_quantization.py`` (``shuffle_matrix_a``,
``shuffle_matrix_sf_a``), ``utils.py::get_shuffle_matrix_a_row_indices``; vLLM
``flashinfer_fp4_moe.py::prepare_static_weights_for_trtllm_fp4_moe`` and ``flashinfer_trtllm_fp4_moe`` (scalars).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4kit.errors import Fp4kitError
from fp4kit.layouts import trtllm
from fp4kit.layouts.swizzle import swizzle_128x4
from fp4kit.nvfp4 import NVFP4Tensor, quantize_group

# (E, H, I): neither padded, H only, I only, both (small and just past a multiple), neither again at 2x
SHAPES = [(2, 256, 64), (2, 240, 64), (1, 256, 80), (3, 48, 32), (1, 272, 80), (1, 16, 16), (2, 512, 128),
          (1, 384, 64), (2, 128, 32)]  # the last two: H % 256 == 128, GEMM2 rows (pad 128) < GEMM1's K (pad 256)


def random_nvfp4(experts: int, rows: int, cols: int, generator: torch.Generator) -> NVFP4Tensor:
    packed = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 256, (experts, rows, cols // 16), dtype=torch.uint8, generator=generator)
    return NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), torch.rand(experts, dtype=torch.float64,
                                                                           generator=generator) + 1e-6)


def random_layer(experts: int, hidden: int, intermediate: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    w13 = random_nvfp4(experts, 2 * intermediate, hidden, generator)
    w2 = random_nvfp4(experts, hidden, intermediate, generator)
    scales = torch.rand(2, experts, dtype=torch.float64, generator=generator) * 10 + 1e-9
    return w13, w2, scales[0], scales[1]


def quantized_layer(experts: int, hidden: int, intermediate: int, seed: int):
    """Real llm-compressor-style quantization of weights spanning a huge range, with all-zero blocks."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.randn(experts, 3 * intermediate, hidden, generator=generator) * 12)
    weights = (torch.randn(magnitude.shape, generator=generator) * magnitude).to(torch.bfloat16)
    weights[:, :, :16] = 0
    per_expert = [quantize_group([w[: 2 * intermediate]])[0] for w in weights]
    down = [quantize_group([w[2 * intermediate:].reshape(hidden, intermediate)])[0] for w in weights]

    def stack(parts: list[NVFP4Tensor]) -> NVFP4Tensor:
        return NVFP4Tensor(torch.stack([p.packed for p in parts]), torch.stack([p.block_scale for p in parts]),
                           torch.stack([p.global_scale_div for p in parts]))

    ones = torch.full((experts,), 1 / 2688, dtype=torch.float64)
    return stack(per_expert), stack(down), ones, ones * 3


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def assert_round_trip(w13: NVFP4Tensor, w2: NVFP4Tensor, s13: torch.Tensor, s2: torch.Tensor) -> None:
    tensors = trtllm.transform(w13, w2, s13, s2)
    hidden = w2.packed.shape[1]
    assert tensors["gemm1_weights"].shape[2] == 128 * -(-hidden // 256)  # K / 2, K = roundUp(H, 256)
    assert tensors["gemm2_weights"].shape[1] == tensors["gemm2_weights_scale"].shape[1] == 128 * -(-hidden // 128)
    back13, back2, back_s13, back_s2 = trtllm.undo(tensors, trtllm.describe(w13, w2, s13, s2))
    for ours, theirs in ((back13, w13), (back2, w2)):
        assert same_bytes(ours.packed, theirs.packed) and same_bytes(ours.block_scale, theirs.block_scale)
        assert same_bytes(ours.global_scale_div, theirs.global_scale_div)
    assert same_bytes(back_s13, s13) and same_bytes(back_s2, s2)


@pytest.mark.parametrize("experts, hidden, intermediate", SHAPES)
def test_round_trip_random_bytes(experts: int, hidden: int, intermediate: int) -> None:
    for seed in range(3):
        assert_round_trip(*random_layer(experts, hidden, intermediate, seed))


@settings(max_examples=25, deadline=None, database=None)
@given(experts=st.integers(1, 3), hidden_blocks=st.integers(1, 40), intermediate_blocks=st.integers(1, 9),
       seed=st.integers(0, 2**16))
def test_round_trip_property(experts: int, hidden_blocks: int, intermediate_blocks: int, seed: int) -> None:
    assert_round_trip(*random_layer(experts, 16 * hidden_blocks, 16 * intermediate_blocks, seed))


@pytest.mark.parametrize("fill", [0x00, 0xFF, 0x7F, 0x80])
def test_round_trip_adversarial_bytes(fill: int) -> None:
    w13, w2, s13, s2 = random_layer(2, 48, 80, seed=1)
    for tensor in (w13.packed, w13.block_scale.view(torch.uint8), w2.packed, w2.block_scale.view(torch.uint8)):
        tensor.fill_(fill)
    assert_round_trip(w13, w2, s13, s2)


def test_round_trip_quantized_huge_range() -> None:
    assert_round_trip(*quantized_layer(2, 272, 48, seed=3))


def independent_rows(num_rows: int, gated: bool) -> list[int]:
    interleaved = [i // 2 + (num_rows // 2) * (i % 2) for i in range(num_rows)] if gated else list(range(num_rows))
    shuffled = [32 * (d // 32) + (d % 32 % 8) * 4 + (d % 32) // 8 for d in range(num_rows)]
    return [interleaved[s] for s in shuffled]


def test_row_permutations_match_written_formula() -> None:
    assert trtllm.w13_rows(256).tolist() == independent_rows(256, gated=True)
    assert trtllm.shuffle_rows(96).tolist() == independent_rows(96, gated=False)


@pytest.mark.parametrize("experts, hidden, intermediate", [(2, 48, 32), (1, 272, 80), (1, 384, 48)])
def test_layout_matches_written_formula(experts: int, hidden: int, intermediate: int) -> None:
    w13, w2, s13, s2 = random_layer(experts, hidden, intermediate, seed=4)
    ours = trtllm.transform(w13, w2, s13, s2)
    padded_h, padded_i = 256 * -(-hidden // 256), 64 * -(-intermediate // 64)
    rows13 = independent_rows(2 * padded_i, gated=True)
    expected13 = padded_up_gate(w13.packed, intermediate, padded_i, padded_h // 2)[:, rows13]
    assert torch.equal(ours["gemm1_weights"], expected13)
    scales13 = padded_up_gate(w13.block_scale, intermediate, padded_i, padded_h // 16)[:, rows13]
    assert torch.equal(ours["gemm1_weights_scale"].view(torch.uint8), swizzle_128x4(scales13))
    rows_h = 128 * -(-hidden // 128)  # GEMM2's N: roundUp(valid_hidden_size, 128), not GEMM1's K
    weights2 = torch.zeros(experts, rows_h, padded_i // 2, dtype=torch.uint8)
    weights2[:, :hidden, : intermediate // 2] = w2.packed
    assert torch.equal(ours["gemm2_weights"], weights2[:, independent_rows(rows_h, gated=False)])


def padded_up_gate(tensor: torch.Tensor, intermediate: int, padded_i: int, padded_cols: int) -> torch.Tensor:
    out = torch.zeros(tensor.shape[0], 2 * padded_i, padded_cols, dtype=torch.uint8)
    raw = tensor.view(torch.uint8)
    out[:, :intermediate, : raw.shape[2]] = raw[:, intermediate:]  # w3 (up) first
    out[:, padded_i: padded_i + intermediate, : raw.shape[2]] = raw[:, :intermediate]
    return out


@pytest.mark.parametrize("experts, hidden, intermediate", [(2, 256, 64), (1, 272, 80), (2, 240, 96), (1, 384, 64)])
def test_byte_identical_with_flashinfer_helpers(experts: int, hidden: int, intermediate: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("flashinfer")
    import flashinfer.quantization.fp4_quantization as fp4_quantization
    from flashinfer import reorder_rows_for_gated_act_gemm, shuffle_matrix_a, shuffle_matrix_sf_a
    from flashinfer.diffusion_ops.minimax_h3_fc1_swiglu import _swizzle_sf_128x4
    from flashinfer.fused_moe.core import (
        _infer_trtllm_moe_output_hidden_size,
        _maybe_get_cached_w3_w1_permute_indices,
        get_w2_permute_indices_with_cache,
    )

    # shuffle_matrix_sf_a ends in the CUDA-only block_scale_interleave; swap in FlashInfer's own torch copy.
    monkeypatch.setattr(fp4_quantization, "block_scale_interleave", _swizzle_sf_128x4)
    w13, w2, s13, s2 = random_layer(experts, hidden, intermediate, seed=11)
    ours = trtllm.transform(w13, w2, s13, s2)
    padded_h, padded_i = 256 * -(-hidden // 256), 64 * -(-intermediate // 64)
    rows_h = -(-hidden // 128) * 128  # FC2 rows as the 0.7.2 launcher sizes them (core._infer_trtllm_moe_output_...)
    assert rows_h == _infer_trtllm_moe_output_hidden_size(padded_h, hidden)
    weights13 = padded_up_gate(w13.packed, intermediate, padded_i, padded_h // 2)
    scales13 = padded_up_gate(w13.block_scale, intermediate, padded_i, padded_h // 16)
    weights2 = torch.zeros(experts, rows_h, padded_i // 2, dtype=torch.uint8)
    weights2[:, :hidden, : intermediate // 2] = w2.packed
    scales2 = torch.zeros(experts, rows_h, padded_i // 16, dtype=torch.uint8)
    scales2[:, :hidden, : intermediate // 16] = w2.block_scale.view(torch.uint8)

    cache: dict = {}
    for e in range(experts):
        rows = _maybe_get_cached_w3_w1_permute_indices(cache, weights13[e], 128)
        assert torch.equal(ours["gemm1_weights"][e], weights13[e][rows])
        reordered = reorder_rows_for_gated_act_gemm(weights13[e])
        assert torch.equal(ours["gemm1_weights"][e], shuffle_matrix_a(reordered, 128))
        sf_rows = _maybe_get_cached_w3_w1_permute_indices(cache, scales13[e], 128, num_elts_per_sf=16)
        expected13 = _swizzle_sf_128x4(scales13[e][sf_rows]).reshape(2 * padded_i, padded_h // 16)
        assert torch.equal(ours["gemm1_weights_scale"][e].view(torch.uint8), expected13)
        via_api = shuffle_matrix_sf_a(reorder_rows_for_gated_act_gemm(scales13[e]), 128).reshape(expected13.shape)
        assert torch.equal(via_api, expected13)

        rows2 = get_w2_permute_indices_with_cache(cache, weights2[e], 128)
        assert torch.equal(ours["gemm2_weights"][e], weights2[e][rows2])
        assert torch.equal(ours["gemm2_weights"][e], shuffle_matrix_a(weights2[e], 128))
        expected2 = shuffle_matrix_sf_a(scales2[e], 128).reshape(rows_h, padded_i // 16)
        assert torch.equal(ours["gemm2_weights_scale"][e].view(torch.uint8), expected2)
    assert ours["gemm1_weights"].dtype == torch.uint8 and ours["gemm1_weights_scale"].dtype == torch.float8_e4m3fn


def test_scalars_as_vllm_computes_them() -> None:
    w13, w2, s13, s2 = random_layer(3, 48, 32, seed=5)
    ours = trtllm.transform(w13, w2, s13, s2)
    gate = w13.global_scale_div.float() * s13.max().expand(3).float()  # one hidden-state scale: the layer's largest
    assert same_bytes(ours["output1_scale_gate_scalar"], gate)
    assert same_bytes(ours["output1_scale_scalar"], gate * (1 / s2.float()))
    assert same_bytes(ours["output2_scale_scalar"], w2.global_scale_div.float() * s2.float())
    assert torch.allclose(ours["output1_scale_scalar"].double(), w13.global_scale_div * s13.max() / s2, rtol=1e-6)


def test_undo_rejects_tampered_padding_and_scalars() -> None:
    w13, w2, s13, s2 = random_layer(1, 48, 32, seed=2)
    meta = trtllm.describe(w13, w2, s13, s2)
    tensors = trtllm.transform(w13, w2, s13, s2)
    tensors["gemm2_weights"][0, trtllm.shuffle_rows(128).argsort()[100], 0] = 1  # row 100 >= H is padding
    with pytest.raises(Fp4kitError, match="padding"):
        trtllm.undo(tensors, meta)
    tensors = trtllm.transform(w13, w2, s13, s2)
    tensors["output2_scale_scalar"] = tensors["output2_scale_scalar"] * 2
    with pytest.raises(Fp4kitError, match="output2_scale_scalar"):
        trtllm.undo(tensors, meta)
    with pytest.raises(Fp4kitError, match="W4A4"):
        trtllm.transform(w13, w2, None, None)


def test_check_shapes_and_call_arguments() -> None:
    trtllm.check_shapes(8, 2048, 768, ep=4)
    with pytest.raises(Fp4kitError, match="divisible by ep = 3"):
        trtllm.check_shapes(8, 2048, 768, ep=3)
    with pytest.raises(Fp4kitError, match="multiple of 16"):
        trtllm.check_shapes(8, 2040, 768)
    w13, w2, s13, s2 = random_layer(2, 272, 80, seed=0)
    arguments = trtllm.call_arguments(trtllm.describe(w13, w2, s13, s2), ep_rank=3)
    assert arguments == {"intermediate_size": 128, "valid_hidden_size": 272, "valid_intermediate_size": 80,
                         "local_expert_offset": 6, "local_num_experts": 2}

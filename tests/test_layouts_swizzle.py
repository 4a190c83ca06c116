"""The 128x4 block-scale swizzle against an index formula and against FlashInfer's own pure-torch copies.

Sources: docs/layouts.md; flashinfer-python 0.7.2.post1 ``quantization/fp4_quantization.py::block_scale_interleave``
(CUDA only) and its CPU copies ``diffusion_ops/minimax_h3_fc1_swiglu.py::_swizzle_sf_128x4`` /
``_unswizzle_sf_128x4``, ``experimental/kimi_k3_fp8_projection/cake_backend.py::swizzle_sf_128x4``,
``trace/templates/gemm.py::_unswizzle_batched_sf_128x4``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4kit.layouts.swizzle import swizzle_128x4, swizzle_padding_is_zero, swizzled_shape, unswizzle_128x4

SHAPES = [(128, 4), (1, 1), (129, 5), (256, 8), (32, 3), (300, 17), (64, 12)]


def formula_offset(row: int, col: int, padded_cols: int) -> int:
    """Byte offset of scale (row, col): 512-byte tiles row-tile major, inside a tile (row % 32) * 16 +
    (row % 128 // 32) * 4 + col % 4."""
    tile = (row // 128) * (padded_cols // 4) + col // 4
    return tile * 512 + (row % 32) * 16 + (row % 128 // 32) * 4 + col % 4


def random_bytes(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_swizzle_matches_index_formula(rows: int, cols: int) -> None:
    scales = random_bytes(rows, cols, seed=rows * 1000 + cols)
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    expected = torch.zeros(padded_rows * padded_cols, dtype=torch.uint8)
    for row in range(rows):
        for col in range(cols):
            expected[formula_offset(row, col, padded_cols)] = scales[row, col]
    swizzled = swizzle_128x4(scales)
    assert swizzled.shape == (padded_rows, padded_cols)
    assert torch.equal(swizzled.reshape(-1), expected)


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_round_trip_batched_fp8_all_bit_patterns(rows: int, cols: int) -> None:
    scales = random_bytes(3, 2, rows, cols, seed=rows + cols).view(torch.float8_e4m3fn)
    swizzled = swizzle_128x4(scales)
    assert swizzled.dtype == torch.float8_e4m3fn and swizzled.shape == (3, 2, *swizzled_shape(rows, cols))
    back = unswizzle_128x4(swizzled, rows, cols)
    assert torch.equal(back.view(torch.uint8), scales.view(torch.uint8))
    flat = swizzled.reshape(3, 2, -1)
    assert torch.equal(unswizzle_128x4(flat, rows, cols).view(torch.uint8), scales.view(torch.uint8))
    assert swizzle_padding_is_zero(swizzled, rows, cols)


@settings(max_examples=40, deadline=None, database=None)
@given(batch=st.integers(1, 3), rows=st.integers(1, 300), cols=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_round_trip_property(batch: int, rows: int, cols: int, seed: int) -> None:
    scales = random_bytes(batch, rows, cols, seed=seed)
    assert torch.equal(unswizzle_128x4(swizzle_128x4(scales), rows, cols), scales)


def test_padding_check_sees_a_stray_byte() -> None:
    swizzled = swizzle_128x4(random_bytes(100, 3, seed=7))
    swizzled.view(-1)[formula_offset(127, 3, 4)] = 1  # row 127 and column 3 are both padding
    assert not swizzle_padding_is_zero(swizzled, 100, 3)


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_matches_flashinfer_cpu_helpers(rows: int, cols: int) -> None:
    pytest.importorskip("flashinfer")
    from flashinfer.diffusion_ops.minimax_h3_fc1_swiglu import _swizzle_sf_128x4, _unswizzle_sf_128x4
    from flashinfer.experimental.kimi_k3_fp8_projection.cake_backend import swizzle_sf_128x4
    from flashinfer.trace.templates.gemm import _unswizzle_batched_sf_128x4

    scales = random_bytes(2, rows, cols, seed=rows * 7 + cols)
    ours = swizzle_128x4(scales)
    for expert in range(2):
        assert torch.equal(ours[expert].reshape(-1), _swizzle_sf_128x4(scales[expert]))
        assert torch.equal(ours[expert].reshape(-1), swizzle_sf_128x4(scales[expert]))
        assert torch.equal(_unswizzle_sf_128x4(ours[expert].reshape(-1), rows, cols), scales[expert])
    assert torch.equal(_unswizzle_batched_sf_128x4(ours.reshape(-1), 2, rows, cols), scales)

"""The 128x4 block-scale swizzle that CUTLASS and TRT-LLM NVFP4 kernels read (docs/layouts.md), and its inverse.

A scale grid [..., M, S] (one FP8 scale per 16 K-elements) is padded with zero bytes to M % 128 == 0 and
S % 4 == 0, then each 128-row x 4-column tile is stored so that the four 32-row groups of one row sit next to
each other: view (B, M/128, 4, 32, S/4, 4), permute (0, 1, 4, 3, 2, 5). The permutation swaps dims 2 and 4,
so it is its own inverse. Bytes move, values never change: any dtype round-trips bit for bit.
"""

from __future__ import annotations

import torch

ROW_TILE = 128
COL_TILE = 4
# (batch, row tile, 32-row group, row in group, 4-column tile, column in tile) -> tile-major order
_PERMUTATION = (0, 1, 4, 3, 2, 5)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    return round_up(rows, ROW_TILE), round_up(cols, COL_TILE)


def swizzle_128x4(scales: torch.Tensor, rows: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Linear scales [..., M, S] -> swizzled [..., pad128(M), pad4(S)], same dtype; padding is zero bytes.

    ``rows`` (int64 [M]), when given, first reorders the rows (out row r = in row rows[r]) in the same pass.
    ``out`` (contiguous, any dtype and shape of the same bytes) receives the result and is returned.
    """
    *lead, num_rows, cols = scales.shape
    padded_rows, padded_cols = swizzled_shape(num_rows, cols)
    as_bytes = scales.view(torch.uint8).reshape(-1, num_rows, cols)
    if rows is not None:
        as_bytes = as_bytes.index_select(1, rows)
    if (padded_rows, padded_cols) != (num_rows, cols) or as_bytes.storage_offset() % COL_TILE:
        padded = as_bytes.new_zeros((as_bytes.shape[0], padded_rows, padded_cols))
        padded[:, :num_rows, :cols] = as_bytes
        as_bytes = padded
    # a 4-column tile of one row is 4 contiguous bytes: moving them as one int32 is 4x fewer elements to copy
    words = as_bytes.contiguous().view(torch.int32)
    tiles = words.reshape(-1, padded_rows // ROW_TILE, 4, 32, padded_cols // COL_TILE)
    if out is not None:
        out.view(torch.uint8).view(-1).view(torch.int32).view(tiles.permute(_PERMUTATION[:-1]).shape).copy_(
            tiles.permute(_PERMUTATION[:-1]))
        return out
    swizzled = tiles.permute(_PERMUTATION[:-1]).contiguous().view(torch.uint8)
    return swizzled.reshape(*lead, padded_rows, padded_cols).view(scales.dtype)


def unswizzle_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_128x4`: [..., pad128(rows), pad4(cols)] (or flat per batch) -> [..., rows, cols]."""
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    lead = swizzled.shape[:-2] if swizzled.shape[-2:] == (padded_rows, padded_cols) else swizzled.shape[:-1]
    as_bytes = swizzled.contiguous().view(torch.uint8)
    tiles = as_bytes.reshape(-1, padded_rows // ROW_TILE, padded_cols // COL_TILE, 32, 4, COL_TILE)
    linear = tiles.permute(_PERMUTATION).reshape(-1, padded_rows, padded_cols)[:, :rows, :cols]
    return linear.contiguous().reshape(*lead, rows, cols).view(swizzled.dtype)


def swizzle_padding_is_zero(swizzled: torch.Tensor, rows: int, cols: int) -> bool:
    """True when every padding byte of a swizzled grid is zero (what the kernel may read past the real scales)."""
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    full = unswizzle_128x4(swizzled, padded_rows, padded_cols).view(torch.uint8)
    mask = torch.ones(padded_rows, padded_cols, dtype=torch.bool)
    mask[:rows, :cols] = False
    return bool((full[..., mask] == 0).all())

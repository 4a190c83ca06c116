"""fp4kit.io.checkpoint.ShardWriter.destination: a planned tensor filled in place in the shard reads back like one
written with write(); offsets that are not 8-byte aligned fall back to write()."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fp4kit.errors import Fp4kitError
from fp4kit.io.checkpoint import PlannedTensor, ShardWriter


def test_destination_fills_the_shard_in_place(tmp_path):
    plan = [PlannedTensor("a", torch.float32, (1,)),  # 4 bytes: "b" starts 4 bytes past an 8-byte boundary
            PlannedTensor("b", torch.int32, (3, 5)), PlannedTensor("c", torch.uint8, (8,)),
            PlannedTensor("d", torch.int64, (2, 1000))]
    writer = ShardWriter(tmp_path, plan, 10**9)
    assert writer.destination("b") is None  # misaligned: written the ordinary way
    d = writer.destination("d")
    assert d is not None and (d.dtype, tuple(d.shape)) == (torch.int64, (2, 1000))
    d.copy_(torch.arange(2000).reshape(2, 1000))
    writer.write("d", d)
    del d
    writer.write("a", torch.tensor([1.5]))
    writer.write("b", torch.arange(15, dtype=torch.int32).reshape(3, 5))
    with pytest.raises(Fp4kitError, match="never written"):
        writer.finish()
    writer.write("c", torch.arange(8, dtype=torch.uint8))
    writer.finish()
    tensors = load_file(tmp_path / "model.safetensors")
    assert torch.equal(tensors["d"], torch.arange(2000).reshape(2, 1000))
    assert torch.equal(tensors["b"], torch.arange(15, dtype=torch.int32).reshape(3, 5))
    assert tensors["a"].item() == 1.5 and tensors["c"].tolist() == list(range(8))


def test_a_copy_of_a_destination_is_written_not_skipped(tmp_path):
    writer = ShardWriter(tmp_path, [PlannedTensor("x", torch.int64, (8,))], 10**9)
    assert writer.destination("x") is not None  # handed out but never filled: write() gets another tensor
    writer.write("x", torch.full((8,), 7))
    writer.finish()
    assert load_file(tmp_path / "model.safetensors")["x"].tolist() == [7] * 8

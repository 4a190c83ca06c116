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


def test_mapped_tensors_are_copied_file_to_file(tmp_path, monkeypatch):
    """CheckpointReader.mapped: views of the file's bytes equal to read / read_rows; file_span finds a contiguous view
    of a live mapping (not a copy, not a strided view); ShardWriter.write copies such a view file to file with
    copy_file_range, and writes it from memory where that fails, the same bytes either way."""
    import errno
    import os

    from safetensors.torch import save_file

    from fp4kit.io.checkpoint import CheckpointReader

    generator = torch.Generator().manual_seed(0)
    stored = {"a": torch.randint(0, 256, (3,), dtype=torch.uint8, generator=generator),  # the rest start unaligned
              "codes": torch.randint(0, 256, (4, 6, 8), dtype=torch.uint8, generator=generator),
              "w": torch.randn(5, 7, generator=generator).to(torch.bfloat16)}
    save_file(stored, tmp_path / "model.safetensors")
    copies = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: copies.append(a[2]) or real(*a))
    with CheckpointReader(tmp_path) as reader:
        codes, rows, w = reader.mapped("codes"), reader.mapped("codes", 1, 3), reader.mapped("w")
        assert torch.equal(codes, reader.read("codes")) and torch.equal(rows, reader.read_rows("codes", 1, 3))
        assert torch.equal(w, stored["w"]) and w.dtype == torch.bfloat16
        info = reader.info("codes")
        fd = reader.file_span(codes)[0]
        assert reader.file_span(codes) == (fd, info.begin)
        assert reader.file_span(rows[1]) == (fd, info.begin + 2 * 48)
        assert reader.file_span(codes.clone()) is None and reader.file_span(codes[:, 1]) is None
        plan = [PlannedTensor("w", torch.bfloat16, (5, 7)), PlannedTensor("rows", torch.uint8, (2, 6, 8)),
                PlannedTensor("copy", torch.uint8, (4, 6, 8))]
        out = tmp_path / "out"
        out.mkdir()
        writer = ShardWriter(out, plan, 10**9)
        writer.write("w", w, reader.file_span(w))
        writer.write("rows", rows, reader.file_span(rows))
        assert copies == [70, 96]
        monkeypatch.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "")))
        writer.write("copy", codes, reader.file_span(codes))  # written from memory
        writer.finish()
        count = len(reader._mappings)
        del codes, rows, w
        assert len(reader._mappings) == count - 3  # a mapping no tensor holds is forgotten
    written = load_file(out / "model.safetensors")
    assert torch.equal(written["w"], stored["w"]) and torch.equal(written["rows"], stored["codes"][1:3])
    assert torch.equal(written["copy"], stored["codes"])

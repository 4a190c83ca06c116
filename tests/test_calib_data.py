"""Calibration files: formats, packing into windows, the default set, and one clear error for each bad input."""

from __future__ import annotations

import json

import pytest
import torch

from fp4kit.errors import Fp4kitError
from fp4kit.quantize.calib_data import load_calibration

VOCAB = 256


@pytest.fixture
def src(tmp_path):
    """A model directory without a tokenizer (like fp4kit's fixtures)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def src_with_tokenizer(tmp_path):
    """A model directory with a small word-level tokenizer, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenized-model"
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(path)
    return path


def write_jsonl(path, records) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def test_input_ids_are_packed_into_full_windows(tmp_path, src):
    calib = tmp_path / "ids.jsonl"
    write_jsonl(calib, [{"input_ids": list(range(10))}, {"input_ids": list(range(10, 25))}])
    ids = load_calibration(calib, src, VOCAB, samples=10, seq_len=8)
    assert ids.dtype == torch.int64 and ids.shape == (3, 8)  # 25 tokens: 3 whole windows, the rest dropped
    assert ids.flatten().tolist() == list(range(24))
    assert load_calibration(calib, src, VOCAB, samples=2, seq_len=8).shape == (2, 8)


def test_text_is_tokenized_with_the_models_tokenizer(tmp_path, src_with_tokenizer):
    calib = tmp_path / "text.jsonl"
    write_jsonl(calib, [{"text": "the cat sat"}, {"text": "on a mat"}, "", {"text": "a dog"}])
    ids = load_calibration(calib, src_with_tokenizer, VOCAB, samples=1, seq_len=8)
    assert ids.tolist() == [[1, 2, 3, 4, 6, 5, 6, 7]]


def test_txt_documents_are_blank_line_separated(tmp_path, src_with_tokenizer):
    calib = tmp_path / "text.txt"
    calib.write_text("the cat\nsat\n\n\non a mat\n")
    assert load_calibration(calib, src_with_tokenizer, VOCAB, samples=4, seq_len=3).tolist() == [[1, 2, 3], [4, 6, 5]]


def test_parquet_text_and_input_ids(tmp_path, src, src_with_tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5, 6, 7]]}), tmp_path / "ids.parquet")
    assert load_calibration(tmp_path / "ids.parquet", src, VOCAB, 4, 3).tolist() == [[1, 2, 3], [4, 5, 6]]
    pq.write_table(pa.table({"text": ["the cat", "sat on a mat"], "id": [1, 2]}), tmp_path / "text.parquet")
    assert load_calibration(tmp_path / "text.parquet", src_with_tokenizer, VOCAB, 4, 3).tolist() == [[1, 2, 3],
                                                                                                      [4, 6, 5]]


def test_default_set_without_tokenizer_is_utf8_bytes_modulo_vocab(src):
    ids = load_calibration(None, src, 100, samples=4, seq_len=64)
    assert ids.shape == (4, 64) and int(ids.max()) < 100
    assert torch.equal(ids, load_calibration(None, src, 100, samples=4, seq_len=64))  # deterministic
    from importlib import resources

    first = json.loads(resources.files("fp4kit.data").joinpath("calib_default.jsonl").read_text().splitlines()[0])
    assert ids[0].tolist() == [b % 100 for b in first["text"].encode()][:64]


def test_default_set_is_varied_and_big_enough_for_the_demo(src):
    from importlib import resources

    lines = resources.files("fp4kit.data").joinpath("calib_default.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    assert len(texts) >= 64 and len(set(texts)) == len(texts)
    assert load_calibration(None, src, VOCAB, samples=16, seq_len=512).shape == (16, 512)


def test_fewer_windows_than_the_default_warn_only_for_a_users_file_or_an_explicit_count(tmp_path, src):
    """The packaged set is small by design: taking all it holds when no count was asked for is not worth a warning
    on every default run; an explicit --samples, or the user's own file, still is."""
    heard: list[str] = []
    ids = load_calibration(None, src, 256, samples=None, seq_len=512, warn=heard.append, default_samples=10**6)
    assert heard == [] and 1 <= ids.shape[0] < 10**6
    load_calibration(None, src, 256, samples=10**6, seq_len=512, warn=heard.append)
    assert len(heard) == 1 and heard[0].startswith("--samples 1000000: the default calibration set")
    calib = tmp_path / "ids.jsonl"
    write_jsonl(calib, [{"input_ids": list(range(40))}])
    ids = load_calibration(calib, src, 256, samples=None, seq_len=8, warn=heard.append, default_samples=9)
    assert ids.shape == (5, 8)
    assert heard[1] == f"--samples 9: {calib} holds 40 tokens, 5 samples of --seq-len 8; using those 5"


def test_default_set_uses_the_tokenizer_when_there_is_one(src_with_tokenizer):
    ids = load_calibration(None, src_with_tokenizer, VOCAB, samples=2, seq_len=16)
    assert ids.shape == (2, 16) and int(ids.max()) < 8  # word-level ids, not bytes


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.jsonl", "", "no calibration samples"),
        ("blank.jsonl", "\n  \n", "no calibration samples"),
        ("empty.txt", "", "no calibration samples"),
        ("bad.jsonl", '{"text": "a"}\n{"text": \n', r"bad\.jsonl:2: not valid JSON"),
        ("list.jsonl", "[1, 2, 3]\n", "expected a JSON object with a 'text' or an 'input_ids' field"),
        ("nofield.jsonl", '{"content": "hello"}\n', "'text' or an 'input_ids' field"),
        ("strids.jsonl", '{"input_ids": "1 2 3"}\n', "input_ids must be a non-empty list of non-negative integers"),
        ("negids.jsonl", '{"input_ids": [1, -2]}\n', "non-negative integers"),
        ("floatids.jsonl", '{"input_ids": [1, 2.5]}\n', "non-negative integers"),
        ("numtext.jsonl", '{"text": 12}\n', "text must be a string"),
        ("vocab.jsonl", '{"input_ids": [1, 2]}\n{"input_ids": [3, 256]}\n', r"vocab\.jsonl:2: token id 256 is outside"),
        ("short.jsonl", '{"input_ids": [1, 2, 3]}\n', "only 3 tokens, fewer than one sample of --seq-len 8"),
        ("data.csv", "text\nhello\n", "unknown calibration file type .csv"),
        ("text.jsonl", '{"text": "hello"}\n', "has no tokenizer; give token ids in an 'input_ids' field"),
        ("text.txt", "hello\n", "has no tokenizer"),
    ],
)
def test_bad_calibration_files_get_one_clear_line(tmp_path, src, name, content, message):
    calib = tmp_path / name
    calib.write_text(content)
    with pytest.raises(Fp4kitError, match=message) as info:
        load_calibration(calib, src, VOCAB, samples=4, seq_len=8)
    assert "\n" not in str(info.value) and str(calib.name) in str(info.value)


def test_missing_directory_binary_and_broken_parquet_files(tmp_path, src):
    with pytest.raises(Fp4kitError, match="calibration file not found"):
        load_calibration(tmp_path / "nope.jsonl", src, VOCAB, 4, 8)
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(Fp4kitError, match="not a regular file"):
        load_calibration(tmp_path / "dir.jsonl", src, VOCAB, 4, 8)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(Fp4kitError, match="not UTF-8"):
        load_calibration(tmp_path / "latin1.txt", src, VOCAB, 4, 8)
    pytest.importorskip("pyarrow")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(Fp4kitError, match="not a readable parquet file"):
        load_calibration(tmp_path / "broken.parquet", src, VOCAB, 4, 8)


def test_parquet_without_a_usable_column_and_out_of_vocab_ids(tmp_path, src):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "cols.parquet")
    with pytest.raises(Fp4kitError, match="no 'text' or 'input_ids' column"):
        load_calibration(tmp_path / "cols.parquet", src, VOCAB, 4, 8)
    pq.write_table(pa.table({"input_ids": [[1, 2, 999]]}), tmp_path / "vocab.parquet")
    with pytest.raises(Fp4kitError, match="row 1: token id 999 is outside the model's vocabulary"):
        load_calibration(tmp_path / "vocab.parquet", src, VOCAB, 4, 2)


@pytest.mark.parametrize(("samples", "seq_len"), [(0, 8), (4, 0)])
def test_samples_and_seq_len_must_be_positive(src, samples, seq_len):
    with pytest.raises(Fp4kitError, match="at least 1"):
        load_calibration(None, src, VOCAB, samples, seq_len)

"""Calibration token ids from a local file: ``.jsonl`` (a ``text`` or ``input_ids`` field per line), ``.txt``
(documents separated by blank lines) or ``.parquet`` (a ``text`` or ``input_ids`` column).

Documents are tokenized with SRC's tokenizer (its own special tokens, e.g. BOS, per document), concatenated and cut
into ``samples`` windows of ``seq_len`` tokens: every sample is full length, so no padding and no attention mask is
involved. ``input_ids`` are taken as they are. Fewer windows than ``samples`` is fine (``warn`` says so); less
than one is an error.

With no file, the small English set shipped in ``fp4kit/data/calib_default.jsonl`` is used so that the demo and the
tests run offline. Real models want real text (ideally like what they will serve) and a few hundred samples.
The default set is also the only text that may be used without a tokenizer: when SRC has none (fp4kit's tiny
fixtures), its ids are the UTF-8 bytes of the text modulo ``vocab_size`` — deterministic, meaningless as language,
good enough to drive activations through a random test model. A user file with text and no tokenizer is an error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

import torch

from fp4kit.errors import Fp4kitError

DEFAULT_SET = "calib_default.jsonl"
FORMATS = (".jsonl", ".txt", ".parquet")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# A document is (where it came from, its text or its token ids).
Document = tuple[str, "str | list[int]"]


def load_calibration(path: Path | None, src: Path, vocab_size: int, samples: int | None, seq_len: int,
                     warn: Callable[[str], None] | None = None, default_samples: int = 256,
                     purpose: str = "calibration") -> torch.Tensor:
    """int64 [S, seq_len] token ids, S = min(samples, whole windows available); errors raise Fp4kitError, naming
    the file as a ``purpose`` file ("calibration"; "eval text" for `fp4kit eval --text`).
    ``samples`` None (not asked for): ``default_samples``. ``warn(text)`` hears when fewer than the samples are
    available, and how many are used, except when the packaged set (``path`` None) holds fewer than the default: it is
    a small offline set by design, and the count used is reported anyway."""
    asked = samples is not None
    samples = samples if samples is not None else default_samples
    if samples < 1 or seq_len < 1:
        raise Fp4kitError(f"--samples and --seq-len must be at least 1 (got {samples} and {seq_len})")
    if path is None:
        where = resources.files("fp4kit.data").joinpath(DEFAULT_SET)
        documents = list(_jsonl_documents(where.read_text(encoding="utf-8").splitlines(), DEFAULT_SET))
        label = f"the default calibration set ({DEFAULT_SET})"
    else:
        path = Path(path)
        documents = list(_documents(path, purpose))  # the whole file is checked before any tokenizing
        label = str(path)
    if not documents:
        raise Fp4kitError(f"{label}: no {purpose} samples (the file is empty)")
    for origin, content in documents:
        if not isinstance(content, str):
            _check_vocab(origin, content, vocab_size)
    tokenize: Callable[[str], list[int]] | None = None
    if any(isinstance(content, str) for _, content in documents):
        tokenize = _tokenizer(Path(src), label, byte_fallback_vocab=vocab_size if path is None else None)
    stream: list[int] = []
    for origin, content in documents:
        if isinstance(content, str):
            assert tokenize is not None
            content = tokenize(content)
            _check_vocab(origin, content, vocab_size)  # a tokenizer with more ids than the model's vocabulary
        stream.extend(content)
        if len(stream) >= samples * seq_len:
            break
    windows = min(samples, len(stream) // seq_len)
    if windows == 0:
        raise Fp4kitError(f"{label}: only {len(stream)} tokens, fewer than one sample of --seq-len {seq_len}")
    if windows < samples and warn is not None and (asked or path is not None):
        warn(f"--samples {samples}: {label} holds {len(stream)} tokens, {windows} samples of --seq-len {seq_len}; "
             f"using those {windows}")
    return torch.tensor(stream[: windows * seq_len], dtype=torch.int64).view(windows, seq_len)


def _check_vocab(origin: str, ids: list[int], vocab_size: int) -> None:
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise Fp4kitError(f"{origin}: token id {bad} is outside the model's vocabulary (vocab_size {vocab_size})")


def _documents(path: Path, purpose: str) -> Iterator[Document]:
    if not path.exists():
        raise Fp4kitError(f"{path}: {purpose} file not found")
    if not path.is_file():
        raise Fp4kitError(f"{path}: {purpose} file is not a regular file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_documents(path)
    if suffix not in FORMATS:
        raise Fp4kitError(f"{path}: unknown {purpose} file type {suffix or '(none)'}; use {', '.join(FORMATS)}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise Fp4kitError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if suffix == ".jsonl":
        return _jsonl_documents(text.splitlines(), str(path))
    paragraphs = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n")]
    return iter([(f"{path} paragraph {i + 1}", p) for i, p in enumerate(paragraphs) if p])


def _jsonl_documents(lines: list[str], label: str) -> Iterator[Document]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{label}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise Fp4kitError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not ({"text", "input_ids"} & record.keys()):
            raise Fp4kitError(f"{where}: expected a JSON object with a 'text' or an 'input_ids' field")
        document = _document(where, record.get("input_ids"), record.get("text"))
        if document is not None:
            yield document


def _document(where: str, input_ids: object, text: object) -> Document | None:
    if input_ids is not None:
        if (
            not isinstance(input_ids, list)
            or not input_ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in input_ids)
        ):
            raise Fp4kitError(f"{where}: input_ids must be a non-empty list of non-negative integers")
        return where, input_ids
    if not isinstance(text, str):
        raise Fp4kitError(f"{where}: text must be a string, got {type(text).__name__}")
    return (where, text) if text.strip() else None


def _parquet_documents(path: Path) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise Fp4kitError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a file that is not parquet
        raise Fp4kitError(f"{path}: not a readable parquet file ({exc})") from None
    columns = set(parquet.schema_arrow.names)
    column = "input_ids" if "input_ids" in columns else "text" if "text" in columns else None
    if column is None:
        raise Fp4kitError(f"{path}: no 'text' or 'input_ids' column (columns: {', '.join(sorted(columns))})")
    row = 0
    for batch in parquet.iter_batches(columns=[column], batch_size=256):
        for value in batch.column(0).to_pylist():
            row += 1
            where = f"{path} row {row}"
            document = _document(where, value, None) if column == "input_ids" else _document(where, None, value)
            if document is not None:
                yield document


def _tokenizer(src: Path, label: str, byte_fallback_vocab: int | None) -> Callable[[str], list[int]]:
    if any((src / name).exists() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(src)
        except Exception as exc:  # transformers raises many types for a broken tokenizer
            raise Fp4kitError(f"{src}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None
        return lambda text: list(tokenizer(text)["input_ids"])
    if byte_fallback_vocab is not None:
        return lambda text: [b % byte_fallback_vocab for b in text.encode("utf-8")]
    raise Fp4kitError(f"{label} holds text but {src} has no tokenizer; give token ids in an 'input_ids' field")

"""Fuzzed bad input: headers, indexes and configs of tiny checkpoints mutated by hypothesis, run through the CLI.

The invariant (docs/bad_input.md): a command either succeeds with exactly the bytes a clean run writes, or exits 2
with one line on stderr and leaves nothing behind. Exit 1 (checks found problems) only from `inspect`. Any other
outcome, a traceback above all, fails the test. CI runs the `ci` profile (few examples, derandomized); set
``--hypothesis-profile dev`` locally for a longer search.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp4kit.cli import main
from fp4kit.io.output import leftovers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

settings.register_profile("ci", max_examples=6, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.load_profile("ci")

INDEX = "model.safetensors.index.json"


def run(capsys, *args: str) -> tuple[int, str]:
    """fp4kit's own entry point in this process: (exit code, stderr)."""
    argv = sys.argv
    sys.argv = ["fp4kit", *args]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    return code, capsys.readouterr().err


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def sharded(tiny, tmp_path_factory, name: str) -> Path:
    """The tiny bf16 checkpoint re-saved as two shards and an index (so index mutations have something to hit)."""
    from safetensors.torch import load_file, save_file

    src = tiny(name)
    out = tmp_path_factory.mktemp(f"sharded-{name}") / "src"
    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, members in halves.items():
        save_file({n: tensors[n] for n in members}, out / file, metadata={"format": "pt"})
        weight_map |= {n: file for n in members}
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return out


@pytest.fixture(scope="module")
def clean(tiny, tmp_path_factory):
    """(source, the bytes `fp4kit quantize` writes from it: by the same command line as the mutated runs, which the
    output's provenance record and model card carry)."""
    from fp4kit import cli

    src = sharded(tiny, tmp_path_factory, "qwen3_moe")
    out = tmp_path_factory.mktemp("clean") / "out"
    cli._register_commands()
    assert cli.run(["quantize", str(src), str(out), "-q"]) == 0
    return src, digest(out)


def read_header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def write_header(path: Path, header: dict | bytes, body: bytes, length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + body)


# --- mutations: each takes (checkpoint dir, hypothesis draw) and edits the copy in place ---------------------------

JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                        st.text(max_size=8), st.lists(st.integers(-5, 10**6), max_size=4),
                        st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def mutate_entry(root: Path, draw) -> None:
    shard = root / draw(st.sampled_from(sorted(p.name for p in root.glob("*.safetensors"))))
    header, body = read_header(shard)
    name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    entry = header[name]
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "drop", "whole", "offset_shift", "dim"]))
    if field == "drop":
        del entry[draw(st.sampled_from(sorted(entry)))]
    elif field == "whole":
        header[name] = draw(JSON_VALUES)
    elif field == "offset_shift":
        delta = draw(st.integers(-64, 64).filter(bool))
        entry["data_offsets"] = [entry["data_offsets"][0] + delta, entry["data_offsets"][1] + delta]
    elif field == "dim" and entry["shape"]:
        i = draw(st.integers(0, len(entry["shape"]) - 1))
        entry["shape"][i] = draw(st.sampled_from([0, 1, entry["shape"][i] * 2, -1, entry["shape"][i] // 2]))
    elif field == "dtype":
        entry["dtype"] = draw(st.sampled_from(["F32", "BF16", "U8", "I64", "F8_E4M3", "C64", "bf16", ""]))
    else:
        entry[field] = draw(JSON_VALUES)
    write_header(shard, header, body)


def mutate_file(root: Path, draw) -> None:
    shard = root / draw(st.sampled_from(sorted(p.name for p in root.glob("*.safetensors"))))
    header, body = read_header(shard)
    kind = draw(st.sampled_from(["truncate", "extend", "length", "garbage", "duplicate_key", "metadata", "empty"]))
    if kind == "truncate":
        write_header(shard, header, body[: -draw(st.integers(1, max(1, len(body))))])
    elif kind == "extend":
        write_header(shard, header, body + b"\0" * draw(st.integers(1, 64)))
    elif kind == "length":
        raw = json.dumps(header).encode()
        write_header(shard, raw, body, draw(st.sampled_from([0, 1, len(raw) - 1, len(raw) + 9, 2**63, 2**40])))
    elif kind == "garbage":
        write_header(shard, draw(st.binary(min_size=1, max_size=32)), body)
    elif kind == "duplicate_key":
        name = next(k for k in header if k != "__metadata__")
        raw = json.dumps(header).encode()
        entry = json.dumps({name: header[name]})[1:-1].encode()
        write_header(shard, raw[:-1] + b"," + entry + b"}", body)
    elif kind == "metadata":
        header["__metadata__"] = draw(JSON_VALUES)
        write_header(shard, header, body)
    else:
        shard.write_bytes(b"")


def mutate_index(root: Path, draw) -> None:
    index = json.loads((root / INDEX).read_text())
    weight_map = index["weight_map"]
    names = sorted(weight_map)
    kind = draw(st.sampled_from(["drop_tensor", "extra_tensor", "move", "escape", "absolute", "empty", "value",
                                 "not_object", "drop_shard", "reformat"]))
    if kind == "drop_tensor":
        del weight_map[draw(st.sampled_from(names))]
    elif kind == "extra_tensor":
        weight_map["model.layers.0.ghost.weight"] = "model-00001-of-00002.safetensors"
    elif kind == "move":
        name = draw(st.sampled_from(names))
        weight_map[name] = next(f for f in sorted(set(weight_map.values())) if f != weight_map[name])
    elif kind == "escape":
        weight_map[draw(st.sampled_from(names))] = "../src/model-00001-of-00002.safetensors"
    elif kind == "absolute":
        weight_map[draw(st.sampled_from(names))] = str(root / "model-00001-of-00002.safetensors")
    elif kind == "empty":
        index["weight_map"] = {}
    elif kind == "value":
        weight_map[draw(st.sampled_from(names))] = draw(JSON_VALUES)
    elif kind == "not_object":
        index = draw(JSON_VALUES)
    elif kind == "drop_shard":
        index["weight_map"] = {n: f for n, f in weight_map.items() if f != "model-00002-of-00002.safetensors"}
    # "reformat": the same index, other whitespace: must give the clean bytes
    (root / INDEX).write_text(json.dumps(index, indent=draw(st.sampled_from([None, 1, 4]))))


CONFIG_KEYS = ["hidden_size", "num_hidden_layers", "num_experts", "num_local_experts", "moe_intermediate_size",
               "num_experts_per_tok", "vocab_size", "model_type"]


def mutate_config(root: Path, draw) -> None:
    config = json.loads((root / "config.json").read_text())
    kind = draw(st.sampled_from(["value", "drop", "not_object", "experts"]))
    if kind == "value":
        key = draw(st.sampled_from(CONFIG_KEYS))
        config[key] = draw(st.one_of(JSON_VALUES, st.sampled_from([0, -1, 3, 7, 16, "16"])))
    elif kind == "drop":
        config.pop(draw(st.sampled_from(CONFIG_KEYS)), None)
    elif kind == "experts":
        for key in ("num_experts", "num_local_experts"):
            if key in config:
                config[key] = draw(st.sampled_from([4, 16, 9]))
    if kind == "not_object":
        config = draw(st.lists(st.integers(), max_size=3))
    (root / "config.json").write_text(json.dumps(config))


MUTATIONS = {"entry": mutate_entry, "file": mutate_file, "index": mutate_index, "config": mutate_config}


def assert_invariant(code: int, err: str, dst: Path, clean_digest: dict[str, str] | None, allowed: set[int]) -> None:
    assert code in allowed, err
    lines = [line for line in err.splitlines() if line.strip()]
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) < 2000, err
        assert not dst.exists() and not leftovers(dst), sorted(p.name for p in dst.parent.iterdir())
    elif code == 0 and clean_digest is not None:
        assert digest(dst) == clean_digest
        assert not leftovers(dst)


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@given(data=st.data())
def test_quantize_on_mutated_source(mutation, data, clean, tmp_path_factory, capsys):
    src, clean_digest = clean
    work = tmp_path_factory.mktemp("fuzz")
    bad = work / "src"
    shutil.copytree(src, bad)
    MUTATIONS[mutation](bad, data.draw)
    dst = work / "out"
    code, err = run(capsys, "quantize", str(bad), str(dst), "-q")
    # exit 0 is allowed only where the mutation changed nothing that matters: then the bytes are the clean ones (a
    # config field the quantization does not read is copied as it is)
    if mutation == "config":
        clean_digest = {f: h for f, h in clean_digest.items() if f != "config.json"}
        if code == 0:
            (dst / "config.json").unlink()
    assert_invariant(code, err, dst, clean_digest, {0, 2})
    if code == 0 and mutation != "config":
        assert run(capsys, "inspect", str(dst))[0] == 0


@pytest.fixture(scope="module")
def quantized(clean, tmp_path_factory):
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    out = tmp_path_factory.mktemp("quantized") / "out"
    quantize_checkpoint(clean[0], out, QuantizeOptions(max_shard_bytes=20_000))
    assert (out / INDEX).exists()
    return out


@pytest.mark.parametrize("mutation", ["entry", "file", "index"])
@pytest.mark.parametrize("command", ["inspect", "convert", "shard", "layout"])
@given(data=st.data())
def test_commands_on_mutated_quantized_checkpoint(command, mutation, data, quantized, tmp_path_factory, capsys):
    work = tmp_path_factory.mktemp("fuzzq")
    bad = work / "ckpt"
    shutil.copytree(quantized, bad)
    MUTATIONS[mutation](bad, data.draw)
    dst = work / "out"
    args = {"inspect": ["inspect", str(bad)], "convert": ["convert", str(bad), str(dst), "--to", "modelopt"],
            "shard": ["shard", str(bad), str(dst), "--ep", "2"],
            "layout": ["layout", str(bad), str(dst), "--backend", "trtllm"]}[command]
    code, err = run(capsys, *args, *([] if command == "inspect" else ["-q"]))
    assert_invariant(code, err, dst, None, {0, 1, 2} if command == "inspect" else {0, 2})

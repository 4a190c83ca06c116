"""Bad input: one clear line on stderr, exit code 2, no traceback, and no output directory left behind."""

import json
import re
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fp4kit", *args], capture_output=True, text=True, timeout=300)


PHASE_LINE = re.compile(r"[a-z]+: [a-z ]+ \(.*\)")


def assert_clean_failure(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    # without a terminal a phase that started says so in a line of its own ("quantize: quantizing (1.2 MB)")
    lines = [line for line in result.stderr.splitlines() if line.strip() and not PHASE_LINE.fullmatch(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0]


def assert_no_output(dst) -> None:
    assert not dst.exists()
    assert not list(dst.parent.glob(f".{dst.name}*"))


@pytest.fixture
def src(tiny, tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(tiny("qwen3_moe"), copy)
    return copy


def rewrite(path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_truncated_shard(src, tmp_path):
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    dst = tmp_path / "out"
    assert_clean_failure(run_cli("quantize", str(src), str(dst)), "model.safetensors", "truncated")
    assert_no_output(dst)


def test_missing_shard_named_in_index(src, tmp_path):
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, src / "model-00001-of-00002.safetensors")
    (src / "model.safetensors").unlink()
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names[:half]}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in names[half:]}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    dst = tmp_path / "out"
    assert_clean_failure(run_cli("quantize", str(src), str(dst)), "model-00002-of-00002.safetensors", "missing")
    assert_no_output(dst)


def test_unsupported_architecture(src, tmp_path):
    config = json.loads((src / "config.json").read_text())
    config["model_type"], config["architectures"] = "mixtral", ["MixtralForCausalLM"]
    (src / "config.json").write_text(json.dumps(config))
    dst = tmp_path / "out"
    assert_clean_failure(run_cli("quantize", str(src), str(dst)), "mixtral")
    assert_no_output(dst)


def test_dimension_not_divisible_by_16(tmp_path):
    from fp4kit.testing.fixtures import build_fixture

    src = build_fixture("qwen3_moe", tmp_path / "src", overrides={"moe_intermediate_size": 24})
    dst = tmp_path / "out"
    assert_clean_failure(run_cli("quantize", str(src), str(dst)), "down_proj.weight", "divisible by 16")
    assert_no_output(dst)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight(src, tmp_path, bad):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"

    def poison(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][4, 9] = bad

    rewrite(src / "model.safetensors", poison)
    dst = tmp_path / "out"
    assert_clean_failure(run_cli("quantize", str(src), str(dst)), name, "NaN or Inf")
    assert_no_output(dst)


def test_existing_nonempty_destination(src, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("user data")
    assert_clean_failure(run_cli("quantize", str(src), str(dst)), "--overwrite")
    assert (dst / "keep.txt").read_text() == "user data"
    assert not list(tmp_path.glob(".out*"))


def test_w4a4_missing_calibration_file(src, tmp_path):
    dst = tmp_path / "out"
    calib = tmp_path / "missing.jsonl"
    assert_clean_failure(run_cli("quantize", str(src), str(dst), "--scheme", "nvfp4", "--calib", str(calib)),
                         "missing.jsonl", "not found")
    assert_no_output(dst)


def test_overwrite_replaces_and_interrupted_run_leaves_nothing(src, tmp_path, monkeypatch):
    from fp4kit.quantize import checkpoint as q

    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    calls = {"n": 0}
    real = q.encode_group

    def crash_midway(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(q, "encode_group", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        q.quantize_checkpoint(src, dst, q.QuantizeOptions(overwrite=True))
    assert (dst / "old.txt").exists() and not list(tmp_path.glob(".out*"))
    monkeypatch.setattr(q, "encode_group", real)
    q.quantize_checkpoint(src, dst, q.QuantizeOptions(overwrite=True))
    assert not (dst / "old.txt").exists() and (dst / "model.safetensors").exists()

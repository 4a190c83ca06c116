"""Bad input: one clear line on stderr, exit code 2, no traceback, and no output directory left behind."""

import json
import re
import shutil
import subprocess

import pytest
from helpers import cli_result
from safetensors.torch import load_file, save_file

# a phase's line, or a line per decoder layer of a phase (fp4kit.progress)
PHASE_LINE = re.compile(r"[a-z]+: [a-z ]+( \(.*\)|: layer \d+/\d+, \d+:\d\d:\d\d elapsed)")


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
    assert_clean_failure(cli_result("quantize", str(src), str(dst)), "model.safetensors", "truncated")
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
    assert_clean_failure(cli_result("quantize", str(src), str(dst)), "model-00002-of-00002.safetensors", "missing")
    assert_no_output(dst)


def test_unsupported_architecture(src, tmp_path):
    config = json.loads((src / "config.json").read_text())
    config["model_type"], config["architectures"] = "mixtral", ["MixtralForCausalLM"]
    (src / "config.json").write_text(json.dumps(config))
    dst = tmp_path / "out"
    assert_clean_failure(cli_result("quantize", str(src), str(dst)), "mixtral")
    assert_no_output(dst)


def test_dimension_not_divisible_by_16(tmp_path):
    from fp4kit.testing.fixtures import build_fixture

    src = build_fixture("qwen3_moe", tmp_path / "src", overrides={"moe_intermediate_size": 24})
    dst = tmp_path / "out"
    assert_clean_failure(cli_result("quantize", str(src), str(dst)), "down_proj.weight", "divisible by 16")
    assert_no_output(dst)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight(src, tmp_path, bad):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"

    def poison(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][4, 9] = bad

    rewrite(src / "model.safetensors", poison)
    dst = tmp_path / "out"
    assert_clean_failure(cli_result("quantize", str(src), str(dst)), name, "NaN or Inf")
    assert_no_output(dst)


def test_existing_nonempty_destination(src, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("user data")
    assert_clean_failure(cli_result("quantize", str(src), str(dst)), "--overwrite")
    assert (dst / "keep.txt").read_text() == "user data"
    assert not list(tmp_path.glob(".out*"))


def test_w4a4_missing_calibration_file(src, tmp_path):
    dst = tmp_path / "out"
    calib = tmp_path / "missing.jsonl"
    assert_clean_failure(cli_result("quantize", str(src), str(dst), "--scheme", "nvfp4", "--calib", str(calib)),
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


NON_POSITIVE = {  # command line (SRC, an NVFP4 CKPT, DST filled in) -> the one line
    "quantize --batch-size 0": (["quantize", "{src}", "{dst}", "--scheme", "nvfp4", "--batch-size", "0"],
                                "--batch-size must be at least 1, got 0"),
    "quantize gptq --batch-size -1": (["quantize", "{src}", "{dst}", "--method", "gptq", "--batch-size", "-1"],
                                      "--batch-size must be at least 1, got -1"),
    "quantize --samples 0": (["quantize", "{src}", "{dst}", "--scheme", "nvfp4", "--samples", "0"],
                             "--samples and --seq-len must be at least 1"),
    "quantize --seq-len 0": (["quantize", "{src}", "{dst}", "--scheme", "nvfp4", "--seq-len", "0"],
                             "--samples and --seq-len must be at least 1"),
    "quantize --gptq-damp -1": (["quantize", "{src}", "{dst}", "--method", "gptq", "--gptq-damp", "-1"],
                                "--gptq-damp must be positive"),
    "quantize --gptq-min-tokens 0": (["quantize", "{src}", "{dst}", "--method", "gptq", "--gptq-min-tokens", "0"],
                                     "--gptq-min-tokens must be at least 1"),
    "quantize --gptq-asymmetric -1": (["quantize", "{src}", "{dst}", "--method", "gptq", "--gptq-asymmetric", "-1"],
                                      "--gptq-asymmetric must be 0 (off) or positive"),
    "quantize mse --gptq-act-order": (["quantize", "{src}", "{dst}", "--method", "mse", "--gptq-act-order"],
                                      "--gptq-act-order applies to --method gptq, not mse"),
    "quantize --gptq-act-quant quantized": (["quantize", "{src}", "{dst}", "--scheme", "nvfp4", "--method", "gptq",
                                             "--gptq-act-quant"], "--gptq-act-quant applies to --method gptq"),
    "quantize --max-shard-size 0": (["quantize", "{src}", "{dst}", "--max-shard-size", "0"], "cannot read size '0'"),
    "eval --batch-size 0": (["eval", "{src}", "{ckpt}", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    "eval --seq-len 1": (["eval", "{src}", "{ckpt}", "--seq-len", "1"], "--seq-len must be at least 2, got 1"),
    "eval --samples 0": (["eval", "{src}", "{ckpt}", "--samples", "0"], "--samples and --seq-len must be at least 1"),
    "shard --ep 0": (["shard", "{ckpt}", "{dst}", "--ep", "0"], "--ep 0: the expert-parallel size must be at least 1"),
    "inspect --ep 0": (["inspect", "{ckpt}", "--ep", "0"], "--ep 0: must be at least 1"),
    "verify --tokens 0": (["verify", "{ckpt}", "--tokens", "0", "-q"], "--tokens must be positive token counts"),
}


@pytest.mark.parametrize("case", NON_POSITIVE)
def test_non_positive_sizes_are_one_line_errors(case, src, tiny_nvfp4a16, tmp_path, capsys):
    """A zero or negative count or size is a usage mistake: its one line, exit 2, no output (not an internal error
    with a traceback file)."""
    from fp4kit import cli

    argv, line = NON_POSITIVE[case]
    dst = tmp_path / "out"
    fields = {"src": src, "ckpt": tiny_nvfp4a16("qwen3_moe"), "dst": dst}
    cli._register_commands()
    code = cli.run([arg.format(**fields) for arg in argv])
    err = capsys.readouterr().err
    lines = [text for text in err.splitlines() if text.strip() and not PHASE_LINE.fullmatch(text)]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and line in lines[0], err
    assert "internal error" not in err
    assert_no_output(dst)


def test_eval_text_not_found_is_named_as_eval_text(src, tiny_nvfp4a16, tmp_path, capsys):
    from fp4kit import cli

    cli._register_commands()
    missing = tmp_path / "missing.jsonl"
    assert cli.run(["eval", str(src), str(tiny_nvfp4a16("qwen3_moe")), "--text", str(missing), "-q"]) == 2
    assert capsys.readouterr().err == f"error: {missing}: eval text file not found\n"

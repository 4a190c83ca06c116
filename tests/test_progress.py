"""What `fp4kit quantize` and `fp4kit run` show while they work and when they end: a determinate bar per phase on a
terminal within 80 columns (calibration counts layers x batches, quantization bytes, the calibrated methods decoder
layers), a line per phase otherwise and a line per decoder layer of the calibration pass and the calibrated methods
with the time elapsed, nothing but warnings with -q; a warning for each option that did not get what it asked for;
the calibration data used, in the summary line and in the output's routing statistics (docs/formats.md)."""

from __future__ import annotations

import json
import re

import pytest
from helpers import run_cli, under_terminal

from fp4kit.progress import Reporter, start_phase
from fp4kit.quantize.calib_data import DEFAULT_SET
from fp4kit.quantize.input_scales import ROUTING_STATS_NAME


def test_calibration_and_quantization_bars_under_a_terminal(tiny, tmp_path) -> None:
    src = tiny("qwen3_moe")
    args = ["quantize", src, tmp_path / "out", "--scheme", "nvfp4", "--samples", "6", "--seq-len", "16",
            "--batch-size", "2"]
    code, stdout, terminal = under_terminal(*args)
    assert code == 0, terminal[-2000:]
    config = json.loads((src / "config.json").read_text())
    total = config["num_hidden_layers"] * 3  # layers x batches (6 samples in batches of 2)
    batches = [(int(done), int(of)) for done, of in re.findall(r"(\d+)/(\d+) batches", terminal)]
    assert batches and {of for _, of in batches} == {total}, terminal[-2000:]  # never "0/?"
    assert max(done for done, _ in batches) == total
    assert "quantize: calibrating" in terminal and "quantize: quantizing" in terminal
    assert re.search(r"\d+(\.\d+)? kB/\d+(\.\d+)? kB", terminal), terminal[-2000:]  # the bytes phase, determinate
    assert "nvfp4 compressed-tensors, method rtn, 6 samples x 16 tokens = 96 tokens" in stdout

    code, stdout, terminal = under_terminal(*args, "--overwrite", "-q")
    assert (code, stdout, terminal) == (0, "", "")


def test_without_a_terminal_a_line_per_phase_and_the_summary(tiny, tmp_path, monkeypatch, capsys) -> None:
    code, out, err = run_cli(monkeypatch, capsys, "quantize", tiny("qwen3_moe"), tmp_path / "out", "--scheme",
                             "nvfp4", "--samples", "4", "--seq-len", "16", "--batch-size", "2", "--format",
                             "modelopt", "--dtype", "fp32")
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0] == "quantize: calibrating (4 samples x 16 tokens, 2 batches through each decoder layer, float32)"
    assert [_elapsed(line) for line in lines[1:3]] == ["quantize: calibrating: layer 1/2", "quantize: calibrating: "
                                                       "layer 2/2"]
    assert re.fullmatch(r"quantize: quantizing \(\d+(\.\d+)? kB\)", lines[3]) and len(lines) == 4, err
    summary = out.splitlines()[-1]
    assert summary.startswith("qwen3_moe: nvfp4 modelopt, method rtn, 4 samples x 16 tokens = 64 tokens of "
                              f"fp4kit:{DEFAULT_SET}: ")
    stats = json.loads((tmp_path / "out" / ROUTING_STATS_NAME).read_text())
    assert stats["calibration"] == {"data": f"fp4kit:{DEFAULT_SET}", "samples": 4, "seq_len": 16, "tokens": 64}

    code, out, err = run_cli(monkeypatch, capsys, "quantize", tiny("qwen3_moe"), tmp_path / "w4a16")
    assert code == 0 and err == "quantize: quantizing (" + err.split("(", 1)[1]
    assert "nvfp4a16 compressed-tensors, method rtn, no calibration data: " in out.splitlines()[-1]


def _elapsed(line: str) -> str:
    """A step line without its elapsed time, which must be there."""
    head, elapsed = line.rsplit(", ", 1)
    assert re.fullmatch(r"\d+:\d\d:\d\d elapsed", elapsed), line
    return head


def test_a_calibrated_method_logs_each_decoder_layer(tiny, tmp_path, monkeypatch, capsys) -> None:
    src = tiny("qwen3_moe")
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    code, out, err = run_cli(monkeypatch, capsys, "quantize", src, tmp_path / "out", "--method", "gptq", "--samples",
                             "4", "--seq-len", "16", "--batch-size", "2", "--dtype", "bf16")
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0] == ("quantize: quantizing (gptq layer by layer: 4 samples x 16 tokens, 2 batches through each "
                        "decoder layer, bfloat16)")
    assert [_elapsed(line) for line in lines[1:]] == [f"quantize: quantizing: layer {i}/{layers}"
                                                      for i in range(1, layers + 1)]


def test_the_gptq_bar_counts_layers_within_80_columns(tiny, tmp_path) -> None:
    src = tiny("qwen3_moe")
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    code, _, terminal = under_terminal("quantize", src, tmp_path / "out", "--method", "gptq", "--scheme", "nvfp4",
                                       "--samples", "4", "--seq-len", "16", "--batch-size", "2", columns=80)
    assert code == 0, terminal[-2000:]
    rows = [row for row in re.split(r"[\r\n]", terminal) if row.strip()]
    assert rows and max(len(row) for row in rows) <= 80, max(rows, key=len)
    counts = _counts(terminal, "layers")
    assert counts and {of for _, of in counts} == {layers} and max(counts) == (layers, layers), terminal[-2000:]
    assert not re.search(r"\d kB/", terminal)  # no byte counts: the pass counts layers
    assert any(re.search(rf"quantize: quantizing .*\d/{layers} layers", row) for row in rows)  # one row, not wrapped


def test_fewer_samples_than_asked_and_an_unused_calib_are_said(tiny, tmp_path, monkeypatch, capsys) -> None:
    calib = tmp_path / "calib.jsonl"  # token ids: the fixture has no tokenizer
    calib.write_text("".join(json.dumps({"input_ids": list(range(1, 101))}) + "\n" for _ in range(3)))
    src = tiny("qwen3_moe")
    code, out, err = run_cli(monkeypatch, capsys, "quantize", src, tmp_path / "few", "--scheme", "nvfp4", "--calib",
                             calib, "--samples", "400", "--seq-len", "64", "-q")
    assert code == 0 and out == ""
    (warning,) = err.splitlines()  # -q: the warning alone
    used = json.loads((tmp_path / "few" / ROUTING_STATS_NAME).read_text())["calibration"]["samples"]
    assert used == 300 // 64
    assert warning == (f"warning: --samples 400: {calib} holds 300 tokens, {used} samples of --seq-len 64; "
                       f"using those {used}")

    code, out, err = run_cli(monkeypatch, capsys, "quantize", src, tmp_path / "a16", "--calib", calib, "-q")
    assert code == 0 and out == ""
    assert err.splitlines() == [f"warning: --calib {calib}: not used: --scheme nvfp4a16 with --method rtn quantizes "
                                "the weights alone, from no data (--method gptq or mse calibrate on it)"]
    assert not (tmp_path / "a16" / ROUTING_STATS_NAME).exists()

    # with --method mse the weight-only scheme does calibrate on it (activation-weighted scale search)
    code, out, err = run_cli(monkeypatch, capsys, "quantize", src, tmp_path / "mse", "--calib", calib,
                             "--method", "mse", "--seq-len", "16", "--samples", "2")
    assert code == 0 and "warning" not in err, err
    assert "nvfp4a16 compressed-tensors, method mse, 2 samples x 16 tokens = 32 tokens of " in out.splitlines()[-1]


def test_a_plain_callable_sees_the_main_phase_only() -> None:
    calls: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        calls.append((done, total))

    assert start_phase(progress, "calibrating", None, "batches") is None
    assert start_phase(progress, "quantizing", 10, main=True) is progress
    assert start_phase(None, "quantizing", 10, main=True) is None
    with Reporter("x", quiet=True) as reporter:
        assert start_phase(reporter, "calibrating", 4, "batches") is reporter


def _counts(terminal: str, unit: str) -> list[tuple[int, int]]:
    return [(int(done), int(of)) for done, of in re.findall(rf"(\d+)/(\d+) {unit}", terminal)]


@pytest.mark.slow  # the whole demo recipe in a child process; test_demo runs the same pipeline in this one
def test_run_and_inspect_bars_under_a_terminal(tmp_path) -> None:
    from importlib import resources

    from fp4kit.pipeline.demo import build_demo_model

    src = build_demo_model("qwen3_moe", tmp_path / "bf16")
    recipe = resources.files("fp4kit.data").joinpath("demo.yaml")
    code, stdout, terminal = under_terminal("run", recipe, "--set", f"model={src}", "--workdir", tmp_path / "run")
    assert code == 0, terminal[-3000:]
    for unit in ("batches", "checks"):  # the quantize step's calibration, the verify step's checks
        counts = _counts(terminal, unit)
        assert counts and len({of for _, of in counts}) == 1, (unit, terminal[-3000:])
        assert max(done for done, _ in counts) == counts[0][1]
    assert "quantize: calibrating" in terminal and "verify" in terminal
    assert stdout.splitlines()[-1].endswith("(quantize: nvfp4 compressed-tensors, method rtn, 16 samples x 64 tokens "
                                            "= 1024 tokens of fp4kit:calib_default.jsonl)")

    code, stdout, terminal = under_terminal("inspect", tmp_path / "run" / "quantize")
    counts = _counts(terminal, "modules")
    assert code == 0 and counts and max(counts) == (counts[0][1], counts[0][1]), terminal
    assert "no problems found" in stdout

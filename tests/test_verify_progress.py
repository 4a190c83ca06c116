"""What `fp4kit verify` shows while it works: a bar of layers x checks on a terminal (a real subprocess under a
pseudo-terminal), a line per layer otherwise, nothing with -q (not even numpy's warning about the NaN row fed on
purpose), `--json -` on stdout, and a warning before a layer that will be slow on the CPU."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import add_input_scales, run_cli, under_terminal

from fp4kit.verify.checks import VerifyOptions
from fp4kit.verify.runner import checks_per_layer, slow_layer_warning, verify_checkpoint


@pytest.fixture(scope="module")
def w4a4(tiny_nvfp4a16, tmp_path_factory) -> Path:
    return add_input_scales(tiny_nvfp4a16("qwen3_moe"), tmp_path_factory.mktemp("progress") / "nvfp4")


def test_terminal_shows_a_determinate_bar_and_quiet_shows_nothing(w4a4) -> None:
    args = ["verify", w4a4, "--device", "cpu", "--tokens", "1,8"]
    code, stdout, terminal = under_terminal(*args)
    assert code == 0, terminal[-2000:]
    total = 2 * checks_per_layer(VerifyOptions(tokens=[1, 8]))  # two MoE layers
    counts = [(int(done), int(of)) for done, of in re.findall(r"(\d+)/(\d+) checks", terminal)]
    assert counts and {of for _, of in counts} == {total}, terminal[-2000:]  # never "0/?"
    assert max(done for done, _ in counts) == total
    assert "verify layer 1 (2 of 2)" in terminal
    assert "PASS" in stdout

    code, stdout, terminal = under_terminal(*args, "-q")
    assert (code, stdout, terminal) == (0, "", "")  # no bar, no table, no numpy warning about the NaN row


def test_without_a_terminal_one_line_per_layer_and_json_on_stdout(monkeypatch, capsys, w4a4) -> None:
    code, stdout, err = run_cli(monkeypatch, capsys, "verify", w4a4, "--device", "cpu", "--tokens", "1",
                                "--backend", "reference", "--json", "-")
    assert code == 0, err
    assert err.splitlines() == ["verify: layer 0 (1 of 2)", "verify: layer 1 (2 of 2)"]
    document = json.loads(stdout)  # the report alone: no table around it
    assert document["format"] == "fp4kit-verify" and document["passed"] is True
    code, stdout, err = run_cli(monkeypatch, capsys, "verify", w4a4, "--device", "cpu", "--tokens", "1",
                                "--backend", "reference", "--json", "-", "-q")
    assert code == 0 and err == "" and json.loads(stdout)["counts"] == document["counts"]


def test_progress_counts_every_check_of_every_layer(tiny, tiny_nvfp4a16) -> None:
    options = VerifyOptions(source=tiny("qwen3_moe"), tokens=[1, 4, 16], backend="reference")
    calls: list[tuple[int, int]] = []
    lines: list[str] = []
    report = verify_checkpoint(tiny_nvfp4a16("qwen3_moe"), options, lambda done, total: calls.append((done, total)),
                               lines.append)
    assert report.passed
    total = 2 * (3 + 1 + 1)  # per layer: each token count, the per-expert source check, the routing rows
    assert checks_per_layer(options) * 2 == total
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert {t for _, t in calls} == {total} and [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert lines == ["layer 0 (1 of 2)", "layer 1 (2 of 2)"]


def _layer(experts: int, hidden: int, intermediate: int) -> SimpleNamespace:
    """Stands for a QuantizedMoe: packed w13 [E, 2I, H/2], w2 [E, H, I/2]."""
    w13 = SimpleNamespace(packed=SimpleNamespace(shape=(experts, 2 * intermediate, hidden // 2)))
    w2 = SimpleNamespace(packed=SimpleNamespace(shape=(experts, hidden, intermediate // 2)))
    return SimpleNamespace(layer=3, num_experts=experts, w13=w13, w2=w2)


def test_a_layer_that_is_slow_on_the_cpu_is_announced() -> None:
    big = _layer(128, 2048, 768)  # a Qwen3-30B-A3B MoE layer
    options = VerifyOptions(tokens=[1, 16, 256, 4096])
    warning = slow_layer_warning(big, options, 8, torch.device("cpu"))  # type: ignore[arg-type]
    assert warning is not None and warning.startswith("layer 3: 128 experts of 2048x768 on the CPU")
    assert "GB" in warning and "--layers 3" in warning
    assert slow_layer_warning(big, options, 8, torch.device("cuda")) is None  # type: ignore[arg-type]
    assert slow_layer_warning(_layer(8, 64, 32), options, 2, torch.device("cpu")) is None  # type: ignore[arg-type]

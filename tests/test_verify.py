"""`fp4kit verify` passes on sound checkpoints: tiny fixtures of every family against their BF16 source, W4A4 with
activation scales, every layout backend undone bit for bit, EP splits whose ranks sum to the unsharded output, and
NaN/Inf routing rows through every backend that ran; the CLI's exit codes, table and JSON report."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

# Before anything imports fp4kit's Triton kernels: on a CPU they can only run under the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import run_cli  # noqa: E402

from fp4kit.errors import Fp4kitError  # noqa: E402
from fp4kit.quantize.checkpoint import quantize_checkpoint  # noqa: E402
from fp4kit.testing.fixtures import FIXTURES  # noqa: E402
from fp4kit.verify.checks import VerifyOptions  # noqa: E402
from fp4kit.verify.runner import verify_checkpoint  # noqa: E402

FAST = [1, 16, 256]
HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _failures(report) -> list[str]:
    return [f"layer {r.layer} {r.check} {r.target}: {r.error} {r.detail}" for r in report.results if r.failed]


@pytest.mark.parametrize("family", FIXTURES)
def test_every_family_passes_against_its_source(tiny, tiny_nvfp4a16, family: str) -> None:
    report = verify_checkpoint(tiny_nvfp4a16(family), VerifyOptions(source=tiny(family), tokens=FAST,
                                                                    backend="reference"))
    assert report.passed, _failures(report)
    checks = {r.check for r in report.results}
    assert {"source", "source-expert", "routing"} <= checks
    assert report.mode == "w4a16"
    errors = [r.error for r in report.results if r.check == "source"]
    assert all(0 < e < 0.25 for e in errors)  # quantized, so not zero; inside the NVFP4 band


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("family", ["glm4_moe", "llama4"])
def test_triton_under_the_interpreter_matches_the_reference(tiny_nvfp4a16, family: str) -> None:
    """The interpreter on a CPU; compiled where a GPU is (the interpreter cannot run once triton is imported)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = VerifyOptions(tokens=[1, 6], backend="triton", layers=[1], device=device)
    report = verify_checkpoint(tiny_nvfp4a16(family), options)
    assert report.passed, _failures(report)
    kernel = [r for r in report.results if r.check == "kernel" and r.target == "triton"]
    assert kernel and all(r.error is not None and r.error < 1e-2 for r in kernel)
    assert {r.target for r in report.results if r.check == "routing"} == {"route", "reference", "triton"}


def test_w4a4_layouts_and_ep_split_pass(square_moe) -> None:
    options = VerifyOptions(source=square_moe["bf16"], tokens=FAST, backend="reference",
                            ep_shards=square_moe["ep4"], layouts=[square_moe["trtllm"], square_moe["cutlass"]])
    report = verify_checkpoint(square_moe["nvfp4"], options)
    assert report.passed, _failures(report)
    assert report.mode == "w4a4"
    layout = [r for r in report.results if r.check == "layout"]
    assert len(layout) == 2 * 2 and all(r.detail == "bit exact" for r in layout)
    ep_sum = [r for r in report.results if r.check == "ep-sum"]
    assert len(ep_sum) == 2 and all(r.error < 1e-5 for r in ep_sum)


@pytest.mark.parametrize("backend", ["trtllm", "cutlass", "marlin"])
def test_a_layout_checkpoint_verifies_on_its_own(square_moe, backend: str) -> None:
    report = verify_checkpoint(square_moe[backend], VerifyOptions(source=square_moe["bf16"], tokens=[4, 64],
                                                                  backend="reference"))
    assert report.passed, _failures(report)
    assert report.kind == f"layout ({backend})"
    assert [r.detail for r in report.results if r.check == "layout"] == ["bit exact"] * 2


def test_marlin_layout_of_the_weight_only_checkpoint(square_moe) -> None:
    report = verify_checkpoint(square_moe["nvfp4a16"], VerifyOptions(tokens=[8], backend="reference",
                                                                     layouts=[square_moe["marlin"]]))
    assert report.passed, _failures(report)


def test_cli_passes_writes_json_and_reports_skipped_backends(monkeypatch, capsys, tiny, tiny_nvfp4a16, tmp_path):
    out = tmp_path / "report.json"
    code, stdout, err = run_cli(monkeypatch, capsys, "verify", tiny_nvfp4a16("qwen3_moe"), "--source",
                                tiny("qwen3_moe"), "--tokens", "1,8", "--layers", "1", "--json", out,
                                "--device", "cpu", "--backend", "reference")
    assert code == 0, stdout + err
    assert "PASS" in stdout and "skipped" in stdout
    document = json.loads(out.read_text())
    assert document["format"] == "fp4kit-verify" and document["passed"] is True
    assert {r["layer"] for r in document["results"]} == {1}
    backends = {b["name"]: b for b in document["backends"]}
    assert backends["reference"]["ran"] is True
    assert backends["flashinfer-trtllm"]["ran"] is False and backends["flashinfer-trtllm"]["reason"]
    if not torch.cuda.is_available():
        assert "no GPU" in backends["marlin"]["reason"]


@pytest.mark.skipif(torch.cuda.is_available() or not HAS_TRITON, reason="needs the Triton interpreter on a CPU")
def test_a_check_that_cannot_run_is_skipped_not_passed(monkeypatch, capsys, tiny_nvfp4a16, tmp_path) -> None:
    """The interpreter takes at most 64 (token, expert) pairs: at 64 tokens (top-2) the Triton kernel check is
    skipped. It is reported as skipped in the JSON, the table and the summary, not counted as passed; the exit code
    stays 0 (1 only when a check fails)."""
    out = tmp_path / "report.json"
    code, stdout, err = run_cli(monkeypatch, capsys, "verify", tiny_nvfp4a16("qwen3_moe"), "--tokens", "1,64",
                                "--layers", "1", "--backend", "triton", "--device", "cpu", "--json", out)
    assert code == 0, stdout + err
    document = json.loads(out.read_text())
    triton = {r["tokens"]: r for r in document["results"] if r["check"] == "kernel" and r["target"] == "triton"}
    assert triton[1]["status"] == "passed" and triton[1]["passed"] is True
    assert triton[64]["status"] == "skipped" and triton[64]["passed"] is False
    assert "Triton interpreter" in triton[64]["detail"] and triton[64]["error"] is None
    statuses = [r["status"] for r in document["results"]]
    assert document["counts"] == {s: statuses.count(s) for s in ("passed", "failed", "skipped")}
    assert document["counts"]["skipped"] == 1 and document["counts"]["failed"] == 0 and document["passed"] is True
    assert f"PASS: {document['counts']['passed']} passed, 1 skipped in" in " ".join(stdout.split())


def test_run_summary_has_one_row_per_check_with_its_worst_layer_and_reads_version_1_reports() -> None:
    from fp4kit.pipeline.runner import _verify_row, _verify_rows

    def result(layer: int, error: float, **fields: object) -> dict:
        return {"layer": layer, "check": "kernel", "target": "triton", "tokens": 16, "error": error,
                "tolerance": 0.01, "detail": "", "status": "passed", "passed": True} | fields

    rows = _verify_rows([result(layer, error) for layer, error in enumerate([1e-4, 5e-3, 2e-4])]
                        + [result(3, None, tokens=64, status="skipped", passed=False, detail="too large")])
    assert len(rows) == 1
    row = _verify_row(rows[0])
    assert row.startswith("| kernel | triton | 0,1,2,3 | 0.005 (≤ 0.01) | pass |"), row
    assert "worst: layer 1, 16 tokens" in row and "1 skipped (too large)" in row
    assert "| skip |" in _verify_row(_verify_rows([result(1, None, status="skipped", passed=False)])[0])
    assert "| **FAIL** |" in _verify_row(_verify_rows([result(1, 0.5, status="failed", passed=False)])[0])
    assert "| pass |" in _verify_row(_verify_rows([result(1, 1e-3, status=None)])[0])  # version 1: no status
    failed_v1 = _verify_row(_verify_rows([result(1, 0.5, status=None, passed=False)])[0])
    assert "| **FAIL** |" in failed_v1 and "1 failed; first: layer 1, 16 tokens" in failed_v1


@pytest.mark.parametrize(("extra", "message"), [
    (["--mode", "w4a4"], "weight-only"),
    (["--layers", "7"], "not an NVFP4 MoE layer"),
    (["--backend", "flashinfer-trtllm"], "cannot run here"),
    (["--backend", "nope"], "'nope' is not one of"),
    (["--tokens", "0"], "--tokens"),
])
def test_cli_unusable_input_exits_2(monkeypatch, capsys, tiny_nvfp4a16, extra: list[str], message: str) -> None:
    if extra[-1] == "flashinfer-trtllm" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code, _, err = run_cli(monkeypatch, capsys, "verify", tiny_nvfp4a16("qwen3_moe"), "--device", "cpu", *extra)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_cli_bf16_checkpoint_is_unusable(monkeypatch, capsys, tiny) -> None:
    code, _, err = run_cli(monkeypatch, capsys, "verify", tiny("qwen3_moe"), "--device", "cpu")
    assert code == 2 and err.startswith("error:")


def test_ep_split_as_ckpt_is_refused(square_moe) -> None:
    with pytest.raises(Fp4kitError, match="--ep-shards"):
        verify_checkpoint(square_moe["ep4"], VerifyOptions(tokens=[1], backend="reference"))


def test_modelopt_dialect_with_fused_llama4_experts(tiny, tmp_path) -> None:
    from fp4kit.quantize.checkpoint import QuantizeOptions

    out = tmp_path / "modelopt"
    quantize_checkpoint(tiny("llama4"), out, QuantizeOptions(format="modelopt"))
    report = verify_checkpoint(out, VerifyOptions(source=tiny("llama4"), tokens=FAST, backend="reference"))
    assert report.passed, _failures(report)
    assert report.kind == "modelopt (nvfp4a16)"


def test_cli_plot(monkeypatch, capsys, tiny_nvfp4a16, tmp_path) -> None:
    plot = tmp_path / "errors.png"
    code, _, err = run_cli(monkeypatch, capsys, "verify", tiny_nvfp4a16("qwen3_moe"), "--device", "cpu", "--tokens",
                           "4", "--backend", "reference", "--plot", plot, "--quiet")
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 2 and "matplotlib" in err and "fp4kit[plot]" in err and not plot.exists()
    else:
        assert code == 0 and plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the plot extra is not installed")
def test_plot_has_integer_layer_ticks_labelled_tolerances_and_a_note_for_exact_zeros() -> None:
    import matplotlib.pyplot as plt

    from fp4kit.verify.checks import CheckResult
    from fp4kit.verify.report import VerifyReport, plot_figure, plot_floor, plot_series

    report = VerifyReport("ckpt", "compressed-tensors (nvfp4)", "qwen3_moe", "w4a4", "cpu", [], 0.01, 0.35)
    for layer in (1, 2, 3):
        report.results += [CheckResult(layer, "kernel", "triton", "passed", 1e-6 * layer, 0.01, 16),
                           CheckResult(layer, "source", "bf16", "passed", 0.2, 0.35, 16),
                           CheckResult(layer, "ep-sum", "ep", "passed", 0.0 if layer != 2 else 1e-7, 1e-5, 16)]
    series, tolerances = plot_series(report)
    assert tolerances == {0.01: ["kernel"], 0.35: ["source"], 1e-5: ["ep-sum"]}
    assert plot_floor(series) == pytest.approx(1e-8)  # a decade below the smallest non-zero error
    figure = plot_figure(report)
    axes = figure.axes[0]
    labels = [text.get_text() for text in axes.get_legend().get_texts()]
    assert "tolerance 0.01 (kernel)" in labels and "tolerance 0.35 (source)" in labels
    assert "error exactly 0 (bit exact), drawn at 1e-08" in labels
    ticks = [t for t in axes.get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)
    plt.close(figure)


NO_FP4 = "sm90: no NVFP4 tensor cores"
NO_FLASHINFER = "flashinfer not installed"


@pytest.mark.parametrize(("capability", "flashinfer", "expected"), [
    ((9, 0), True, {"flashinfer-cutlass": NO_FP4, "flashinfer-trtllm": NO_FP4, "marlin": "vllm not installed"}),
    ((10, 0), False, {"flashinfer-cutlass": NO_FLASHINFER, "flashinfer-trtllm": NO_FLASHINFER}),
    ((10, 0), True, {"flashinfer-cutlass": None, "flashinfer-trtllm": None}),
    ((12, 0), True, {"flashinfer-cutlass": None, "flashinfer-trtllm": "sm120: no NVFP4 tensor cores"}),
    ((7, 0), True, {"marlin": "sm70: Marlin needs sm75+", "triton": "sm70: Triton needs sm80+"}),
])
def test_backends_are_dispatched_by_capability(monkeypatch, capability, flashinfer: bool, expected: dict) -> None:
    from fp4kit.verify import backends

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(backends, "_importable", lambda module: module in ("triton",) or
                        (flashinfer and module == "flashinfer"))
    for name, reason in expected.items():
        ok, why = backends.BACKENDS[name].available(torch.device("cuda"))
        assert (ok, why.startswith(reason) if reason else True) == (reason is None, True), (name, why)


def test_triton_imported_before_the_interpreter_switch_falls_back_to_the_reference(tiny_nvfp4a16, tmp_path):
    """Triton fixes compiled vs interpreted per @jit function when it is defined: with triton.language imported
    before TRITON_INTERPRET=1, a later switch would mix the modes and the interpreted kernel would crash on the
    compiled tl.zeros (it did, from the second `fp4kit run` in one process). A CPU verify then runs the reference
    alone, twice in a row, and says why."""
    import subprocess
    import sys

    script = (
        "import sys, triton.language\n"
        "from fp4kit.verify.checks import VerifyOptions\n"
        "from fp4kit.verify.runner import verify_checkpoint\n"
        "for _ in range(2):\n"
        "    report = verify_checkpoint(sys.argv[1], VerifyOptions(tokens=[4], device='cpu'))\n"
        "    assert all(r.passed for r in report.results), [r for r in report.results if not r.passed]\n"
        "    status = {s.name: s for s in report.backends}['triton']\n"
        "    assert not status.ran and 'before TRITON_INTERPRET=1' in status.reason, status\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script, str(tiny_nvfp4a16("qwen3_moe"))], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]


def test_report_in_a_log_is_markdown_with_whole_names_and_on_a_terminal_rich_tables(capsys, monkeypatch) -> None:
    """Without a terminal (a log, a pipe, CI) the report is markdown tables whose rows are never wrapped: a long
    checkpoint path, backend reason and failure detail each stay whole on one line, and a '|' inside a cell is
    escaped; on a terminal it is rich's tables."""
    import rich.console

    from fp4kit.verify.checks import FAILED, PASSED, CheckResult
    from fp4kit.verify.report import BackendStatus, VerifyReport, print_report

    path = "/models/" + "a-very-long-directory-name/" * 4 + "Qwen3-235B-A22B-NVFP4"
    reason = "no GPU: needs an NVFP4 tensor-core GPU (sm100 or newer) with flashinfer's TRT-LLM MoE kernels installed"
    detail = "expert 117 of layer 93 differs from the reference by more than the tolerance | see --json"
    report = VerifyReport(path, "compressed-tensors (nvfp4)", "qwen3_moe", "w4a4", "cpu",
                          [BackendStatus("flashinfer-trtllm", False, reason)], 0.01, 0.25,
                          [CheckResult(93, "kernel", "triton", FAILED, 0.5, 0.01, 16, detail),
                           CheckResult(92, "kernel", "triton", PASSED, 0.001, 0.01, 16)])
    print_report(report)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"{path}: qwen3_moe, compressed-tensors (nvfp4), mode w4a4, device cpu"
    assert f"| flashinfer-trtllm | skipped | {reason} |" in lines
    row = next(line for line in lines if line.startswith("| kernel | triton |"))
    assert row.endswith(f"| FAIL | 1 failed; first: layer 93, 16 tokens: {detail.replace('|', chr(92) + '|')} |")
    assert "┃" not in out and "━" not in out and lines[-1].startswith("FAIL: 1 passed, 1 failed")

    monkeypatch.setattr(rich.console.Console, "is_terminal", property(lambda self: True))
    print_report(report)
    assert "┃" in capsys.readouterr().out

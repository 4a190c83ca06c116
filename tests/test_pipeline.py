"""`fp4kit run` skips finished steps, redoes changed ones, and a run killed in the middle of a step finishes,
when rerun, with the same bytes as an uninterrupted run."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fp4kit.pipeline.runner import MARKER_SUFFIX, run_recipe

RECIPE = """\
model: {model}
family: qwen3_moe
quantize:
  scheme: nvfp4
  device: cpu
  samples: 4
  seq_len: 16
layout:
  backend: trtllm
shard:
  ep: 2
  placement: balanced
verify:
  backend: reference
  device: cpu
  tokens: [4]
"""
# The killed run: ShardWriter.finish is called once by quantize, then by layout; the second call writes layout's
# shards and then the process dies, before layout's output is renamed into place and before its marker.
KILL_IN_LAYOUT = """\
import os, signal, sys
from fp4kit.io import checkpoint
from fp4kit.pipeline import run_recipe

finish, calls = checkpoint.ShardWriter.finish, []

def finish_then_die(self, *args, **kwargs):
    result = finish(self, *args, **kwargs)
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return result

checkpoint.ShardWriter.finish = finish_then_die
run_recipe(sys.argv[1], [], sys.argv[2])
"""


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def recipe(tiny, tmp_path_factory) -> Path:
    """W4A4 calibrated on 4 x 16 tokens, TRT-LLM layout, EP 2 placed by the calibration's routing counts."""
    path = tmp_path_factory.mktemp("pipeline") / "recipe.yaml"
    path.write_text(RECIPE.format(model=tiny("qwen3_moe")))
    return path


@pytest.fixture(scope="module")
def uninterrupted(recipe, tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("uninterrupted") / "work"
    run_recipe(recipe, [], workdir)
    return workdir


def output_hashes(workdir: Path) -> dict[str, str]:
    """sha256 of every file the steps wrote. Markers, summaries and the verify report hold timings and paths, so they
    are left out (the tests check verify's verdict instead)."""
    files = [p for p in sorted(workdir.rglob("*")) if p.is_file() and not p.name.endswith(MARKER_SUFFIX)
             and p.name not in ("summary.md", "summary.json") and p.relative_to(workdir).parts[0] != "verify"]
    assert files
    return {str(p.relative_to(workdir)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def statuses(summary) -> dict[str, str]:
    return {s.name: s.status for s in summary.steps}


def test_rerun_skips_finished_steps(recipe, uninterrupted):
    before = output_hashes(uninterrupted)
    summary = run_recipe(recipe, [], uninterrupted)
    assert statuses(summary) == dict.fromkeys(("quantize", "layout", "shard", "verify"), "skipped")
    assert summary.passed and summary.steps[0].seconds > 0  # the timing of the run that produced it
    assert output_hashes(uninterrupted) == before
    document = json.loads((uninterrupted / "summary.json").read_text())
    assert [s["status"] for s in document["steps"]] == ["skipped"] * 4 and document["passed"] is True


def test_changed_step_reruns_with_everything_that_reads_it(recipe, uninterrupted, tmp_path):
    workdir = tmp_path / "work"
    run_recipe(recipe, [], workdir)
    summary = run_recipe(recipe, ["shard.ep=4"], workdir)
    assert statuses(summary) == {"quantize": "skipped", "layout": "skipped", "shard": "ran", "verify": "ran"}
    manifest = json.loads((workdir / "shard" / "fp4kit_shard.json").read_text())
    assert manifest["ep_size"] == 4
    summary = run_recipe(recipe, ["quantize.exact_fp32_global_scale=true"], workdir)
    assert set(statuses(summary).values()) == {"ran"}


def test_output_without_marker_is_redone(recipe, uninterrupted, tmp_path):
    """Killed after a step's output is in place but before its marker: the step runs again, same bytes."""
    workdir = tmp_path / "work"
    run_recipe(recipe, [], workdir)
    (workdir / f"layout{MARKER_SUFFIX}").unlink()
    summary = run_recipe(recipe, [], workdir)
    assert statuses(summary) == {"quantize": "skipped", "layout": "ran", "shard": "skipped", "verify": "skipped"}
    assert output_hashes(workdir) == output_hashes(uninterrupted)


def test_killed_in_the_middle_of_a_step_resumes_to_the_same_bytes(recipe, uninterrupted, tmp_path):
    workdir = tmp_path / "work"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", KILL_IN_LAYOUT, str(recipe), str(workdir)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (workdir / f"quantize{MARKER_SUFFIX}").is_file()
    assert not (workdir / f"layout{MARKER_SUFFIX}").exists() and not (workdir / "layout").exists()
    assert any(".fp4kit-partial-" in p.name for p in workdir.iterdir()), "killed mid-step: a partial output"
    summary = run_recipe(recipe, [], workdir)
    assert statuses(summary) == {"quantize": "skipped", "layout": "ran", "shard": "ran", "verify": "ran"}
    assert summary.passed
    assert output_hashes(workdir) == output_hashes(uninterrupted)
    assert not any(".fp4kit-" in p.name for p in workdir.iterdir())


def test_failed_verify_exits_1_after_the_summary(recipe, uninterrupted, tmp_path, monkeypatch, capsys):
    from fp4kit.cli import main

    workdir = tmp_path / "work"
    run_recipe(recipe, [], workdir)
    argv = ["fp4kit", "run", str(recipe), "--workdir", str(workdir), "--set", "verify.tol_source=1e-9", "-q"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 1
    assert json.loads((workdir / "summary.json").read_text())["passed"] is False
    assert "FAIL" in (workdir / "summary.md").read_text()


def test_repair_step_rewrites_the_dialect_for_the_later_steps(recipe, tmp_path):
    workdir = tmp_path / "work"
    summary = run_recipe(recipe, ["repair.to=modelopt"], workdir)
    assert [s.name for s in summary.steps] == ["quantize", "repair", "layout", "shard", "verify"]
    assert (workdir / "repair" / "hf_quant_config.json").is_file()
    assert summary.passed and summary.verify and summary.verify["checkpoint"] == str(workdir / "repair")

"""Two runs into one DST, as real processes: the second is refused at once while the first finishes byte-identical to
a solo run; a killed run's lock dies with it and its work directory goes with the next run; a terminated run
(SIGTERM) removes its own, says so in one line and exits 143 (fp4kit.io.output, fp4kit.cli)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import reaching_children

from fp4kit.cli import EXIT_TERMINATED, TERMINATED
from fp4kit.errors import Fp4kitError
from fp4kit.io.output import atomic_directory, exclusive, leftovers, lock_path, partial_prefix


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def start_quantize(src: Path, dst: Path) -> subprocess.Popen:
    # W4A4: the calibration pass keeps the run busy for seconds after it took the lock
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "fp4kit", "quantize", str(src), str(dst), "--scheme", "nvfp4",
                             "--samples", "16", "--seq-len", "64", "-q"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_lock(dst: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(partial_prefix(dst)) for p in dst.parent.iterdir()):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert lock_path(dst).exists()


@pytest.fixture(scope="module")
def solo(tiny, tmp_path_factory):
    src = tiny("qwen3_moe")
    out = tmp_path_factory.mktemp("solo") / "out"
    first = start_quantize(src, out)
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    return src, digest(out)


def test_a_second_run_is_refused_while_the_first_finishes(solo, tmp_path):
    src, expected = solo
    dst = tmp_path / "out"
    first = start_quantize(src, dst)
    wait_for_lock(dst, first)
    started = time.monotonic()
    second = subprocess.run([sys.executable, "-m", "fp4kit", "quantize", str(src), str(dst), "-q"],
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and "another fp4kit run is writing it" in lines[0] and f"pid {first.pid}" in lines[0]
    assert time.monotonic() - started < 60  # refused at once, not after doing the work
    assert first.poll() is None, "the second run must not have waited for the first"
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert digest(dst) == expected
    assert not leftovers(dst)


def test_a_killed_run_leaves_no_lock_and_the_rerun_cleans_up(solo, tmp_path):
    src, expected = solo
    dst = tmp_path / "out"
    first = start_quantize(src, dst)
    wait_for_lock(dst, first)
    first.send_signal(signal.SIGKILL)
    first.communicate()
    assert not dst.exists() and any(p.name.startswith(partial_prefix(dst)) for p in leftovers(dst))
    rerun = start_quantize(src, dst)
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err
    assert digest(dst) == expected
    assert not leftovers(dst)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_sigterm_during_calibration_cleans_up_and_says_so(tiny, tmp_path, method):
    """SIGTERM once the calibration pass has started (rtn W4A4: the source model's pass; gptq: the layer-by-layer
    pass that quantizes as it goes): the work directory and the lock go, one line says so, exit 143."""
    dst = tmp_path / "out"
    samples = []
    if method == "rtn":  # the packaged set's pass is over in a moment: token ids for a pass of seconds
        calib = tmp_path / "calib.jsonl"
        calib.write_text("".join(json.dumps({"input_ids": [(7 * i + s) % 256 for i in range(256)]}) + "\n"
                                 for s in range(512)))
        samples = ["--calib", str(calib), "--samples", "512", "--seq-len", "256"]
    src = tiny("qwen3_moe")
    with reaching_children():
        process = subprocess.Popen([sys.executable, "-m", "fp4kit", "quantize", str(src), str(dst), "--scheme", "nvfp4",
                                    "--method", method, *samples], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    phase = {"rtn": "quantize: calibrating (", "gptq": "quantize: quantizing (gptq layer by layer"}[method]
    try:
        line = process.stderr.readline()  # in a log, each phase starts with a line of its own
        assert line.startswith(phase), line + process.stderr.read()
        assert any(p.name.startswith(partial_prefix(dst)) for p in leftovers(dst))
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    # the layers the pass finished before the signal came each said so in a line
    said = [line for line in err.splitlines() if not re.match(r"quantize: [a-z]+: layer \d+/\d+, ", line)]
    assert (process.returncode, out, said) == (EXIT_TERMINATED, "", [TERMINATED]), err
    assert not dst.exists() and not leftovers(dst)


def test_exclusive_in_one_process(tmp_path):
    dst = tmp_path / "out"
    with exclusive(dst):
        with pytest.raises(Fp4kitError, match=f"pid {os.getpid()}"):
            with exclusive(dst):
                pass
    assert not leftovers(dst)
    with atomic_directory(dst) as work:
        (work / "file").write_text("x")
    assert (dst / "file").read_text() == "x" and not leftovers(dst)


def test_a_failed_run_leaves_nothing_and_keeps_the_old_output(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old").write_text("kept")
    with pytest.raises(RuntimeError), atomic_directory(dst) as work:
        (work / "new").write_text("x")
        raise RuntimeError
    assert sorted(p.name for p in dst.iterdir()) == ["old"] and not leftovers(dst)

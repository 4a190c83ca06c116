"""`torchrun --nproc-per-node 2` (gloo, CPU) writes byte-identical output to a single process, for data-free
and calibrated quantization in both dialects and for `fp4kit run`; a failure on one rank is one line, exit 2 on every
rank, and no output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fp4kit.errors import Fp4kitError
from fp4kit.io.output import leftovers
from fp4kit.quantize.distributed import assign_jobs

# calibrated W4A4 (4 batches: 2 per rank) in ModelOpt's dialect, in several shards and an index, then EP 2
RECIPE = """\
model: {model}
family: glm4_moe
quantize:
  scheme: nvfp4
  format: modelopt
  samples: 4
  seq_len: 16
  batch_size: 1
  max_shard_size: 100KB
shard:
  ep: 2
  placement: round-robin
"""
# Several fp4kit commands in one torchrun launch: each launch costs seconds of process start and imports.
# Then leave the process group as the exit does and name the threads still running: gloo's must be gone, or they
# run into the interpreter's finalization, which sometimes aborts ("terminate called without an active exception").
RUN_COMMANDS = """\
import json, os, sys
from fp4kit.quantize import distributed
from fp4kit.cli import main

for argv in json.loads(sys.argv[1]):
    sys.argv = ["fp4kit", *argv, "-q"]
    main()
distributed._leave()
threads = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
with open(f"threads-after-leaving-rank{distributed.rank()}.txt", "w") as f:  # ranks' prints would interleave
    f.write(" ".join(sorted(threads)))
"""


def torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # the worktree's fp4kit, and one thread per rank as torchrun would set it anyway (without its banner)
    env = os.environ | {"PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_assign_jobs_balances_by_size_in_plan_order() -> None:
    sizes = [5, 1, 9, 3, 3, 7, 2, 8, 1, 4]
    owned = assign_jobs(sizes, 3)
    assert sorted(i for indices in owned for i in indices) == list(range(len(sizes)))
    assert all(indices == sorted(indices) for indices in owned)
    loads = [sum(sizes[i] for i in indices) for indices in owned]
    assert max(loads) - min(loads) <= max(sizes)
    assert loads == [15, 14, 14]  # largest first to the least loaded rank, ties to the lower rank
    assert assign_jobs(sizes, 3) == owned
    assert assign_jobs([4, 4], 3) == [[0], [1], []]


def test_calibration_shares_combine_to_the_single_process_statistics(tiny) -> None:
    """Each rank's batches b % world == rank; max of the amax and sum of the counts give one process's result, also
    for a rank left without a batch."""
    from fp4kit.quantize.calib_data import load_calibration
    from fp4kit.quantize.calibrate import calibrate

    src = tiny("qwen3_moe")
    ids = load_calibration(None, src, 256, 2, 8)
    whole = calibrate(src, ids, batch_size=1)
    shares = [calibrate(src, ids, batch_size=1, batch_share=(r, 3)) for r in range(3)]
    assert not shares[2].input_amax and set(shares[2].routing_counts) == set(whole.routing_counts)
    amax = {name: max(s.input_amax[name] for s in shares if name in s.input_amax) for name in whole.input_amax}
    counts = {layer: [sum(c) for c in zip(*(s.routing_counts[layer] for s in shares), strict=True)]
              for layer in whole.routing_counts}
    assert amax == whole.input_amax
    assert counts == whole.routing_counts


KV_ARGS = ["--kv-cache", "fp8", "--samples", "4", "--seq-len", "16", "--batch-size", "2"]


def test_torchrun_output_is_byte_identical_to_one_process(tiny, tmp_path) -> None:
    from fp4kit.pipeline import run_recipe
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    src = tiny("glm4_moe")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=src))
    commands = [
        # data-free, compressed-tensors
        ["quantize", str(src), str(tmp_path / "ranks" / "weight-only"), "--max-shard-size", "100KB"],
        ["run", str(recipe), "--workdir", str(tmp_path / "ranks" / "run")],
        # KV-cache scales alone: two batches, one per rank, their amax combined
        ["quantize", str(src), str(tmp_path / "ranks" / "kv"), *KV_ARGS],
    ]
    script = tmp_path / "run_commands.py"
    script.write_text(RUN_COMMANDS)
    launched = torchrun([str(script), json.dumps(commands)], tmp_path)
    assert launched.returncode == 0, launched.stderr[-3000:]
    left = [(tmp_path / f"threads-after-leaving-rank{r}.txt").read_text() for r in range(2)]
    assert not any("gloo" in threads for threads in left), left  # calibration loaded transformers

    command = "fp4kit quantize SRC DST --max-shard-size 100KB -q"  # as the output records the command line
    single = quantize_checkpoint(src, tmp_path / "one" / "weight-only",
                                 QuantizeOptions(max_shard_bytes=100_000, command=command))
    assert len(single.output_files) > 1
    assert files(tmp_path / "ranks" / "weight-only") == files(tmp_path / "one" / "weight-only")
    kv = QuantizeOptions(kv_cache="fp8", samples=4, seq_len=16, batch_size=2,
                         command="fp4kit quantize SRC DST " + " ".join(KV_ARGS) + " -q")
    quantize_checkpoint(src, tmp_path / "one" / "kv", kv)
    assert files(tmp_path / "ranks" / "kv") == files(tmp_path / "one" / "kv")
    run_recipe(recipe, [], tmp_path / "one" / "run")
    assert len(list((tmp_path / "one" / "run" / "quantize").glob("*.safetensors"))) > 1
    for step in ("quantize", "shard"):
        assert files(tmp_path / "ranks" / "run" / step) == files(tmp_path / "one" / "run" / step), step
    steps = json.loads((tmp_path / "ranks" / "run" / "summary.json").read_text())["steps"]
    assert [(s["name"], s["status"]) for s in steps] == [("quantize", "ran"), ("shard", "ran")]


def test_w4a4_quantize_exits_0_every_time(tiny, tmp_path) -> None:
    """The process group is left before the interpreter's finalization, so the exit never aborts: five launches."""
    src = tiny("glm4_moe")
    for attempt in range(5):
        dst = tmp_path / f"out-{attempt}"
        launched = torchrun(["-m", "fp4kit", "quantize", str(src), str(dst), "--scheme", "nvfp4", "--samples", "2",
                             "--seq-len", "16", "-q"], tmp_path)
        assert launched.returncode == 0 and "terminate called" not in launched.stderr, \
            f"launch {attempt}: {launched.stderr[-3000:]}"
        assert (dst / "config.json").is_file()


def test_failure_on_one_rank_is_one_line_exit_2_and_no_output(tiny, tmp_path) -> None:
    """A NaN in a weight that rank 1 quantizes: rank 1 reports it, rank 0 stops and removes the partial output."""
    from safetensors.torch import load_file, save_file

    from fp4kit.io.checkpoint import CheckpointReader, read_config
    from fp4kit.quantize.checkpoint import _job_bytes
    from fp4kit.quantize.plan import QuantGroup, build_plan

    src = tmp_path / "nan"
    src.mkdir()
    for path in tiny("qwen3_moe").iterdir():
        (src / path.name).write_bytes(path.read_bytes())
    with CheckpointReader(src) as reader:
        plan = build_plan(reader, read_config(src))
        rank1 = assign_jobs([_job_bytes(reader, job) for job in plan.jobs], 2)[1]
    bad = next(plan.jobs[i] for i in rank1 if isinstance(plan.jobs[i], QuantGroup))
    name = bad.members[0].linear.source.tensor  # type: ignore[union-attr]
    tensors = load_file(src / "model.safetensors")
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})

    dst = tmp_path / "out"
    launched = torchrun(["-m", "fp4kit", "quantize", str(src), str(dst), "-q"], tmp_path)
    errors = [line for line in launched.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {name}: NaN or Inf in a weight to be quantized ({bad.members[0].linear.module})"], \
        launched.stderr[-3000:]
    # torchrun itself exits 1 when a rank failed, and lists the ranks' exit codes: 2, or its own SIGTERM for a rank
    # that had not exited yet when it noticed the first one
    assert launched.returncode == 1
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", launched.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, launched.stderr[-3000:]
    assert not dst.exists() and not leftovers(dst)


def test_commands_that_do_not_split_refuse_torchrun(monkeypatch) -> None:
    from fp4kit.cli import _check_ranks

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "argv", ["fp4kit", "layout", "SRC", "DST", "--backend", "trtllm"])
    with pytest.raises(Fp4kitError, match="fp4kit layout does not split its work across ranks"):
        _check_ranks()
    monkeypatch.setattr(sys, "argv", ["fp4kit", "quantize", "SRC", "DST"])
    _check_ranks()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(sys, "argv", ["fp4kit", "layout", "SRC", "DST"])
    _check_ranks()

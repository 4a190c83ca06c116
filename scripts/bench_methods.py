"""Time `fp4kit quantize --method rtn|mse[|gptq]` as whole processes on one synthetic Qwen3-30B-A3B-shaped
checkpoint, and print each method's time as a ratio to rtn's measured in the same run.

    python scripts/bench_methods.py [--layers 1] [--methods rtn,mse] [--repeats 3] [--device cpu|cuda]
                                    [--workdir DIR] [--samples 64] [--seq-len 512]

The checkpoint is fp4kit.testing.synthetic's (hidden 2048, moe_intermediate 768, 128 experts, 32/4 heads of 128, bf16).
One run = the wall and CPU time of `python -m fp4kit quantize SRC DST --scheme nvfp4a16 --method M -q` (gptq adds
``--samples/--seq-len`` of the packaged calibration set); the median of R runs is reported, with the source read
into the page cache once before (untimed). rtn and mse runs alternate so that both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run(src: Path, dst: Path, method: str, device: str, samples: int, seq_len: int) -> tuple[float, float]:
    """(wall s, CPU s) of one quantize process."""
    if dst.exists():
        shutil.rmtree(dst)
    command = [sys.executable, "-m", "fp4kit", "quantize", str(src), str(dst), "--scheme", "nvfp4a16",
               "--method", method, "--device", device, "-q"]
    if method == "gptq":
        command += ["--samples", str(samples), "--seq-len", str(seq_len)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--methods", default="rtn,mse")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-bench-methods"))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args(argv)
    from fp4kit.testing.synthetic import write_synthetic_qwen3_moe

    src = args.workdir / f"src-{args.layers}L"
    if not (src / "config.json").exists():
        write_synthetic_qwen3_moe(src, args.layers)
    for file in src.glob("*.safetensors"):  # into the page cache
        with open(file, "rb") as f:
            while f.read(1 << 24):
                pass
    methods = args.methods.split(",")
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for method in methods:
            wall, cpu_s = run(src, args.workdir / f"out-{method}", method, args.device, args.samples, args.seq_len)
            times[method].append(wall)
            cpu[method].append(cpu_s)
    medians = {m: statistics.median(t) for m, t in times.items()}
    cpu_medians = {m: statistics.median(t) for m, t in cpu.items()}
    anchor = "rtn" if "rtn" in medians else methods[0]
    print(f"{'method':8} {'runs (wall s)':26} {'wall s':>7} {'vs rtn':>7} {'CPU s':>7} {'vs rtn':>7}")
    for method in methods:
        runs = ", ".join(f"{t:.1f}" for t in times[method])
        print(f"{method:8} {runs:26} {medians[method]:7.1f} {medians[method] / medians[anchor]:6.2f}x "
              f"{cpu_medians[method]:7.1f} {cpu_medians[method] / cpu_medians[anchor]:6.2f}x")
    print(json.dumps({"layers": args.layers, "device": args.device, "cpus": os.cpu_count(), "wall": times,
                      "cpu": cpu}))


if __name__ == "__main__":
    main()

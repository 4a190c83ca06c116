"""Benchmark `fp4kit convert` against a plain safetensors copy of the same NVFP4 checkpoint, and the peak RSS of
`convert` and `inspect` against the layer count.

    python scripts/bench_convert.py [--layers 8] [--small-layers 2] [--experts 128] [--repeats 3] [--workdir DIR]

(--repeats 0: the memory runs only.)

Checkpoints: a bf16 checkpoint of one decoder layer with Qwen3-30B-A3B's shapes (fp4kit.testing.synthetic) is quantized
once with `fp4kit quantize` (compressed-tensors NVFP4A16); `fp4kit.testing.synthetic.repeat_first_layer` copies that
layer into checkpoints of --small-layers and --layers layers (~350 MB of NVFP4 per layer), which `fp4kit convert` turns
into ModelOpt ones. All are kept in the workdir and reused.

Speed, on the --layers checkpoints, interleaved so that load on the machine hits every tool alike, medians of R runs:

  copy        the compressed-tensors checkpoint read with safetensors' safe_open/get_tensor and written tensor by
              tensor to shards of the same layout: the I/O floor a conversion is held to (target: >= 0.7x its speed)
  ct->mo      fp4kit convert --to modelopt
  mo->ct      fp4kit convert --to compressed-tensors

One run = process wall time (docs/BENCHMARKS.md) plus an fsync of every file it wrote. The source is read once into the
page cache before each run (untimed); the previous output is deleted. CPU seconds (user + system) and peak RSS come
from /usr/bin/time -v (getrusage where it is missing). `work_s` is the time each tool reports for itself (fp4kit
convert's "in X s", which excludes the Python/torch start-up; the copy child's likewise excludes imports).

Memory: `fp4kit convert` both ways and `fp4kit inspect` of both dialects run once on the --small-layers and once on
the --layers checkpoints; the table gives each one's peak RSS and the growth per extra layer (a tool that held the
whole model would grow by ~350 MB per layer).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_quantize as bq  # the copy anchor and page-cache helpers every benchmark shares

TIME_BIN = "/usr/bin/time"
# where /usr/bin/time is missing: the child's getrusage, printed the way `time -v` prints it
RUSAGE = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
          "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
          "print(f'User time (seconds): {u.ru_utime}', f'System time (seconds): {u.ru_stime}', "
          "f'Maximum resident set size (kbytes): {u.ru_maxrss}', sep='\\n', file=sys.stderr); sys.exit(rc)")


def child_copy(src: Path, dst: Path) -> None:
    start = time.perf_counter()
    bq.child_copy(src, dst)
    print(f"in {time.perf_counter() - start:.2f} s")


def time_run(command: list[str], src: Path, dst: Path | None) -> dict:
    """Wall seconds (incl. fsync of the output), the tool's own work seconds, CPU seconds and peak RSS bytes."""
    if dst is not None:
        shutil.rmtree(dst, ignore_errors=True)
    bq.warm_page_cache(src)
    wrapped = [TIME_BIN, "-v", *command] if os.path.exists(TIME_BIN) else [sys.executable, "-c", RUSAGE, *command]
    start = time.perf_counter()
    done = subprocess.run(wrapped, capture_output=True, text=True, check=False)
    if dst is not None and dst.exists():
        bq.fsync_tree(dst)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    fields = dict(line.strip().rsplit(": ", 1) for line in done.stderr.splitlines() if ": " in line)
    work = re.search(r"\bin ([0-9.]+) s\b", done.stdout)
    cpu = float(fields.get("User time (seconds)", "nan")) + float(fields.get("System time (seconds)", "nan"))
    rss = fields.get("Maximum resident set size (kbytes)")
    result = {"s": seconds, "work_s": float(work.group(1)) if work else float("nan"), "cpu_s": cpu,
              "rss": int(rss) * 1024 if rss else None}
    print(json.dumps({"command": command[2:], **result, "load": os.getloadavg()[0]}), file=sys.stderr, flush=True)
    return result


def checkpoints(work: Path, layers: list[int], experts: int) -> dict[tuple[str, int], Path]:
    """(dialect, layers) -> checkpoint directory, built once and reused."""
    from fp4kit.quantize.checkpoint import quantize_checkpoint
    from fp4kit.testing.synthetic import repeat_first_layer, write_synthetic_qwen3_moe
    from fp4kit.tools.convert import convert_checkpoint

    one = work / "ct-1"
    if not (one / "config.json").exists():
        bf16 = write_synthetic_qwen3_moe(work / "bf16-1", 1, num_experts=experts)
        quantize_checkpoint(bf16, one)
        shutil.rmtree(bf16)
    out = {}
    for n in layers:
        ct_dir, mo_dir = work / f"ct-{n}", work / f"mo-{n}"
        if not (ct_dir / "config.json").exists():
            repeat_first_layer(one, ct_dir, n)
        if not (mo_dir / "config.json").exists():
            convert_checkpoint(ct_dir, mo_dir, "modelopt")
        out["ct", n], out["mo", n] = ct_dir, mo_dir
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--small-layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-bench-convert"))
    parser.add_argument("--child", choices=["copy"])
    parser.add_argument("--src", type=Path)
    parser.add_argument("--dst", type=Path)
    args = parser.parse_args()
    if args.child:
        child_copy(args.src, args.dst)
        return

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    dirs = checkpoints(work, [args.small_layers, args.layers], args.experts)
    out = work / "out"
    fp4kit = [sys.executable, "-m", "fp4kit"]

    def tools(n: int) -> dict[str, tuple[list[str], Path, Path | None]]:
        ct_dir, mo_dir = dirs["ct", n], dirs["mo", n]
        return {
            "copy": ([sys.executable, __file__, "--child", "copy", "--src", str(ct_dir), "--dst", str(out)], ct_dir,
                     out),
            "ct->mo": ([*fp4kit, "convert", str(ct_dir), str(out), "--to", "modelopt"], ct_dir, out),
            "mo->ct": ([*fp4kit, "convert", str(mo_dir), str(out), "--to", "compressed-tensors"], mo_dir, out),
            "inspect ct": ([*fp4kit, "inspect", str(ct_dir)], ct_dir, None),
            "inspect mo": ([*fp4kit, "inspect", str(mo_dir)], mo_dir, None),
        }

    load_before = os.getloadavg()
    speed: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for tool, (command, src, dst) in tools(args.layers).items():
            if not tool.startswith("inspect"):
                speed.setdefault(tool, []).append(time_run(command, src, dst))
    load_after_speed = os.getloadavg()
    memory: dict[str, dict[int, int | None]] = {}
    for n in (args.small_layers, args.layers):
        for tool, (command, src, dst) in tools(n).items():
            if tool != "copy":
                memory.setdefault(tool, {})[n] = time_run(command, src, dst)["rss"]
    shutil.rmtree(out, ignore_errors=True)

    size = sum(p.stat().st_size for p in dirs["ct", args.layers].glob("*.safetensors"))
    rows = []
    anchor = statistics.median(r["s"] for r in speed["copy"]) if speed else 0.0  # --repeats 0: memory only
    anchor_work = statistics.median(r["work_s"] for r in speed["copy"]) if speed else 0.0
    for tool, runs in speed.items():
        median = {key: statistics.median(r[key] for r in runs) for key in ("s", "work_s", "cpu_s")}
        rss = max((r["rss"] for r in runs if r["rss"]), default=None)
        rows.append({"tool": tool, "median_s": round(median["s"], 2), "runs_s": [round(r["s"], 2) for r in runs],
                     "GB_per_s": round(size / median["s"] / 1e9, 3), "speed_vs_copy": round(anchor / median["s"], 2),
                     "work_s": round(median["work_s"], 2),
                     "work_speed_vs_copy": round(anchor_work / median["work_s"], 2),
                     "cpu_s": round(median["cpu_s"], 2), "cpu_runs_s": [round(r["cpu_s"], 2) for r in runs],
                     "peak_rss_MB": None if rss is None else round(rss / 1e6)})
    extra = args.layers - args.small_layers
    rss_rows = [{"tool": tool, **{f"peak_rss_MB_{n}_layers": None if r is None else round(r / 1e6)
                                  for n, r in peaks.items()},
                 "MB_per_extra_layer": None if None in peaks.values() or not extra else
                 round((peaks[args.layers] - peaks[args.small_layers]) / extra / 1e6, 1)}  # type: ignore[operator]
                for tool, peaks in memory.items()]
    layer_bytes = (size - sum(p.stat().st_size for p in dirs["ct", args.small_layers].glob("*.safetensors"))) / extra \
        if extra else None
    print(json.dumps({"checkpoint_bytes": size, "layers": args.layers, "experts": args.experts,
                      "cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after_speed": load_after_speed,
                      "load_avg_after": os.getloadavg(), "speed": rows,
                      "memory": {"layers": [args.small_layers, args.layers],
                                 "MB_per_layer_of_checkpoint": layer_bytes and round(layer_bytes / 1e6, 1),
                                 "rows": rss_rows}}, indent=2))


if __name__ == "__main__":
    main()

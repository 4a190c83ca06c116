"""Benchmark `fp4kit convert` against a plain safetensors copy of the same NVFP4 checkpoint.

    python scripts/bench_convert.py --layers 2 [--experts 128] [--repeats 3] [--workdir DIR]

Builds a bf16 checkpoint with Qwen3-30B-A3B's layer shapes (fp4kit.synthetic), quantizes it once with
`fp4kit quantize` (compressed-tensors NVFP4A16), converts it once to ModelOpt, then times as whole processes
(DESIGN.md §10), each the median of R runs:

  copy        the compressed-tensors checkpoint read with safetensors' safe_open/get_tensor and written tensor by
              tensor to shards of the same layout: the I/O floor a conversion is held to (target: >= 0.7x its speed)
  ct->mo      fp4kit convert --to modelopt
  mo->ct      fp4kit convert --to compressed-tensors

One run = process wall time plus an fsync of every file it wrote. The source is read once into the page cache
before each run (untimed); the previous output is deleted. Peak RSS from /usr/bin/time -v when present. `work_s` is
the time each tool reports for itself (fp4kit convert's "in X s", which excludes the Python/torch start-up but
includes importing compressed-tensors to build that dialect's config; the copy child's likewise excludes imports).
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

TIME_BIN = "/usr/bin/time"


def child_copy(src: Path, dst: Path) -> None:
    import torch  # noqa: F401  (safe_open(framework="pt") needs it)
    from safetensors import safe_open

    from fp4kit.checkpoint import CheckpointReader, PlannedTensor, ShardWriter, copy_side_files

    start = time.perf_counter()

    dst.mkdir(parents=True, exist_ok=True)
    with CheckpointReader(src) as headers:
        infos = list(headers.tensors.values())
    largest_shard = max(sum(i.nbytes for i in infos if i.file == f) for f in {i.file for i in infos})
    writer = ShardWriter(dst, [PlannedTensor(i.name, i.dtype, i.shape) for i in infos], largest_shard)
    for shard in sorted({i.file for i in infos}):
        with safe_open(shard, framework="pt") as reader:
            for name in reader.keys():
                writer.write(name, reader.get_tensor(name))
    writer.finish()
    copy_side_files(src, dst)
    shutil.copy2(src / "config.json", dst / "config.json")
    print(f"in {time.perf_counter() - start:.2f} s")


def fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def warm(directory: Path) -> None:
    for path in sorted(directory.iterdir()):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass


def time_run(command: list[str], src: Path, dst: Path) -> tuple[float, float, int | None]:
    """(process seconds incl. fsync, seconds the tool reports for its own work, peak RSS bytes)."""
    shutil.rmtree(dst, ignore_errors=True)
    warm(src)
    wrapped = [TIME_BIN, "-v", *command] if os.path.exists(TIME_BIN) else command
    start = time.perf_counter()
    done = subprocess.run(wrapped, capture_output=True, text=True, check=False)
    if dst.exists():
        fsync_tree(dst)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    rss = [int(line.rsplit(":", 1)[1]) * 1024 for line in done.stderr.splitlines()
           if "Maximum resident set size" in line]
    work = re.search(r"\bin ([0-9.]+) s\b", done.stdout)
    return seconds, float(work.group(1)) if work else float("nan"), (rss[0] if rss else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
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

    from fp4kit.convert import convert_checkpoint
    from fp4kit.quantize import quantize_checkpoint
    from fp4kit.synthetic import write_synthetic_qwen3_moe

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    bf16, ct_dir, mo_dir = work / "bf16", work / "ct", work / "mo"
    if not (ct_dir / "config.json").exists():
        write_synthetic_qwen3_moe(bf16, args.layers, num_experts=args.experts, max_shard_bytes=10**9)
        quantize_checkpoint(bf16, ct_dir)
        shutil.rmtree(bf16)
    if not (mo_dir / "config.json").exists():
        convert_checkpoint(ct_dir, mo_dir, "modelopt")
    size = sum(p.stat().st_size for p in ct_dir.glob("*.safetensors"))
    fp4kit = [sys.executable, "-m", "fp4kit", "convert"]
    tools = {
        "copy": ([sys.executable, __file__, "--child", "copy", "--src", str(ct_dir), "--dst", str(work / "out")],
                 ct_dir),
        "ct->mo": ([*fp4kit, str(ct_dir), str(work / "out"), "--to", "modelopt"], ct_dir),
        "mo->ct": ([*fp4kit, str(mo_dir), str(work / "out"), "--to", "compressed-tensors"], mo_dir),
    }
    results = {}
    for _ in range(args.repeats):  # interleaved, so that load on the machine hits every tool alike
        for tool, (command, src) in tools.items():
            results.setdefault(tool, []).append(time_run(command, src, work / "out"))
    shutil.rmtree(work / "out", ignore_errors=True)
    anchor = statistics.median(s for s, _, _ in results["copy"])
    anchor_work = statistics.median(w for _, w, _ in results["copy"])
    rows = []
    for tool, runs in results.items():
        seconds = statistics.median(s for s, _, _ in runs)
        work = statistics.median(w for _, w, _ in runs)
        rss = max((r for _, _, r in runs if r), default=None)
        rows.append({"tool": tool, "median_s": round(seconds, 2), "runs_s": [round(s, 2) for s, _, _ in runs],
                     "GB_per_s": round(size / seconds / 1e9, 3), "speed_vs_copy": round(anchor / seconds, 2),
                     "work_s": round(work, 2), "work_speed_vs_copy": round(anchor_work / work, 2),
                     "peak_rss_MB": None if rss is None else round(rss / 1e6)})
    print(json.dumps({"checkpoint_bytes": size, "layers": args.layers, "experts": args.experts, "cpus": os.cpu_count(),
                      "results": rows}, indent=2))


if __name__ == "__main__":
    main()

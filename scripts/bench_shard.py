"""Benchmark `fp4kit shard --ep N` against a plain copy of the same checkpoint (target: >= 0.8x a copy).

    python scripts/bench_shard.py --layers 4 [--ep 8] [--placement linear] [--repeats 3] [--workdir DIR] [--bf16]

Builds an NVFP4A16 compressed-tensors checkpoint laid out exactly as `fp4kit quantize` writes one for a model with
Qwen3-30B-A3B's shapes (fp4kit.testing.synthetic's tensor plan: hidden 2048, moe_intermediate 768, 128 experts, 32/4
heads of 128) and N layers: the same names, dtypes, shapes and 4 GB shards, filled with random bytes instead of
quantized weights, because quantizing on a small CPU box takes minutes and sharding never looks at the values. --bf16
shards fp4kit.testing.synthetic's bf16 checkpoint instead. Then it times as whole subprocesses (docs/BENCHMARKS.md):

  copy         cp -r SRC DST: the I/O floor for writing the same bytes (the anchor of the >= 0.8x target)
  copy+sha256  cp -r SRC DST, then sha256sum of every copied file: a copy with the integrity record shard writes
  shard        python -m fp4kit shard SRC DST --ep N --placement P (balanced: skewed synthetic routing statistics)

One run = the process's wall time plus an fsync of every file it wrote (fp4kit fsyncs its shards itself; cp does not,
so without it cp would be credited with unflushed writes). Before every run the source is read once into the page
cache (untimed) and the previous output is deleted. Reported: median of R runs, the ratio copy / shard (>= 1 means
shard is as fast as a copy), CPU seconds (user + system), peak RSS (/usr/bin/time -v; without it getrusage, whose
peak is the largest child so far), the disk use of the output
(hard links counted once) and the machine's load average, since on a shared box other processes' load slows the
CPU-bound part (checksumming) far more than cp's in-kernel copy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_quantize as bq  # page-cache and fsync helpers every benchmark shares

TIME_BIN = "/usr/bin/time"


def build_source(workdir: Path, layers: int, bf16: bool) -> Path:
    from fp4kit.testing.synthetic import write_synthetic_qwen3_moe

    if bf16:
        raw = workdir / f"qwen3moe-{layers}l-bf16"
        if not (raw / "config.json").exists():
            shutil.rmtree(raw, ignore_errors=True)
            write_synthetic_qwen3_moe(raw, num_layers=layers)
        return raw
    quantized = workdir / f"qwen3moe-{layers}l-nvfp4a16-synthetic"
    if not (quantized / "config.json").exists():
        shutil.rmtree(quantized, ignore_errors=True)
        write_nvfp4_like_quantize(quantized, layers)
    return quantized


def write_nvfp4_like_quantize(path: Path, layers: int) -> None:
    import torch

    from fp4kit.formats import compressed_tensors as ct
    from fp4kit.io.checkpoint import PlannedTensor, ShardWriter
    from fp4kit.nvfp4 import GLOBAL_NUMERATOR
    from fp4kit.testing.synthetic import REAL_SHARD_BYTES, Qwen3MoeDims, qwen3_moe_config, qwen3_moe_tensor_plan

    dims = Qwen3MoeDims(layers)
    kept_bf16 = ("lm_head.weight", "mlp.gate.weight", "norm.weight", "embed_tokens.weight")
    plan: list[PlannedTensor] = []
    for t in qwen3_moe_tensor_plan(dims):
        if t.name.endswith(kept_bf16):
            plan.append(t)
        else:
            plan.extend(ct.planned(t.name.removesuffix(".weight"), t.shape[0], t.shape[1], with_input_scale=False))
    pool = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    pool = torch.where((pool & 0x7F) == 0x7F, pool ^ 1, pool)  # no fp8 / bf16 NaN patterns
    path.mkdir(parents=True)
    writer = ShardWriter(path, plan, REAL_SHARD_BYTES, metadata={"producer": "fp4kit"})
    for i, t in enumerate(plan):
        start = (i * 4096) % (pool.numel() - t.nbytes) if t.nbytes < pool.numel() else 0
        data = pool[start:start + t.nbytes] if t.nbytes <= pool.numel() else pool.repeat(t.nbytes // pool.numel() + 1)
        if t.dtype == torch.float32:
            writer.write(t.name, torch.full(t.shape, GLOBAL_NUMERATOR / (1 + i % 7)))
        else:
            writer.write(t.name, data[: t.nbytes].view(t.dtype).reshape(t.shape))
    writer.finish()
    config = qwen3_moe_config(dims)
    config["quantization_config"] = ct.quantization_config("nvfp4a16", ["lm_head", "re:.*mlp.gate$"])
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def skewed_stats(src: Path, path: Path) -> Path:
    config = json.loads((src / "config.json").read_text())
    experts = config["num_experts"]
    layers = {str(i): [int(10_000 / (1 + (e + 7 * i) % experts)) for e in range(experts)]
              for i in range(config["num_hidden_layers"])}
    path.write_text(json.dumps({"model_type": config["model_type"], "num_experts": experts, "layers": layers}))
    return path


def timed(command: list[str], out: Path) -> tuple[float, int, float]:
    """(wall seconds including fsync of the output, peak RSS in bytes, CPU seconds) of one process."""
    if not os.path.exists(TIME_BIN):  # e.g. a GPU image: getrusage of the children instead
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command, check=True)
        bq.fsync_tree(out)
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        return seconds, after.ru_maxrss * 1024, cpu  # peak RSS: the largest child so far, not this one's
    with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
        start = time.perf_counter()
        subprocess.run([TIME_BIN, "-v", "-o", log.name, *command], check=True)
        bq.fsync_tree(out)
        seconds = time.perf_counter() - start
        fields = dict(line.strip().rsplit(": ", 1) for line in log.read().splitlines() if ": " in line)
    cpu = float(fields["User time (seconds)"]) + float(fields["System time (seconds)"])
    return seconds, int(fields["Maximum resident set size (kbytes)"]) * 1024, cpu


def disk_bytes(root: Path) -> int:
    inodes = {p.stat().st_ino: p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file()}
    return sum(inodes.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--placement", default="linear", choices=("linear", "round-robin", "balanced"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "fp4kit-bench-shard")
    parser.add_argument("--bf16", action="store_true", help="shard the bf16 checkpoint instead of the NVFP4 one")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    src = build_source(args.workdir, args.layers, args.bf16)
    source_bytes = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    copy_dst, shard_dst = args.workdir / "copy", args.workdir / "shard"
    shard_cmd = [sys.executable, "-m", "fp4kit", "shard", str(src), str(shard_dst), "--ep", str(args.ep),
                 "--placement", args.placement, "--quiet", "--overwrite"]
    if args.placement == "balanced":
        shard_cmd += ["--stats", str(skewed_stats(src, args.workdir / "stats.json"))]
    checked_copy = f"cp -r {src} {copy_dst} && find {copy_dst} -type f -exec sha256sum {{}} + > /dev/null"
    commands = {"copy": ["cp", "-r", str(src), str(copy_dst)], "copy+sha256": ["sh", "-c", checked_copy],
                "shard": shard_cmd}
    outputs = {"copy": copy_dst, "copy+sha256": copy_dst, "shard": shard_dst}
    runs: dict[str, list[tuple[float, int, float]]] = {tool: [] for tool in commands}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for tool in commands:  # interleaved, so drift in the machine's load hits every tool alike
            shutil.rmtree(outputs[tool], ignore_errors=True)
            bq.warm_page_cache(src)
            runs[tool].append(timed(commands[tool], outputs[tool]))
    load_after = os.getloadavg()[0]
    results = {}
    for tool, measured in runs.items():
        median_run = sorted(measured)[len(measured) // 2]
        results[tool] = {"seconds": median_run[0], "all_seconds": [m[0] for m in measured],
                         "cpu_seconds": median_run[2], "peak_rss_bytes": median_run[1],
                         "gb_per_s": source_bytes / median_run[0] / 1e9}
        if tool != "copy+sha256":
            results[tool]["disk_bytes"] = disk_bytes(outputs[tool])
    ratio = results["copy"]["seconds"] / results["shard"]["seconds"]
    ratio_checked = results["copy+sha256"]["seconds"] / results["shard"]["seconds"]
    summary = {"source": src.name, "source_bytes": source_bytes, "ep": args.ep, "placement": args.placement,
               "repeats": args.repeats, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
               "load_average": [load_before, load_after], "results": results, "shard_speed_vs_copy": ratio,
               "shard_speed_vs_checksummed_copy": ratio_checked}
    print(f"source {src.name}: {source_bytes / 1e9:.2f} GB; --ep {args.ep} --placement {args.placement}; "
          f"median of {args.repeats}; {os.cpu_count()} CPUs, load average {load_before:.1f} -> {load_after:.1f}")
    for tool, r in results.items():
        disk = f"  disk {r['disk_bytes'] / 1e9:.2f} GB" if "disk_bytes" in r else ""
        print(f"  {tool:11s} {r['seconds']:7.2f} s  {r['gb_per_s']:.3f} GB/s  CPU {r['cpu_seconds']:5.1f} s  "
              f"peak RSS {r['peak_rss_bytes'] / 1e6:5.0f} MB{disk}  runs "
              + ", ".join(f"{s:.1f}" for s in r["all_seconds"]))
    print(f"  shard: {ratio:.2f}x the speed of a plain copy (target >= 0.8x), {ratio_checked:.2f}x a checksummed copy")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()

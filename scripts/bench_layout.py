"""Benchmark `fp4kit layout` against a plain safetensors copy of the same NVFP4 checkpoint (the I/O floor).

    python scripts/bench_layout.py --layers 2 [--backends trtllm,cutlass,marlin] [--repeats 3] [--workdir DIR]
                                   [--experts 128 --hidden 2048 --intermediate 768]

Input: a synthetic bf16 Qwen3-MoE (fp4kit.testing.synthetic, Qwen3-30B-A3B's MoE shapes by default) quantized by
`fp4kit quantize` (NVFP4A16), plus a W4A4 copy with per-expert activation scales added (the trtllm and cutlass
kernels are W4A4; the values are arbitrary, the bytes and shapes are what matter here). Both are built once and
reused when --workdir already holds them.

Each run is a whole process timed from start to exit (docs/BENCHMARKS.md):
  copy     safetensors safe_open/get_tensor of every tensor, written to shards of the same layout with
           fp4kit.io.checkpoint.ShardWriter (which fsyncs, as `fp4kit layout` does), config and side files copied
  layout   python -m fp4kit layout SRC DST --backend B (the W4A4 source for trtllm / cutlass, NVFP4A16 for marlin)
Before every timed run the source is read once into the page cache (untimed) and the previous output deleted.
Reported: the median of R runs per tool (wall and CPU seconds, user + system, of the child) and speed relative to
the copy of the same source, copy_s / layout_s (the issue's target is >= 0.7). On a shared machine the wall times
move with its load; CPU seconds show the work itself.
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

import bench_quantize as bq  # the copy anchor and page-cache helpers every benchmark shares

W4A4_BACKENDS = ("trtllm", "cutlass")


def add_input_scales(src: Path, dst: Path) -> Path:
    """A W4A4 copy of an NVFP4A16 compressed-tensors checkpoint: one input_global_scale per quantized module."""
    import torch

    from fp4kit.formats import compressed_tensors as ct
    from fp4kit.io.checkpoint import CheckpointReader, PlannedTensor, ShardWriter, copy_side_files
    from fp4kit.nvfp4 import GLOBAL_NUMERATOR

    dst.mkdir(parents=True)
    with CheckpointReader(src) as reader:
        modules = [n.removesuffix(".weight_packed") for n in reader.names() if n.endswith(".weight_packed")]
        plan = [PlannedTensor(i.name, i.dtype, i.shape) for i in reader.tensors.values()]
        plan += [PlannedTensor(f"{m}.input_global_scale", torch.float32, (1,)) for m in modules]
        writer = ShardWriter(dst, plan, 4 * 10**9)
        for name in reader.names():
            writer.write(name, reader.read(name))
        for m in modules:
            writer.write(f"{m}.input_global_scale", torch.tensor([GLOBAL_NUMERATOR / 4.0]))
        writer.finish()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = ct.quantization_config("nvfp4", config["quantization_config"]["ignore"])
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(src, dst)
    return dst


def build_sources(work: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
    from fp4kit.testing.synthetic import write_synthetic_qwen3_moe

    bf16, a16, w4a4 = work / "bf16", work / "nvfp4a16", work / "nvfp4"
    if not (a16 / "config.json").exists():
        if not (bf16 / "config.json").exists():
            write_synthetic_qwen3_moe(bf16, num_layers=args.layers, hidden=args.hidden,
                                      moe_intermediate=args.intermediate, num_experts=args.experts)
        quantize_checkpoint(bf16, a16, QuantizeOptions(overwrite=True))
        shutil.rmtree(bf16)
    if not (w4a4 / "config.json").exists():
        shutil.rmtree(w4a4, ignore_errors=True)
        add_input_scales(a16, w4a4)
    return a16, w4a4


def timed(command: list[str], src: Path, dst: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds user + system) of one child process."""
    shutil.rmtree(dst, ignore_errors=True)
    bq.warm_page_cache(src)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run(args: argparse.Namespace) -> dict:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    a16, w4a4 = build_sources(work, args)
    results: dict[str, dict] = {}
    for backend in args.backends.split(","):
        src = w4a4 if backend in W4A4_BACKENDS else a16
        out_copy, out_layout = work / "out-copy", work / f"out-{backend}"
        copy_cmd = [sys.executable, __file__, "--child-copy", str(src), str(out_copy)]
        layout_cmd = [sys.executable, "-m", "fp4kit", "layout", str(src), str(out_layout), "--backend", backend,
                      "--quiet"]
        copies, layouts = [], []
        for _ in range(args.repeats):  # interleaved, so load changes on the machine hit both alike
            copies.append(timed(copy_cmd, src, out_copy))
            layouts.append(timed(layout_cmd, src, out_layout))
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        copy_s, layout_s = (statistics.median(wall for wall, _ in runs) for runs in (copies, layouts))
        copy_cpu, layout_cpu = (statistics.median(cpu for _, cpu in runs) for runs in (copies, layouts))
        results[backend] = {"source": src.name, "source_bytes": size, "copy_runs": copies, "layout_runs": layouts,
                            "copy_median_s": copy_s, "layout_median_s": layout_s, "copy_median_cpu_s": copy_cpu,
                            "layout_median_cpu_s": layout_cpu, "speed_vs_copy": copy_s / layout_s}
        shutil.rmtree(out_layout, ignore_errors=True)
        shutil.rmtree(out_copy, ignore_errors=True)
    return {"layers": args.layers, "experts": args.experts, "hidden": args.hidden, "intermediate": args.intermediate,
            "repeats": args.repeats, "cpus": os.cpu_count(), "load_average": os.getloadavg(), "results": results}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child-copy":
        bq.child_copy(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--backends", default="trtllm,cutlass,marlin")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/fp4kit-bench-layout")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    report = run(args)
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'backend':8} {'source':>10} {'copy s':>8} {'layout s':>9} {'speed vs copy':>14} {'copy CPU s':>11} "
          f"{'layout CPU s':>13}")
    for backend, r in report["results"].items():
        print(f"{backend:8} {r['source_bytes'] / 1e9:8.2f}GB {r['copy_median_s']:8.2f} {r['layout_median_s']:9.2f} "
              f"{r['speed_vs_copy']:13.2f}x {r['copy_median_cpu_s']:11.2f} {r['layout_median_cpu_s']:13.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Quantize speed from an FP8-block source against the same checkpoint in BF16 (the anchor), same run.

    python scripts/bench_sources.py --layers 2[,4] [--experts 128] [--device cpu|cuda] [--repeats 3]
                                    [--workdir DIR] [--dequant-dtype fp32|bf16]

Builds a bf16 synthetic with Qwen3-30B-A3B's MoE layer shapes (fp4kit.testing.synthetic; hidden 2048, moe_intermediate
768, 32/4 heads of 128) and N layers, writes the same weights as DeepSeek's FP8-block format
(fp4kit.io.sources.write_fp8_block_copy), then times `fp4kit quantize --scheme nvfp4a16` on each as a whole subprocess,
bf16 and fp8 runs alternating (so a change in the machine's load hits both), the source read once into the page
cache before each run, the output deleted. Prints per source the median seconds and the largest peak RSS of its own
runs, and the ratio of speeds (bf16 seconds / fp8 seconds; >= 1 means the FP8 source is as fast). Several layer
counts show whether peak memory grows with the model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def warm(path: Path) -> None:
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            while f.read(1 << 24):
                pass


def timed_quantize(src: Path, dst: Path, device: str, extra: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS in bytes of this run alone)."""
    shutil.rmtree(dst, ignore_errors=True)
    warm(src)
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "fp4kit", "quantize", str(src), str(dst), "--device", device,
                              "--quiet", *extra])
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"quantize {src} exited {child.returncode}")
    return seconds, usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2", help="comma-separated layer counts")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-bench-sources"))
    parser.add_argument("--dequant-dtype", default=None, choices=["fp32", "bf16"])
    args = parser.parse_args()

    from fp4kit.io.sources import write_fp8_block_copy
    from fp4kit.testing.synthetic import write_synthetic_qwen3_moe

    extra = ["--dequant-dtype", args.dequant_dtype] if args.dequant_dtype else []
    for layers in (int(n) for n in args.layers.split(",")):
        bf16 = args.workdir / f"bf16-{layers}l-{args.experts}e"
        fp8 = args.workdir / f"fp8-{layers}l-{args.experts}e"
        if not (bf16 / "config.json").exists():
            write_synthetic_qwen3_moe(bf16, layers, num_experts=args.experts)
        if not (fp8 / "config.json").exists():
            write_fp8_block_copy(bf16, fp8)
        runs: dict[str, list[tuple[float, int]]] = {"bf16": [], "fp8-block": []}
        for _ in range(args.repeats):
            for name, src, flags in (("bf16", bf16, []), ("fp8-block", fp8, extra)):
                runs[name].append(timed_quantize(src, args.workdir / "out", args.device, flags))
        results = {name: (statistics.median(s for s, _ in r), max(m for _, m in r)) for name, r in runs.items()}
        for name, (seconds, peak) in results.items():
            print(f"{layers} layers {name:10s} {seconds:8.2f} s (runs {', '.join(f'{s:.2f}' for s, _ in runs[name])})"
                  f"   peak RSS {peak / 2**30:.2f} GiB")
        ratio = results["bf16"][0] / results["fp8-block"][0]
        print(f"speed fp8-block / bf16: {ratio:.2f}x  ({layers} layers, {args.experts} experts, {args.device}"
              f"{', dequant ' + args.dequant_dtype if args.dequant_dtype else ''})")
    shutil.rmtree(args.workdir / "out", ignore_errors=True)


if __name__ == "__main__":
    main()

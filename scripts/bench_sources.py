"""Quantize speed from an FP8-block source against the same checkpoint in BF16 (the anchor), same run.

    python scripts/bench_sources.py --layers 2 [--experts 128] [--device cpu|cuda] [--repeats 3] [--workdir DIR]
                                    [--dequant-dtype fp32|bf16]

Builds a bf16 synthetic with Qwen3-30B-A3B's MoE layer shapes (fp4kit.synthetic; hidden 2048, moe_intermediate
768, 32/4 heads of 128) and N layers, writes the same weights as DeepSeek's FP8-block format
(fp4kit.sources.write_fp8_block_copy), then times `fp4kit quantize --scheme nvfp4a16` on each as a whole subprocess
(median of R runs, the source read once into the page cache before each, the output deleted). Prints seconds, peak
RSS and the ratio of speeds (fp8 / bf16; >= 1 means the FP8 source is as fast). ``--dequant-dtype`` needs
QuantizeOptions.dequant_dtype (fp4kit.plan.build_plan's parameter) to be wired into the CLI.
"""

from __future__ import annotations

import argparse
import resource
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
    shutil.rmtree(dst, ignore_errors=True)
    warm(src)
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fp4kit", "quantize", str(src), str(dst), "--device", device, "--quiet",
                    *extra], check=True)
    seconds = time.perf_counter() - start
    peak_kib = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before)
    return seconds, peak_kib * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-bench-sources"))
    parser.add_argument("--dequant-dtype", default=None, choices=["fp32", "bf16"])
    args = parser.parse_args()

    from fp4kit.sources import write_fp8_block_copy
    from fp4kit.synthetic import write_synthetic_qwen3_moe

    bf16 = args.workdir / f"bf16-{args.layers}l-{args.experts}e"
    fp8 = args.workdir / f"fp8-{args.layers}l-{args.experts}e"
    if not (bf16 / "config.json").exists():
        write_synthetic_qwen3_moe(bf16, args.layers, num_experts=args.experts)
    if not (fp8 / "config.json").exists():
        write_fp8_block_copy(bf16, fp8)
    extra = ["--dequant-dtype", args.dequant_dtype] if args.dequant_dtype else []
    results = {}
    for name, src, flags in (("bf16", bf16, []), ("fp8-block", fp8, extra)):
        runs = [timed_quantize(src, args.workdir / "out", args.device, flags) for _ in range(args.repeats)]
        results[name] = (statistics.median(s for s, _ in runs), max(m for _, m in runs))
        print(f"{name:10s} {results[name][0]:8.2f} s   children peak RSS so far {results[name][1] / 2**30:.2f} GiB")
    ratio = results["bf16"][0] / results["fp8-block"][0]
    print(f"speed fp8-block / bf16: {ratio:.2f}x  ({args.layers} layers, {args.experts} experts, {args.device})")
    shutil.rmtree(args.workdir / "out", ignore_errors=True)


if __name__ == "__main__":
    main()

"""On a CUDA machine: `torchrun --nproc-per-node N -m fp4kit quantize --device cuda` (NCCL) writes the same bytes as
one process, data-free and calibrated (every output file), and how long each took.

    python scripts/device_distributed_check.py --layers 2 --nproc 2 --workdir /tmp/dcheck

With one GPU, ``--nproc 1`` still runs the torchrun launch (a world of one) beside the plain process.
"""

from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import time
from pathlib import Path

SCHEMES = {"nvfp4a16": [], "nvfp4": ["--samples", "64", "--seq-len", "512", "--batch-size", "8"]}


def quantize(launcher: list[str], src: Path, dst: Path, extra: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([*launcher, "quantize", str(src), str(dst), "--device", "cuda", "--overwrite", "-q", *extra],
                   check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-dcheck"))
    args = parser.parse_args()
    from fp4kit.testing.synthetic import write_synthetic_qwen3_moe

    src = write_synthetic_qwen3_moe(args.workdir / "bf16", num_layers=args.layers, threads=8)
    plain = [sys.executable, "-m", "fp4kit"]
    ranks = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
             "-m", "fp4kit"]
    failed = False
    for scheme, extra in SCHEMES.items():
        one, many = args.workdir / f"{scheme}-1", args.workdir / f"{scheme}-x{args.nproc}"
        seconds_one = quantize(plain, src, one, ["--scheme", scheme, *extra])
        seconds_many = quantize(ranks, src, many, ["--scheme", scheme, *extra])
        files = sorted(p.name for p in one.iterdir())
        assert files == sorted(p.name for p in many.iterdir()), (files, sorted(p.name for p in many.iterdir()))
        different = [f for f in files if not filecmp.cmp(one / f, many / f, shallow=False)]
        failed |= bool(different)
        print(f"{scheme}: 1 process {seconds_one:.1f} s, torchrun x{args.nproc} {seconds_many:.1f} s; "
              f"{len(files)} files compared, {len(different)} differ: {different}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

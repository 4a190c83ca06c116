"""On a CUDA machine: `fp4kit quantize --device cuda` writes the same bytes as `--device cpu` (every output file).

    python scripts/device_quantize_check.py --layers 2 --workdir /tmp/qcheck
"""

from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-qcheck"))
    args = parser.parse_args()
    from fp4kit.testing.synthetic import write_synthetic_qwen3_moe

    src = write_synthetic_qwen3_moe(args.workdir / "bf16", num_layers=args.layers, threads=8)
    outputs = {}
    for device in ("cuda", "cpu"):
        dst = args.workdir / f"nvfp4-{device}"
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fp4kit", "quantize", str(src), str(dst), "--device", device,
                        "--overwrite", "-q"], check=True)
        print(f"{device}: {time.perf_counter() - start:.1f} s")
        outputs[device] = dst
    files = sorted(p.name for p in outputs["cpu"].iterdir())
    assert files == sorted(p.name for p in outputs["cuda"].iterdir())
    different = [f for f in files if not filecmp.cmp(outputs["cpu"] / f, outputs["cuda"] / f, shallow=False)]
    print(f"{len(files)} files compared, {len(different)} differ: {different}")
    sys.exit(1 if different else 0)


if __name__ == "__main__":
    main()

"""The data-free mse search's squared weight error relative to RTN's, per search range, over every quantized Linear
of a checkpoint's decoder layers: how wide `--mse-range` has to be before wider ranges choose the same codes.

    python scripts/bench_scale_search.py SRC [RANGE ...]     (e.g. codes 0.8:1.8 0.6:2.5; default: a few ranges)

Each weight gets its own RTN global scale (fused groups' shared one does not change the comparison) and the search
of fp4kit.quantize.scale_search.quantize_mse with `--mse-range RANGE` (squared error); the sums are over all weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fp4kit import nvfp4
from fp4kit.io.checkpoint import CheckpointReader
from fp4kit.quantize.scale_search import parse_scale_search, quantize_mse

DEFAULT_RANGES = ("codes", "0.8:1.8", "0.7:1.8", "0.9:1.8", "0.8:1.5", "0.8:2.2", "0.6:2.5", "1:1.8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("ranges", nargs="*", default=list(DEFAULT_RANGES))
    args = parser.parse_args()
    reader = CheckpointReader(args.src)
    names = [n for n in reader.names() if ".layers." in n and n.endswith("proj.weight")]
    weights = [reader.read(n) for n in names]
    global_muls = [nvfp4.global_scale_mul(w.abs().amax()) for w in weights]

    def squared_error(span: str | None) -> float:
        total = 0.0
        for weight, global_mul in zip(weights, global_muls, strict=True):
            if span is None:
                q = nvfp4.quantize(weight, global_mul)
            else:
                q = quantize_mse(weight, global_mul, native=True, search=parse_scale_search(span, 2.0))
            total += float((q.dequantize().double() - weight.double()).square().sum())
        return total

    rtn = squared_error(None)
    print(f"{len(weights)} weights of {args.src}; squared error relative to RTN's")
    for span in args.ranges:
        print(f"  --mse-range {span:10s} {squared_error(span) / rtn:.4f}")


if __name__ == "__main__":
    main()

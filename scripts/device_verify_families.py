"""Every seed recipe end to end on the GPU, on a tiny stand-in of its family: quantize (calibrated on the device),
layout, EP shard and `verify --device cuda` with the kernels the GPU allows.

    python scripts/device_verify_families.py [--json OUT] [--tokens 1,16,256] [--recipes glm-4.5-air,demo]
        [--sources bf16,quantized]

Recipes whose model is also published quantized (QUANTIZED_RELEASES: FP8-block, Kimi-K2's INT4) run a second time
from the stand-in written in that format (fp4kit.testing.fixtures), dequantized on the device; DeepSeek-V3's also as
W4A4 (CUTLASS), calibrated through its dequantized FP8 layers. Prints one line per verify check that failed and a table
per run: checks passed / run, the worst kernel error against the fp32 reference for each backend and mode, and the
quantized-vs-source error. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from fp4kit.pipeline import run_recipe
from fp4kit.pipeline.recipe import load_recipe
from fp4kit.testing.fixtures import RECIPE_STAND_INS, build_fixture, write_fp8_block_source, write_pack_quantized_source

RECIPES = sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))
WRITERS = {"fp8-block": write_fp8_block_source, "int4": write_pack_quantized_source}
# recipe -> (source format, extra --set overrides) runs besides the BF16 one: the formats the models are published in
QUANTIZED_RELEASES = {
    "deepseek-v3": [("fp8-block", []), ("fp8-block", ["quantize.scheme=nvfp4", "layout.backend=cutlass"])],
    "kimi-k2": [("int4", [])],
    "qwen3-30b-a3b": [("fp8-block", [])],
    "glm-4.5-air": [("fp8-block", [])],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tokens", default="1,16,256")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--recipes", help="comma-separated recipe names (file stems); default every recipe")
    parser.add_argument("--sources", default="bf16,quantized",
                        help="bf16: every recipe from its BF16 stand-in; quantized: the QUANTIZED_RELEASES runs")
    args = parser.parse_args()
    recipes = [p for p in RECIPES if not args.recipes or p.stem in args.recipes.split(",")]
    kinds = set(args.sources.split(","))
    runs = [(path, "bf16", []) for path in recipes if "bf16" in kinds]
    if "quantized" in kinds:
        runs += [(path, fmt, extra) for path in recipes for fmt, extra in QUANTIZED_RELEASES.get(path.stem, [])]
    rows, failed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        stand_ins: dict[tuple[str, str], Path] = {}
        for n, (path, fmt, extra) in enumerate(runs):
            family = load_recipe(path).recipe.family
            if (family, "bf16") not in stand_ins:
                stand_ins[(family, "bf16")] = build_fixture(family, Path(tmp) / f"bf16-{family}",
                                                            overrides=RECIPE_STAND_INS[family])
            if (family, fmt) not in stand_ins:
                stand_ins[(family, fmt)] = WRITERS[fmt](stand_ins[(family, "bf16")], Path(tmp) / f"{fmt}-{family}")
            overrides = [f"model={stand_ins[(family, fmt)]}", f"quantize.device={args.device}", "quantize.samples=16",
                         "quantize.seq_len=64", f"verify.device={args.device}", f"verify.tokens=[{args.tokens}]",
                         *extra]
            name = path.stem if fmt == "bf16" else f"{path.stem} from {fmt}{' ' + ' '.join(extra) if extra else ''}"
            start = time.perf_counter()
            summary = run_recipe(path, overrides, Path(tmp) / f"work-{n}-{path.stem}")
            results = summary.verify["results"] if summary.verify else []
            bad = [r for r in results if r["status"] == "failed"]
            failed += len(bad)
            for r in bad:
                print(f"FAIL {name}: {r}")
            rows.append({"recipe": name, "family": family, "seconds": round(time.perf_counter() - start, 1),
                         "passed": sum(r["status"] == "passed" for r in results), "checks": len(results),
                         "skipped": sum(r["status"] == "skipped" for r in results),
                         "notes": summary.verify.get("notes", []) if summary.verify else [],
                         "results": results})
    print("| recipe | family | checks passed | skipped | worst error per check kind | s |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        worst: dict[str, float] = {}
        for r in row["results"]:
            if isinstance(r.get("error"), (int, float)):
                kind = f"{r['check']}/{Path(r['target']).name}"
                worst[kind] = max(worst.get(kind, 0.0), float(r["error"]))
        kinds = ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items()))
        print(f"| {row['recipe']} | {row['family']} | {row['passed']}/{row['checks']} | {row['skipped']} | {kinds} "
              f"| {row['seconds']} |")
    for row in rows:
        for note in row["notes"]:
            print(f"note ({row['recipe']}): {note}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()

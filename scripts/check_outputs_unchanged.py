"""Every command's output at a base commit and at this tree, byte for byte, on the tiny fixtures of every family.

    python scripts/check_outputs_unchanged.py [--base REV] [--families qwen3_moe,llama4] [--keep DIR]

The base (default: the merge-base of HEAD and main) is checked out with ``git worktree`` in a temporary directory;
this tree is the working tree the script lives in (uncommitted edits included). Both trees run the same command list
on the same seeded fixtures (fp4kit.pipeline.demo's models: sized for every layout backend; SOURCE_FAMILIES' also as
FP8-block and INT4 sources), each in one process per
tree (``fp4kit.cli.run``, PYTHONPATH set to that tree) with relative paths, so reports name the same paths. Compared:
exit codes; every output file byte for byte (a JSON file with keys that hold timings: without them, key order
kept); stdout of the JSON reports likewise, and the other stdout lines with timings and rates blanked. Prints one
row per command and exits 1 on any difference, 0 when everything matches.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the demo models; llama4_text is built with llama4's sizes (its config file is its own)
FAMILIES = ("qwen3_moe", "qwen3_vl_moe", "glm4_moe", "glm4v_moe", "llama4", "llama4_text", "deepseek_v3")
CALIBRATION = ["--samples", "4", "--seq-len", "32", "--batch-size", "4"]
# families whose fixtures are also written as the quantized sources fp4kit reads (FP8-block, INT4 pack-quantized)
SOURCE_FAMILIES = ("qwen3_moe", "deepseek_v3")
SOURCE_KINDS = ("fp8", "int4")
# JSON keys whose values are wall-clock measurements, dropped before comparing
TIMING_KEYS = re.compile(r"(seconds|elapsed|duration|wall|_time|time_s)$")
# in plain stdout lines: "0.3 s", "12.1 MB/s"
TIMING_TEXT = re.compile(r"\d+(\.\d+)? ?(s\b|[KMGT]?B/s)")


def commands(family: str) -> list[tuple[str, list[str]]]:
    """(output name, argv) in order; later commands read earlier outputs. Every output lands in ``out/<name>``,
    reports on stdout."""
    src = f"fixtures/{family}"
    out = f"out/{family}"
    q = f"{out}/quantize"
    cmds: list[tuple[str, list[str]]] = []
    for scheme in ("nvfp4a16", "nvfp4"):
        for dialect, short in (("compressed-tensors", "ct"), ("modelopt", "mo")):
            extra = CALIBRATION if scheme == "nvfp4" else []
            cmds.append((f"quantize-{short}-{scheme}", ["quantize", src, f"{q}-{short}-{scheme}", "--scheme", scheme,
                                                         "--format", dialect, "-q", *extra]))
    cmds.append(("quantize-ct-nvfp4a16-mse", ["quantize", src, f"{q}-ct-nvfp4a16-mse", "--method", "mse", "-q"]))
    # the calibrated methods: weighted mse and GPTQ on W4A4, each in one dialect
    cmds.append(("quantize-mo-nvfp4-mse", ["quantize", src, f"{q}-mo-nvfp4-mse", "--scheme", "nvfp4", "--format",
                                           "modelopt", "--method", "mse", "-q", *CALIBRATION]))
    cmds.append(("quantize-ct-nvfp4-gptq", ["quantize", src, f"{q}-ct-nvfp4-gptq", "--scheme", "nvfp4", "--method",
                                            "gptq", "--gptq-min-tokens", "1", "-q", *CALIBRATION]))
    # per-module schemes: FP8 attention beside NVFP4 experts, in both dialects
    for dialect, short, fp8 in (("compressed-tensors", "ct", "fp8-dynamic"), ("modelopt", "mo", "fp8-block")):
        cmds.append((f"quantize-{short}-mixed", ["quantize", src, f"{q}-{short}-mixed", "--format", dialect,
                                                 "--scheme-for", rf"self_attn\.={fp8}", "-q"]))
    ct4, mo4, ct16, mo16 = f"{q}-ct-nvfp4", f"{q}-mo-nvfp4", f"{q}-ct-nvfp4a16", f"{q}-mo-nvfp4a16"
    cmds += [
        ("convert-ct-to-mo-nvfp4", ["convert", ct4, f"{out}/convert-ct-to-mo-nvfp4", "--to", "modelopt"]),
        ("convert-mo-to-ct-nvfp4", ["convert", mo4, f"{out}/convert-mo-to-ct-nvfp4", "--to", "compressed-tensors"]),
        ("convert-ct-to-mo-nvfp4a16", ["convert", ct16, f"{out}/convert-ct-to-mo-nvfp4a16", "--to", "modelopt"]),
        ("convert-mo-to-ct-nvfp4a16", ["convert", mo16, f"{out}/convert-mo-to-ct-nvfp4a16", "--to",
                                       "compressed-tensors"]),
        ("convert-ct-to-ct-repair", ["convert", ct4, f"{out}/convert-ct-to-ct-repair", "--to", "compressed-tensors",
                                     "--repair"]),
        ("convert-mo-to-mo-repair", ["convert", mo4, f"{out}/convert-mo-to-mo-repair", "--to", "modelopt", "--repair"]),
        ("convert-ct-to-bf16", ["convert", ct4, f"{out}/convert-ct-to-bf16", "--to", "bf16"]),
        ("convert-mo-to-bf16", ["convert", mo16, f"{out}/convert-mo-to-bf16", "--to", "bf16"]),
        ("layout-trtllm", ["layout", ct4, f"{out}/layout-trtllm", "--backend", "trtllm"]),
        ("layout-cutlass", ["layout", ct4, f"{out}/layout-cutlass", "--backend", "cutlass"]),
        ("layout-cutlass-vllm", ["layout", mo4, f"{out}/layout-cutlass-vllm", "--backend", "cutlass",
                                 "--cutlass-flavor", "vllm"]),
        ("layout-marlin", ["layout", ct16, f"{out}/layout-marlin", "--backend", "marlin"]),
        ("layout-marlin-fp16", ["layout", mo16, f"{out}/layout-marlin-fp16", "--backend", "marlin",
                                "--act-dtype", "fp16"]),
        ("shard-ct-ep2", ["shard", ct4, f"{out}/shard-ct-ep2", "--ep", "2"]),
        ("shard-mo-ep2-balanced", ["shard", mo4, f"{out}/shard-mo-ep2-balanced", "--ep", "2", "--placement",
                                   "balanced"]),
        ("inspect-ct-nvfp4", ["inspect", ct4, "--json", "--backend", "cutlass", "--ep", "2"]),
        ("inspect-mo-nvfp4", ["inspect", mo4, "--json", "--engine", "vllm"]),
        ("inspect-ct-nvfp4a16", ["inspect", ct16, "--json", "--backend", "marlin"]),
        ("inspect-ct-repaired", ["inspect", f"{out}/convert-ct-to-ct-repair", "--json"]),
        ("verify-ct-nvfp4", ["verify", ct4, "--backend", "reference", "--tokens", "1,16", "--source", src,
                             "--ep-shards", f"{out}/shard-ct-ep2", "--layout", f"{out}/layout-trtllm", "--layout",
                             f"{out}/layout-cutlass", "--json", "-", "-q", "--device", "cpu"]),
        ("verify-mo-nvfp4a16", ["verify", mo16, "--backend", "reference", "--tokens", "1,16", "--source", src,
                                "--layout", f"{out}/layout-marlin-fp16", "--json", "-", "-q", "--device", "cpu"]),
    ]
    if family in SOURCE_FAMILIES:
        cmds += source_commands(family)
    return cmds


def source_commands(family: str) -> list[tuple[str, list[str]]]:
    """Quantizing, verifying and evaluating from the family's FP8-block and INT4 sources (the C loop's FP8 path, the
    dequantizing paths of the calibrated methods and of ``--dequant-dtype bf16``)."""
    out = f"out/{family}"
    cmds: list[tuple[str, list[str]]] = []
    for kind in SOURCE_KINDS:
        src, q = f"fixtures/{family}-{kind}", f"{out}/quantize-{kind}"
        cmds += [
            (f"quantize-{kind}-ct-nvfp4a16", ["quantize", src, f"{q}-ct-nvfp4a16", "-q"]),
            (f"quantize-{kind}-mo-nvfp4", ["quantize", src, f"{q}-mo-nvfp4", "--scheme", "nvfp4", "--format",
                                          "modelopt", "-q", *CALIBRATION]),
            (f"verify-{kind}-ct-nvfp4a16", ["verify", f"{q}-ct-nvfp4a16", "--backend", "reference", "--tokens", "1,16",
                                            "--source", src, "--json", "-", "-q", "--device", "cpu"]),
            (f"eval-{kind}-ct-nvfp4a16", ["eval", src, f"{q}-ct-nvfp4a16", "--samples", "2", "--seq-len", "16",
                                          "--json", "-", "-q"]),
        ]
    src, q = f"fixtures/{family}-fp8", f"{out}/quantize-fp8"
    cmds += [
        ("quantize-fp8-ct-nvfp4a16-bf16", ["quantize", src, f"{q}-ct-nvfp4a16-bf16", "--dequant-dtype", "bf16", "-q"]),
        ("quantize-fp8-ct-nvfp4a16-mse", ["quantize", src, f"{q}-ct-nvfp4a16-mse", "--method", "mse", "-q"]),
        ("quantize-fp8-ct-nvfp4-gptq", ["quantize", src, f"{q}-ct-nvfp4-gptq", "--scheme", "nvfp4", "--method", "gptq",
                                        "--gptq-min-tokens", "1", "-q", *CALIBRATION]),
    ]
    return cmds


def run_commands(plan_path: Path) -> None:
    """The per-tree runner (``--run PLAN``): every command of PLAN through fp4kit.cli.run, results to PLAN.out."""
    import fp4kit

    tree = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]).resolve()
    if tree not in Path(fp4kit.__file__).resolve().parents:
        sys.exit(f"fp4kit imported from {fp4kit.__file__}, not from {tree}")
    from fp4kit import cli

    cli._register_commands()
    results = {}
    for name, argv in json.loads(plan_path.read_text()):
        stdout, stderr = io.StringIO(), io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = cli.run(argv)
        results[name] = {"rc": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(),
                         "seconds": time.perf_counter() - start}
    Path(f"{plan_path}.out").write_text(json.dumps(results))


def build_fixtures(root: Path, families: list[str]) -> None:
    sys.path.insert(0, str(REPO))
    from fp4kit.pipeline.demo import demo_overrides
    from fp4kit.testing.fixtures import build_fixture, write_fp8_block_source, write_pack_quantized_source

    writers = {"fp8": write_fp8_block_source, "int4": write_pack_quantized_source}
    for family in families:
        if not (root / family).exists():
            build_fixture(family, root / family, overrides=demo_overrides(family.removesuffix("_text")))
        for kind in SOURCE_KINDS if family in SOURCE_FAMILIES else ():
            if not (root / f"{family}-{kind}").exists():
                writers[kind](root / family, root / f"{family}-{kind}")


def _drop_timings(value: object, dropped: list[str]) -> object:
    if isinstance(value, dict):
        dropped.extend(k for k in value if TIMING_KEYS.search(str(k)))
        return {k: _drop_timings(v, dropped) for k, v in value.items() if not TIMING_KEYS.search(str(k))}
    if isinstance(value, list):
        return [_drop_timings(v, dropped) for v in value]
    return value


def _normal_json(text: str | bytes) -> tuple[str, bool]:
    """The document without timing keys, serialized in its own key order; and whether any key was dropped."""
    dropped: list[str] = []
    return json.dumps(_drop_timings(json.loads(text), dropped)), bool(dropped)


def _normal_stdout(text: str) -> object:
    try:
        return _normal_json(text)[0]
    except json.JSONDecodeError:
        return TIMING_TEXT.sub("<t>", text)


def _files(root: Path) -> dict[str, Path]:
    if not root.is_dir():
        return {}
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def _same_file(a: Path, b: Path) -> bool:
    if a.suffix == ".json":  # bytes, except that values of timing keys may differ
        try:
            (normal_a, timed), (normal_b, _) = _normal_json(a.read_bytes()), _normal_json(b.read_bytes())
            if timed:
                return normal_a == normal_b
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
    if a.stat().st_size != b.stat().st_size:
        return False
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            chunk_a, chunk_b = fa.read(1 << 20), fb.read(1 << 20)
            if chunk_a != chunk_b:
                return False
            if not chunk_a:
                return True


def compare(name: str, output: str | None, base: Path, head: Path, results: dict[str, dict]) -> list[str]:
    """What differs for one command: exit code, stdout, output files."""
    b, h = results["base"][name], results["head"][name]
    diffs = []
    if b["rc"] != h["rc"]:
        diffs.append(f"exit {b['rc']} -> {h['rc']}" + (f" ({h['stderr'].strip()[:200]})" if h["rc"] else ""))
    if _normal_stdout(b["stdout"]) != _normal_stdout(h["stdout"]):
        diffs.append("stdout")
    if output:
        fb, fh = _files(base / output), _files(head / output)
        for rel in sorted(set(fb) | set(fh)):
            if rel not in fb or rel not in fh:
                diffs.append(f"{rel} {'only at head' if rel in fh else 'only at base'}")
            elif not _same_file(fb[rel], fh[rel]):
                diffs.append(f"{rel} differs")
    return diffs


def _output_of(argv: list[str]) -> str | None:
    return argv[2] if argv[0] in ("quantize", "convert", "layout", "shard") else None


def _run_tree(tree: Path, work: Path, plan: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run", str(plan)], cwd=work, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the runner in {tree} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(Path(f"{plan}.out").read_text())


def _base_rev(arg: str | None) -> str:
    if arg:
        return arg
    return subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="base commit (default: merge-base of HEAD and main)")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--keep", type=Path, help="keep fixtures and both trees' outputs in this directory")
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_commands(args.run)
        return 0
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    rev = _base_rev(args.base)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        root = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fp4kit-unchanged-")))
        root.mkdir(parents=True, exist_ok=True)
        base_tree = root / "base-tree"
        if base_tree.exists():
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO, check=True)
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), rev], cwd=REPO, check=True)
        stack.callback(subprocess.run, ["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO)
        build_fixtures(root / "fixtures", families)
        cmds = [(name, argv) for family in families for name, argv in
                ((f"{family}/{name}", argv) for name, argv in commands(family))]
        works = {}
        for side in ("base", "head"):
            work = root / side
            if work.exists():
                subprocess.run(["rm", "-rf", str(work)], check=True)
            (work / "out").mkdir(parents=True)
            (work / "fixtures").symlink_to(root / "fixtures")
            (work / "plan.json").write_text(json.dumps(cmds))
            works[side] = work
        trees = {"base": base_tree, "head": REPO}
        with ThreadPoolExecutor(2) as pool:
            futures = {side: pool.submit(_run_tree, trees[side], works[side], works[side] / "plan.json")
                       for side in trees}
            results = {side: f.result() for side, f in futures.items()}
        failed = 0
        print(f"base {rev[:12]} vs head {REPO} (working tree), {len(families)} families, {len(cmds)} commands")
        print(f"{'command':<48} {'rc':>5} {'base s':>7} {'head s':>7}  result")
        for name, argv in cmds:
            diffs = compare(name, _output_of(argv), works["base"], works["head"], results)
            failed += bool(diffs)
            b, h = results["base"][name], results["head"][name]
            rc = str(b["rc"]) if b["rc"] == h["rc"] else f"{b['rc']}/{h['rc']}"
            print(f"{name:<48} {rc:>5} {b['seconds']:>7.2f} {h['seconds']:>7.2f}  "
                  f"{'same' if not diffs else '; '.join(diffs[:6]) + (' ...' if len(diffs) > 6 else '')}")
        print(f"{len(cmds) - failed} same, {failed} differ ({time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

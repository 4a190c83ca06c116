"""Benchmark `fp4kit quantize` against the I/O floor and llm-compressor on synthetic checkpoints of real layer shapes.

    python scripts/bench_quantize.py --layers 2 [--model qwen3-30b-a3b|qwen3.6-35b-a3b|glm-5] [--experts E]
                                     [--device cpu|cuda] [--repeats 3] [--workdir DIR] [--skip-oneshot] [--nproc N]
                                     [--tools copy,fp4kit,...] [--format compressed-tensors|modelopt]
                                     [--base-tree DIR]

Builds a bf16 checkpoint with N layers of the model's layer shapes (default Qwen3-30B-A3B: hidden 2048,
moe_intermediate 768, 128 experts, 32/4 heads of 128; the others from fp4kit.testing.synthetic.PUBLISHED, in the
release's on-disk layout; ``--experts`` keeps every matrix shape and stores fewer routed experts), then times each
tool as a whole subprocess (docs/BENCHMARKS.md):

  copy            plain safetensors read (safe_open/get_tensor) + tensor-by-tensor write: the I/O floor
  fp4kit          fp4kit quantize --scheme nvfp4a16 --format F (default compressed-tensors)
  model_free_ptq  llmcompressor.model_free_ptq(scheme="NVFP4A16")
  oneshot         llmcompressor.oneshot NVFP4A16 on AutoModelForCausalLM, save_pretrained(save_compressed=True)

``--base-tree DIR`` adds the tool fp4kit-base: fp4kit run from the source tree DIR (PYTHONPATH), e.g. a worktree of
main, so that a change and the code before it are timed in the same rounds, and their outputs compared file by file.

The tools run in rounds, each tool once per round in turn, so that a change in the machine's load falls on all of
them alike. Each tool's time is the median of R runs; one run = the process's wall time plus an fsync of every file
it wrote (fp4kit fsyncs itself; the others do not, so without it they would be credited with unflushed writes).
Before every timed run the source shards are read once into the page cache (untimed) and the previous output is
deleted; the page cache is never dropped. Peak RSS is `/usr/bin/time -v`'s maximum resident set size (or getrusage
of the child in a wrapper process when /usr/bin/time is missing); the median run's value is reported.

``--nproc N`` starts fp4kit under torchrun with N ranks on this node (``--device cuda``: one GPU per rank) instead of
as a plain process, for scaling figures; the other tools are unchanged (``--tools copy,fp4kit`` to skip them). Peak
RSS is then the largest single rank's (or torchrun's), not the sum over ranks.

The same file holds the child entry points (`--child copy|model-free|oneshot`), so every tool runs in a process of
its own started the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

TIME_BIN = "/usr/bin/time"
LLMC_IGNORE = ["lm_head", "re:.*mlp.gate$"]
MODELS = ("qwen3-30b-a3b", "qwen3.6-35b-a3b", "glm-5", "qwen3-235b-a22b")
# Qwen3-MoE shapes written by write_synthetic_qwen3_moe (its defaults are Qwen3-30B-A3B's); Qwen3-235B-A22B's from
# its published config.json (94 layers of these).
QWEN3_MOE_SHAPES = {"qwen3-30b-a3b": {},
                    "qwen3-235b-a22b": {"hidden": 4096, "moe_intermediate": 1536, "num_heads": 64, "num_kv_heads": 4}}
TOOLS = ("copy", "fp4kit", "model_free_ptq", "oneshot")
# fp4kit from another source tree (--base-tree): the code before a change, timed in the same rounds as the change
BASE_TOOL = "fp4kit-base"
# Rough peak of oneshot over the bf16 model size: the loaded model, the linearized experts, the compressed copy.
ONESHOT_MEMORY_FACTOR = 3.0
CHECK_TENSOR_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")


# ----------------------------------------------------------------------------------------------------------------
# Child entry points (each runs in its own process)
# ----------------------------------------------------------------------------------------------------------------


def child_copy(src: Path, dst: Path) -> None:
    """Read every tensor with safetensors' safe_open and write it, one at a time, to shards of the same layout."""
    import torch  # noqa: F401  (safe_open(framework="pt") needs it)
    from safetensors import safe_open

    from fp4kit.io.checkpoint import CheckpointReader, PlannedTensor, ShardWriter, copy_side_files

    dst.mkdir(parents=True, exist_ok=True)
    with CheckpointReader(src) as header_only:  # headers only: names, shapes, shard of each tensor
        infos = list(header_only.tensors.values())
    plan = [PlannedTensor(i.name, i.dtype, i.shape) for i in infos]
    largest_shard = max(sum(i.nbytes for i in infos if i.file == f) for f in {i.file for i in infos})
    writer = ShardWriter(dst, plan, largest_shard)
    for shard in sorted({i.file for i in infos}):
        with safe_open(shard, framework="pt") as reader:
            for name in reader.keys():
                writer.write(name, reader.get_tensor(name))
    writer.finish()
    copy_side_files(src, dst)
    shutil.copy2(src / "config.json", dst / "config.json")


def llmc_ignore(src: Path) -> list[str]:
    """llm-compressor's ignore list for SRC: fp4kit's default ignores of its family (``re.search`` regexes) in
    llm-compressor's ``re:`` form, which matches from the start of the name."""
    from fp4kit.families import detect
    from fp4kit.io.checkpoint import read_config

    config = read_config(src)
    return [f"re:.*{pattern}" for pattern in detect(config).default_ignore(config)]


def load_model(src: Path, device: str):
    """SRC in bf16 with transformers' class of its first architecture (the class its release names)."""
    import torch
    import transformers

    from fp4kit.io.checkpoint import read_config

    model_class = getattr(transformers, (read_config(src).get("architectures") or ["AutoModelForCausalLM"])[0])
    return model_class.from_pretrained(str(src), dtype=torch.bfloat16, device_map=None if device == "cpu" else device)


def child_model_free(src: Path, dst: Path, device: str) -> None:
    from llmcompressor import model_free_ptq

    model_free_ptq(model_stub=str(src), save_directory=str(dst), scheme="NVFP4A16", ignore=llmc_ignore(src),
                   device=device)


def child_oneshot(src: Path, dst: Path, device: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = load_model(src, device)
    recipe = QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=llmc_ignore(src))
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(str(dst), save_compressed=True)


def run_child(kind: str, src: Path, dst: Path, device: str) -> None:
    if kind == "copy":
        child_copy(src, dst)
    elif kind == "model-free":
        child_model_free(src, dst, device)
    elif kind == "oneshot":
        child_oneshot(src, dst, device)
    else:
        raise SystemExit(f"unknown child {kind!r}")


# ----------------------------------------------------------------------------------------------------------------
# Measuring one process
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    seconds: float
    peak_rss_bytes: int
    cpu_seconds: float  # user + system of the child: what the work costs, whatever else the machine is running
    load_average: float  # 1-minute load average when the run ended


@dataclass
class ToolResult:
    tool: str
    runs: list[RunResult] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.runs)

    @property
    def seconds(self) -> float:
        return statistics.median(r.seconds for r in self.runs)

    @property
    def median_run(self) -> RunResult:
        ordered = sorted(self.runs, key=lambda r: r.seconds)
        return ordered[(len(ordered) - 1) // 2]


def _rss_wrapper(command: list[str]) -> list[str]:
    """Run ``command`` in a wrapper process that prints the child's peak RSS (getrusage) as its last line."""
    code = (
        "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
        "usage = resource.getrusage(resource.RUSAGE_CHILDREN); "
        "print('MAXRSS_KB', usage.ru_maxrss, file=sys.stderr); "
        "print('CPU_S', usage.ru_utime + usage.ru_stime, file=sys.stderr); sys.exit(rc)"
    )
    return [sys.executable, "-c", code, *command]


def parse_usage(log_text: str) -> tuple[int, float]:
    """(peak RSS in kB, user + system CPU seconds) from `/usr/bin/time -v` or the getrusage wrapper's lines."""
    peak_kb, cpu = None, 0.0
    for line in log_text.splitlines()[-40:]:
        line = line.strip()
        if line.startswith("Maximum resident set size (kbytes):"):
            peak_kb = int(line.rsplit(":", 1)[1])
        elif line.startswith(("User time (seconds):", "System time (seconds):")):
            cpu += float(line.rsplit(":", 1)[1])
        elif line.startswith("MAXRSS_KB "):
            peak_kb = int(line.split()[1])
        elif line.startswith("CPU_S "):
            cpu = float(line.split()[1])
    if peak_kb is None:
        raise RuntimeError("no peak RSS found in the child's log")
    return peak_kb, cpu


def fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def warm_page_cache(directory: Path) -> None:
    """Read every file of the source once, so that each timed run starts with the source cached."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass


def time_process(command: list[str], dst: Path, log: Path, env: dict[str, str] | None = None) -> RunResult:
    """Wall time of ``command`` plus the fsync of what it wrote under ``dst``, and its peak RSS."""
    if os.path.exists(TIME_BIN):
        wrapped = [TIME_BIN, "-v", *command]
    else:
        wrapped = _rss_wrapper(command)
    start = time.perf_counter()
    with open(log, "w") as out:
        completed = subprocess.run(wrapped, stdout=out, stderr=subprocess.STDOUT, check=False, env=env)
    if dst.exists():
        fsync_tree(dst)
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    if completed.returncode != 0:
        tail = "\n".join(text.splitlines()[-15:])
        raise RuntimeError(f"exit status {completed.returncode}; log {log}:\n{tail}")
    peak_kb, cpu_seconds = parse_usage(text)
    return RunResult(seconds, peak_kb * 1024, cpu_seconds, os.getloadavg()[0])


# ----------------------------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------------------------


def fp4kit_launcher(nproc: int) -> list[str]:
    """How fp4kit is started: a plain process (nproc 0), or torchrun with ``nproc`` ranks on this node."""
    if nproc == 0:
        return [sys.executable, "-m", "fp4kit"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "fp4kit"]


def tool_command(tool: str, src: Path, dst: Path, device: str, nproc: int = 0,
                 dialect: str = "compressed-tensors") -> list[str]:
    if tool in ("fp4kit", BASE_TOOL):
        return [*fp4kit_launcher(nproc), "quantize", str(src), str(dst), "--scheme", "nvfp4a16", "--device", device,
                "--format", dialect, "--quiet"]
    child = {"copy": "copy", "model_free_ptq": "model-free", "oneshot": "oneshot"}[tool]
    return [sys.executable, str(Path(__file__).resolve()), "--child", child, "--src", str(src), "--dst", str(dst),
            "--device", device]


def checkpoint_bytes(src: Path) -> int:
    from fp4kit.io.checkpoint import CheckpointReader

    with CheckpointReader(src) as reader:
        return sum(info.nbytes for info in reader.tensors.values())


def oneshot_fits(input_bytes: int) -> tuple[bool, str]:
    available = _mem_available_bytes()
    needed = int(ONESHOT_MEMORY_FACTOR * input_bytes)
    if needed > available:
        return False, (f"skipped: needs ~{needed / 1e9:.1f} GB ({ONESHOT_MEMORY_FACTOR:g}x the bf16 model), "
                       f"{available / 1e9:.1f} GB available")
    return True, ""


def _mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def timed_attempt(result: ToolResult, command: list[str], src: Path, dst: Path, log: Path, attempt: int, repeats: int,
                  env: dict[str, str] | None = None) -> bool:
    """One timed run of ``command`` writing ``dst`` (emptied first, the source in the page cache), added to
    ``result``; False, with the failure noted, when it fails."""
    shutil.rmtree(dst, ignore_errors=True)
    warm_page_cache(src)
    try:
        run = time_process(command, dst, log, env)
    except RuntimeError as exc:
        result.note = f"failed: {exc}"
        print(f"  {result.tool}: FAILED\n{exc}", flush=True)
        return False
    result.runs.append(run)
    print(f"  {result.tool} run {attempt + 1}/{repeats}: {run.seconds:.1f} s, {run.cpu_seconds:.1f} CPU s, "
          f"peak RSS {run.peak_rss_bytes / 1e9:.2f} GB, load {run.load_average:.1f}", flush=True)
    return True


def bench_run(result: ToolResult, src: Path, workdir: Path, device: str, attempt: int, repeats: int, nproc: int = 0,
              env: dict[str, str] | None = None, dialect: str = "compressed-tensors") -> None:
    """One timed run of ``result.tool`` into ``workdir/out-<tool>``, added to ``result`` (or its failure noted)."""
    dst = workdir / f"out-{result.tool}"
    timed_attempt(result, tool_command(result.tool, src, dst, device, nproc, dialect), src, dst,
                  workdir / f"{result.tool}-{attempt}.log", attempt, repeats, env)


def bench_interleaved(tools: list[str], src: Path, workdir: Path, device: str, repeats: int, nproc: int = 0,
                      base_tree: Path | None = None, dialect: str = "compressed-tensors") -> list[ToolResult]:
    """Each round runs every tool once, in turn, so that a change in the machine's load falls on all of them alike.
    ``base_tree``: the fp4kit-base tool runs fp4kit from that source tree (PYTHONPATH), the others from this one."""
    results = [ToolResult(tool) for tool in tools]
    for attempt in range(repeats):
        for result in results:
            if result.note:
                continue
            env = None
            if result.tool == BASE_TOOL and base_tree is not None:
                env = {**os.environ, "PYTHONPATH": str(base_tree.resolve())}
            bench_run(result, src, workdir, device, attempt, repeats, nproc, env, dialect)
    return results


def _differing(ours: object, theirs: object, names: list[str]) -> list[str]:
    import torch

    return [n for n in names if not torch.equal(ours.read(n).view(torch.uint8), theirs.read(n).view(torch.uint8))]


def compare_outputs(fp4kit_dir: Path, reference_dir: Path) -> str:
    """Byte-compare fp4kit's output with a reference's for the experts 0, E/2, E-1 of the first MoE layer (names
    parsed with the family's grammar) and every other quantized module of the first layer."""
    from fp4kit.families import detect
    from fp4kit.families.base import layer_of
    from fp4kit.io.checkpoint import CheckpointReader, read_config

    config = read_config(fp4kit_dir)
    family = detect(config)
    grammar, num_experts = family.grammar, family.num_experts(family.text_config(config))
    picked = (0, num_experts // 2, num_experts - 1)
    projections: dict[str, list[str]] = {proj: [] for proj in grammar.projections} | {"other": []}
    with CheckpointReader(fp4kit_dir) as ours:
        modules = sorted({n.removesuffix(".weight_packed") for n in ours.names() if n.endswith(".weight_packed")})
    first_layer = min(layer_of(m) for m in modules if layer_of(m) is not None)
    first_moe = min(layer_of(m) for m in modules if grammar.split_expert(m) and layer_of(m) is not None)
    for module in modules:
        split = grammar.split_expert(module)
        if split and layer_of(module) == first_moe and split[1] in picked:
            projections[split[2]].append(module)
        elif not split and layer_of(module) == first_layer:
            projections["other"].append(module)
    verdicts = []
    with CheckpointReader(fp4kit_dir) as ours, CheckpointReader(reference_dir) as theirs:
        for label, modules in projections.items():
            names = [f"{m}.{suffix}" for m in modules for suffix in CHECK_TENSOR_SUFFIXES]
            missing = [n for n in names if n not in ours or n not in theirs]
            if not names:
                continue
            if missing:
                verdicts.append(f"{label}: missing {missing[0]}")
                continue
            differing = _differing(ours, theirs, names)
            verdict = "identical" if not differing else f"{len(differing)}/{len(names)} tensors DIFFER"
            verdicts.append(f"{label} {verdict}")
    return "; ".join(verdicts)


def same_files(ours: Path, theirs: Path) -> str:
    """Whether two output directories hold the same files with the same bytes (the provenance record aside: it
    names the command line and the output directory)."""
    import filecmp

    names = sorted({p.name for p in ours.iterdir()} | {p.name for p in theirs.iterdir()})
    differing = [n for n in names if n != "fp4kit_provenance.json"
                 and not ((ours / n).is_file() and (theirs / n).is_file()
                          and filecmp.cmp(ours / n, theirs / n, shallow=False))]
    return "every file identical" if not differing else f"{len(differing)} files DIFFER: {', '.join(differing)}"


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def _ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}x" if denominator else "-"


def results_table(results: list[ToolResult], input_bytes: int) -> str:
    """Markdown table; speed ratios compare median wall times (> 1: faster), the RSS ratio peak RSS (< 1: smaller)."""
    by_tool = {r.tool: r.median_run for r in results if r.ok}
    floor, mfp = by_tool.get("copy"), by_tool.get("model_free_ptq")
    columns = ["tool", "runs", "wall s", "GB/s (bf16 in)", "CPU s", "peak RSS GB", "load", "speed vs floor",
               "speed vs mfp", "RSS vs mfp"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in results:
        if not r.ok:
            lines.append(f"| {r.tool} | {r.note} |" + " |" * (len(columns) - 2))
            continue
        run = r.median_run
        cells = [r.tool, str(len(r.runs)), f"{run.seconds:.1f}", f"{input_bytes / run.seconds / 1e9:.3f}",
                 f"{run.cpu_seconds:.1f}", f"{run.peak_rss_bytes / 1e9:.2f}", f"{run.load_average:.1f}",
                 _ratio(floor.seconds, run.seconds) if floor else "-",
                 _ratio(mfp.seconds, run.seconds) if mfp else "-",
                 _ratio(run.peak_rss_bytes, mfp.peak_rss_bytes) if mfp else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment() -> dict:
    import importlib.metadata as md

    versions = {}
    for package in ("fp4kit", "torch", "safetensors", "transformers", "llmcompressor", "compressed-tensors"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = "missing"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "git": commit, **versions}


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the synthetic checkpoint")
    parser.add_argument("--model", choices=MODELS, default=MODELS[0], help="whose layer shapes")
    parser.add_argument("--experts", type=int, default=0,
                        help="routed experts per layer (0: the model's); every matrix keeps its real shape")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N], passed to every tool")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per tool (the median is reported)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-bench"))
    parser.add_argument("--skip-oneshot", action="store_true", help="do not run llm-compressor's oneshot")
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    parser.add_argument("--keep", action="store_true", help="keep the outputs in the workdir")
    parser.add_argument("--nproc", type=int, default=0,
                        help="run fp4kit under torchrun with N ranks (0: a plain process)")
    parser.add_argument("--format", default="compressed-tensors", choices=("compressed-tensors", "modelopt"),
                        help="the dialect fp4kit writes (modelopt where compressed-tensors is not installed)")
    parser.add_argument("--base-tree", type=Path,
                        help=f"also time fp4kit from this source tree as {BASE_TOOL} (e.g. a worktree of main)")
    parser.add_argument("--child", choices=("copy", "model-free", "oneshot"), help=argparse.SUPPRESS)
    parser.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def source_name(model: str, layers: int, experts: int = 0) -> str:
    name = "qwen3-moe" if model == MODELS[0] else model  # the first model's name predates the others
    return f"{name}-{layers}L{f'-{experts}E' if experts else ''}-bf16"


def build_source(workdir: Path, layers: int, model: str = MODELS[0], experts: int = 0) -> Path:
    from fp4kit.families import detect
    from fp4kit.testing.synthetic import published_config, write_synthetic, write_synthetic_qwen3_moe

    src = workdir / source_name(model, layers, experts)
    if (src / "config.json").exists():
        print(f"reusing {src}", flush=True)
        return src
    shutil.rmtree(src, ignore_errors=True)
    start = time.perf_counter()
    if model in QWEN3_MOE_SHAPES:
        shape = {**QWEN3_MOE_SHAPES[model], **({"num_experts": experts} if experts else {})}
        write_synthetic_qwen3_moe(src, layers, **shape)
    else:
        config = published_config(model, layers)
        if experts:  # the family says which key counts the routed experts
            text = config.get("text_config", config)
            key = next(k for k in ("num_experts", "n_routed_experts", "num_local_experts") if k in text)
            config = published_config(model, layers, **{key: experts})
            assert detect(config).num_experts(detect(config).text_config(config)) == experts
        write_synthetic(src, config)
    print(f"built {src} in {time.perf_counter() - start:.1f} s", flush=True)
    return src


def selected_tools(args: argparse.Namespace) -> list[str]:
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown:
        raise SystemExit(f"unknown tool(s) {unknown}; choose from {TOOLS}")
    return [t for t in TOOLS if t in tools and not (t == "oneshot" and args.skip_oneshot)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args.child, args.src, args.dst, args.device)
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = build_source(args.workdir, args.layers, args.model, args.experts)
    input_bytes = checkpoint_bytes(src)
    ranks = f" under torchrun x{args.nproc}" if args.nproc else ""
    print(f"source: {src.name}, {input_bytes / 1e9:.2f} GB bf16; device {args.device}{ranks}; "
          f"median of {args.repeats}; source read into page cache before each run, nothing dropped; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    tools, skipped = [], []
    for tool in selected_tools(args):
        if tool == "oneshot":
            fits, note = oneshot_fits(input_bytes)
            if not fits:
                print(f"  oneshot: {note}", flush=True)
                skipped.append(ToolResult(tool, note=note))
                continue
        tools.append(tool)
    if args.base_tree is not None:
        tools.insert(tools.index("fp4kit") if "fp4kit" in tools else len(tools), BASE_TOOL)
    results = bench_interleaved(tools, src, args.workdir, args.device, args.repeats, args.nproc, args.base_tree,
                                args.format)
    results += skipped
    ok = {r.tool for r in results if r.ok}
    identity = {ref: compare_outputs(args.workdir / "out-fp4kit", args.workdir / f"out-{ref}")
                for ref in ("model_free_ptq", "oneshot") if {"fp4kit", ref} <= ok}
    if {"fp4kit", BASE_TOOL} <= ok:
        identity[BASE_TOOL] = same_files(args.workdir / "out-fp4kit", args.workdir / f"out-{BASE_TOOL}")
    if not args.keep:
        for tool in (*TOOLS, BASE_TOOL):
            shutil.rmtree(args.workdir / f"out-{tool}", ignore_errors=True)
    report = {"args": {k: str(v) for k, v in vars(args).items() if not k.startswith(("child", "src", "dst"))},
              "environment": environment(), "input_bytes": input_bytes, "identity": identity,
              "results": [asdict(r) for r in results]}
    suffix = f"-nproc{args.nproc}" if args.nproc else ""
    out = args.workdir / f"results-{src.name}-{args.device}{suffix}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("\nfp4kit output bytes (against llm-compressor: experts 0, E/2, E-1 and attention of layer 0; packed, "
          f"scales, global scale; against {BASE_TOOL}: every file):")
    for ref, verdict in identity.items() or {"-": "not checked (needs fp4kit and a reference output)"}.items():
        print(f"  vs {ref}: {verdict}")
    print(f"\n{args.layers} layers, {input_bytes / 1e9:.2f} GB bf16 in, device {args.device}{ranks}, "
          f"median of {args.repeats} run(s) (wall time incl. fsync of the output; load = 1-min load average):")
    print(results_table(results, input_bytes))


if __name__ == "__main__":
    main()

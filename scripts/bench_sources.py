"""Quantize speed from an FP8-block source against the same checkpoint in BF16 (the anchor), same run; or the MXFP4
cast against the I/O floor (``--source mxfp4``).

    python scripts/bench_sources.py --layers 2[,4] [--experts 128] [--device cpu|cuda] [--repeats 3]
                                    [--workdir DIR] [--dequant-dtype fp32|bf16]
    python scripts/bench_sources.py --source mxfp4 --layers 2[,4] [--experts 8] [--repeats 3] [--workdir DIR]
                                    [--base-tree DIR] [--skip-torch]

Builds a bf16 synthetic with Qwen3-30B-A3B's MoE layer shapes (fp4kit.testing.synthetic; hidden 2048, moe_intermediate
768, 32/4 heads of 128) and N layers, writes the same weights as DeepSeek's FP8-block format
(fp4kit.io.sources.write_fp8_block_copy), then times `fp4kit quantize --scheme nvfp4a16` on each as a whole subprocess,
bf16 and fp8 runs alternating (so a change in the machine's load hits both), the source read once into the page
cache before each run, the output deleted. Prints per source the median seconds and the largest peak RSS of its own
runs, and the ratio of speeds (bf16 seconds / fp8 seconds; >= 1 means the FP8 source is as fast). Several layer
counts show whether peak memory grows with the model.

``--source mxfp4``: a synthetic with gpt-oss-120b's expert and attention shapes (hidden 2880, expert intermediate
2880, 64 query / 8 KV heads of 64; ``--experts`` per layer), its first layer written as compressed-tensors MXFP4A16
(``write_mxfp4_copy``: llm-compressor's ``MXFP4A16`` layout and exponent rule, its Linears but lm_head and the routers)
and repeated to N layers. Two measures, each
against the I/O floor in the same run:

- the cast alone, one thread: ``fp4kit.nvfp4.cast_mxfp4_group`` (the C loop, and the torch ops) over layer 0's
  expert groups (gate/up fused, down) already in memory, against reading the same tensors from the page cache with
  fp4kit's reader and against a memory copy of their bytes; GB/s of stored bytes;
- the whole conversion: ``quantize_checkpoint`` (the cast by default) in a child process, timed inside it (from the
  call, imports excluded) with its peak RSS, and again with the cast's torch ops (``native_cpu=False``: the output
  shards compared byte for byte), against a plain copy of the source's shards into a fresh directory
  (read from the page cache, written, fsynced: the least any tool writing a same-sized output does), runs
  alternating (``--base-tree DIR``: fp4kit from that source tree too, its shards compared with this tree's;
  ``--skip-torch``: without the torch-ops runs). Ratio copy seconds / quantize seconds: >= 1 is at the I/O floor.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import math
import multiprocessing
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


GPT_OSS_120B = {"hidden": 2880, "moe_intermediate": 2880, "num_heads": 64, "num_kv_heads": 8, "head_dim": 64}
CHILD = """
import json, sys, time
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
start = time.perf_counter()
report = quantize_checkpoint(sys.argv[1], sys.argv[2], QuantizeOptions(native_cpu=sys.argv[3] == "native"))
seconds = time.perf_counter() - start
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "cast": report.mxfp4_cast, "peak": peak}))
"""


MXFP4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head", "re:.*mlp.gate$"],
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized", "weights": {
        "type": "float", "num_bits": 4, "group_size": 32, "strategy": "group", "symmetric": True, "dynamic": False,
        "scale_dtype": "torch.uint8"}}},
}


def mxfp4_of(weight):
    """(code bytes [N, K/2], E8M0 bytes [N, K/32]) of a weight: compressed-tensors' exponent rule (the 32-block's
    largest magnitude's power of two, minus 2), values rounded to E2M1, saturating."""
    import torch

    from fp4kit.nvfp4 import e2m1_codes, pack_codes

    blocks = weight.to(torch.float32).unflatten(-1, (-1, 32))
    _, exponent = torch.frexp(blocks.abs().amax(-1))
    k = (exponent - 3).clamp(-127, 127)
    codes = e2m1_codes(torch.ldexp(blocks, -k.unsqueeze(-1)).flatten(-2))
    return pack_codes(codes), (k + 127).to(torch.uint8)


def write_mxfp4_copy(src: Path, dst: Path) -> None:
    """SRC's Linears (not lm_head, routers or embeddings) as compressed-tensors MXFP4A16, streaming."""
    import torch

    from fp4kit.io.checkpoint import CheckpointReader, PlannedTensor, ShardWriter

    def quantized(name: str, shape: tuple[int, ...]) -> bool:
        return (name.endswith(".weight") and len(shape) == 2 and "embed_tokens" not in name
                and not name.endswith(("lm_head.weight", "mlp.gate.weight")))

    dst.mkdir(parents=True, exist_ok=True)
    with CheckpointReader(src) as reader:
        plan = []
        for info in reader.tensors.values():
            if quantized(info.name, info.shape):
                rows, cols = info.shape
                module = info.name.removesuffix(".weight")
                plan += [PlannedTensor(f"{module}.weight_packed", torch.uint8, (rows, cols // 2)),
                         PlannedTensor(f"{module}.weight_scale", torch.uint8, (rows, cols // 32))]
            else:
                plan.append(PlannedTensor(info.name, info.dtype, info.shape))
        writer = ShardWriter(dst, plan, 4 * 10**9)
        for info in reader.tensors.values():
            tensor = reader.read(info.name)
            if quantized(info.name, info.shape):
                packed, exponents = mxfp4_of(tensor)
                module = info.name.removesuffix(".weight")
                writer.write(f"{module}.weight_packed", packed)
                writer.write(f"{module}.weight_scale", exponents)
            else:
                writer.write(info.name, tensor)
        writer.finish()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}, indent=2) + "\n")


def mxfp4_source(workdir: Path, layers: int, experts: int) -> Path:
    """The MXFP4A16 synthetic of ``layers`` layers (its one-layer form written once, then its layer repeated)."""
    from fp4kit.testing.synthetic import repeat_first_layer, write_synthetic_qwen3_moe

    one = workdir / f"mxfp4-1l-{experts}e"
    if not (one / "config.json").exists():
        bf16 = workdir / f"bf16-gptoss120b-1l-{experts}e"
        if not (bf16 / "config.json").exists():
            write_synthetic_qwen3_moe(bf16, 1, num_experts=experts, top_k=min(4, experts), **GPT_OSS_120B)
        write_mxfp4_copy(bf16, one)
    if layers == 1:
        return one
    path = workdir / f"mxfp4-{layers}l-{experts}e"
    if not (path / "config.json").exists():
        repeat_first_layer(one, path, layers)
    return path


def plain_copy(src: Path, dst: Path, kernel: bool = False) -> float:
    """Seconds to copy SRC's shards into DST (empty): read, written, fsynced. ``kernel``: file to file inside the
    kernel (``os.copy_file_range``, no pass through this process's memory) instead of read and written."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    warm(src)
    start = time.perf_counter()
    for file in sorted(src.glob("*.safetensors")):
        with open(file, "rb") as f, open(dst / file.name, "wb") as out:
            if kernel:
                size, done = file.stat().st_size, 0
                while done < size:
                    done += os.copy_file_range(f.fileno(), out.fileno(), min(1 << 24, size - done))
            else:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    return time.perf_counter() - start


def child_quantize(src: Path, dst: Path, native: bool = True,
                   tree: Path | None = None) -> tuple[float, float, int, dict, float]:
    """(seconds inside the call, seconds of the whole process, peak RSS bytes (the child's own address space, VmHWM:
    wait4's ru_maxrss of a child spawned from this process counts this process's memory at the spawn), the cast's
    block counts, CPU seconds of the process); ``native`` False: the cast's torch ops (``--no-native``); ``tree``:
    fp4kit from that source tree (PYTHONPATH) instead of this one."""
    shutil.rmtree(dst, ignore_errors=True)
    warm(src)
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree.resolve())}
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(dst), "native" if native else "torch"],
                             stdout=subprocess.PIPE, text=True, env=env)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    whole = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"quantize {src} failed")
    result = json.loads(out.strip().splitlines()[-1])
    return result["seconds"], whole, result["peak"], result["cast"], usage.ru_utime + usage.ru_stime


def best_of(repeats: int, work) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def cast_alone(src: Path, repeats: int) -> None:
    """The cast of layer 0's experts, one thread, against reading them and copying their bytes in memory."""
    import torch

    from fp4kit.io.checkpoint import CheckpointReader
    from fp4kit.nvfp4 import Mxfp4Weight, cast_mxfp4_group

    torch.set_num_threads(1)
    with CheckpointReader(src) as reader:
        names = [n for n in reader.names() if ".layers.0.mlp.experts." in n and n.endswith(".weight_packed")]
        tensors = [n for m in names for n in (m, m.replace("weight_packed", "weight_scale"))]
        stored = sum(reader.info(n).nbytes for n in tensors)
        warm(src)
        read = best_of(repeats, lambda: [reader.read(n) for n in tensors])
        loaded = {n: reader.read(n) for n in tensors}
    weights = {n: Mxfp4Weight(loaded[n], loaded[n.replace("weight_packed", "weight_scale")]) for n in names}
    groups: dict[str, list[Mxfp4Weight]] = {}
    for name, weight in weights.items():  # gate and up of an expert share a global scale
        key = name.replace("gate_proj", "gate_up").replace("up_proj", "gate_up")
        groups.setdefault(key, []).append(weight)
    flat = torch.cat([loaded[n].reshape(-1) for n in tensors])
    target = torch.empty_like(flat)
    memcpy = best_of(repeats, lambda: target.copy_(flat))
    print(f"cast alone, one thread, layer 0's {len(groups)} expert groups, {stored / 1e6:.1f} MB stored:")
    print(f"  read from the page cache (fp4kit's reader) {read * 1e3:8.2f} ms  {stored / read / 1e9:6.2f} GB/s")
    print(f"  memory copy of the bytes                   {memcpy * 1e3:8.2f} ms  {stored / memcpy / 1e9:6.2f} GB/s")
    for label, native in (("cast, C loop", True), ("cast, torch ops", False)):
        seconds = best_of(repeats, lambda native=native: [cast_mxfp4_group(g, native=native) for g in groups.values()])
        print(f"  {label:42s} {seconds * 1e3:8.2f} ms  {stored / seconds / 1e9:6.2f} GB/s  "
              f"({read / seconds:.1f}x the read)")


def bench_mxfp4(args: argparse.Namespace) -> None:
    layer_counts = [int(n) for n in args.layers.split(",")]
    # in a process of its own: the gigabytes it loads would stay in this one's heap for the whole-call runs
    alone = multiprocessing.get_context("spawn").Process(
        target=cast_alone, args=(mxfp4_source(args.workdir, layer_counts[0], args.experts), max(args.repeats, 5)))
    alone.start()
    alone.join()
    for layers in layer_counts:
        src = mxfp4_source(args.workdir, layers, args.experts)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        copies, kernel_copies, runs, torch_runs, base_runs = [], [], [], [], []
        for _ in range(args.repeats):
            copies.append(plain_copy(src, args.workdir / "out"))
            kernel_copies.append(plain_copy(src, args.workdir / "out", kernel=True))
            runs.append(child_quantize(src, args.workdir / "out"))
            if args.base_tree is not None:
                base_runs.append(child_quantize(src, args.workdir / "out-base", tree=args.base_tree))
            if not args.skip_torch:
                torch_runs.append(child_quantize(src, args.workdir / "out-torch", native=False))
        shards = sorted((args.workdir / "out").glob("*.safetensors"))
        copy, inside = statistics.median(copies), statistics.median(r[0] for r in runs)
        whole, peak = statistics.median(r[1] for r in runs), max(r[2] for r in runs)
        print(f"{layers} layers, {args.experts} experts, {size / 1e6:.0f} MB: plain copy {copy:.2f} s "
              f"(runs {', '.join(f'{c:.2f}' for c in copies)}); quantize (cast) {inside:.2f} s in the call "
              f"(runs {', '.join(f'{r[0]:.2f}' for r in runs)}), {whole:.2f} s as a process, "
              f"{statistics.median(r[4] for r in runs):.1f} CPU s, peak RSS {peak / 2**30:.2f} GiB, "
              f"blocks {runs[0][3]}")
        if torch_runs:
            same = all(filecmp.cmp(f, args.workdir / "out-torch" / f.name, shallow=False) for f in shards)
            print(f"  the cast's torch ops (--no-native): {statistics.median(r[0] for r in torch_runs):.2f} s in the "
                  f"call (runs {', '.join(f'{r[0]:.2f}' for r in torch_runs)}); shards byte-identical to the C "
                  f"loop's: {same}")
        if base_runs:
            same = all(filecmp.cmp(f, args.workdir / "out-base" / f.name, shallow=False) for f in shards)
            base = statistics.median(r[0] for r in base_runs)
            print(f"  fp4kit from {args.base_tree}: {base:.2f} s in the call (runs "
                  f"{', '.join(f'{r[0]:.2f}' for r in base_runs)}), {statistics.median(r[1] for r in base_runs):.2f} "
                  f"s as a process, {statistics.median(r[4] for r in base_runs):.1f} CPU s, peak RSS "
                  f"{max(r[2] for r in base_runs) / 2**30:.2f} GiB; copy / it {copy / base:.2f}x; shards "
                  f"byte-identical to this tree's: {same}")
        kernel = statistics.median(kernel_copies)
        print(f"  kernel copy (copy_file_range) {kernel:.2f} s (runs {', '.join(f'{c:.2f}' for c in kernel_copies)}): "
              f"kernel copy / quantize {kernel / inside:.2f}x")
        print(f"speed against the I/O floor (copy / quantize): {copy / inside:.2f}x")
    for out in ("out", "out-torch", "out-base"):
        shutil.rmtree(args.workdir / out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="fp8", choices=["fp8", "mxfp4"])
    parser.add_argument("--layers", default="2", help="comma-separated layer counts")
    parser.add_argument("--experts", type=int, default=None, help="per layer (default 128; mxfp4: 8)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-bench-sources"))
    parser.add_argument("--dequant-dtype", default=None, choices=["fp32", "bf16"])
    parser.add_argument("--base-tree", type=Path, default=None,
                        help="mxfp4: also time fp4kit from this source tree (the code before a change), same rounds")
    parser.add_argument("--skip-torch", action="store_true", help="mxfp4: no runs with the cast's torch ops")
    args = parser.parse_args()
    if args.source == "mxfp4":
        args.experts = args.experts or 8
        return bench_mxfp4(args)
    args.experts = args.experts or 128

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

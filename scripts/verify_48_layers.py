"""Time `fp4kit verify --device cuda` over every layer of a 48-layer Qwen3-30B-A3B-shaped NVFP4 checkpoint.

    python scripts/verify_48_layers.py [--layers 48] [--chunk 8] [--workdir DIR] [--tokens 1,16,256,4096]
    python scripts/verify_48_layers.py --smoke --layers 4 --chunk 2 --tokens 1,8 --device cpu   # checks the script
    python scripts/verify_48_layers.py --repeat-first-chunk      # layers 8..47 repeat layers 0..7's weights

The bf16 model (hidden 2048, moe_intermediate 768, 128 experts, top-8; fp4kit.testing.synthetic) is 1.2 GB per layer, 58
GB for 48 layers, which with its NVFP4 output does not fit a 64 GiB disk. So it is built in chunks of ``--chunk``
layers: each chunk is written in bf16, quantized (`fp4kit quantize`, NVFP4A16, on the GPU when there is one) and its
bf16 deleted, except the first chunk's, which stays as the BF16 source of layers 0..chunk-1; then the chunks are
merged into one checkpoint with their layers renumbered. ``--repeat-first-chunk`` builds only the first chunk and
repeats its layers up to ``--layers`` (same shapes and the same work for verify, minutes less to build).
Two timed runs of the CLI, each a whole process:

  1. fp4kit verify CKPT --device cuda                                  every layer: kernels, routing rows
  2. fp4kit verify CKPT --source BF16_CHUNK0 --layers 0..chunk-1       + quantized vs BF16, per-expert errors

Each prints its table; the script prints the wall times (the target for run 1 is under 5 minutes) and writes the
JSON reports to WORKDIR.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fp4kit.io.checkpoint import CheckpointReader, PlannedTensor, ShardWriter
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.testing.synthetic import write_synthetic_qwen3_moe

LAYER = re.compile(r"(?P<prefix>(^|.*\.)layers\.)(?P<layer>\d+)\.")


def renumber(name: str, offset: int) -> str:
    return LAYER.sub(lambda m: f"{m['prefix']}{int(m['layer']) + offset}.", name, count=1)


SMOKE_DIMS = {"hidden": 128, "moe_intermediate": 64, "num_experts": 8, "top_k": 2, "num_heads": 2, "num_kv_heads": 1,
              "head_dim": 32, "vocab_size": 64}


def build_chunks(work: Path, layers: int, chunk: int, device: str, dims: dict,
                 repeat_first: bool = False) -> list[tuple[int, Path]]:
    """[(first layer, quantized chunk dir)]; the first chunk's bf16 stays in WORKDIR/bf16-0."""
    chunks = []
    for offset in range(0, layers, chunk):
        if repeat_first and offset:
            chunks.append((offset, chunks[0][1]))
            continue
        count = min(chunk, layers - offset)
        start = time.perf_counter()
        bf16 = write_synthetic_qwen3_moe(work / f"bf16-{offset}", num_layers=count, seed=offset, threads=8, **dims)
        quantize_checkpoint(bf16, work / f"nvfp4-{offset}", QuantizeOptions(device=device))
        if offset:
            shutil.rmtree(bf16)
        chunks.append((offset, work / f"nvfp4-{offset}"))
        print(f"layers {offset}..{offset + count - 1}: written and quantized in {time.perf_counter() - start:.0f} s",
              flush=True)
    return chunks


def merge(chunks: list[tuple[int, Path]], dst: Path, layers: int) -> Path:
    """One checkpoint of every chunk's layers, renumbered; tensors outside the layers come from the first chunk."""
    config = json.loads((chunks[0][1] / "config.json").read_text())
    plan: list[PlannedTensor] = []
    sources: list[tuple[Path, str, str]] = []  # (chunk dir, name in chunk, name in dst)
    ignore: list[str] = []
    for offset, path in chunks:
        with CheckpointReader(path) as reader:
            for name in reader.names():
                if LAYER.match(name) is None and offset:
                    continue
                info = reader.info(name)
                plan.append(PlannedTensor(renumber(name, offset), info.dtype, info.shape))
                sources.append((path, name, renumber(name, offset)))
        chunk_config = json.loads((path / "config.json").read_text())
        ignore += [renumber(m, offset) for m in chunk_config["quantization_config"].get("ignore", [])]
    dst.mkdir(parents=True)
    writer = ShardWriter(dst, plan, 4 * 10**9, metadata={"producer": "fp4kit scripts/verify_48_layers.py"})
    for path in dict.fromkeys(p for p, _, _ in sources):
        with CheckpointReader(path) as reader:
            for _, name, new_name in (s for s in sources if s[0] == path):
                writer.write(new_name, reader.read(name))
        shutil.rmtree(path)
    writer.finish()
    config["num_hidden_layers"] = layers
    config["quantization_config"]["ignore"] = sorted(set(ignore))
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def timed_verify(args: list[str]) -> tuple[int, float]:
    start = time.perf_counter()
    code = subprocess.run([sys.executable, "-m", "fp4kit", "verify", *args]).returncode
    return code, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--chunk", type=int, default=8, help="layers per bf16 chunk (1.2 GB of disk each)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny layer shapes: checks the script only")
    parser.add_argument("--repeat-first-chunk", action="store_true",
                        help="build one chunk and repeat its layers (needs --layers a multiple of --chunk)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fp4kit-verify48-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "nvfp4"
    if not ckpt.exists():
        start = time.perf_counter()
        if args.repeat_first_chunk and args.layers % args.chunk:
            parser.error("--repeat-first-chunk needs --layers to be a multiple of --chunk")
        chunks = build_chunks(work, args.layers, args.chunk, args.device, SMOKE_DIMS if args.smoke else {},
                              args.repeat_first_chunk)
        merge(chunks, ckpt, args.layers)
        print(f"built {ckpt} ({args.layers} layers) in {time.perf_counter() - start:.0f} s", flush=True)
    common = ["--device", args.device, "--tokens", args.tokens]
    code_all, seconds_all = timed_verify([str(ckpt), *common, "--json", str(work / "report-all.json")])
    source_layers = ",".join(str(i) for i in range(min(args.chunk, args.layers)))
    code_src, seconds_src = timed_verify([str(ckpt), *common, "--source", str(work / "bf16-0"), "--layers",
                                          source_layers, "--json", str(work / "report-source.json")])
    print(f"\nfp4kit verify, {args.layers} layers, tokens {args.tokens}, {args.device}: {seconds_all:.1f} s wall "
          f"(exit {code_all}; target < 300 s)")
    print(f"fp4kit verify --source, layers {source_layers}: {seconds_src:.1f} s wall (exit {code_src})")
    print(f"reports: {work / 'report-all.json'}, {work / 'report-source.json'}")
    sys.exit(code_all or code_src)


if __name__ == "__main__":
    main()

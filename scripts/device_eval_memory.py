"""GPU memory of `fp4kit eval --device cuda` by layer count: it must stay flat (one decoder layer's weights at a time).

    python scripts/device_eval_memory.py --layers 2,8,48 [--samples 64] [--seq-len 512] [--bf16-source-up-to 8]
                                         [--workdir DIR] [--json FILE]

A one-layer synthetic Qwen3-30B-A3B-shaped bf16 checkpoint (fp4kit.testing.synthetic) is quantized once to W4A4 NVFP4 on
the GPU; both are then repeated to each layer count (``repeat_first_layer``: byte copies of layer 0). Each count runs
one in-process ``fp4kit.tools.evaluate`` on the GPU on seeded random token ids, and reports the peak
``torch.cuda.max_memory_allocated`` next to the hidden states it must hold (both models, float32, all samples) and
one layer's dequantized float32 weights. A 48-layer bf16 source is ~60 GB of disk: above ``--bf16-source-up-to``
layers the checkpoint is compared with itself (both sides then dequantize NVFP4 layers, the larger case for memory).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.testing.synthetic import repeat_first_layer, write_synthetic_qwen3_moe
from fp4kit.tools.evaluate import evaluate

GB = 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="2,8,48")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--bf16-source-up-to", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-eval-mem"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny dims on the CPU: checks the script only")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    dims = dict(hidden=256, moe_intermediate=128, num_experts=8, num_heads=4, num_kv_heads=2, head_dim=64,
                vocab_size=1024) if args.smoke else {}
    shutil.rmtree(args.workdir, ignore_errors=True)
    one_bf16 = write_synthetic_qwen3_moe(args.workdir / "bf16-1L", num_layers=1, threads=16, **dims)
    one_q = args.workdir / "nvfp4-1L"
    quantize_checkpoint(one_bf16, one_q, QuantizeOptions(scheme="nvfp4", device=device, samples=8, seq_len=512))
    config = json.loads((one_bf16 / "config.json").read_text())
    token_ids = torch.randint(0, config["vocab_size"], (args.samples, args.seq_len),
                              generator=torch.Generator().manual_seed(0))
    hidden_bytes = 2 * args.samples * args.seq_len * config["hidden_size"] * 4
    rows = []
    for layers in [int(n) for n in args.layers.split(",")]:
        ckpt = repeat_first_layer(one_q, args.workdir / f"nvfp4-{layers}L", layers)
        source = repeat_first_layer(one_bf16, args.workdir / f"bf16-{layers}L", layers) \
            if layers <= args.bf16_source_up_to else ckpt
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = evaluate(source, ckpt, token_ids, device, args.batch_size)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        row = {"layers": layers, "source": "bf16" if source != ckpt else "itself", "seconds": time.perf_counter()
               - start, "peak_gb": peak / GB, "hidden_states_gb": hidden_bytes / GB, "kl": result.kl}
        rows.append(row)
        print(json.dumps(row), flush=True)
        for path in {source, ckpt}:
            shutil.rmtree(path)
    print("| layers | source | s | peak GPU GB | hidden states GB (both models) | KL |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['source']} | {r['seconds']:.1f} | {r['peak_gb']:.2f} | "
              f"{r['hidden_states_gb']:.2f} | {r['kl']:.5f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""GPU memory of `fp4kit quantize --scheme nvfp4 --device cuda` against what streaming allows: one decoder layer's
weights plus the calibration activations, whatever the number of layers.

    python scripts/device_calibrate_memory.py --layers 2,4 --samples 64 --seq-len 512 [--workdir DIR]

For each layer count: a synthetic Qwen3-30B-A3B-shaped checkpoint, then one in-process quantization with
calibration on the GPU. Peak `torch.cuda.max_memory_allocated` is reported separately for the calibration pass and
for the quantization pass, next to the budget = largest layer's weights (bf16, as transformers holds them) + the
hidden states of every calibration token (bf16, kept between layers) + the embedding table (on the device for the
first forward) + what a plain transformers forward of one calibration batch through one decoder layer allocates
beyond its weights (attention scores, expert intermediates: the activations any calibration needs).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path

import torch

from fp4kit.io.checkpoint import CheckpointReader
from fp4kit.quantize import checkpoint as q
from fp4kit.testing.synthetic import write_synthetic_qwen3_moe

LAYER = re.compile(r"layers\.(\d+)\.")
GB = 1e9


def layer_bytes(src: Path) -> tuple[int, int]:
    """(largest decoder layer's bytes, embedding bytes) from the checkpoint's headers."""
    per_layer: dict[int, int] = {}
    embedding = 0
    with CheckpointReader(src) as reader:
        for name in reader.names():
            info = reader.info(name)
            if (match := LAYER.search(name)) is not None:
                per_layer[int(match[1])] = per_layer.get(int(match[1]), 0) + info.nbytes
            elif name.endswith("embed_tokens.weight"):
                embedding = info.nbytes
    return max(per_layer.values()), embedding


def layer_forward_bytes(src: Path, batch_size: int, seq_len: int) -> int:
    """Peak GPU memory a plain transformers forward of one calibration batch through one decoder layer needs beyond
    the layer's weights and its input: the activations any calibration of this model has to hold."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config)
    layer = model.layers[0].to_empty(device="cuda").to(torch.bfloat16)
    rotary = type(model.rotary_emb)(config=config).to("cuda")
    hidden = torch.randn(batch_size, seq_len, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(seq_len, device="cuda").unsqueeze(0).expand(batch_size, -1)
    position_embeddings = rotary(hidden, positions)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        layer(hidden, position_embeddings=position_embeddings, attention_mask=None, position_ids=positions)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="2,4")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-calib-mem"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    calibration_peak: list[int] = []
    real_calibrate = q._calibrate

    def calibrate_and_record(*a, **kw):
        torch.cuda.reset_peak_memory_stats()
        result = real_calibrate(*a, **kw)
        torch.cuda.synchronize()
        calibration_peak.append(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        return result

    q._calibrate = calibrate_and_record
    rows = []
    for layers in [int(n) for n in args.layers.split(",")]:
        work = args.workdir / f"{layers}L"
        shutil.rmtree(work, ignore_errors=True)
        src = write_synthetic_qwen3_moe(work / "bf16", num_layers=layers, threads=16)
        largest_layer, embedding = layer_bytes(src)
        hidden = json.loads((src / "config.json").read_text())["hidden_size"]
        activations = args.samples * args.seq_len * hidden * 2
        start = time.perf_counter()
        options = q.QuantizeOptions(scheme="nvfp4", device="cuda", samples=args.samples, seq_len=args.seq_len,
                                    batch_size=args.batch_size)
        q.quantize_checkpoint(src, work / "out", options)
        seconds = time.perf_counter() - start
        quantize_peak = torch.cuda.max_memory_allocated()
        forward = layer_forward_bytes(src, args.batch_size, args.seq_len)
        budget = largest_layer + activations + embedding + forward
        row = {"layers": layers, "seconds": round(seconds, 1), "largest_layer_gb": largest_layer / GB,
               "activations_gb": activations / GB, "embedding_gb": embedding / GB,
               "batch_forward_gb": forward / GB, "budget_gb": budget / GB,
               "calibration_peak_gb": calibration_peak[-1] / GB, "quantize_peak_gb": quantize_peak / GB}
        rows.append(row)
        print(json.dumps(row), flush=True)
        shutil.rmtree(work)
    print("| layers | s | layer GB | hidden states GB | embedding GB | one batch's forward GB | budget GB | "
          "calibration peak GB | quantization peak GB | within budget |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        within = max(r["calibration_peak_gb"], r["quantize_peak_gb"]) <= r["budget_gb"]
        print(f"| {r['layers']} | {r['seconds']} | {r['largest_layer_gb']:.3f} | {r['activations_gb']:.3f} | "
              f"{r['embedding_gb']:.3f} | {r['batch_forward_gb']:.3f} | {r['budget_gb']:.3f} | "
              f"{r['calibration_peak_gb']:.3f} | "
              f"{r['quantize_peak_gb']:.3f} | {'yes' if within else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

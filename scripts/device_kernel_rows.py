"""Triton kernel vs fp32 reference, row by row, under several tile configs, on a family's tiny stand-in (W4A4).

    python scripts/device_kernel_rows.py [--family glm4_moe] [--device cuda] [--tokens 16,256,1024]

Quantizes the stand-in with calibration (fp4kit quantize --scheme nvfp4 on the device), then for every MoE layer and
token count prints, per kernel config, the relative error and the rows whose error exceeds 1e-3 with their expert
ids, and the tokens routed to each expert. Rows off under every config point at the reference or the data; rows off
under some configs only, at the kernel. (The GLM-4.5-Air W4A4 rows were found this way: docs/benchmarks_history.md.)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.testing.fixtures import RECIPE_STAND_INS, build_fixture
from fp4kit.verify.backends import _prepare_reference
from fp4kit.verify.checks import LayerVerifier, VerifyOptions, activation_divisors, route_batch
from fp4kit.verify.moe_layer import QuantizedModel
from fp4kit.verify.triton_moe import DECODE_CONFIG, PREFILL_CONFIG, KernelConfig, TritonMoeWeights, fused_moe

CONFIGS = {
    "decode": DECODE_CONFIG,
    "prefill": PREFILL_CONFIG,
    "m64": KernelConfig(block_m=64, block_n1=64, block_n2=128, block_k=128, num_warps=4),
    "m128-integer-decode": KernelConfig(block_m=128, block_n1=64, block_n2=128, block_k=128, num_warps=4,
                                        fast_dequant=False),
    "m128-8-warps": KernelConfig(block_m=128, block_n1=64, block_n2=128, block_k=128, num_warps=8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="glm4_moe")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", default="16,256,1024")
    args = parser.parse_args()
    device = torch.device(args.device)
    tmp = Path(tempfile.mkdtemp())
    src = build_fixture(args.family, tmp / "bf16", overrides=RECIPE_STAND_INS[args.family])
    quantize_checkpoint(src, tmp / "nvfp4", QuantizeOptions(scheme="nvfp4", device=device.type, samples=16, seq_len=64))
    model = QuantizedModel(tmp / "nvfp4")
    for layer in model.layers:
        moe = model.layer(layer)
        act = activation_divisors(moe, "w4a4")
        verifier = LayerVerifier(model, moe, VerifyOptions(), "w4a4", {}, device)
        reference = _prepare_reference(moe, model.spec, act, device)
        weights_on_device = TritonMoeWeights.from_nvfp4(moe.w13, moe.w2, act, device=device)
        for num_tokens in map(int, args.tokens.split(",")):
            hidden = verifier.hidden_states(num_tokens)
            logits, weights, ids = route_batch(moe, hidden, model.spec)
            expected = reference(hidden, weights, ids, logits)
            counts = torch.bincount(ids.flatten().cpu(), minlength=moe.w13.shape[0]).tolist()
            print(f"layer {layer}, {num_tokens} tokens, tokens per expert {counts}")
            for name, config in CONFIGS.items():
                got = fused_moe(hidden.to(torch.bfloat16), weights, ids, weights_on_device, model.spec, config=config)
                row_error = (got - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-30)
                off = (row_error > 1e-3).nonzero().flatten().tolist()
                rows = [(r, round(float(row_error[r]), 4), ids[r].tolist()) for r in off[:6]]
                total = float((got - expected).norm() / expected.norm())
                print(f"  {name}: relative error {total:.3g}, {len(off)} rows off {rows}")


if __name__ == "__main__":
    main()

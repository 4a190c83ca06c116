"""Per-kernel GPU time of one `fused_moe` call (torch.profiler), for the launch-by-launch picture behind
scripts/bench_verify_kernel.py's totals at few tokens.

    python scripts/device_kernel_profile.py --tokens 1,16 --variants "default;cfg:i=32,g=pair,n=128"
    ncu --clock-control none -k regex:gemm --section WarpStateStats ... \
        python scripts/device_kernel_profile.py --tokens 1 --shapes Qwen3-30B-A3B --calls 1   # plain calls for ncu
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from functools import partial

import torch
from bench_verify_kernel import SHAPES, random_experts, variant_config

from fp4kit.families.routing import RoutingSpec, route
from fp4kit.verify.triton_moe import TritonMoeWeights, default_config, fused_moe


def kernel_times(fn, repeats: int = 50) -> dict[str, float]:
    """Mean device µs per call of each kernel fn launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:40]] += event.device_time / repeats
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,16")
    parser.add_argument("--variants", default="default")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    parser.add_argument("--calls", type=int, default=0,
                        help="just call fused_moe this many times, no torch.profiler (to run under ncu)")  # fmt: skip
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes.split(","):
        num_experts, hidden_size, inter_size, top_k = SHAPES[name]
        w13 = random_experts(num_experts, 2 * inter_size, hidden_size, generator)
        w2 = random_experts(num_experts, hidden_size, inter_size, generator)
        moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, device="cuda")
        spec = RoutingSpec("softmax_topk", num_experts, top_k)
        for tokens in (int(t) for t in args.tokens.split(",")):
            hidden = torch.randn(tokens, hidden_size, device="cuda", generator=generator).to(torch.bfloat16)
            weights, ids = route(torch.randn(tokens, num_experts, device="cuda", generator=generator), spec)
            for variant in args.variants.split(";"):
                cfg = variant_config(variant, default_config(ids.numel(), num_experts, top_k))
                call = partial(fused_moe, hidden, weights, ids, moe_weights, spec, config=cfg)
                if args.calls:
                    for _ in range(args.calls):
                        call()
                    torch.cuda.synchronize()
                    continue
                times = kernel_times(call)
                parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(times.items(), key=lambda kv: -kv[1]))
                print(f"{name} T={tokens} {variant}: sum {sum(times.values()):.1f} µs = {parts}", flush=True)


if __name__ == "__main__":
    main()

"""Benchmark fp4kit's Triton fused NVFP4 MoE on one GPU against a torch reference (roofline: docs/BENCHMARKS.md).

For Qwen3-30B-A3B and Qwen3-235B-A22B MoE layer shapes with random NVFP4 experts and softmax top-8 routing:
correctness of W4A16 and W4A4-emulated against `moe_reference` (fp32, dequantized weights), then times
(`triton.testing.do_bench` medians; CUDA-graph medians beside them) at decode (1, 16, 64 tokens) and prefill (4096),
the achieved bandwidth on the bytes that must be read (touched experts' packed weights + block scales) against a
measured device copy bandwidth, what two read-only launches over those bytes take (`read_floor`: the bound of any
two-GEMM kernel), and the speedup over a per-expert torch loop (dequantize to bf16 + bf16 matmuls).

    python scripts/bench_verify_kernel.py [--quick] [--json FILE]
    python scripts/bench_verify_kernel.py --variants current,fast-scales --tokens 1,16,64 [--modes W4A16] [--json FILE]
    TRITON_INTERPRET=1 python scripts/bench_verify_kernel.py --smoke   # tiny shapes on a CPU: checks the script only
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

from fp4kit.families.routing import RoutingSpec, route
from fp4kit.nvfp4 import NVFP4Tensor, divisor_from_amax
from fp4kit.verify.reference import dequantize_experts, moe_reference
from fp4kit.verify.triton_moe import (
    DECODE_CONFIG,
    PREFILL_CONFIG,
    KernelConfig,
    TritonMoeWeights,
    default_config,
    fused_moe,
)

SHAPES = {  # name: (experts, hidden, moe_intermediate, top_k)
    "Qwen3-30B-A3B": (128, 2048, 768, 8),
    "Qwen3-235B-A22B": (128, 4096, 1536, 8),
}
TOKENS = (1, 16, 64, 4096)
DEVICE = "cuda"
DECODE_CANDIDATES = [
    DECODE_CONFIG,
    replace(DECODE_CONFIG, num_stages=4),
    replace(DECODE_CONFIG, block_k=256),
    replace(DECODE_CONFIG, block_n1=64, block_n2=64),
    replace(DECODE_CONFIG, block_n2=64, num_stages=4),
    replace(DECODE_CONFIG, block_n1=64, block_n2=64, num_stages=5),
    replace(DECODE_CONFIG, block_n1=16, block_n2=16, block_k=256, num_warps=1),
    replace(DECODE_CONFIG, block_n1=64, block_n2=64, num_warps=4),
]
PREFILL_CANDIDATES = [
    PREFILL_CONFIG,
    replace(PREFILL_CONFIG, block_k=64, num_stages=4),
    replace(PREFILL_CONFIG, block_n1=64, num_warps=4),
    replace(PREFILL_CONFIG, block_m=64, num_warps=4),
    replace(PREFILL_CONFIG, block_n2=256),
    replace(PREFILL_CONFIG, num_stages=4),
]


# --variants: kernel alternatives timed against each other on the tiles of each batch size (default_config's M
# tile and warps); "default" is what fused_moe runs
_PLAIN = {"fast_scales": False, "shuffled": False, "fold_bias": False}
VARIANTS = {
    "plain": lambda cfg: replace(cfg, **_PLAIN, **_n32(cfg)),  # the kernel before the decode variants
    "fast-scales": lambda cfg: replace(cfg, **{**_PLAIN, "fast_scales": True}, **_n32(cfg)),
    "shuffled": lambda cfg: replace(cfg, fold_bias=False, **_n32(cfg)),
    "shuffled-folded": lambda cfg: replace(cfg, **_n32(cfg)),
    # the same with 64-row N tiles at decode: twice the weight bytes per thread per K step over the same activation
    # fragments, scale loads and loop overhead (SASS per byte 8.1 / 7.4 for GEMM2 / GEMM1 against 9.9 / 8.2)
    "shuffled-folded-n64": lambda cfg: replace(cfg, **_n64(cfg)),
    "default": lambda cfg: cfg,
}


_CONFIG_KEYS = {"i": "slice_i", "g": "grouping", "c": "fused_combine", "m": "block_m", "n1": "block_n1",
                "n": "block_n2", "k": "block_k", "w": "num_warps", "s": "num_stages"}  # fmt: skip


def variant_config(name: str, cfg: KernelConfig) -> KernelConfig:
    """A named variant, or `cfg:key=value,...` on top of the default config (keys: i slice_i, g grouping
    (align, pair), c fused_combine (0/1), m block_m, n1 block_n1, n block_n2, k block_k, w num_warps,
    s num_stages), e.g. `cfg:i=0,g=pair,c=1`."""
    if not name.startswith("cfg:"):
        return VARIANTS[name](cfg)
    fields = {}
    for item in name.removeprefix("cfg:").split(","):
        key, _, value = item.partition("=")
        fields[_CONFIG_KEYS[key]] = value if key == "g" else bool(int(value)) if key in "cp" else int(value)
    return replace(cfg, **fields)


def _n32(cfg: KernelConfig) -> dict:
    return {"block_n1": 32, "block_n2": 32} if cfg.block_m == DECODE_CONFIG.block_m else {}


def _n64(cfg: KernelConfig) -> dict:
    return {"block_n1": 64, "block_n2": 64} if cfg.block_m == DECODE_CONFIG.block_m else {}


def random_experts(num_experts: int, rows: int, cols: int, generator: torch.Generator) -> NVFP4Tensor:
    """Random codes, FP8 block scales in [4, 64], and divisors giving weights of std ~0.02."""
    packed = torch.randint(
        0, 256, (num_experts, rows, cols // 2), dtype=torch.uint8, device=DEVICE, generator=generator
    )
    scale = 4 + 60 * torch.rand(num_experts, rows, cols // 16, device=DEVICE, generator=generator)
    divisor = torch.full((num_experts,), 0.02 / (2.4 * 34), dtype=torch.float64)
    return NVFP4Tensor(packed, scale.to(torch.float8_e4m3fn), divisor)


def expert_bytes(*stacks: NVFP4Tensor) -> int:
    """Packed weight and block scale bytes of one expert of each stack."""
    tensors = [t for stack in stacks for t in (stack.packed[0], stack.block_scale[0])]
    return sum(t.numel() * t.element_size() for t in tensors)


def torch_dequant_moe(
    hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor
):
    """The per-expert torch loop a user would write: dequantize each touched expert to bf16, two bf16 matmuls."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    div13, div2 = w13.global_scale_div.reshape(-1), w2.global_scale_div.reshape(-1)
    for expert in torch.unique(ids).tolist():
        token_idx, slot = torch.where(ids == expert)
        gate_up = NVFP4Tensor(w13.packed[expert], w13.block_scale[expert], div13[expert]).dequantize(torch.bfloat16)
        down = NVFP4Tensor(w2.packed[expert], w2.block_scale[expert], div2[expert]).dequantize(torch.bfloat16)
        gate, up = F.linear(hidden[token_idx], gate_up).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down).float() * weights[token_idx, slot, None]
        out.index_add_(0, token_idx, expert_out)
    return out


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second."""
    import triton.testing

    src = torch.empty(1 << 31, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * (1 << 31) / (ms * 1e-3)


def read_floor(bytes13: int, bytes2: int) -> Callable[[], None]:
    """What reading the must-read bytes alone costs (the "read-floor" variant): two dependent read-only launches over
    buffers of the w13 and the w2 share of them (GEMM2 cannot start before GEMM1's SwiGLU), no arithmetic. Any
    two-launch kernel pays at least this; its ratio to the copy bandwidth bounds the % copy reachable."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(src_ptr, num_words, sums_ptr, WORDS: tl.constexpr):
        offs = tl.program_id(0) * WORDS + tl.arange(0, WORDS)
        tl.store(sums_ptr + tl.program_id(0), tl.sum(tl.load(src_ptr + offs, mask=offs < num_words, other=0), 0))

    words = 4096  # 16 KB per program
    buffers = [torch.randint(0, 1 << 30, (-(-size // 4),), dtype=torch.int32, device=DEVICE) for size in (bytes13,
               bytes2)]  # fmt: skip
    sums = torch.empty(max(b.numel() for b in buffers) // words + 1, dtype=torch.int32, device=DEVICE)

    def run() -> None:
        for buffer in buffers:
            read_kernel[(triton.cdiv(buffer.numel(), words),)](buffer, buffer.numel(), sums, WORDS=words, num_warps=4)

    return run


def probe_fast_dequant(generator: torch.Generator) -> bool:
    """The PTX nibble decode must give bit-identical outputs to the integer decode; else fall back to the latter."""
    w13 = random_experts(8, 256, 512, generator)
    w2 = random_experts(8, 512, 128, generator)
    spec = RoutingSpec("softmax_topk", 8, 2)
    hidden = torch.randn(33, 512, device=DEVICE, generator=generator).to(torch.bfloat16)
    weights, ids = route(torch.randn(33, 8, device=DEVICE, generator=generator), spec)
    moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, device=DEVICE)
    # the plain layout: the shuffled integer decode feeds the MMA its K elements in another order (same values, fp32
    # sums that differ in the last bit); the shuffled PTX decode is checked against the plain one by --variants
    plain = replace(DECODE_CONFIG, shuffled=False, fold_bias=False)
    slow = fused_moe(hidden, weights, ids, moe_weights, spec, config=replace(plain, fast_dequant=False))
    try:
        fast = fused_moe(hidden, weights, ids, moe_weights, spec, config=plain)
    except Exception as error:
        print(f"fast dequant does not compile here ({type(error).__name__}: {str(error)[:300]}); integer decode used")
        return False
    same = bool(torch.equal(fast, slow))
    print(f"fast dequant {'matches' if same else 'DIFFERS from'} the integer decode bit for bit", flush=True)
    return same


def errors(got: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    diff = (got.float() - expected).nan_to_num(nan=float("inf"))
    return {
        "rel_l2": float(diff.norm() / expected.norm()),
        "max_abs_rel": float(diff.abs().max() / expected.abs().max()),
    }


def check_correctness(name, w13, w2, hidden_size, top_k, generator, fast: bool) -> tuple[list[dict], torch.Tensor]:
    """Kernel vs fp32 reference for W4A16 and W4A4, three routing families; returns rows and W4A4 divisors."""
    num_experts = w13.shape[0]
    # The reference runs on the CPU: full fp32 matmuls whatever the GPU's TF32 / reduced-precision settings are.
    dense13, dense2 = dequantize_experts(w13).cpu(), dequantize_experts(w2).cpu()
    rows = []
    hidden = torch.randn(64, hidden_size, device=DEVICE, generator=generator).to(torch.bfloat16)
    spec = RoutingSpec("softmax_topk", num_experts, top_k)
    weights, ids = route(torch.randn(64, num_experts, device=DEVICE, generator=generator), spec)
    # Static activation scales: one per projection for all experts (EP-independent), from this sample's amax.
    gate, up = torch.einsum("th,eih->eti", hidden.float().cpu(), dense13).chunk(2, dim=-1)
    amax13 = hidden.float().abs().amax().double().cpu()
    amax2 = (F.silu(gate) * up).abs().amax().double().cpu()
    divisors = (torch.full((num_experts,), divisor_from_amax(float(amax13)), dtype=torch.float64),
                torch.full((num_experts,), divisor_from_amax(float(amax2)), dtype=torch.float64))  # fmt: skip
    del gate, up
    specs = [
        ("softmax_topk", spec, weights, ids),
        ("sigmoid_grouped_topk", *_grouped(num_experts, top_k, generator)),
        ("llama4_sigmoid_top1", *_llama4(num_experts, generator)),
    ]
    for tokens in (64, 1024 if DEVICE == "cuda" else 40):
        if tokens != 64:
            hidden = torch.randn(tokens, hidden_size, device=DEVICE, generator=generator).to(torch.bfloat16)
            weights, ids = route(torch.randn(tokens, num_experts, device=DEVICE, generator=generator), spec)
            specs = [("softmax_topk", spec, weights, ids)]
        for kind, kind_spec, kind_weights, kind_ids in specs:
            for mode, act_div in (("W4A16", None), ("W4A4", divisors)):
                moe_weights = TritonMoeWeights.from_nvfp4(w13, w2, act_div, device=DEVICE)
                cfg = replace(default_config(kind_ids.numel(), num_experts, kind_ids.shape[1]), fast_dequant=fast)
                got = fused_moe(hidden, kind_weights, kind_ids, moe_weights, kind_spec, config=cfg)
                expected = moe_reference(hidden.cpu(), kind_weights.cpu(), kind_ids.cpu(), dense13, dense2, kind_spec,
                                         activation_global_div=act_div)  # fmt: skip
                row = {"shape": name, "tokens": tokens, "routing": kind, "mode": mode, **errors(got.cpu(), expected)}
                rows.append(row)
                print("check", json.dumps(row), flush=True)
    del dense13, dense2
    return rows, divisors


def _grouped(num_experts: int, top_k: int, generator: torch.Generator):
    spec = RoutingSpec("sigmoid_grouped_topk", num_experts, top_k, True, 4, 2, 2.5)
    bias = torch.randn(num_experts, device=DEVICE, generator=generator) * 0.1
    return (spec, *route(torch.randn(64, num_experts, device=DEVICE, generator=generator), spec, bias))


def _llama4(num_experts: int, generator: torch.Generator):
    spec = RoutingSpec("llama4_sigmoid_top1", num_experts, 1)
    return (spec, *route(torch.randn(64, num_experts, device=DEVICE, generator=generator), spec))


def time_ms(fn, graph: bool = False, rep: int = 100) -> float:
    import triton.testing

    if DEVICE == "cpu":  # --smoke: wall clock, one run
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def best_config(fn_for_config, candidates: list[KernelConfig]) -> tuple[KernelConfig, float, list[dict]]:
    trials, best, best_ms = [], candidates[0], float("inf")
    for cfg in candidates:
        try:
            ms = time_ms(fn_for_config(cfg))
        except Exception as error:  # a config that does not compile or fit is skipped and reported
            trials.append({"config": asdict(cfg), "error": f"{type(error).__name__}: {str(error)[:200]}"})
            continue
        trials.append({"config": asdict(cfg), "ms": ms})
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms, trials


def compare_variants(shapes, tokens_list, names, generator, copy_bw, mode_names=("W4A16", "W4A4")) -> dict:
    """Each variant on the default config at each batch size, W4A16 and W4A4: do_bench and CUDA-graph medians, and
    whether its output equals the first variant's bit for bit (the variants change instructions, not values)."""
    rows = []
    for name, (num_experts, hidden_size, inter_size, top_k) in shapes:
        w13 = random_experts(num_experts, 2 * inter_size, hidden_size, generator)
        w2 = random_experts(num_experts, hidden_size, inter_size, generator)
        per_expert = expert_bytes(w13, w2)
        spec = RoutingSpec("softmax_topk", num_experts, top_k)
        divisors = (torch.full((num_experts,), divisor_from_amax(5.0), dtype=torch.float64),
                    torch.full((num_experts,), divisor_from_amax(0.05), dtype=torch.float64))  # fmt: skip
        modes = {"W4A16": TritonMoeWeights.from_nvfp4(w13, w2, device=DEVICE),
                 "W4A4": TritonMoeWeights.from_nvfp4(w13, w2, divisors, device=DEVICE)}  # fmt: skip
        modes = {mode: modes[mode] for mode in mode_names}
        for tokens in tokens_list:
            hidden = torch.randn(tokens, hidden_size, device=DEVICE, generator=generator).to(torch.bfloat16)
            weights, ids = route(torch.randn(tokens, num_experts, device=DEVICE, generator=generator), spec)
            touched = int(torch.unique(ids).numel())
            read_bytes = touched * per_expert
            base_cfg = default_config(ids.numel(), num_experts, top_k)
            for mode, moe_weights in modes.items():
                first = None
                for variant in names:
                    if variant == "read-floor":
                        run = read_floor(touched * expert_bytes(w13), touched * expert_bytes(w2))
                        out = first
                    else:
                        cfg = variant_config(variant, base_cfg)

                        def run(cfg=cfg, moe_weights=moe_weights, hidden=hidden, weights=weights, ids=ids, spec=spec):
                            return fused_moe(hidden, weights, ids, moe_weights, spec, config=cfg)

                        out = run()
                        first = out if first is None else first
                    ms, graph_ms = time_ms(run), time_ms(run, graph=True)
                    row = {
                        "shape": name, "tokens": tokens, "mode": mode, "variant": variant, "read_mb": read_bytes / 1e6,
                        "us": ms * 1e3, "graph_us": graph_ms * 1e3,
                        "graph_pct_copy": 100 * read_bytes / (graph_ms * 1e-3) / copy_bw,
                        "identical_to_first": out is not None
                        and bool(torch.equal(out.nan_to_num(), first.nan_to_num())),
                        "config": asdict(cfg) if variant != "read-floor" else {},
                    }  # fmt: skip
                    rows.append(row)
                    print("variant", json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
    print("\n| shape | tokens | mode | variant | MB read | µs | graph µs | graph % copy | same bits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['tokens']} | {r['mode']} | {r['variant']} | {r['read_mb']:.1f} | {r['us']:.1f} "
              f"| {r['graph_us']:.1f} | {r['graph_pct_copy']:.0f}% | {r['identical_to_first']} |")  # fmt: skip
    return {"variants": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="first shape only")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs; report the fastest")
    parser.add_argument("--json", default=None, help="write all results here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU under TRITON_INTERPRET=1")
    parser.add_argument("--variants", default=None,
                        help=f"compare kernel variants only: {','.join(VARIANTS)} or cfg:key=value,... "
                        "(see variant_config), separated by ';'")  # fmt: skip
    parser.add_argument("--tokens", default=None, help="batch sizes, e.g. 1,16,64 (default 1,16,64,4096)")
    parser.add_argument("--modes", default="W4A16,W4A4", help="with --variants: W4A16, W4A4 or both")
    args = parser.parse_args()
    global DEVICE, TOKENS
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.smoke:
        DEVICE, TOKENS = "cpu", (1, 40)
        shapes = [("tiny", (8, 64, 32, 2))]
        device_name, copy_bw = "cpu (smoke)", 1e10
    else:
        shapes = list(SHAPES.items())[:1] if args.quick else list(SHAPES.items())
        device_name, copy_bw = torch.cuda.get_device_name(), copy_bandwidth()
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    precision = f"{torch.get_float32_matmul_precision()}, allow_tf32 {torch.backends.cuda.matmul.allow_tf32}"
    print(f"device {device_name}  copy bandwidth {copy_bw / 1e12:.2f} TB/s  fp32 matmul {precision}", flush=True)
    if args.tokens:
        TOKENS = tuple(int(t) for t in args.tokens.split(","))
    fast = probe_fast_dequant(generator)
    if args.variants:
        parts = args.variants.split(";")
        names = [n for part in parts for n in ([part] if part.startswith("cfg:") else part.split(","))]
        unknown = [n for n in names if n not in VARIANTS and n != "read-floor" and not n.startswith("cfg:")]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
        results = {"device": device_name, "copy_bw": copy_bw, "fast_dequant": fast,
                   **compare_variants(shapes, TOKENS, names, generator, copy_bw, args.modes.split(","))}  # fmt: skip
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=1)
        return
    results = {"device": device_name, "copy_bw": copy_bw, "fast_dequant": fast, "checks": [], "timings": []}
    for name, (num_experts, hidden_size, inter_size, top_k) in shapes:
        started = time.time()
        w13 = random_experts(num_experts, 2 * inter_size, hidden_size, generator)
        w2 = random_experts(num_experts, hidden_size, inter_size, generator)
        checks, divisors = check_correctness(name, w13, w2, hidden_size, top_k, generator, fast)
        results["checks"] += checks
        per_expert = expert_bytes(w13, w2)
        spec = RoutingSpec("softmax_topk", num_experts, top_k)
        weights16 = TritonMoeWeights.from_nvfp4(w13, w2, device=DEVICE)
        weights4 = TritonMoeWeights.from_nvfp4(w13, w2, divisors, device=DEVICE)
        for tokens in TOKENS:
            hidden = torch.randn(tokens, hidden_size, device=DEVICE, generator=generator).to(torch.bfloat16)
            weights, ids = route(torch.randn(tokens, num_experts, device=DEVICE, generator=generator), spec)
            touched = int(torch.unique(ids).numel())
            read_bytes = touched * per_expert
            # what fused_moe runs by default first; --sweep also times the candidates and reports the fastest
            default = default_config(tokens * top_k, num_experts, top_k)
            candidates = [default]
            if args.sweep:
                sweep = DECODE_CANDIDATES if tokens * top_k <= 16 * num_experts else PREFILL_CANDIDATES
                candidates += [c for c in sweep if c != default]
            if not fast:
                candidates = list(dict.fromkeys(replace(c, fast_dequant=False) for c in candidates))

            def runner(cfg, moe_weights=weights16, hidden=hidden, weights=weights, ids=ids, spec=spec):
                return lambda: fused_moe(hidden, weights, ids, moe_weights, spec, config=cfg)

            def torch_loop(hidden=hidden, weights=weights, ids=ids, w13=w13, w2=w2):
                return torch_dequant_moe(hidden, weights, ids, w13, w2)

            cfg, _, trials = best_config(runner, candidates)
            torch_ms = time_ms(torch_loop, rep=300)
            read_only_ms = time_ms(read_floor(touched * expert_bytes(w13), touched * expert_bytes(w2)), graph=True)
            for mode, moe_weights in (("W4A16", weights16), ("W4A4", weights4)):
                ms = time_ms(runner(cfg, moe_weights))
                graph_ms = time_ms(runner(cfg, moe_weights), graph=True)
                row = {
                    "shape": name, "tokens": tokens, "mode": mode, "touched_experts": touched,
                    "read_mb": read_bytes / 1e6, "us": ms * 1e3, "graph_us": graph_ms * 1e3,
                    "gbps": read_bytes / (ms * 1e-3) / 1e9, "graph_gbps": read_bytes / (graph_ms * 1e-3) / 1e9,
                    "pct_copy": 100 * read_bytes / (ms * 1e-3) / copy_bw,
                    "graph_pct_copy": 100 * read_bytes / (graph_ms * 1e-3) / copy_bw,
                    "floor_us": read_bytes / copy_bw * 1e6, "read_only_graph_us": read_only_ms * 1e3,
                    "torch_us": torch_ms * 1e3,
                    "speedup": torch_ms / ms, "config": asdict(cfg), "trials": trials if mode == "W4A16" else [],
                }  # fmt: skip
                results["timings"].append(row)
                print("time", json.dumps({k: v for k, v in row.items() if k != "trials"}), flush=True)
        print(f"{name} done in {time.time() - started:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    print_tables(results)


def print_tables(results: dict) -> None:
    print(f"\ncopy bandwidth {results['copy_bw'] / 1e12:.2f} TB/s (bytes read + written)")
    print("\n| shape | tokens | routing | mode | rel L2 err | max abs err / max abs |")
    print("|---|---|---|---|---|---|")
    for row in results["checks"]:
        print(f"| {row['shape']} | {row['tokens']} | {row['routing']} | {row['mode']} | {row['rel_l2']:.2e} "
              f"| {row['max_abs_rel']:.2e} |")  # fmt: skip
    print("\n| shape | tokens | mode | experts | MB read | floor µs | read-only graph µs | µs | GB/s | % copy "
          "| graph µs | graph % copy | torch µs | speedup | config (KernelConfig fields in order) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results["timings"]:
        cfg = row["config"]
        cfg_text = ",".join(str(int(v) if isinstance(v, bool) else v) for v in cfg.values())
        print(f"| {row['shape']} | {row['tokens']} | {row['mode']} | {row['touched_experts']} | {row['read_mb']:.1f} "
              f"| {row['floor_us']:.1f} | {row['read_only_graph_us']:.1f} | {row['us']:.1f} | {row['gbps']:.0f} "
              f"| {row['pct_copy']:.0f}% "
              f"| {row['graph_us']:.1f} | {row['graph_pct_copy']:.0f}% | {row['torch_us']:.0f} "
              f"| {row['speedup']:.1f}x | {cfg_text} |")  # fmt: skip


if __name__ == "__main__":
    main()

"""vLLM's Marlin NVFP4 MoE kernel on fp4kit's checkpoints, on a GPU without vLLM's wheel (docs/verify.md).

    python scripts/device_vllm_marlin_moe.py (--ops LIB.so | --src VLLM_SRC --build-out DIR) [--json OUT]
        [--families qwen3_moe,...] [--tokens 1,16,256] [--skip-matrix] [--skip-bench] [--bench-families [F,...]]

1. Loads the ops `scripts/device_build_vllm_marlin_moe.py` builds from vLLM 0.33's source (building them first
   with ``--src``), through ``FP4KIT_VLLM_MARLIN_OPS`` as `fp4kit verify` does.
2. Per family (fp4kit.testing.fixtures, H = 128 so the Marlin tiles fit), per dialect (compressed-tensors, ModelOpt),
   W4A16 and calibrated W4A4 checkpoints (the W4A4 ones served weight-only, as vLLM serves them on Hopper):
   `verify --backend auto --mode w4a16 --device cuda` with EP 2 and EP 4 splits (``ep-kernel``: each rank through
   Marlin with vLLM's expert_map), NaN/Inf router rows included (``routing``).
3. Planted defects (gate/up swapped, w2's global scale off by 2, the expert map shifted by one): each must fail.
4. Tokens/s of Marlin and fp4kit's Triton kernel on the same weights at 1, 16, 256 tokens (CUDA-event medians of
   ``triton.testing.do_bench``): a fixture layer and a Qwen3-30B-A3B-sized layer (E 128, H 2048, I 768, top-8).
5. ``--bench-families``: the same per family, on one MoE layer of the family's published model's shapes (experts,
   hidden, expert intermediate, top-k, routing and activation from the family's own code, random NVFP4 weights).
Prints a table per part; exit 1 when a check fails or a planted defect passes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

FAMILY_SHAPES = {"hidden_size": 128}  # Marlin's down GEMM needs H % 128; the stand-ins' I = 64 fits its k % 64
DEFECTS = ("gate/up swapped", "global scale off by 2", "expert map shifted")


def load_ops(args: argparse.Namespace) -> str:
    from fp4kit.verify.vllm_marlin import OPS_LIBRARY_ENV, find_ops

    library = args.ops
    if library is None:
        sys.path.insert(0, str(Path(__file__).parent))
        from device_build_vllm_marlin_moe import build

        library = build(args.src, args.build_out, os.cpu_count() or 8, verbose=False)
    os.environ[OPS_LIBRARY_ENV] = str(library)
    ops, reason = find_ops()
    if ops is None:
        raise SystemExit(f"ops not usable: {reason}")
    return reason


def stand_in(family: str) -> dict:
    from fp4kit.testing.fixtures import RECIPE_STAND_INS

    return RECIPE_STAND_INS.get(family, RECIPE_STAND_INS.get(family.removesuffix("_text"), {})) | FAMILY_SHAPES


def worst(results: list[dict], check: str, target: str) -> tuple[float | None, int, int]:
    rows = [r for r in results if r["check"] == check and r["target"].startswith(target)]
    errors = [r["error"] for r in rows if r["error"] is not None]
    return (max(errors) if errors else None), sum(r["status"] == "passed" for r in rows), len(rows)


def matrix(families: list[str], tokens: list[int], root: Path) -> tuple[list[dict], int]:
    from fp4kit.ep.shard import ShardOptions, shard_checkpoint
    from fp4kit.errors import Fp4kitError
    from fp4kit.quantize.checkpoint import QuantizeOptions, quantize_checkpoint
    from fp4kit.testing.fixtures import build_fixture, streams_layers
    from fp4kit.verify.checks import VerifyOptions
    from fp4kit.verify.runner import verify_checkpoint

    rows, failed = [], 0
    for family in families:
        bf16 = build_fixture(family, root / f"{family}-bf16", overrides=stand_in(family))
        for dialect in ("compressed-tensors", "modelopt"):
            # W4A4 calibrates through the family's streamed decoder layers
            for scheme in ("nvfp4a16", "nvfp4") if streams_layers(family) else ("nvfp4a16",):
                start = time.perf_counter()
                ckpt = root / f"{family}-{dialect}-{scheme}"
                quantize_checkpoint(bf16, ckpt, QuantizeOptions(scheme=scheme, format=dialect, device="cuda",
                                                                samples=16, seq_len=64))
                results: list[dict] = []
                notes = []
                for ep in (2, 4):
                    shards: Path | None = root / f"{ckpt.name}-ep{ep}"
                    try:
                        shard_checkpoint(ckpt, shards, ShardOptions(ep=ep))
                    except Fp4kitError as exc:  # e.g. ModelOpt's fused Llama-4 experts: `shard` refuses them
                        notes.append(f"EP {ep}: not shardable: {exc}"[:200])
                        shards = None
                    options = VerifyOptions(tokens=tokens if ep == 2 else [max(tokens)], backend="auto",
                                            device="cuda", mode="w4a16", ep_shards=shards)
                    report = verify_checkpoint(ckpt, options)
                    results += [vars(r) | {"ep": ep} for r in report.results]
                    statuses = {s.name: (s.ran, s.reason) for s in report.backends}
                bad = [r for r in results if r["status"] == "failed"]
                failed += len(bad)
                for r in bad:
                    print(f"FAIL {family} {dialect} {scheme}: {r}")
                rows.append({"family": family, "dialect": dialect, "scheme": scheme, "results": results,
                             "backends": statuses, "notes": notes, "seconds": round(time.perf_counter() - start, 1)})
    print("\n| family | dialect | checkpoint | marlin kernel (worst, passed/run) | triton kernel | "
          "marlin EP 2 / EP 4 ep-kernel | marlin NaN/Inf rows | all checks | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        res = row["results"]
        m, mp, mn = worst(res, "kernel", "marlin")
        t, tp, tn = worst(res, "kernel", "triton")
        ep = [worst([r for r in res if r["ep"] == n], "ep-kernel", "marlin") for n in (2, 4)]
        _, rp, rn = worst(res, "routing", "marlin")
        passed = sum(r["status"] == "passed" for r in res)
        print(f"| {row['family']} | {row['dialect']} | {'W4A4 as W4A16' if row['scheme'] == 'nvfp4' else 'W4A16'} "
              f"| {_e(m)} ({mp}/{mn}) | {_e(t)} ({tp}/{tn}) | {_e(ep[0][0])} / {_e(ep[1][0])} "
              f"({ep[0][1] + ep[1][1]}/{ep[0][2] + ep[1][2]}) | {rp}/{rn} | {passed}/{len(res)} | {row['seconds']} |")
    for row in rows:
        for note in row["notes"]:
            print(f"note ({row['family']} {row['dialect']} {row['scheme']}): {note}")
    return rows, failed


def _rate(tokens: int, ms: float | None) -> str:
    return "-" if ms is None else f"{tokens / (ms / 1e3):,.0f} ({ms:.3f})"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def _e(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def planted(root: Path, tokens: list[int]) -> tuple[list[dict], int]:
    """Each defect through the real kernel: the check meant to catch it must fail."""
    from fp4kit.ep.shard import ShardOptions, shard_checkpoint
    from fp4kit.layouts import marlin
    from fp4kit.nvfp4 import NVFP4Tensor
    from fp4kit.quantize.checkpoint import quantize_checkpoint
    from fp4kit.testing.fixtures import build_fixture
    from fp4kit.verify import vllm_marlin
    from fp4kit.verify.checks import VerifyOptions
    from fp4kit.verify.runner import verify_checkpoint

    bf16 = build_fixture("qwen3_moe", root / "defect-bf16", overrides=stand_in("qwen3_moe"))
    ckpt = root / "defect-nvfp4a16"
    quantize_checkpoint(bf16, ckpt)
    shard_checkpoint(ckpt, root / "defect-ep2", ShardOptions(ep=2))
    transform, expert_map_of = marlin.transform, vllm_marlin.expert_map_of

    def swap_gate_up(w13, w2, *args, **kwargs):
        half = w13.packed.shape[1] // 2
        order = torch.cat([torch.arange(half, 2 * half), torch.arange(half)])
        swapped = NVFP4Tensor(w13.packed[:, order], w13.block_scale[:, order], w13.global_scale_div)
        return transform(swapped, w2, *args, **kwargs)

    def doubled_scale(*args, **kwargs):
        tensors = transform(*args, **kwargs)
        return {**tensors, "global_scale2": tensors["global_scale2"] * 2}

    rows, missed = [], 0
    for defect in DEFECTS:
        if defect == "gate/up swapped":
            marlin.transform = swap_gate_up
        elif defect == "global scale off by 2":
            marlin.transform = doubled_scale
        else:
            vllm_marlin.expert_map_of = lambda *a: expert_map_of(*a).roll(1)
        try:
            report = verify_checkpoint(ckpt, VerifyOptions(tokens=tokens, backend="marlin", device="cuda",
                                                           ep_shards=root / "defect-ep2"))
        finally:
            marlin.transform, vllm_marlin.expert_map_of = transform, expert_map_of
        check = "ep-kernel" if defect == "expert map shifted" else "kernel"
        caught = [r for r in report.results if r.check == check and r.target.startswith("marlin")]
        ok = bool(caught) and all(r.failed for r in caught)
        missed += not ok
        rows.append({"defect": defect, "check": check, "caught": ok,
                     "errors": [r.error for r in caught], "failed": sum(r.failed for r in caught), "run": len(caught)})
    print("\n| planted defect | check | failed / run | error (min..max) |")
    print("|---|---|---|---|")
    for row in rows:
        errors = [e for e in row["errors"] if e is not None]
        span = f"{min(errors):.2f}..{max(errors):.2f}" if errors else "crashed"
        print(f"| {row['defect']} | {row['check']} | {row['failed']}/{row['run']} | {span} |")
    return rows, missed


def bench_layers(root: Path):
    from fp4kit.families.routing import RoutingSpec
    from fp4kit.nvfp4 import NVFP4Tensor, quantize_group
    from fp4kit.verify.moe_layer import QuantizedModel

    with QuantizedModel(root / "qwen3_moe-compressed-tensors-nvfp4a16") as model:
        moe = model.layer(1)
        yield "qwen3_moe fixture (E 8, H 128, I 64, top-2)", moe.w13, moe.w2, model.spec
    generator = torch.Generator(device="cuda").manual_seed(0)

    def stacked(experts: int, rows: int, cols: int) -> NVFP4Tensor:
        parts = [quantize_group([(0.02 * torch.randn(rows, cols, device="cuda", generator=generator))
                                 .to(torch.bfloat16)])[0] for _ in range(experts)]
        return NVFP4Tensor(*(torch.stack([getattr(p, field) for p in parts]).cpu()
                             for field in ("packed", "block_scale", "global_scale_div")))

    spec = RoutingSpec("softmax_topk", 128, 8)
    yield "Qwen3-30B-A3B size (E 128, H 2048, I 768, top-8)", stacked(128, 1536, 2048), stacked(128, 2048, 768), spec


def graph_ms(run, batch) -> float | None:
    """Median of CUDA-graph replays of one call: the GPU's time without the Python and launch cost per call (as
    vLLM serves decode batches); None when the call cannot be captured."""
    import triton.testing

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                run(*batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(*batch)
        return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    except Exception as exc:
        print(f"no CUDA graph: {exc!r}"[:200])
        return None


def bench(root: Path, tokens: list[int]) -> list[dict]:
    import triton.testing

    from fp4kit.families.routing import route
    from fp4kit.layouts import StackedExperts
    from fp4kit.verify.backends import BACKENDS, dequantized
    from fp4kit.verify.checks import relative_error
    from fp4kit.verify.moe_layer import QuantizedMoe, Router
    from fp4kit.verify.reference import moe_reference

    device = torch.device("cuda")
    rows = []
    for name, w13, w2, spec in bench_layers(root):
        router = Router(torch.zeros(spec.num_experts, w13.packed.shape[2] * 2), None)  # routing is given below
        moe = QuantizedMoe(1, "bench", StackedExperts(w13, w2, None, None), router, None)
        runners = {b: BACKENDS[b].prepare(moe, spec, None, device) for b in ("marlin", "triton")}
        dense = dequantized(moe, device)
        generator = torch.Generator(device="cuda").manual_seed(1)
        for count in tokens:
            hidden = torch.randn(count, w13.packed.shape[2] * 2, device="cuda", generator=generator)
            hidden = hidden.to(torch.bfloat16).float()
            logits = torch.randn(count, spec.num_experts, device="cuda", generator=generator)
            weights, ids = route(logits, spec)
            expected = moe_reference(hidden, weights, ids, *dense, spec)
            row = {"layer": name, "tokens": count}
            for backend, run in runners.items():
                error = relative_error(run(hidden, weights, ids, logits), expected)
                batch = (hidden, weights, ids, logits)
                ms = triton.testing.do_bench(lambda run=run, batch=batch: run(*batch), warmup=25, rep=200,
                                             return_mode="median")
                row[backend] = {"error": error, "ms": ms, "tokens_per_s": count / (ms / 1e3),
                                "graph_ms": graph_ms(run, batch)}
            rows.append(row)
    print("\n| layer | tokens | Marlin tokens/s (ms) | Triton tokens/s (ms) | Marlin / Triton | graph replay: "
          "Marlin tokens/s (ms) | Triton tokens/s (ms) | Marlin / Triton | Marlin err | Triton err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, t, count = r["marlin"], r["triton"], r["tokens"]
        print(f"| {r['layer']} | {count} | {_rate(count, m['ms'])} | {_rate(count, t['ms'])} | "
              f"{t['ms'] / m['ms']:.2f}x | {_rate(count, m['graph_ms'])} | {_rate(count, t['graph_ms'])} | "
              f"{_ratio(t['graph_ms'], m['graph_ms'])} | {m['error']:.2e} | {t['error']:.2e} |")
    return rows


# One MoE layer of each family's published model (the recipes' headers): text-config keys as the family reads them.
PUBLISHED_LAYERS = {
    "qwen3_moe": ("Qwen3-30B-A3B", {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128,
                                    "num_experts_per_tok": 8}),
    "qwen3_vl_moe": ("Qwen3-VL-235B-A22B", {"hidden_size": 4096, "moe_intermediate_size": 1536, "num_experts": 128,
                                            "num_experts_per_tok": 8}),
    "glm4_moe": ("GLM-4.5-Air", {"hidden_size": 4096, "moe_intermediate_size": 1408, "n_routed_experts": 128,
                                 "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1}),
    "glm4v_moe": ("GLM-4.5V", {"hidden_size": 4096, "moe_intermediate_size": 1408, "n_routed_experts": 128,
                               "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1}),
    "llama4": ("Llama-4-Scout", {"hidden_size": 5120, "intermediate_size": 8192, "num_local_experts": 16,
                                 "num_experts_per_tok": 1}),
    "llama4_text": ("Llama-4-Scout", {"hidden_size": 5120, "intermediate_size": 8192, "num_local_experts": 16,
                                      "num_experts_per_tok": 1}),
    "deepseek_v3": ("DeepSeek-V3", {"hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                                    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                                    "routed_scaling_factor": 2.5}),
    "deepseek_v32": ("DeepSeek-V3.2", {"hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                                       "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                                       "routed_scaling_factor": 2.5}),
    "glm4_moe_lite": ("GLM-4.7-Flash", {"hidden_size": 2048, "moe_intermediate_size": 1536, "n_routed_experts": 64,
                                        "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1,
                                        "routed_scaling_factor": 1.8}),
    "glm_moe_dsa": ("GLM-5.1", {"hidden_size": 6144, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                                "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
                                "routed_scaling_factor": 2.5}),
    "qwen3_next": ("Qwen3-Next-80B-A3B", {"hidden_size": 2048, "moe_intermediate_size": 512, "num_experts": 512,
                                          "num_experts_per_tok": 10}),
    "qwen3_5_moe": ("Qwen3.6-35B-A3B", {"hidden_size": 2048, "moe_intermediate_size": 512, "num_experts": 256,
                                        "num_experts_per_tok": 8}),
    "qwen3_5_moe_text": ("Qwen3.6-35B-A3B", {"hidden_size": 2048, "moe_intermediate_size": 512, "num_experts": 256,
                                             "num_experts_per_tok": 8}),
    "minimax_m2": ("MiniMax-M2.5", {"hidden_size": 3072, "intermediate_size": 1536, "num_local_experts": 256,
                                    "num_experts_per_tok": 8}),
    "gpt_oss": ("gpt-oss-120b", {"hidden_size": 2880, "intermediate_size": 2880, "num_local_experts": 128,
                                 "num_experts_per_tok": 4}),
    "deepseek_v4": ("DeepSeek-V4-Flash", {"hidden_size": 4096, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                                          "num_experts_per_tok": 6, "routed_scaling_factor": 1.5}),
}


def random_nvfp4(experts: int, rows: int, cols: int, generator: torch.Generator):
    """Random E2M1 codes and FP8 block scales in [0.25, 1.75) on the GPU: a real-sized layer without quantizing."""
    from fp4kit.nvfp4 import NVFP4Tensor

    packed = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, device="cuda", generator=generator)
    scale = torch.rand(experts, rows, cols // 16, device="cuda", generator=generator) * 1.5 + 0.25
    divisor = torch.full((experts,), 64.0, dtype=torch.float64, device="cuda")
    return NVFP4Tensor(packed, scale.to(torch.float8_e4m3fn), divisor)


def dequantize_per_expert(stack) -> torch.Tensor:
    """fp32 [E, N, K], one expert at a time: a DeepSeek-sized layer's whole-stack dequantization would need twice
    its 45 GB in temporaries."""
    from fp4kit.nvfp4 import NVFP4Tensor

    dense = torch.empty(stack.shape, dtype=torch.float32, device=stack.packed.device)
    for e in range(stack.shape[0]):
        dense[e] = NVFP4Tensor(stack.packed[e], stack.block_scale[e], stack.global_scale_div[e]).dequantize()
    return dense


def bench_families(families: list[str], tokens: list[int]) -> list[dict]:
    """Marlin and Triton per family on one layer of the published model's shapes: errors against the fp32 reference
    on the same weights, CUDA-graph replay times (the GPU's time per call, as vLLM serves decode batches)."""
    import transformers

    from fp4kit.families import detect
    from fp4kit.families.routing import route
    from fp4kit.layouts import StackedExperts
    from fp4kit.nvfp4 import NVFP4Tensor
    from fp4kit.testing.fixtures import fixture_spec
    from fp4kit.verify.backends import BACKENDS
    from fp4kit.verify.checks import relative_error
    from fp4kit.verify.moe_layer import QuantizedMoe, Router
    from fp4kit.verify.reference import moe_reference

    device = torch.device("cuda")
    rows = []
    for name in families:
        model, sizes = PUBLISHED_LAYERS[name]
        fixture = fixture_spec(name)
        config = getattr(transformers, fixture["config_class"])(**fixture["config"]).to_dict()
        family = detect(config)
        text_config = {**family.text_config(config), **sizes}
        spec, activation = family.routing(text_config), family.activation(text_config)
        experts, hidden = family.num_experts(text_config), int(text_config["hidden_size"])
        inter = family.moe_intermediate(text_config)
        generator = torch.Generator(device="cuda").manual_seed(0)
        w13, w2 = random_nvfp4(experts, 2 * inter, hidden, generator), random_nvfp4(experts, hidden, inter, generator)
        biases = None
        if activation.kind == "swiglu_oai":  # gpt-oss: the experts' biases are part of the layer
            biases = (0.1 * torch.randn(experts, 2 * inter, device="cuda", generator=generator),
                      0.1 * torch.randn(experts, hidden, device="cuda", generator=generator))
        router = Router(torch.zeros(experts, hidden), None)  # routing is given below
        dense = (dequantize_per_expert(w13), dequantize_per_expert(w2))
        w13, w2 = (NVFP4Tensor(t.packed.cpu(), t.block_scale.cpu(), t.global_scale_div.cpu()) for t in (w13, w2))
        moe = QuantizedMoe(1, "bench", StackedExperts(w13, w2, None, None), router, None, biases, activation)  # as read
        row_base = {"family": name, "model": model, "experts": experts, "hidden": hidden, "inter": inter,
                    "top_k": spec.top_k, "routing": spec.kind, "activation": activation.kind}
        runners, skipped = {}, {}
        for backend in ("marlin", "triton"):
            ok, why = BACKENDS[backend].available(device)
            fits, reason = BACKENDS[backend].fits(device, max(tokens), moe, spec) if ok else (False, why)
            try:
                if fits:
                    runners[backend] = BACKENDS[backend].prepare(moe, spec, None, device)
                else:
                    skipped[backend] = reason
            except Exception as exc:  # one family's failure is reported in its row, not the end of the run
                skipped[backend] = f"failed to prepare: {exc!r}"[:300]
        for count in tokens:
            hidden_states = torch.randn(count, hidden, device="cuda", generator=generator).to(torch.bfloat16).float()
            logits = torch.randn(count, experts, device="cuda", generator=generator)
            weights, ids = route(logits, spec)
            expected = moe_reference(hidden_states, weights, ids, *dense, spec, activation=activation, biases=biases)
            row = row_base | {"tokens": count, "skipped": skipped}
            batch = (hidden_states, weights, ids, logits)
            for backend, run in runners.items():
                try:
                    row[backend] = {"error": relative_error(run(*batch), expected), "graph_ms": graph_ms(run, batch)}
                except Exception as exc:
                    row["skipped"] = {**row["skipped"], backend: f"failed: {exc!r}"[:300]}
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
        del runners, dense, moe, w13, w2
        torch.cuda.empty_cache()
    print("\n| family | layer (E, H, I, top-k) | tokens | Marlin tokens/s (ms) | Triton tokens/s (ms) | "
          "Marlin / Triton | Marlin err | Triton err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, t, count = r.get("marlin"), r.get("triton"), r["tokens"]
        marlin = _rate(count, m["graph_ms"]) if m else f"skipped: {r['skipped'].get('marlin')}"
        triton = _rate(count, t["graph_ms"]) if t else f"skipped: {r['skipped'].get('triton')}"
        ratio = _ratio(t["graph_ms"], m["graph_ms"]) if m and t else "-"
        print(f"| {r['family']} | {r['model']} ({r['experts']}, {r['hidden']}, {r['inter']}, {r['top_k']}) | {count} "
              f"| {marlin} | {triton} | {ratio} | {_e(m and m['error'])} | {_e(t and t['error'])} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=Path, help="the library device_build_vllm_marlin_moe.py built")
    parser.add_argument("--src", type=Path, help="vLLM 0.33.0 source (or csrc) to build the ops from")
    parser.add_argument("--build-out", type=Path, default=Path("build/vllm-marlin-ops"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--families", help="comma-separated fixture names; default every family")
    parser.add_argument("--tokens", default="1,16,256")
    parser.add_argument("--skip-matrix", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--bench-families", nargs="?", const="", default=None,
                        help="per-family timings on published layer shapes (comma-separated; empty: every family)")
    args = parser.parse_args()
    if args.ops is None and args.src is None:
        parser.error("give --ops or --src")
    from fp4kit.testing.fixtures import FIXTURES

    print(f"ops: {load_ops(args)}; {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    families = args.families.split(",") if args.families else list(FIXTURES)
    out: dict[str, object] = {}
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if not args.skip_matrix:
            out["matrix"], failed = matrix(families, tokens, root)
            failures += failed
        out["defects"], missed = planted(root, [16, 256])
        failures += missed
        if not args.skip_bench:
            if args.skip_matrix:
                matrix(["qwen3_moe"], [16], root)
            out["bench"] = bench(root, tokens)
        if args.bench_families is not None:
            out["bench_families"] = bench_families(args.bench_families.split(",") if args.bench_families
                                                   else list(PUBLISHED_LAYERS), tokens)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    print(f"\n{'FAIL' if failures else 'PASS'}: {failures} failed checks or missed defects")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()

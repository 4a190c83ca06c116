"""Benchmark quantization quality: fp4kit's methods against llm-compressor's, by `fp4kit eval` on a trained model.

    python scripts/bench_quality.py [--model ../shared/refmodel/qwen3-moe-bytes] [--methods rtn,mse,mse+calib,gptq]
                                    [--schemes nvfp4a16,nvfp4] [--calib-samples 128] [--eval-samples 48]
                                    [--seq-len 512] [--skip-llmc | --llmc-only] [--llmc-methods M,...] [--no-check]
                                    [--json FILE] [--quantize-only | --scores-from FILE] [--workdir DIR]

Model: a small Qwen3-MoE trained on text (6 layers, 16 experts, byte vocabulary) with its own ``calib.jsonl`` and
held-out ``eval.jsonl`` (``input_ids`` windows of 512). Every row quantizes it in a process of its own (wall time
with the output's fsync, peak RSS, as scripts/bench_quantize.py times them), then scores the output with
``fp4kit.tools.evaluate`` on the first ``--eval-samples`` eval windows:

  fp4kit <method> <scheme>  python -m fp4kit quantize SRC DST --scheme S [--method M] [--calib calib.jsonl ...];
                            rtn is fp4kit's default (no --method); "+calib" gives a W4A16 method the calibration
                            windows; W4A4 and gptq always get them. A method that `fp4kit quantize` does not know
                            (no --method option) is skipped with a note.
  llmc rtn <scheme>         llm-compressor oneshot(QuantizationModifier(scheme NVFP4A16 | NVFP4)); NVFP4 calibrates
                            on the same windows (moe_calibrate_all_experts, its default)
  llmc gptq <scheme>        oneshot(GPTQModifier(scheme ...)) on the same windows
  llmc <m>-emse <scheme>    the same with weight_observer="nvfp4_expanded_mse" (llm-compressor 0.14's search over
                            1.8x down to 0.8x of each group's absmax, error exponent 2.4): rtn-emse (data-free in
                            W4A16), gptq-emse, awq+gptq-emse (AWQModifier, its default mappings, then GPTQModifier)

Independent check (unless --no-check): each compressed-tensors output is also dequantized, in float32, by
compressed-tensors' own NVFP4 unpack and dequantize functions into transformers' whole model (its own loader for the
source, weights substituted in memory), W4A4 activations quantized by the few lines below (not fp4kit's code), and
the KL of that forward is printed beside `fp4kit eval`'s. The table gives each row's KL as a ratio to fp4kit RTN
of the same scheme in the same run. llm-compressor's GPTQ takes minutes on a CPU: --skip-llmc leaves its rows out,
--llmc-only runs only them (plus the fp4kit RTN anchors).

Each row records where it was quantized (host, CPU count, the 1-minute load average before and after, the GPU if
torch sees one) and the child's CPU seconds. Quantizing and scoring can run on different machines:
``--quantize-only --json times.json`` quantizes every row into --workdir and stops; ``--scores-from times.json``
then scores the outputs found in --workdir (copied from there) with the times recorded in the JSON, quantizing only
the rows the JSON does not have.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE.parent.parent / "shared" / "refmodel" / "qwen3-moe-bytes"
LLMC_IGNORE = ["lm_head", "re:.*mlp.gate$"]
SCHEMES = {"nvfp4a16": "NVFP4A16", "nvfp4": "NVFP4"}


@dataclass
class Row:
    label: str
    tool: str  # fp4kit or llmc
    method: str  # rtn, mse, mse+calib, gptq
    scheme: str
    seconds: float | None = None
    peak_rss_gb: float | None = None
    cpu_seconds: float | None = None
    where: str = ""  # host, CPUs, load average before -> after, GPU
    kl: float | None = None
    ce: float | None = None
    top1: float | None = None
    check_kl: float | None = None  # the independent whole-model forward's KL
    note: str = ""


def _bench_quantize():
    spec = importlib.util.spec_from_file_location("bench_quantize", HERE / "bench_quantize.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_quantize"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def read_windows(path: Path, count: int) -> list[list[int]]:
    rows = [json.loads(line)["input_ids"] for line in path.read_text().splitlines() if line.strip()]
    return rows[:count]


# ---------------------------------------------------------------------------------------------------------------
# Quantizing
# ---------------------------------------------------------------------------------------------------------------


def child_llmc(src: Path, dst: Path, calib: Path, method: str, scheme: str) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    base, _, observer = method.partition("-")
    kwargs = {"weight_observer": "nvfp4_expanded_mse"} if observer == "emse" else {}
    modifier = QuantizationModifier if base == "rtn" else GPTQModifier
    recipe = [modifier(targets="Linear", scheme=SCHEMES[scheme], ignore=LLMC_IGNORE, **kwargs)]
    if base.startswith("awq+"):
        from llmcompressor.modifiers.transform import AWQModifier

        recipe.insert(0, AWQModifier())
    if base == "rtn" and scheme == "nvfp4a16":  # data-free
        oneshot(model=model, recipe=recipe)
    else:
        ids = [json.loads(line)["input_ids"] for line in calib.read_text().splitlines() if line.strip()]
        dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]})
        oneshot(model=model, dataset=dataset, recipe=recipe, num_calibration_samples=len(ids),
                max_seq_length=len(ids[0]), moe_calibrate_all_experts=True)
    model.save_pretrained(str(dst), save_compressed=True)


def quantize_method_supported() -> bool:
    out = subprocess.run([sys.executable, "-m", "fp4kit", "quantize", "--help"], capture_output=True, text=True)
    return "--method" in out.stdout


def command(row: Row, src: Path, dst: Path, calib: Path, args: argparse.Namespace) -> list[str]:
    if row.tool == "llmc":
        return [sys.executable, str(Path(__file__).resolve()), "--child", row.method, row.scheme, str(src), str(dst),
                str(calib)]
    cmd = [sys.executable, "-m", "fp4kit", "quantize", str(src), str(dst), "--scheme", row.scheme, "--quiet"]
    method = row.method.removesuffix("+calib")
    if method != "rtn":
        cmd += ["--method", method]
    if row.scheme == "nvfp4" or row.method != method or method == "gptq":
        cmd += ["--calib", str(calib), "--samples", str(args.calib_samples), "--seq-len", str(args.seq_len)]
    return cmd


# ---------------------------------------------------------------------------------------------------------------
# The independent check: compressed-tensors' decompression, transformers' whole model, a few-line activation FP4
# ---------------------------------------------------------------------------------------------------------------

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fake_fp4(x, input_global_scale):
    """x quantized per 16-block with static multiplier G (compressed-tensors' input_global_scale) and dequantized:
    block scale fp8(amax / 6 * G), values rounded to the nearest E2M1 magnitude (ties to the even code)."""
    import torch

    blocks = x.float().unflatten(-1, (-1, 16))
    amax = blocks.abs().amax(-1, keepdim=True)
    g = input_global_scale.float()
    s = (amax / torch.tensor(6.0) * g).clamp(max=448).to(torch.float8_e4m3fn).float()
    divisor = s / g
    ratio = (blocks / torch.where(divisor > 0, divisor, torch.ones_like(divisor))).abs()
    grid = torch.tensor(E2M1, dtype=torch.float64)
    odd = torch.arange(len(E2M1)) % 2
    distance = (ratio.double().unsqueeze(-1) - grid).abs() + odd * 1e-12  # a tie goes to the even code
    values = grid[distance.argmin(-1)].float() * torch.sign(blocks)
    # (values * s) / g: the last bit of the product moves W4A4's KL by ~1% through later layers' roundings
    return torch.where(divisor > 0, values * s / g, torch.zeros_like(values)).flatten(-2).to(x.dtype)


def _w4a4_experts(experts, gate_up_g, down_g):
    import torch
    import torch.nn.functional as F

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(experts.gate_up_proj.shape[0]):
            tokens, slots = (top_k_index == e).nonzero(as_tuple=True)
            if tokens.numel() == 0:
                continue
            gate, up = F.linear(fake_fp4(hidden_states[tokens], gate_up_g[e]), experts.gate_up_proj[e]).chunk(2, -1)
            y = F.linear(fake_fp4(experts.act_fn(gate) * up, down_g[e]), experts.down_proj[e])
            out.index_add_(0, tokens, y * top_k_weights[tokens, slots, None])
        return out

    return forward


def independent_kl(src: Path, ckpt: Path, windows: list[list[int]], batch: int) -> float:
    """KL(source || checkpoint) per token from transformers' whole Qwen3-MoE models in float32, the checkpoint's
    weights unpacked and dequantized by compressed-tensors' own functions (in float32: its NVFP4 compressor's
    decompress rounds to bf16)."""
    import torch
    import torch.nn.functional as F
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(config).config_groups["group_0"]
    tensors = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    input_g: dict[str, torch.Tensor] = {}
    quantized = {k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")}
    with torch.no_grad():
        # tensors stored unquantized come from the checkpoint too: AWQ folds its scales into the norms and the router
        for name, tensor in tensors.items():
            if name.rpartition(".")[0] not in quantized:
                params[name].copy_(tensor.float())
        for name in [k for k in tensors if k.endswith(".weight_packed")]:
            module = name.removesuffix(".weight_packed")
            packed = tensors[name]
            weight = dequantize(unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, torch.float32),
                                tensors[f"{module}.weight_scale"].float(), args=scheme.weights, dtype=torch.float32,
                                global_scale=tensors[f"{module}.weight_global_scale"])
            if f"{module}.input_global_scale" in tensors:
                input_g[module] = tensors[f"{module}.input_global_scale"].reshape(())
            parent, proj = module.rsplit(".", 1)
            experts, _, e = parent.rpartition(".")
            if e.isdigit():  # transformers holds experts fused: gate_up_proj [E, 2I, H] = [gate; up], down [E, H, I]
                fused = params[f"{experts}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][int(e)]
                first = weight.shape[0] if proj == "up_proj" else 0
                fused[first : first + weight.shape[0]] = weight
            else:
                params[f"{module}.weight"].copy_(weight)
        for name, sub in model.named_modules():
            if isinstance(sub, torch.nn.Linear) and name in input_g:
                sub.register_forward_pre_hook(lambda m, a, g=input_g[name]: (fake_fp4(a[0], g), *a[1:]))
            if hasattr(sub, "gate_up_proj") and f"{name}.0.gate_proj" in input_g:
                count = sub.gate_up_proj.shape[0]
                sub.forward = _w4a4_experts(sub, [input_g[f"{name}.{e}.gate_proj"] for e in range(count)],
                                            [input_g[f"{name}.{e}.down_proj"] for e in range(count)])
    total, tokens = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(windows), batch):
            ids = torch.tensor(windows[start : start + batch])
            p, q = (F.log_softmax(m(input_ids=ids).logits[:, :-1].float(), -1) for m in (source, model))
            total += float((p.exp() * (p - q)).sum())
            tokens += ids.shape[0] * (ids.shape[1] - 1)
    return total / tokens


# ---------------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------------


def plan_rows(args: argparse.Namespace) -> list[Row]:
    rows = []
    methods = ["rtn"] if args.llmc_only else [m for m in args.methods.split(",") if m]  # "" for none
    for scheme in args.schemes.split(","):
        for method in methods:
            if method == "mse+calib" and scheme == "nvfp4":
                continue  # W4A4 calibrates anyway: the same as mse
            rows.append(Row(f"fp4kit {method} {scheme}", "fp4kit", method, scheme))
        if not args.skip_llmc:
            rows += [Row(f"llmc {m} {scheme}", "llmc", m, scheme) for m in args.llmc_methods.split(",")]
    return rows


def host() -> str:
    import torch

    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    return f"{platform.node()}, {os.cpu_count()} CPUs{gpu}"


def quantize_row(row: Row, bq, src: Path, calib: Path, args: argparse.Namespace) -> bool:
    dst = args.workdir / row.label.replace(" ", "-")
    shutil.rmtree(dst, ignore_errors=True)
    log = args.workdir / f"{dst.name}.log"
    bq.warm_page_cache(src)
    load_before = os.getloadavg()[0]
    try:
        run = bq.time_process(command(row, src, dst, calib, args), dst, log)
    except RuntimeError as exc:
        row.note = f"quantize failed (log {log})"
        print(f"  {row.label}: FAILED\n{exc}", flush=True)
        return False
    row.seconds, row.peak_rss_gb, row.cpu_seconds = run.seconds, run.peak_rss_bytes / 1e9, run.cpu_seconds
    row.where = f"{host()}, load {load_before:.1f} -> {run.load_average:.1f}"
    print(f"  {row.label}: quantized in {row.seconds:.1f} s ({row.cpu_seconds:.1f} CPU s; {row.where})", flush=True)
    return True


def run_row(row: Row, bq, src: Path, calib: Path, token_ids, windows, args: argparse.Namespace,
            recorded: dict[str, dict]) -> None:
    from fp4kit.tools.evaluate import evaluate

    dst = args.workdir / row.label.replace(" ", "-")
    if row.label in recorded:
        for key in ("seconds", "peak_rss_gb", "cpu_seconds", "where"):
            setattr(row, key, recorded[row.label][key])
    elif not quantize_row(row, bq, src, calib, args):
        return
    if args.quantize_only:
        return
    result = evaluate(src, dst, token_ids, args.device, args.batch_size)
    row.kl, row.ce, row.top1 = result.kl, result.ce_quantized, result.top1
    args.ce_source = result.ce_source
    if not args.no_check:
        row.check_kl = independent_kl(src, dst, windows, args.batch_size)
    check = f", independent KL {row.check_kl:.5f}" if row.check_kl is not None else ""
    print(f"  {row.label}: {row.seconds:.1f} s, KL {row.kl:.5f}{check}, CE {row.ce:.4f}, top-1 {100 * row.top1:.2f}%",
          flush=True)


def table(rows: list[Row], ce_source: float | None) -> str:
    columns = ["checkpoint", "eval CE", "KL(bf16 ‖ q) per token", "KL, independent check", "top-1 agreement",
               "quantize wall s", "CPU s", "peak RSS GB", "KL vs fp4kit RTN", "quantized on"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    if ce_source is not None:
        lines.append(f"| bf16 source | {ce_source:.4f} | 0 | - | 1 |" + " - |" * (len(columns) - 5))
    anchors = {r.scheme: r.kl for r in rows if r.tool == "fp4kit" and r.method == "rtn" and r.kl is not None}
    for r in rows:
        if r.kl is None:
            done = f"quantized in {r.seconds:.1f} s, not scored" if r.seconds is not None else "not run"
            lines.append(f"| {r.label} | {r.note or done} |" + " |" * (len(columns) - 2))
            continue
        check = f"{r.check_kl:.5f}" if r.check_kl is not None else "-"
        ratio = f"{r.kl / anchors[r.scheme]:.2f}x" if anchors.get(r.scheme) else "-"
        lines.append(f"| {r.label} | {r.ce:.4f} | {r.kl:.5f} | {check} | {100 * r.top1:.2f}% | {r.seconds:.1f} | "
                     f"{r.cpu_seconds:.1f} | {r.peak_rss_gb:.2f} | {ratio} | {r.where} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--methods", default="rtn,mse,mse+calib,gptq", help="fp4kit methods, comma-separated ('' none)")
    parser.add_argument("--schemes", default="nvfp4a16,nvfp4")
    parser.add_argument("--calib-samples", type=int, default=128, help="windows of calib.jsonl for calibration")
    parser.add_argument("--eval-samples", type=int, default=48, help="windows of eval.jsonl to score")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8, help="eval batch size")
    parser.add_argument("--device", default="cpu", help="where fp4kit eval runs")
    parser.add_argument("--llmc-methods", default="rtn,gptq,rtn-emse,gptq-emse,awq+gptq-emse",
                        help="llm-compressor recipes, comma-separated")
    parser.add_argument("--skip-llmc", action="store_true", help="leave out llm-compressor's rows")
    parser.add_argument("--llmc-only", action="store_true", help="only llm-compressor's rows and fp4kit's RTN anchors")
    parser.add_argument("--no-check", action="store_true", help="skip the independent whole-model KL")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-bench-quality"))
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    stage = parser.add_mutually_exclusive_group()
    stage.add_argument("--quantize-only", action="store_true", help="quantize every row into --workdir, no scoring")
    stage.add_argument("--scores-from", type=Path,
                       help="a --json of a --quantize-only run: score its outputs in --workdir with its times")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        method, scheme, src, dst, calib = args.child
        child_llmc(Path(src), Path(dst), Path(calib), method, scheme)
        return
    import torch

    bq = _bench_quantize()
    src = args.model.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    calib = args.workdir / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": w}) + "\n"
                             for w in read_windows(src / "calib.jsonl", args.calib_samples)))
    windows = read_windows(src / "eval.jsonl", args.eval_samples)
    token_ids = torch.tensor(windows, dtype=torch.int64)
    args.ce_source = None
    rows = plan_rows(args)
    method_ok = quantize_method_supported()
    recorded = {}
    if args.scores_from:
        recorded = {r["label"]: r for r in json.loads(args.scores_from.read_text())["rows"] if r["seconds"] is not None}
    start = time.perf_counter()
    print(f"{src.name}: {len(rows)} rows, calibration {args.calib_samples} x {args.seq_len}, eval {len(windows)} x "
          f"{token_ids.shape[1]}", flush=True)
    for row in rows:
        if row.tool == "fp4kit" and row.method != "rtn" and not method_ok:
            row.note = "skipped: fp4kit quantize has no --method"
            print(f"  {row.label}: {row.note}", flush=True)
            continue
        run_row(row, bq, src, calib, token_ids, windows, args, recorded)
        if args.json:  # after every row: a long run's finished rows survive its interruption
            args.json.write_text(json.dumps({"ce_source": args.ce_source, "rows": [asdict(r) for r in rows]},
                                            indent=2))
    print(f"\n{time.perf_counter() - start:.0f} s in all\n")
    print(table(rows, args.ce_source))


if __name__ == "__main__":
    main()

"""Benchmark calibrated NVFP4: `fp4kit quantize --calib` against llm-compressor `oneshot`, RTN or GPTQ.

    python scripts/bench_calibrate.py --layers 2 [--model qwen3-30b-a3b|qwen3.6-35b-a3b|glm-5] [--experts E]
                                      [--samples 8] [--seq-len 128] [--device cpu|cuda] [--repeats 3]
                                      [--nproc N] [--method rtn|gptq] [--scheme nvfp4|nvfp4a16]

Source: the synthetic bf16 checkpoint of scripts/bench_quantize.py (fp4kit.testing.synthetic) with the model's
layer shapes (default Qwen3-30B-A3B's).
Calibration data: ``samples`` x ``seq-len`` seeded random token ids, written once to an ``input_ids`` jsonl that both
tools read, so both see exactly the same tokens:

  fp4kit   python -m fp4kit quantize SRC DST --scheme nvfp4 --calib ids.jsonl (layer-streaming calibration pass,
           then the weight pass; input scales shared per layer and projection, the default)
  oneshot  the class of config.json's architecture (bf16) + oneshot(QuantizationModifier(scheme="NVFP4", ignore =
           fp4kit's default ignores of the family), dataset = the same ids, moe_calibrate_all_experts=True, its
           default), save_pretrained(save_compressed=True)

``--method gptq`` runs `fp4kit quantize --method gptq` against llm-compressor's GPTQModifier (same scheme, same
ids); ``--scheme nvfp4a16`` compares weight-only quantization (RTN weight-only needs no calibration: use gptq).

Both are whole processes timed the way bench_quantize.py times them (median wall time incl. fsync of the output,
peak RSS from `/usr/bin/time -v`, CPU seconds of the child); ``--nproc N`` starts fp4kit under torchrun with N
ranks, as in bench_quantize.py. The targets: fp4kit >= 3x faster than
oneshot with <= 1/3 of its peak RSS. The report also prints, for layer 0, the ratio of the two tools' input global
scales for o_proj (llm-compressor's attention statistics lack the causal mask, so they differ) and
for an expert's gate/up (same function before the attention output matters, so close), in the first MoE layer.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLS = ("fp4kit", "oneshot")
LLMC_RECIPES = ("rtn", "gptq", "rtn-emse", "gptq-emse", "awq+gptq-emse")


def _bench_quantize():
    """scripts/bench_quantize.py: its process timing, page-cache warming, source builder and report helpers."""
    spec = importlib.util.spec_from_file_location("bench_quantize", HERE / "bench_quantize.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_quantize"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def child_oneshot(src: Path, dst: Path, calib: Path, device: str, recipe_name: str = "rtn",
                  scheme: str = "nvfp4") -> None:
    """oneshot with one of LLMC_RECIPES: rtn / gptq (the plain observer), rtn-emse / gptq-emse (llm-compressor's
    `nvfp4_expanded_mse` weight observer), awq+gptq-emse (its AWQModifier, default mappings, before that GPTQ)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    bq = _bench_quantize()
    ids = [json.loads(line)["input_ids"] for line in calib.read_text().splitlines() if line.strip()]
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]})
    model = bq.load_model(src, device)
    base, _, observer = recipe_name.partition("-")
    kwargs = {"weight_observer": "nvfp4_expanded_mse"} if observer == "emse" else {}
    modifier = QuantizationModifier if base == "rtn" else GPTQModifier
    recipe = [modifier(targets="Linear", scheme=scheme.upper(), ignore=bq.llmc_ignore(src), **kwargs)]
    if base.startswith("awq+"):
        from llmcompressor.modifiers.transform import AWQModifier

        recipe.insert(0, AWQModifier())
    oneshot(model=model, dataset=dataset, recipe=recipe, num_calibration_samples=len(ids),
            max_seq_length=len(ids[0]), moe_calibrate_all_experts=True, processor=_id_tokenizer(src))
    model.save_pretrained(str(dst), save_compressed=True)


def _id_tokenizer(src: Path):
    """The tokenizer of SRC; for a synthetic checkpoint, which has none, a stand-in (the dataset is token ids
    already: oneshot only asks the processor for padding, which equal-length samples never need)."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if any((src / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(str(src))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0}, unk_token="<pad>")),
                                   pad_token="<pad>")


def tool_command(bq, tool: str, src: Path, dst: Path, calib: Path, args: argparse.Namespace) -> list[str]:
    if tool == "fp4kit":
        return [*bq.fp4kit_launcher(args.nproc), "quantize", str(src), str(dst), "--scheme", args.scheme,
                "--method", args.method, "--calib",
                str(calib), "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--batch-size",
                str(args.batch_size), "--device", args.device, "--quiet",
                *(["--no-native"] if args.no_native else []), *args.fp4kit_args.split()]
    return [sys.executable, str(Path(__file__).resolve()), "--child", "--src", str(src), "--dst", str(dst),
            "--calib", str(calib), "--device", args.device, "--llmc-recipe", llmc_recipe(args), "--scheme",
            args.scheme]


def llmc_recipe(args: argparse.Namespace) -> str:
    return args.llmc_recipe or args.method


def write_calibration(path: Path, samples: int, seq_len: int, vocab_size: int) -> None:
    import torch

    ids = torch.randint(0, vocab_size, (samples, seq_len), generator=torch.Generator().manual_seed(0))
    path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids.tolist()))


def scale_ratios(ours: Path, theirs: Path) -> dict[str, float]:
    """fp4kit / oneshot input_global_scale for the first layer's quantized modules outside the routed experts and
    expert 0 of the first MoE layer."""
    from fp4kit.families import detect
    from fp4kit.families.base import layer_of
    from fp4kit.io.checkpoint import CheckpointReader, read_config

    grammar = detect(read_config(ours)).grammar
    with CheckpointReader(ours) as reader:
        modules = sorted(n.removesuffix(".input_global_scale") for n in reader.names()
                         if n.endswith(".input_global_scale"))
    first_moe = min((layer_of(m) for m in modules if grammar.split_expert(m)), default=None)
    first = min((layer_of(m) for m in modules if layer_of(m) is not None), default=None)
    names = [m for m in modules if (not grammar.split_expert(m) and layer_of(m) == first)
             or (layer_of(m) == first_moe and (grammar.split_expert(m) or (None, None))[1] == 0)]
    ratios = {}
    with CheckpointReader(ours) as a, CheckpointReader(theirs) as b:
        for name in names:
            key = f"{name}.input_global_scale"
            if key in a and key in b:
                ratios[name] = float(a.read(key).float()) / float(b.read(key).float())
    return ratios


def bench_tool(bq, tool: str, src: Path, calib: Path, args: argparse.Namespace):
    result = bq.ToolResult(tool)
    dst = args.workdir / f"out-calib-{tool}-{run_tag(args)}"
    for attempt in range(args.repeats):
        log = args.workdir / f"calib-{tool}-{attempt}.log"
        if not bq.timed_attempt(result, tool_command(bq, tool, src, dst, calib, args), src, dst, log, attempt,
                                args.repeats):
            break
    return result


def run_tag(args: argparse.Namespace) -> str:
    return f"{args.method}-{args.scheme}" + (f"-llmc-{args.llmc_recipe}" if args.llmc_recipe else "")


def table(results: list) -> str:
    columns = ["tool", "runs", "wall s", "CPU s", "peak RSS GB", "load", "speed vs oneshot", "RSS vs oneshot"]
    ref = next((r.median_run for r in results if r.ok and r.tool == "oneshot"), None)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in results:
        if not r.ok:
            lines.append(f"| {r.tool} | {r.note} |" + " |" * (len(columns) - 2))
            continue
        run = r.median_run
        speed = f"{ref.seconds / run.seconds:.2f}x" if ref else "-"
        rss = f"{run.peak_rss_bytes / ref.peak_rss_bytes:.2f}x" if ref else "-"
        lines.append(f"| {r.tool} | {len(r.runs)} | {run.seconds:.1f} | {run.cpu_seconds:.1f} | "
                     f"{run.peak_rss_bytes / 1e9:.2f} | {run.load_average:.1f} | {speed} | {rss} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the synthetic checkpoint")
    parser.add_argument("--model", default="qwen3-30b-a3b", help="whose layer shapes (bench_quantize.py's MODELS)")
    parser.add_argument("--experts", type=int, default=0, help="routed experts per layer (0: the model's)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="fp4kit's calibration batch size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-native", action="store_true", help="pass --no-native to fp4kit quantize")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=0, help="run fp4kit under torchrun with N ranks (0: plain)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-bench-calib"))
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--method", choices=("rtn", "gptq"), default="rtn")
    parser.add_argument("--fp4kit-args", default="", help="more `fp4kit quantize` options, one string")
    parser.add_argument("--llmc-recipe", choices=LLMC_RECIPES, default=None,
                        help="llm-compressor's recipe (default: --method with the plain observer)")
    parser.add_argument("--scheme", choices=("nvfp4", "nvfp4a16"), default="nvfp4")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--calib", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_oneshot(args.src, args.dst, args.calib, args.device, args.llmc_recipe, args.scheme)
        return
    bq = _bench_quantize()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = bq.build_source(args.workdir, args.layers, args.model, args.experts)
    from fp4kit.families import detect
    from fp4kit.io.checkpoint import read_config

    config = read_config(src)
    vocab_size = int(detect(config).text_config(config)["vocab_size"])
    calib = args.workdir / f"calib-{args.samples}x{args.seq_len}-{vocab_size}.jsonl"
    write_calibration(calib, args.samples, args.seq_len, vocab_size)
    input_bytes = bq.checkpoint_bytes(src)
    print(f"source: {src.name}, {input_bytes / 1e9:.2f} GB bf16; calibration {args.samples} x "
          f"{args.seq_len} tokens; device {args.device}; median of {args.repeats}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    tools = [t for t in TOOLS if t in args.tools.split(",")]
    results = [bench_tool(bq, tool, src, calib, args) for tool in tools]
    ok = {r.tool for r in results if r.ok}
    tag = run_tag(args)
    ratios = scale_ratios(args.workdir / f"out-calib-fp4kit-{tag}", args.workdir / f"out-calib-oneshot-{tag}") if (
        set(TOOLS) <= ok and args.scheme == "nvfp4") else {}
    report = {"args": {k: str(v) for k, v in vars(args).items() if k not in ("child", "src", "dst", "calib")},
              "environment": bq.environment(), "input_bytes": input_bytes, "input_scale_ratio_fp4kit_over_oneshot":
              ratios, "results": [asdict(r) for r in results]}
    suffix = f"-nproc{args.nproc}" if args.nproc else ""
    out = args.workdir / (f"calib-results-{src.name}-{args.samples}x{args.seq_len}-{args.device}-{tag}"
                          f"{suffix}.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\ninput_global_scale fp4kit / oneshot, layer 0: {json.dumps(ratios)}")
    print(f"\nfp4kit {args.method} {args.fp4kit_args}, llm-compressor {llmc_recipe(args)}, {args.scheme}: "
          f"{src.name}, {input_bytes / 1e9:.2f} GB bf16, {args.samples} x "
          f"{args.seq_len} calibration "
          f"tokens, device {args.device}, median of {args.repeats} (wall incl. fsync; load = 1-min load average):")
    print(table(results))
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()

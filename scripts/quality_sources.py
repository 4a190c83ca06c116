"""KL of NVFP4 quantized from an FP8-block source: one rounding (fp32 dequantization) against two (a bf16
intermediate, the peers' path), same run.

    python scripts/quality_sources.py [--model ../shared/refmodel/qwen3-moe-bytes] [--windows 128] [--workdir DIR]

Writes the model as DeepSeek's FP8-block files (fp4kit.io.sources.write_fp8_block_copy), quantizes that to NVFP4A16
with ``--dequant-dtype`` fp32 and bf16, and compares each output with the FP8 source's exact
values (its weights dequantized in fp32):

- weight space: the squared error of every quantized Linear's dequantized NVFP4 weight against the FP8 source's
  exact weight, summed over the model (MSE per element, and relative to the weights' mean square), how many Linears
  each path quantizes with the smaller error, and the share of 4-bit codes the two paths set differently;
- output space: the next-token distributions, in fp32 with transformers, on the first N held-out ``eval.jsonl``
  windows: mean KL(source || quantized) per token, and the per-window paired difference (bf16 - fp32) with its
  standard error, so a difference can be told from the spread between windows.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch


def dequantized_copy(src: Path, dst: Path) -> Path:
    """SRC (an FP8-block source or an NVFP4 compressed-tensors output) as a plain fp32 checkpoint."""
    from safetensors.torch import save_file

    from fp4kit.formats import compressed_tensors as ct
    from fp4kit.io.checkpoint import CheckpointReader, copy_side_files, read_config
    from fp4kit.io.sources import dequantize, detect_source

    dst.mkdir(parents=True, exist_ok=True)
    config = read_config(src)
    qc = config.pop("quantization_config", None) or {}
    tensors: dict[str, torch.Tensor] = {}
    with CheckpointReader(src) as reader:
        if qc.get("quant_method") == "fp8":
            source = detect_source({"quantization_config": qc}, {n: (i.dtype, i.shape) for n, i in
                                                                 reader.tensors.items()})
            consumed = source.consumed()
            for module, linear in source.linears.items():
                tensors[f"{module}.weight"] = dequantize(reader, linear, torch.float32)
            tensors.update({n: reader.read(n).float() for n in reader.names() if n not in consumed})
        else:
            packed = [n[: -len(".weight_packed")] for n in reader.names() if n.endswith(".weight_packed")]
            for module in packed:
                parts = {f"{module}.{p}": reader.read(f"{module}.{p}", check_finite=False)
                         for p in ("weight_packed", "weight_scale", "weight_global_scale")}
                tensors[f"{module}.weight"] = ct.decode(module, parts)[0].dequantize(torch.float32)
            suffixes = (".weight_packed", ".weight_scale", ".weight_global_scale")
            tensors.update({n: reader.read(n).float() for n in reader.names() if not n.endswith(suffixes)})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    copy_side_files(src, dst)
    config["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@torch.inference_mode()
def log_probs(model_dir: Path, windows: torch.Tensor) -> torch.Tensor:
    """[windows, tokens, vocab] next-token log-probabilities."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return torch.stack([torch.log_softmax(model(w[None]).logits[0].float(), -1) for w in windows])


def weight_space(exact_dir: Path, outputs: dict[str, Path], dequantized: dict[str, Path]) -> None:
    """Print, per mode, the squared error of the dequantized NVFP4 Linears against the FP8 source's exact weights,
    the Linears each mode quantizes with the smaller error, and the share of codes / block scales that differ."""
    from safetensors.torch import load_file

    from fp4kit.formats import compressed_tensors as ct
    from fp4kit.nvfp4 import _encode_with_scales, unpack_codes

    exact = load_file(exact_dir / "model.safetensors")
    found = {mode: load_file(path / "model.safetensors") for mode, path in dequantized.items()}
    packed = {mode: load_file(path / "model.safetensors") for mode, path in outputs.items()}
    modules = sorted(n.removesuffix(".weight_packed") for n in packed["fp32"] if n.endswith(".weight_packed"))
    sse = dict.fromkeys(outputs, 0.0)
    same_scale_sse = dict.fromkeys(outputs, 0.0)  # over the blocks whose fp8 scale both modes chose alike
    # the value rounding alone: bf16(exact weight) encoded with the fp32 output's own global and block scales
    rounded_sse = 0.0
    wins = dict.fromkeys([*outputs, "tie"], 0)
    elements, square = 0, 0.0
    codes_differ = scales_differ = blocks = 0
    for module in modules:
        weight = exact[f"{module}.weight"].double()
        errors = {mode: float((found[mode][f"{module}.weight"].double() - weight).square().sum()) for mode in outputs}
        for mode, error in errors.items():
            sse[mode] += error
        wins["tie" if errors["fp32"] == errors["bf16"] else min(errors, key=errors.__getitem__)] += 1
        elements += weight.numel()
        square += float(weight.square().sum())
        codes = [unpack_codes(packed[mode][f"{module}.weight_packed"]) for mode in ("fp32", "bf16")]
        codes_differ += int((codes[0] != codes[1]).sum())
        scales = [packed[mode][f"{module}.weight_scale"].view(torch.uint8) for mode in ("fp32", "bf16")]
        scales_differ += int((scales[0] != scales[1]).sum())
        same = (scales[0] == scales[1]).unsqueeze(-1)
        scaled = ct.decode(module, packed["fp32"])[0]
        global_mul = scaled.global_scale_mul_fp32.reshape(1, 1)
        rounded = _encode_with_scales(weight.float().bfloat16(), global_mul, scaled.block_scale.float(), torch.Size([]))
        rounded_sse += float((rounded.dequantize(torch.float64) - weight).square().sum())
        for mode in outputs:
            block_errors = (found[mode][f"{module}.weight"].double() - weight).square().unflatten(-1, (-1, 16))
            same_scale_sse[mode] += float((block_errors * same).sum())
        blocks += scales[0].numel()
    for mode in outputs:
        print(f"dequant {mode}: weight MSE vs the FP8 source {sse[mode] / elements:.6e} (relative "
              f"{sse[mode] / square:.6e}) over {len(modules)} Linears, {elements} weights")
    print(f"weight MSE bf16 / fp32: {sse['bf16'] / sse['fp32']:.5f}; smaller error per Linear: fp32 {wins['fp32']}, "
          f"bf16 {wins['bf16']}, tie {wins['tie']}; codes that differ {codes_differ / elements:.4%}, block scales "
          f"{scales_differ / blocks:.4%}")
    print(f"the bf16 rounding of the values alone (bf16 weights encoded with the fp32 output's scales): weight MSE "
          f"{rounded_sse / sse['fp32']:.5f} of the fp32 output's")
    print(f"over the {1 - scales_differ / blocks:.4%} of blocks whose scale both chose alike: weight MSE bf16 / fp32 "
          f"{same_scale_sse['bf16'] / same_scale_sse['fp32']:.5f}; over the others "
          f"{(sse['bf16'] - same_scale_sse['bf16']) / (sse['fp32'] - same_scale_sse['fp32']):.5f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(__file__).parents[2] / "shared/refmodel/qwen3-moe-bytes")
    parser.add_argument("--windows", type=int, default=128)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-quality-sources"))
    args = parser.parse_args()

    from fp4kit.io.sources import write_fp8_block_copy
    from fp4kit.quantize import checkpoint as quantize

    shutil.rmtree(args.workdir, ignore_errors=True)
    fp8 = write_fp8_block_copy(args.model, args.workdir / "fp8")
    modes = ("fp32", "bf16")
    for mode in modes:
        quantize.quantize_checkpoint(fp8, args.workdir / f"nvfp4-{mode}", quantize.QuantizeOptions(dequant_dtype=mode))
    outputs = {mode: args.workdir / f"nvfp4-{mode}" for mode in modes}
    exact = dequantized_copy(fp8, args.workdir / "fp8-fp32")
    dequantized = {mode: dequantized_copy(outputs[mode], args.workdir / f"nvfp4-{mode}-fp32") for mode in modes}
    weight_space(exact, outputs, dequantized)

    lines = (args.model / "eval.jsonl").read_text().splitlines()[: args.windows]
    windows = torch.tensor([json.loads(line)["input_ids"] for line in lines])
    reference = log_probs(exact, windows)
    kl = {}  # per window: mean over its tokens
    for mode in modes:
        found = log_probs(dequantized[mode], windows)
        kl[mode] = (reference.exp() * (reference - found)).sum(-1).mean(-1).double()
        del found
        print(f"dequant {mode}: KL(FP8 source || NVFP4A16) = {float(kl[mode].mean()):.6f} nats/token "
              f"({windows.numel()} tokens, {len(windows)} windows)")
    diff = kl["bf16"] - kl["fp32"]
    print(f"KL two roundings / one: {float(kl['bf16'].mean() / kl['fp32'].mean()):.4f}; paired difference bf16 - fp32 "
          f"{float(diff.mean()):+.6f} +- {float(diff.std() / len(diff) ** 0.5):.6f} (standard error), fp32 lower "
          f"in {int((diff > 0).sum())} of {len(diff)} windows")

    # the same comparison as `fp4kit eval FP8-SOURCE CKPT` makes it (positions with a next token, streamed by layer)
    from fp4kit.tools.evaluate import evaluate

    scored = {mode: evaluate(fp8, outputs[mode], windows) for mode in modes}
    for mode in modes:
        print(f"fp4kit eval fp8 nvfp4-{mode}: KL {scored[mode].kl:.6f} nats/token, CE {scored[mode].ce_quantized:.5f} "
              f"(source {scored[mode].ce_source:.5f}), top-1 {scored[mode].top1:.4%} ({scored[mode].tokens} tokens)")
    print(f"fp4kit eval KL two roundings / one: {scored['bf16'].kl / scored['fp32'].kl:.4f}")


if __name__ == "__main__":
    main()

"""KL of NVFP4 quantized from an FP8-block source: one rounding (fp32 dequantization) against two (a bf16
intermediate, the peers' path), same run.

    python scripts/quality_sources.py [--model ../shared/refmodel/qwen3-moe-bytes] [--windows 32] [--workdir DIR]

Writes the model as DeepSeek's FP8-block files (fp4kit.sources.write_fp8_block_copy), quantizes that to NVFP4A16
with ``dequant_dtype`` fp32 and bf16 (fp4kit.plan.build_plan), and compares each output's next-token distribution
with the FP8 source's own (its weights dequantized in fp32), in fp32 with transformers, on the first N held-out
``eval.jsonl`` windows: mean KL(source || quantized) per token. Prints both and their ratio (two / one).
"""

from __future__ import annotations

import argparse
import json
import shutil
from functools import partial
from pathlib import Path

import torch


def dequantized_copy(src: Path, dst: Path) -> Path:
    """SRC (an FP8-block source or an NVFP4 compressed-tensors output) as a plain fp32 checkpoint."""
    from safetensors.torch import save_file

    from fp4kit.checkpoint import CheckpointReader, copy_side_files, read_config
    from fp4kit.formats import compressed_tensors as ct
    from fp4kit.sources import dequantize, detect_source

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
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return torch.cat([torch.log_softmax(model(w[None]).logits[0].float(), -1) for w in windows])


def plan_with(dequant_dtype: str, *args, **kwargs):
    """fp4kit.plan.build_plan in ``dequant_dtype`` whatever quantize passes."""
    from fp4kit import plan

    return plan.build_plan(*args, **{**kwargs, "dequant_dtype": dequant_dtype})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(__file__).parents[2] / "shared/refmodel/qwen3-moe-bytes")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp4kit-quality-sources"))
    args = parser.parse_args()

    from fp4kit import quantize
    from fp4kit.sources import write_fp8_block_copy

    shutil.rmtree(args.workdir, ignore_errors=True)
    fp8 = write_fp8_block_copy(args.model, args.workdir / "fp8")
    outputs = {}
    for mode in ("fp32", "bf16"):
        quantize.build_plan = partial(plan_with, mode)
        outputs[mode] = quantize.quantize_checkpoint(fp8, args.workdir / f"nvfp4-{mode}").output_files
    lines = (args.model / "eval.jsonl").read_text().splitlines()[: args.windows]
    windows = torch.tensor([json.loads(line)["input_ids"] for line in lines])
    reference = log_probs(dequantized_copy(fp8, args.workdir / "fp8-fp32"), windows)
    kl = {}
    for mode in ("fp32", "bf16"):
        found = log_probs(dequantized_copy(args.workdir / f"nvfp4-{mode}", args.workdir / f"nvfp4-{mode}-fp32"),
                          windows)
        kl[mode] = float((reference.exp() * (reference - found)).sum(-1).mean())
        print(f"dequant {mode}: KL(FP8 source || NVFP4A16) = {kl[mode]:.6f} nats/token "
              f"({windows.numel()} tokens)")
    print(f"two roundings / one: {kl['bf16'] / kl['fp32']:.4f}")


if __name__ == "__main__":
    main()

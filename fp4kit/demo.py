"""`fp4kit demo`: the whole job on a tiny Qwen3-MoE built offline, in well under a minute on a CPU."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path


def run_demo(workdir: Path | None = None, device: str = "cpu") -> Iterator[str]:
    from fp4kit.checkpoint import CheckpointReader
    from fp4kit.fixtures import build_fixture
    from fp4kit.formats import compressed_tensors as ct
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    with tempfile.TemporaryDirectory(prefix="fp4kit-demo-") as tmp:
        root = Path(workdir) if workdir else Path(tmp)
        src = build_fixture("qwen3_moe", root / "tiny-qwen3-moe-bf16")
        yield f"built tiny Qwen3-MoE (seeded random weights) at {src}"
        dst = root / "tiny-qwen3-moe-nvfp4a16"
        report = quantize_checkpoint(src, dst, QuantizeOptions(device=device, overwrite=True))
        yield (
            f"quantized {report.quantized_linears} Linears to NVFP4A16 (compressed-tensors) in {report.seconds:.2f} s: "
            f"{report.input_bytes / 1e6:.2f} MB -> {report.output_bytes / 1e6:.2f} MB; kept in bf16: "
            f"{', '.join(report.ignored_modules[:3])}{' ...' if len(report.ignored_modules) > 3 else ''}"
        )
        worst = 0.0
        with CheckpointReader(src) as bf16, CheckpointReader(dst) as nvfp4:
            for name in bf16.names():
                module = name[: -len(".weight")]
                if f"{module}.weight_packed" not in nvfp4:
                    continue
                keys = [f"{module}.{s}" for s in ("weight_packed", "weight_scale", "weight_global_scale")]
                weight, _ = ct.decode(module, {k: nvfp4.read(k) for k in keys})
                ref = bf16.read(name).float()
                worst = max(worst, ((weight.dequantize() - ref).norm() / ref.norm()).item())
        yield f"largest relative weight error after dequantization: {worst:.3%} (NVFP4 band: ~8-12%)"
        yield f"output: {dst}" if workdir else "output was in a temp dir (use --workdir to keep it)"

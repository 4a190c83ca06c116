"""Activation-scale audit: recompute every quantized Linear's input amax from the BF16 model's own causal forward
(fp4kit.quantize.calibrate) and compare it with the input scale the checkpoint stores.

ratio = stored amax / true amax, where stored amax = 448*6 * divisor. Below 1 the scale clips real activations;
far above 1 (``waste``, default 16) it wastes FP4 range; a shared per-layer expert scale (EP-invariant) sits
above most experts' own amax by design, hence the generous default. llm-compressor 0.14's sequential calibration
loses the causal mask, which shows up here as attention-output scales well below the true amax.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fp4kit.errors import Fp4kitError
from fp4kit.formats.detect import open_checkpoint
from fp4kit.nvfp4 import amax_of_divisor
from fp4kit.progress import start_phase, warn
from fp4kit.tools.inspect import Finding

CLIP_TOLERANCE = 2**-7  # one bf16 rounding step: statistics taken in bf16 may differ by that much


def audit_input_scales(
    ckpt_path: Path, source: Path, calib: Path | None, samples: int = 64, seq_len: int = 256,
    waste: float = 16.0, device: str = "cpu", progress: Callable[[int, int], None] | None = None,
) -> tuple[list[Finding], dict[str, float]]:
    """Findings for input scales that clip or waste range, and every module's ratio (``progress``: see
    fp4kit.progress; the source's calibration pass counts layers x batches)."""
    from fp4kit.families import detect
    from fp4kit.io.checkpoint import read_config
    from fp4kit.quantize.calib_data import load_calibration
    from fp4kit.quantize.calibrate import calibrate

    config = read_config(source)
    text_config = detect(config).text_config(config)
    token_ids = load_calibration(calib, source, int(text_config["vocab_size"]), samples, seq_len,
                                 lambda text: warn(progress, text))
    with open_checkpoint(ckpt_path) as ckpt:
        stored = {m.name: amax_of_divisor(ckpt.divisor(m.input_scale).item()) for m in ckpt.modules if m.input_scale}
    if not stored:
        raise Fp4kitError(f"{ckpt_path}: weight-only checkpoint (no input scales): nothing to audit")
    phase = start_phase(progress, "auditing input scales", None, "batches",
                        f"{token_ids.shape[0]} samples x {token_ids.shape[1]} tokens through the source's layers")
    true_amax = calibrate(source, token_ids, device, modules=set(stored), progress=phase).input_amax
    findings, ratios = [], {}
    for module, amax in sorted(stored.items()):
        truth = true_amax.get(module)
        if not truth:
            continue
        ratio = amax / truth
        ratios[module] = ratio
        if ratio < 1 - CLIP_TOLERANCE:
            findings.append(Finding("input_scale_clips", module, f"stored amax {amax:.4g} < true {truth:.4g}", ratio))
        elif ratio > waste:
            findings.append(Finding("input_scale_wastes_range", module,
                                    f"stored amax {amax:.4g} > {waste:g}x the true {truth:.4g}", ratio))
    return findings, ratios

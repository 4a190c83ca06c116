"""What `fp4kit convert` reports, for a dialect conversion (tools/convert.py) and a dense one (tools/dense.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fp4kit.tools.repair import RepairReport


@dataclass
class ConvertReport:
    source_dialect: str
    target_dialect: str
    scheme: str
    family: str
    quantized_modules: int
    fused_tensors: int
    passthrough_tensors: int
    exact_scales_recorded: int
    input_bytes: int
    output_bytes: int
    output_files: list[str]
    seconds: float
    notes: list[str] = field(default_factory=list)
    fp8_modules: int = 0  # a mixed-precision checkpoint's FP8 Linears
    repair: RepairReport | None = None

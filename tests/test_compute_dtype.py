"""`quantize --dtype auto|bf16|fp32`: the calibration forward's compute dtype. auto takes the checkpoint's dtype where
the hardware computes it fast (a GPU; a CPU with AVX512-BF16 or AMX that oneDNN may use) and fp32 elsewhere; the
dtype used is recorded; outputs that no calibration forward shapes are the same bytes for every choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from fp4kit.errors import Fp4kitError
from fp4kit.quantize.calibrate import compute_dtype, fast_bf16

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16_CONFIG, FP32_CONFIG = {"torch_dtype": "bfloat16"}, {"torch_dtype": "float32"}


def _cpu(monkeypatch, bf16_units: bool, onednn_bf16: bool = True, isa_cap: str | None = None) -> None:
    """A CPU with or without bf16 instructions, oneDNN bf16 GEMMs, and an ONEDNN_MAX_CPU_ISA cap."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_units)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if isa_cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa_cap)


def test_auto_follows_the_hardware(monkeypatch) -> None:
    _cpu(monkeypatch, bf16_units=True)
    assert fast_bf16(CPU) and compute_dtype("auto", CPU, BF16_CONFIG) == torch.bfloat16
    assert compute_dtype("auto", CPU, {}) == torch.bfloat16  # config.json naming no dtype: bf16
    for isa in ("avx2", "AVX512_CORE"):  # oneDNN capped below its bf16 instructions
        _cpu(monkeypatch, bf16_units=True, isa_cap=isa)
        assert not fast_bf16(CPU) and compute_dtype("auto", CPU, BF16_CONFIG) == torch.float32
    _cpu(monkeypatch, bf16_units=True, isa_cap="AVX512_CORE_AMX")
    assert fast_bf16(CPU)
    _cpu(monkeypatch, bf16_units=False)  # AVX2 or AVX-512 without bf16 instructions
    assert not fast_bf16(CPU) and compute_dtype("auto", CPU, BF16_CONFIG) == torch.float32
    _cpu(monkeypatch, bf16_units=True, onednn_bf16=False)  # torch's bf16 GEMM is not oneDNN's
    assert compute_dtype("auto", CPU, BF16_CONFIG) == torch.float32

    assert compute_dtype("auto", CUDA, BF16_CONFIG) == torch.bfloat16
    assert compute_dtype("auto", CUDA, {"torch_dtype": "float16"}) == torch.float16
    assert compute_dtype("auto", CPU, {"torch_dtype": "float16"}) == torch.float32
    assert compute_dtype("auto", CPU, FP32_CONFIG) == torch.float32
    for device in (CPU, CUDA):  # an explicit choice is taken as it is
        assert compute_dtype("bf16", device, FP32_CONFIG) == torch.bfloat16
        assert compute_dtype("fp32", device, BF16_CONFIG) == torch.float32
    with pytest.raises(Fp4kitError, match="unknown --dtype 'fp16'; choose one of auto, bf16, fp32"):
        compute_dtype("fp16", CPU, BF16_CONFIG)


def _weights(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.glob("*.safetensors"))} | {
        "config.json": (root / "config.json").read_bytes()}


def test_no_calibration_forward_same_bytes_for_every_dtype(tiny, tmp_path, monkeypatch, capsys) -> None:
    src = tiny("qwen3_moe")
    for method in ("rtn", "mse"):  # data-free: --dtype changes nothing
        outputs = []
        for dtype in ("auto", "bf16", "fp32"):
            dst = tmp_path / f"{method}-{dtype}"
            code, _, err = run_cli(monkeypatch, capsys, "quantize", src, dst, "--method", method, "--dtype", dtype,
                                   "-q")
            assert code == 0, err
            outputs.append(_weights(dst))
            record = json.loads((dst / "fp4kit_provenance.json").read_text())
            assert record["calibration"] is None and "dtype" not in record["options"]
        assert outputs[0] == outputs[1] == outputs[2]


def test_the_calibration_records_its_dtype(tiny, tmp_path, monkeypatch, capsys) -> None:
    src = tiny("qwen3_moe")
    for dtype, name in (("bf16", "bfloat16"), ("fp32", "float32")):
        dst = tmp_path / dtype
        code, _, err = run_cli(monkeypatch, capsys, "quantize", src, dst, "--scheme", "nvfp4", "--samples", "2",
                               "--seq-len", "16", "--dtype", dtype)
        assert code == 0, err
        assert err.splitlines()[0].endswith(f", {name})")  # the calibration phase's line
        assert json.loads((dst / "fp4kit_provenance.json").read_text())["calibration"]["dtype"] == name


def test_onednn_capped_to_avx2_calibrates_in_fp32(tiny, tmp_path) -> None:
    """A whole run as on a CPU without bf16 instructions: oneDNN's own cap, read by torch in a fresh process."""
    env = os.environ | {"PYTHONPATH": str(Path(__file__).parents[1]), "ONEDNN_MAX_CPU_ISA": "AVX2",
                        "OMP_NUM_THREADS": "1"}
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.ops.mkldnn._is_mkldnn_bf16_supported())"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "False"  # the cap took effect: torch's bf16 GEMM is not oneDNN's
    dst = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "fp4kit", "quantize", str(tiny("qwen3_moe")), str(dst), "--scheme",
                           "nvfp4", "--samples", "2", "--seq-len", "16"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0].endswith(", float32)")
    assert json.loads((dst / "fp4kit_provenance.json").read_text())["calibration"]["dtype"] == "float32"

"""MiniMax-M2 end to end on its tiny fixture (block_sparse_moe.experts.E.w1/w2/w3, the router and its correction
bias beside the experts): every method, dialect and scheme quantizes, inspects clean and keeps every source tensor;
from the FP8-block release form too; verify passes (reference, Triton under the interpreter, EP shards, NaN router
rows); the correction bias on disk is the one routing uses."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports fp4kit's Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import run_cli  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from fp4kit.quantize import QuantizeOptions, quantize_checkpoint  # noqa: E402
from fp4kit.tools.inspect import inspect_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CALIBRATION = {"samples": 4, "seq_len": 16, "batch_size": 4}


def _tensors(root) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _suffixes(dialect: str) -> tuple[str, ...]:
    return (".weight_packed",) if dialect == "compressed-tensors" else (".weight",)


@pytest.mark.parametrize("method", ["rtn", "mse", "gptq"])
@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
def test_every_method_dialect_and_scheme(tiny, tmp_path, method, dialect, scheme) -> None:
    src = tiny("minimax_m2")
    out = tmp_path / "out"
    quantize_checkpoint(src, out, QuantizeOptions(scheme=scheme, format=dialect, method=method, **CALIBRATION))
    report = inspect_checkpoint(out)
    assert report.clean, report.problems
    source, written = _tensors(src), _tensors(out)
    quantized = {n.rsplit(".", 1)[0] for n in written if n.endswith(".weight_scale")}
    assert len(quantized) == 2 * 8 * 3 and all(".block_sparse_moe.experts." in m for m in quantized)
    for name, tensor in source.items():
        module = name.removesuffix(".weight")
        if module in quantized:
            assert any(module + s in written for s in _suffixes(dialect)), name
        else:  # router, correction bias (fp32), attention, norms, embeddings: byte for byte
            assert torch.equal(written[name], tensor) and written[name].dtype == tensor.dtype, name
    assert written["model.layers.0.block_sparse_moe.e_score_correction_bias"].dtype == torch.float32


def test_fp8_block_source_quantizes_and_verifies(tiny, tmp_path, monkeypatch, capsys) -> None:
    from fp4kit.testing.fixtures import write_fp8_block_source

    fp8 = write_fp8_block_source(tiny("minimax_m2"), tmp_path / "fp8", (32, 32))
    fp8_tensors = _tensors(fp8)
    assert fp8_tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"].dtype == torch.float8_e4m3fn
    assert fp8_tensors["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.bfloat16  # as released
    out = tmp_path / "out"
    quantize_checkpoint(fp8, out, QuantizeOptions(scheme="nvfp4", method="gptq", **CALIBRATION))
    code, stdout, err = run_cli(monkeypatch, capsys, "verify", out, "--source", fp8, "--tokens", "1,16",
                                "--device", "cpu")
    assert code == 0, stdout + err
    assert "fp8-block" in stdout


def test_verify_with_ep_shards_and_nan_rows(tiny, tmp_path, monkeypatch, capsys) -> None:
    src, out = tiny("minimax_m2"), tmp_path / "out"
    # enough calibration that verify's random hidden states stay within the activation scales
    quantize_checkpoint(src, out, QuantizeOptions(scheme="nvfp4", samples=16, seq_len=128, batch_size=8))
    code, _, err = run_cli(monkeypatch, capsys, "shard", out, tmp_path / "ep", "--ep", "2")
    assert code == 0, err
    code, stdout, err = run_cli(monkeypatch, capsys, "verify", out, "--source", src, "--ep-shards", tmp_path / "ep",
                                "--tokens", "1,16", "--backend", "triton", "--device", "cpu")
    assert code == 0, stdout + err
    for check in ("kernel", "routing", "ep-sum"):
        assert check in stdout


def test_routing_uses_the_correction_bias_on_disk(tiny) -> None:
    """The fixture's bias changes which experts route (so verify and calibration would see a dropped bias)."""
    from fp4kit.families import detect
    from fp4kit.families.routing import route
    from fp4kit.io.checkpoint import read_config

    src = tiny("minimax_m2")
    config, tensors = read_config(src), _tensors(src)
    spec = detect(config).routing(config)
    hidden = torch.randn(256, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    logits = hidden @ tensors["model.layers.0.block_sparse_moe.gate.weight"].float().T
    _, biased = route(logits, spec, tensors["model.layers.0.block_sparse_moe.e_score_correction_bias"])
    _, plain = route(logits, spec)
    assert not torch.equal(biased.sort(dim=-1).values, plain.sort(dim=-1).values)


def test_layout_of_an_experts_only_checkpoint_inspects_and_verifies(tiny, tmp_path, monkeypatch, capsys) -> None:
    """MiniMax's default quantizes only the routed experts, so its layout directory holds no NVFP4 module outside
    the laid-out MoE layers: inspect still reads it (and verify undoes it bit for bit)."""
    src, out, lay = tiny("minimax_m2"), tmp_path / "out", tmp_path / "lay"
    quantize_checkpoint(src, out, QuantizeOptions(scheme="nvfp4", samples=16, seq_len=128, batch_size=8))
    code, _, err = run_cli(monkeypatch, capsys, "layout", out, lay, "--backend", "trtllm")
    assert code == 0, err
    code, stdout, err = run_cli(monkeypatch, capsys, "inspect", lay)
    assert code == 0 and "no problems found" in stdout, stdout + err
    code, stdout, err = run_cli(monkeypatch, capsys, "verify", out, "--source", src, "--layout", lay, "--tokens",
                                "1,16", "--device", "cpu")
    assert code == 0, stdout + err

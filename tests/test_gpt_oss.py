"""gpt-oss from BF16 on its tiny fixture (transformers' GptOssForCausalLM saved as is: fused, K-major, interleaved
gate/up experts with biases): data-free quantization in both dialects with rtn and mse, inspect clean, every other
source tensor kept byte for byte, gate and up de-interleaved (the dense conversion loads back into transformers with
the source's layout), and one-line refusals where fp4kit does not compute gpt-oss's experts yet."""

from __future__ import annotations

import pytest
import torch
from _verify_sources import run_cli
from safetensors.torch import load_file

from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.tools.inspect import inspect_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tensors(root) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize("method", ["rtn", "mse"])
@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
def test_data_free_quantization_in_both_dialects(tiny, tmp_path, dialect, method) -> None:
    src, out = tiny("gpt_oss"), tmp_path / "out"
    quantize_checkpoint(src, out, QuantizeOptions(scheme="nvfp4a16", format=dialect, method=method))
    report = inspect_checkpoint(out)
    assert report.clean, report.problems
    source, written = _tensors(src), _tensors(out)
    quantized = {n.rsplit(".", 1)[0] for n in written if n.endswith(".weight_scale")}
    experts = {m for m in quantized if ".mlp.experts." in m}
    assert len(experts) == 2 * 8 * 3 and {m.rsplit(".", 1)[1] for m in experts} == {"gate_proj", "up_proj",
                                                                                      "down_proj"}
    assert not any(".mlp.router" in m for m in quantized)
    assert {m.rsplit(".", 1)[1] for m in quantized - experts} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for name, tensor in source.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) or name.removesuffix(".weight") in quantized:
            continue
        # expert biases (interleaved, as stored), router weight and bias, attention biases, sinks, norms, embeddings
        assert torch.equal(written[name], tensor), name


def test_gate_and_up_are_de_interleaved(tiny, tmp_path, monkeypatch, capsys) -> None:
    import transformers

    src, out, dense = tiny("gpt_oss"), tmp_path / "out", tmp_path / "dense"
    quantize_checkpoint(src, out, QuantizeOptions(scheme="nvfp4a16"))
    source, written = _tensors(src), _tensors(out)
    fused = source["model.layers.0.mlp.experts.gate_up_proj"][3].float().T  # [2I, H], rows gate, up, gate, ...
    scale = written["model.layers.0.mlp.experts.3.gate_proj.weight_scale"].float()
    # the per-16 block scales follow the rows' magnitudes: those of the even rows, not the first half
    even, first_half = fused[0::2].abs().unflatten(-1, (-1, 16)).amax(-1), fused[: len(fused) // 2].abs().unflatten(
        -1, (-1, 16)).amax(-1)
    ratio = scale / even
    assert float(ratio.std() / ratio.mean()) < 0.1
    assert float((scale / first_half).std() / (scale / first_half).mean()) > 0.2
    code, _, err = run_cli(monkeypatch, capsys, "convert", out, dense, "--to", "bf16")
    assert code == 0, err
    transformers.utils.logging.set_verbosity_error()
    model = transformers.GptOssForCausalLM.from_pretrained(dense, dtype=torch.float32)
    reference = transformers.GptOssForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        got = model.model.layers[0].mlp.experts.gate_up_proj
        expected = reference.model.layers[0].mlp.experts.gate_up_proj
        assert float((got - expected).norm() / expected.norm()) < 0.15  # one NVFP4 rounding of random weights


@pytest.mark.parametrize("args", [("quantize", "--scheme", "nvfp4"), ("quantize", "--method", "gptq"),
                                  ("verify",)])
def test_what_is_not_computed_yet_is_refused_in_one_line(tiny, tmp_path, monkeypatch, capsys, args) -> None:
    src = tiny("gpt_oss")
    if args[0] == "verify":
        quantize_checkpoint(src, tmp_path / "q", QuantizeOptions(scheme="nvfp4a16"))
        argv = ["verify", tmp_path / "q", "--source", src]
    else:
        argv = [args[0], src, tmp_path / "out", *args[1:]]
    code, _, err = run_cli(monkeypatch, capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "gpt_oss" in lines[0] and "Traceback" not in err
    assert not (tmp_path / "out").exists()

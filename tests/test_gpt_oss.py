"""gpt-oss from BF16 on its tiny fixture (transformers' GptOssForCausalLM saved as is: fused, K-major, interleaved
gate/up experts with biases): rtn / mse / gptq in both dialects and both schemes, inspect clean, every other source
tensor kept byte for byte, gate and up de-interleaved (the dense conversion loads back into transformers with the
source's layout), calibration through transformers' own decoder layer and `_apply_gate`, verify with gpt-oss's
activation and biases (reference, Triton under the interpreter, EP shards, NaN router rows; W4A16 and W4A4), and
eval."""

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


def _tensors(root) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize("method", ["rtn", "mse", "gptq"])
@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
def test_every_method_dialect_and_scheme(tiny, tmp_path, dialect, method, scheme) -> None:
    src, out = tiny("gpt_oss"), tmp_path / "out"
    quantize_checkpoint(src, out, QuantizeOptions(scheme=scheme, format=dialect, method=method, samples=4, seq_len=16,
                                                  batch_size=4))
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


def test_eval_runs(tiny, tmp_path, monkeypatch, capsys) -> None:
    src, out = tiny("gpt_oss"), tmp_path / "out"
    quantize_checkpoint(src, out, QuantizeOptions(scheme="nvfp4", samples=4, seq_len=16, batch_size=4))
    code, stdout, err = run_cli(monkeypatch, capsys, "eval", out, src, "--samples", "2", "--seq-len", "32")
    assert code == 0, err
    assert "top-1 agreement" in stdout


def test_verify_computes_gpt_oss_experts(tiny, tmp_path, monkeypatch, capsys) -> None:
    src, out = tiny("gpt_oss"), tmp_path / "out"
    quantize_checkpoint(src, out, QuantizeOptions(scheme="nvfp4a16"))
    code, _, err = run_cli(monkeypatch, capsys, "shard", out, tmp_path / "ep", "--ep", "2")
    assert code == 0, err
    code, stdout, err = run_cli(monkeypatch, capsys, "verify", out, "--source", src, "--ep-shards", tmp_path / "ep",
                                "--tokens", "1,16", "--backend", "triton", "--device", "cpu")
    assert code == 0, stdout + err
    for check in ("kernel", "source-expert", "routing", "ep-sum"):
        assert check in stdout


def test_verify_sees_a_wrong_gate_up_order(tiny, tmp_path, monkeypatch, capsys) -> None:
    """The negative control: the source with gate and up read contiguously (not interleaved) fails verify."""
    from safetensors.torch import save_file

    src, out, wrong = tiny("gpt_oss"), tmp_path / "out", tmp_path / "wrong"
    quantize_checkpoint(src, out, QuantizeOptions(scheme="nvfp4a16"))
    wrong.mkdir()
    for side in src.iterdir():
        if side.suffix != ".safetensors":
            (wrong / side.name).write_bytes(side.read_bytes())
    tensors = _tensors(src)
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
        t = tensors[name]
        tensors[name] = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1).contiguous()  # interleaving undone
    save_file(tensors, wrong / "model.safetensors", metadata={"format": "pt"})
    code, stdout, _ = run_cli(monkeypatch, capsys, "verify", out, "--source", wrong, "--tokens", "16",
                              "--backend", "reference", "--device", "cpu")
    assert code == 1 and "FAIL" in stdout


def test_w4a4_verify_passes(tiny, tmp_path, monkeypatch, capsys) -> None:
    src, out = tiny("gpt_oss"), tmp_path / "out"
    quantize_checkpoint(src, out, QuantizeOptions(scheme="nvfp4", method="gptq", samples=16, seq_len=64,
                                                  batch_size=8))
    code, stdout, err = run_cli(monkeypatch, capsys, "verify", out, "--source", src, "--mode", "w4a4", "--tokens",
                                "1,16", "--device", "cpu")
    assert code == 0, stdout + err


def test_calibration_streams_transformers_layers_and_measures_the_clamped_intermediate(tiny) -> None:
    """calibrate() on gpt-oss, one decoder layer at a time: each layer's output equals the whole transformers
    model's, and each expert's down-projection input amax is what transformers' own `_apply_gate` gives on the
    biased gate/up product (every token through every expert, as fp4kit measures experts)."""
    import transformers

    from fp4kit.quantize.calibrate import calibrate

    src = tiny("gpt_oss")
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))
    transformers.utils.logging.set_verbosity_error()
    model = transformers.GptOssForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    outputs, block_inputs = [], {}
    handles = [layer.register_forward_hook(lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple) else out))
               for layer in model.model.layers]
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.mlp.register_forward_pre_hook(
            lambda m, args, i=i: block_inputs.setdefault(i, []).append(args[0].reshape(-1, args[0].shape[-1]))))
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    streamed: dict[int, torch.Tensor] = {}
    result = calibrate(src, ids, batch_size=4, dtype=torch.float32,
                       on_layer=lambda i, batches: streamed.__setitem__(i, torch.cat(batches)))
    for i, reference in enumerate(outputs):
        assert (streamed[i] - reference).abs().max().item() <= 1e-5, i
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            hidden, experts = torch.cat(block_inputs[i]), layer.mlp.experts
            for e in range(8):
                inter = experts._apply_gate(hidden @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e])
                ours = result.input_amax[f"model.layers.{i}.mlp.experts.{e}.down_proj"]
                assert abs(ours - inter.abs().amax().item()) <= 1e-5 * inter.abs().amax().item(), (i, e)
                assert result.input_amax[f"model.layers.{i}.mlp.experts.{e}.gate_proj"] == pytest.approx(
                    hidden.abs().amax().item(), rel=1e-6)

"""`fp4kit convert --to bf16` (fp4kit/tools/dense.py): transformers' own loader reads the dense checkpoint into exactly
the weights compressed-tensors' decompression gives, on every family; ModelOpt input dequantizes to the same bytes."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli, text_forward

from fp4kit.io.checkpoint import CheckpointReader
from fp4kit.io.sources import QUANTIZATION_TENSOR
from fp4kit.testing.fixtures import FIXTURES, fixture_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _load(path, family: str):
    import transformers

    cls = getattr(transformers, fixture_spec(family)["model_class"])
    model, info = cls.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    return model.eval(), info


def _decompressed(ckpt) -> dict[str, torch.Tensor]:
    """Every quantized module's weight as compressed-tensors' NVFP4 compressor decompresses it."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qconfig = QuantizationConfig.model_validate(json.loads((ckpt / "config.json").read_text())["quantization_config"])
    scheme = qconfig.config_groups["group_0"]
    reader = CheckpointReader(ckpt)
    out = {}
    for name in reader.names():
        if name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            local = {k: reader.read(f"{module}.{k}") for k in ("weight_packed", "weight_scale", "weight_global_scale")}
            out[module] = NVFP4PackedCompressor.decompress(local, scheme)["weight"]
    return out


def _substitute(model: torch.nn.Module, weights: dict[str, torch.Tensor], config: dict) -> None:
    """Put each module's weight where transformers keeps it in memory: nn.Linear weights, or one expert's rows of
    the fused [E, 2I, H] / [E, H, I] parameters (Llama-4: columns of [E, H, 2I] / [E, I, H]), through the family's
    own view of transformers' modules (names and layouts: Family.moe_modules, Family.grammar)."""
    import re

    from fp4kit.families import detect

    owner = detect(config)
    moe, grammar = owner.moe_modules(), owner.grammar
    with torch.no_grad():
        for module, weight in weights.items():
            layer, rest = re.match(r"^(.*?layers\.\d+\.)?(.*)$", module).groups()
            path = (layer or "") + moe.module_name(rest)
            split = grammar.split_expert(path)
            if split is not None and "." not in split[2]:
                experts, e, proj = split
                target = moe.weight(model.get_submodule(experts), e, proj, grammar)
            else:
                target = model.get_submodule(path).weight
            target.copy_(weight.to(target.dtype))


def _reference(src, family: str, weights: dict[str, torch.Tensor], config: dict, scratch) -> torch.nn.Module:
    """transformers' model of the source with the decompressed weights in place of the quantized ones. Modules that
    transformers holds under other names than the checkpoint's (DeepSeek-V4: its conversion mapping renames and
    merges on load) are substituted in a copy of the source file, which transformers then loads itself."""
    import shutil

    from safetensors.torch import load_file, save_file

    reference, _ = _load(src, family)
    held = {name for name, _ in reference.named_modules()}
    stored = load_file(src / "model.safetensors")
    on_disk = {m: w for m, w in weights.items() if m not in held and f"{m}.weight" in stored}
    if on_disk:
        shutil.copytree(src, scratch)
        stored.update({f"{m}.weight": w.to(stored[f"{m}.weight"].dtype) for m, w in on_disk.items()})
        save_file(stored, scratch / "model.safetensors", metadata={"format": "pt"})
        reference, _ = _load(scratch, family)
    _substitute(reference, {m: w for m, w in weights.items() if m not in on_disk}, config)
    return reference


@pytest.mark.parametrize("family", FIXTURES)
def test_transformers_loads_the_dequantized_weights(family, monkeypatch, capsys, tiny, tiny_nvfp4a16, tmp_path):
    ckpt, dense = tiny_nvfp4a16(family), tmp_path / "dense"
    code, out, err = run_cli(monkeypatch, capsys, "convert", ckpt, dense, "--to", "bf16")
    assert code == 0, err
    assert "-> bf16" in out
    config = json.loads((dense / "config.json").read_text())
    assert "quantization_config" not in config and not (dense / "hf_quant_config.json").exists()
    assert not [n for n in CheckpointReader(dense).names() if QUANTIZATION_TENSOR.search(n)]
    model, info = _load(dense, family)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    reference = _reference(tiny(family), family, _decompressed(ckpt), config, tmp_path / "reference")
    loaded, expected = model.state_dict(), reference.state_dict()
    assert loaded.keys() == expected.keys()
    differ = [k for k in expected if not torch.equal(loaded[k], expected[k])]
    assert not differ, differ[:5]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    # in fp32: transformers' DeepSeek-V4 keeps its hyper-connections and norms fp32 (_keep_in_fp32_modules_strict),
    # whose outputs its bf16 Linears then refuse
    model, reference = model.float(), reference.float()
    with torch.inference_mode():
        assert torch.equal(text_forward(model)(input_ids=ids).logits, text_forward(reference)(input_ids=ids).logits)


@pytest.mark.parametrize("family", ["llama4", "qwen3_moe"])
def test_modelopt_input_gives_the_dense_checkpoint_of_its_conversion(family, tiny, tmp_path):
    """A ModelOpt checkpoint (Llama-4: fused expert tensors) dequantizes to the same tensors as its lossless
    conversion to compressed-tensors, which the test above checks against compressed-tensors' decompression."""
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
    from fp4kit.tools.convert import convert_checkpoint
    from fp4kit.tools.dense import dequantize_checkpoint

    quantize_checkpoint(tiny(family), tmp_path / "mo", QuantizeOptions(scheme="nvfp4", format="modelopt", samples=2,
                                                                       seq_len=32))
    convert_checkpoint(tmp_path / "mo", tmp_path / "ct", "compressed-tensors")
    dense = {}
    for dialect in ("mo", "ct"):
        report = dequantize_checkpoint(tmp_path / dialect, tmp_path / f"dense-{dialect}")
        assert report.notes and "input scales dropped" in report.notes[0]
        dense[dialect] = CheckpointReader(tmp_path / f"dense-{dialect}")
    names = dense["mo"].names()
    assert sorted(names) == sorted(dense["ct"].names())
    assert all(torch.equal(dense["mo"].read(n), dense["ct"].read(n)) for n in names)


def test_bad_input(monkeypatch, capsys, tiny, tiny_nvfp4a16, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "convert", tiny("qwen3_moe"), tmp_path / "out", "--to", "bf16")
    assert code == 2 and err.startswith("error: ") and "no NVFP4" in err
    assert not (tmp_path / "out").exists()
    code, _, err = run_cli(monkeypatch, capsys, "convert", tiny_nvfp4a16("qwen3_moe"), tmp_path / "out", "--to",
                           "bf16", "--repair")
    assert code == 2 and "--repair" in err

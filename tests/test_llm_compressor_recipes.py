"""llm-compressor recipes in `fp4kit run` and `fp4kit recipe convert`: recipes written by llm-compressor's own recipe
classes (and in its examples' YAML form) translate into fp4kit's quantize step, with one note per setting fp4kit
does not honour; one runs end to end on a tiny model, with the bytes `fp4kit quantize` writes for the same options."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp4kit import cli
from fp4kit.errors import Fp4kitError
from fp4kit.pipeline.recipe import load_recipe

llmcompressor = pytest.importorskip("llmcompressor", reason="llm-compressor writes the recipes under test")


def llmc_yaml(*modifiers: object) -> str:
    """The YAML llm-compressor itself writes for these modifiers (Recipe.yaml, as its oneshot saves recipe.yaml)."""
    from llmcompressor.recipe import Recipe

    return Recipe.from_modifiers(list(modifiers)).yaml()


@pytest.fixture(autouse=True, scope="module")
def _commands() -> None:
    cli._register_commands()


def write(tmp_path: Path, text: str, name: str = "llmc.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_gptq_recipe_from_llm_compressors_classes(tmp_path, tiny) -> None:
    from llmcompressor.modifiers.gptq import GPTQModifier

    text = llmc_yaml(GPTQModifier(scheme="NVFP4", targets="Linear", ignore=["lm_head", "re:.*mlp.gate$"],
                                  dampening_frac=0.05, weight_observer="minmax"))
    loaded = load_recipe(write(tmp_path, text), [f"model={tiny('qwen3_moe')}"])
    quantize = loaded.recipe.quantize
    assert loaded.from_llm_compressor and loaded.recipe.family == "qwen3_moe"
    assert quantize is not None and (quantize.scheme, quantize.method) == ("nvfp4", "gptq")
    assert quantize.ignore == ["^lm_head$", "^(?:.*mlp.gate$)"] and quantize.targets == []
    assert quantize.gptq_damp == 0.05 and quantize.gptq_scales == "rtn"
    # llm-compressor's GPTQ defaults: static activation ordering, which fp4kit does not do; one line, at its key
    assert len(loaded.notes) == 1 and "actorder: static: not honoured" in loaded.notes[0], loaded.notes
    assert loaded.notes[0].startswith(f"{tmp_path / 'llmc.yaml'}:")


def test_quantization_modifier_observers_and_other_modifiers(tmp_path, tiny) -> None:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import SmoothQuantModifier

    text = llmc_yaml(SmoothQuantModifier(smoothing_strength=0.8),
                     QuantizationModifier(scheme="NVFP4A16", targets=["re:.*experts.*"], ignore=["lm_head"],
                                          observer={"weights": "mse", "input": "imatrix_mse"}))
    loaded = load_recipe(write(tmp_path, text), [f"model={tiny('qwen3_moe')}"])
    quantize = loaded.recipe.quantize
    assert quantize is not None and (quantize.scheme, quantize.method) == ("nvfp4a16", "mse")
    assert quantize.targets == ["^(?:.*experts.*)"]
    notes = "\n".join(loaded.notes)
    assert "SmoothQuantModifier" in notes and "input_observer: imatrix_mse: not honoured" in notes
    assert len(loaded.notes) == 2, loaded.notes


@pytest.mark.parametrize("observer", ["nvfp4_expanded_mse", "nvfp4-expanded-mse", "fouroversix"])
def test_expanded_mse_observer_is_the_range_search(tmp_path, tiny, observer: str) -> None:
    """llm-compressor's recommended NVFP4 weight observer (a search over 0.8x-1.8x of each block's absmax) becomes
    fp4kit's mse search over the same range, alone (QuantizationModifier) and inside GPTQ; nothing is noted."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.observers.base import Observer

    assert observer.replace("_", "-") in Observer.registered_names(), "llm-compressor no longer registers it"
    rtn = llmc_yaml(QuantizationModifier(scheme="NVFP4A16", targets="Linear", ignore=["lm_head"],
                                         observer={"weights": observer}))
    loaded = load_recipe(write(tmp_path, rtn), [f"model={tiny('qwen3_moe')}"])
    quantize = loaded.recipe.quantize
    assert quantize is not None and (quantize.method, quantize.mse_range) == ("mse", "0.8:1.8"), quantize
    assert loaded.notes == []
    gptq = llmc_yaml(GPTQModifier(scheme="NVFP4", targets="Linear", ignore=["lm_head"], weight_observer=observer,
                                  actorder=None))
    loaded = load_recipe(write(tmp_path, gptq, "gptq.yaml"), [f"model={tiny('qwen3_moe')}"])
    quantize = loaded.recipe.quantize
    assert quantize is not None and (quantize.method, quantize.gptq_scales, quantize.mse_range) == (
        "gptq", "mse", "0.8:1.8"), quantize
    assert loaded.notes == [], loaded.notes


EXAMPLE = """\
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head", "re:.*mlp.gate$"]
      scheme: NVFP4
      targets: ["Linear"]
      dampening_frac: 0.02
      sequential_targets: ["Qwen3MoeDecoderLayer"]
      block_size: 64
      kv_cache_scheme: {num_bits: 8, type: float}
model: {model}
"""


def test_examples_yaml_keys_each_get_a_line(tmp_path, tiny) -> None:
    path = write(tmp_path, EXAMPLE.replace("{model}", str(tiny("qwen3_moe"))))
    loaded = load_recipe(path)
    assert loaded.recipe.quantize is not None and loaded.recipe.quantize.gptq_damp == 0.02
    assert loaded.recipe.quantize.kv_cache == "fp8"  # a per-tensor FP8 kv_cache_scheme: --kv-cache fp8
    by_key = {note.split(": ")[1]: note for note in loaded.notes}
    assert set(by_key) == {f"quant_stage.quant_modifiers.GPTQModifier.{k}"
                           for k in ("sequential_targets", "block_size")}, loaded.notes
    assert by_key["quant_stage.quant_modifiers.GPTQModifier.block_size"].startswith(f"{path}:9:")


@pytest.mark.parametrize(("text", "message"), [
    ("quant_stage:\n  quant_modifiers:\n    GPTQModifier:\n      scheme: W4A16\n      targets: Linear\n",
     "llmc.yaml:4: quant_stage.quant_modifiers.GPTQModifier.scheme: 'W4A16': fp4kit writes NVFP4 and NVFP4A16 only"),
    ("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      scheme: NVFP4\n      ignore: [Qwen3MoeMLP]\n",
     "ignore: 'Qwen3MoeMLP' is a module class"),
    ("quant_stage:\n  smooth_modifiers:\n    SmoothQuantModifier: {smoothing_strength: 0.5}\n",
     "no quantization modifier"),
    ("quant_stage:\n  quant_modifiers:\n    GPTQModifier:\n      config_groups: {group_0: {targets: [Linear]}}\n",
     "config_groups: fp4kit reads a preset scheme"),
])
def test_what_fp4kit_cannot_write_is_refused(tmp_path, tiny, text, message) -> None:
    with pytest.raises(Fp4kitError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_recipe(write(tmp_path, text), [f"model={tiny('qwen3_moe')}"])


def test_a_recipe_without_model_says_how_to_give_it(tmp_path, capsys) -> None:
    path = write(tmp_path, "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      scheme: NVFP4A16\n")
    assert cli.run(["run", str(path)]) == 2
    assert "add --set model=DIR" in capsys.readouterr().err


def test_convert_writes_the_recipe_run_runs(tmp_path, tiny, capsys) -> None:
    from llmcompressor.modifiers.gptq import GPTQModifier

    model = tiny("qwen3_moe")
    src = write(tmp_path, llmc_yaml(GPTQModifier(scheme="NVFP4", targets="Linear", ignore=["lm_head"])))
    dst = tmp_path / "fp4kit.yaml"
    assert cli.run(["recipe", "convert", str(src), str(dst), "--set", f"model={model}", "--set", "shard.ep=2"]) == 0
    captured = capsys.readouterr()
    assert "note:" in captured.err and f"wrote {dst}" in captured.out
    assert "# note: " in dst.read_text()
    converted, direct = load_recipe(dst), load_recipe(src, [f"model={model}", "shard.ep=2"])
    assert not converted.from_llm_compressor and converted.recipe == direct.recipe
    assert cli.run(["recipe", "convert", str(src), str(dst), "--set", f"model={model}"]) == 2  # DST exists
    assert cli.run(["recipe", "convert", str(dst), str(tmp_path / "again.yaml")]) == 2  # not llm-compressor's


def test_run_of_an_llm_compressor_recipe_writes_what_quantize_writes(tmp_path, tiny, capsys) -> None:
    """End to end: an NVFP4A16 QuantizationModifier recipe through `fp4kit run`, and `fp4kit quantize` with the same
    ignore list: the same tensors, byte for byte."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = tiny("qwen3_moe")
    src = write(tmp_path, llmc_yaml(QuantizationModifier(scheme="NVFP4A16", targets="Linear", ignore=["lm_head"])))
    work = tmp_path / "work"
    assert cli.run(["run", str(src), "--set", f"model={model}", "--workdir", str(work), "-q"]) == 0
    assert cli.run(["quantize", str(model), str(tmp_path / "direct"), "--ignore", "^lm_head$", "-q"]) == 0
    ran = sorted(p.name for p in (work / "quantize").glob("*.safetensors"))
    assert ran and ran == sorted(p.name for p in (tmp_path / "direct").glob("*.safetensors"))
    for name in ran:
        assert (work / "quantize" / name).read_bytes() == (tmp_path / "direct" / name).read_bytes(), name


def test_fp4kit_keys_beside_the_stages_win(tmp_path, tiny) -> None:
    """fp4kit's own keys in the same file: its quantize keys over the translation's, its other steps as written."""
    text = EXAMPLE.replace("{model}", str(tiny("qwen3_moe"))) + "quantize:\n  gptq_damp: 0.03\nshard:\n  ep: 2\n"
    recipe = load_recipe(write(tmp_path, text)).recipe
    assert recipe.quantize is not None and recipe.quantize.gptq_damp == 0.03 and recipe.quantize.method == "gptq"
    assert recipe.shard is not None and recipe.shard.ep == 2

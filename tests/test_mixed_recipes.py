"""The recipes reproducing published mixed-precision layouts: each validates, and its quantize step on its family's
tiny fixture gives every Linear the scheme the checkpoint it follows gives it (the expected map is written from the
published layout, not from the recipe's regexes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp4kit.formats.detect import open_checkpoint
from fp4kit.options import quantize_kwargs
from fp4kit.pipeline.recipe import load_recipe
from fp4kit.quantize.checkpoint import QuantizeOptions, quantize_checkpoint

RECIPES = Path(__file__).parents[1] / "recipes"
MLA_FP8 = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj")


def deepseek_r1_nvfp4_fp8_block(module: str, mtp_layer: str) -> str | None:
    """RedHatAI/DeepSeek-R1-NVFP4-FP8-BLOCK: MLA projections FP8 blocks but kv_b_proj (kept), every MLP NVFP4;
    the MTP layer, routers and lm_head kept."""
    if module.startswith(mtp_layer) or module == "lm_head" or module.endswith(".mlp.gate"):
        return None
    leaf = module.rsplit(".", 1)[-1]
    if ".self_attn." in module:
        return "fp8-block" if leaf in MLA_FP8 else None
    if ".mlp." in module and leaf in ("gate_proj", "up_proj", "down_proj"):
        return "nvfp4"
    return None


def qwen36_nvfp4_fp8(module: str, mtp_layer: str) -> str | None:
    """Infatoshi/Qwen3.6-35B-A3B-NVFP4-FP8: routed experts NVFP4; full attention and the shared expert FP8 dynamic;
    linear attention, routers, vision, MTP and lm_head kept."""
    if module.startswith(("mtp.", "model.visual.")) or ".linear_attn." in module or module.endswith("lm_head"):
        return None
    if ".self_attn." in module:
        return "fp8-dynamic"
    if ".mlp.shared_expert." in module:
        return "fp8-dynamic"
    if ".mlp.experts." in module:
        return "nvfp4"
    return None


CASES = {"deepseek-r1-nvfp4-fp8-block": deepseek_r1_nvfp4_fp8_block, "qwen3.6-35b-a3b-nvfp4-fp8": qwen36_nvfp4_fp8}


@pytest.mark.parametrize("name", sorted(CASES))
def test_recipe_gives_the_published_scheme_map(name, tiny, tmp_path):
    recipe = load_recipe(RECIPES / f"{name}.yaml").recipe
    assert recipe.quantize is not None and recipe.quantize.scheme_for
    options = QuantizeOptions(**{**quantize_kwargs(recipe.quantize.model_dump()), "device": "cpu", "samples": 4,
                                 "seq_len": 16})
    source = tiny(recipe.family)
    quantize_checkpoint(source, tmp_path / "out", options)
    with open_checkpoint(tmp_path / "out", mixed=True) as ckpt:
        schemes = ckpt.module_schemes()
        text = ckpt.family.text_config(ckpt.config)
        mtp_layer = f"model.layers.{text['num_hidden_layers']}."
        linears = [n.removesuffix(".weight") for n in ckpt.passthrough if n.endswith(".weight")
                   and len(ckpt.reader.info(n).shape) == 2 and "embed" not in n and "norm" not in n]
        expected = {m: s for m in [*schemes, *linears] if (s := CASES[name](m, mtp_layer)) is not None}
    assert schemes == expected
    assert len(set(schemes.values())) == 2 and any(".experts." in m for m in schemes)

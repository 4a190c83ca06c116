"""Every recipe in recipes/ runs on a tiny stand-in of its family; invalid recipes fail with one line that
names the key and where it was set, exit 2."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from fp4kit.errors import Fp4kitError
from fp4kit.pipeline import run_recipe
from fp4kit.pipeline.recipe import MAX_VALUES, STEP_ORDER, RecipeError, check_against_model, load_recipe
from fp4kit.testing.fixtures import RECIPE_STAND_INS

RECIPES = sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))
SEED_RECIPES = {"qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3-vl-235b-a22b", "glm-4.5-air", "glm-4.5v", "llama-4-scout",
                "llama-4-maverick", "demo", "deepseek-v3", "kimi-k2"}
SEED_RECIPES |= {"glm-4.7-flash", "glm-5.1", "deepseek-v3.2"}
SEED_RECIPES |= {"minimax-m2.5", "gpt-oss-120b"}
SEED_RECIPES |= {"qwen3.6-35b-a3b", "qwen3.5-397b-a17b", "qwen3-next-80b-a3b"}
SEED_RECIPES |= {"deepseek-v4-flash"}
SEED_RECIPES |= {"deepseek-r1-nvfp4-fp8-block", "qwen3.6-35b-a3b-nvfp4-fp8"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    from fp4kit.testing.fixtures import build_fixture

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_fixture(family, tmp_path_factory.mktemp(f"stand-in-{family}"),
                                          overrides=RECIPE_STAND_INS[family])
        return built[family]

    return get


def cpu_overrides(model: Path) -> list[str]:
    """Run a recipe on the CPU in seconds: the stand-in, little calibration, the reference MoE on small batches."""
    return [f"model={model}", "quantize.device=cpu", "quantize.samples=4", "quantize.seq_len=16", "verify.device=cpu",
            "verify.backend=reference", "verify.tokens=[4]"]


def test_recipes_directory_has_every_seed_model():
    assert {p.stem for p in RECIPES} == SEED_RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_is_valid_and_documented(path):
    loaded = load_recipe(path)
    assert loaded.recipe.steps(), path
    header = path.read_text().splitlines()
    assert header[0].startswith("# ") and sum(line.startswith("#") for line in header) >= 5, "comment header"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_header_commands_parse_and_load(path):
    """Each `--set ...` a recipe's header suggests is what `fp4kit run RECIPE --set ...` accepts, and the recipe
    loads with it."""
    import shlex

    import typer

    from fp4kit import cli

    header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    quoted = re.findall(r"`([^`]*)`", header.replace("\n# ", " "))
    fragments = [f for f in quoted if f.startswith("--set") and "<" not in f]  # <placeholder>: a description
    cli._register_commands()
    run = typer.main.get_command(cli.app).commands["run"]
    for fragment in fragments:
        with run.make_context("run", [str(path), *shlex.split(fragment)]) as ctx:
            load_recipe(path, ctx.params["set_"])


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_runs_on_tiny_stand_in(path, stand_in, tmp_path):
    family = load_recipe(path).recipe.family
    summary = run_recipe(path, cpu_overrides(stand_in(family)), tmp_path / "work")
    ran = [(s.name, s.status) for s in summary.steps]
    assert ran == [(step, "ran") for step in STEP_ORDER if getattr(load_recipe(path).recipe, step) is not None]
    assert summary.passed, [r for r in summary.verify["results"] if not r["passed"]]  # type: ignore[index]
    assert (tmp_path / "work" / "summary.md").is_file() and (tmp_path / "work" / "summary.json").is_file()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


BASE = "model: {model}\nfamily: qwen3_moe\n"
INVALID = {
    "unknown key": (BASE + "quantize:\n  sheme: nvfp4\n", [], "r.yaml:4: quantize.sheme: unknown key; did you mean "
                                                             "'scheme'?"),
    "unknown step": (BASE + "quantise:\n  scheme: nvfp4\n", [], "r.yaml:3: quantise: unknown key; did you mean "
                                                                "'quantize'?"),
    "wrong type": (BASE + "shard:\n  ep: eight\n", [], "r.yaml:4: shard.ep: Input should be a valid integer"),
    "bad value": (BASE + "layout:\n  backend: cutless\n", [],
                  "r.yaml:4: layout.backend: Input should be 'trtllm', 'cutlass'"),
    "list item": (BASE + "verify:\n  tokens: [1, x]\n", [], "r.yaml:4: verify.tokens.1: Input should be a valid "
                                                            "integer"),
    "unknown family": ("model: {model}\nfamily: qwen4_moe\nshard:\n  ep: 2\n", [],
                       "r.yaml:2: family: unknown model family 'qwen4_moe'"),
    "missing model": ("family: qwen3_moe\nshard:\n  ep: 2\n", [], "r.yaml: model: missing (required)"),
    "duplicate key": (BASE + "shard:\n  ep: 2\n  ep: 4\n", [], "r.yaml:5: shard.ep: duplicate key (first at line 4)"),
    "not a mapping": ("- model\n", [], "r.yaml:1: a recipe is a mapping"),
    "no steps": (BASE, [], "r.yaml: no steps"),
    "weight-only W4A4 kernel": (BASE + "quantize:\n  scheme: nvfp4a16\nlayout:\n  backend: cutlass\n", [],
                                "r.yaml:6: layout.backend: cutlass runs a W4A4 kernel"),
    "--set unknown key": (BASE + "shard:\n  ep: 2\n", ["shard.epp=4"], "--set shard.epp=4: shard.epp: unknown key"),
    "--set wrong type": (BASE + "shard:\n  ep: 2\n", ["shard.ep=two"], "--set shard.ep=two: shard.ep: Input should "
                                                                       "be a valid integer"),
    "--set malformed": (BASE + "shard:\n  ep: 2\n", ["shard.ep"], "--set shard.ep: expected KEY=VALUE"),
}


@pytest.mark.parametrize("case", INVALID, ids=list(INVALID))
def test_invalid_recipe_names_key_and_line(case, tmp_path):
    text, overrides, expected = INVALID[case]
    with pytest.raises(Fp4kitError) as error:
        load_recipe(write(tmp_path, text.format(model=tmp_path)), overrides)
    assert str(error.value).startswith(str(tmp_path / expected) if expected.startswith("r.yaml") else expected)
    assert "\n" not in str(error.value)


AGAINST_MODEL = {
    "family mismatch": ("model: {model}\nfamily: glm4_moe\nshard:\n  ep: 2\n", "r.yaml:2: family: glm4_moe does not "
                                                                               "match the model"),
    "EP not dividing E for the backend": (
        BASE + "layout:\n  backend: trtllm\nshard:\n  ep: 3\n",
        "r.yaml:6: shard.ep: 3 with layout.backend trtllm: TRT-LLM-gen MoE places E/ep experts on each rank"),
    "EP above E": (BASE + "shard:\n  ep: 16\n", "r.yaml:4: shard.ep: 16 exceeds the model's 8 experts"),
    "backend shape": (BASE + "quantize:\n  scheme: nvfp4a16\nlayout:\n  backend: marlin\n",
                      "r.yaml:6: layout.backend: marlin: hidden size H = 64 must be a positive multiple of 128"),
    "model not there": ("model: {model}/nothing\nfamily: qwen3_moe\nshard:\n  ep: 2\n",
                        "r.yaml:1: model: {model}/nothing: no config.json there"),
}


@pytest.mark.parametrize("case", AGAINST_MODEL, ids=list(AGAINST_MODEL))
def test_recipe_checked_against_model_before_any_step(case, tiny, tmp_path):
    model = tiny("qwen3_moe")  # 8 experts, H 64, I 32
    text, expected = AGAINST_MODEL[case]
    loaded = load_recipe(write(tmp_path, text.format(model=model)))
    with pytest.raises(Fp4kitError) as error:
        check_against_model(loaded)
    assert str(error.value).startswith(str(tmp_path / expected.format(model=model)))


def test_cli_exit_2_with_one_line(tmp_path, monkeypatch, capsys):
    from fp4kit.cli import main

    path = write(tmp_path, BASE.format(model=tmp_path) + "shard:\n  ep: 2\n  placment: linear\n")
    monkeypatch.setattr(sys, "argv", ["fp4kit", "run", str(path), "--workdir", str(tmp_path / "w")])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {path}:5: shard.placment: unknown key; did you mean 'placement'?"]
    assert not (tmp_path / "w").exists()


def problems(tmp_path: Path, text: str, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(RecipeError) as error:
        load_recipe(write(tmp_path, text.format(model=tmp_path)), overrides or [])
    prefix = f"{tmp_path}{os.sep}"
    return [p.removeprefix(prefix) for p in error.value.problems]


def test_a_typo_is_an_unknown_key_not_a_missing_one(tmp_path):
    assert problems(tmp_path, BASE + "shard:\n  epp: 4\n") == ["r.yaml:4: shard.epp: unknown key; did you mean 'ep'?"]


def test_every_problem_is_reported_in_file_order(tmp_path, monkeypatch, capsys):
    text = BASE + "shard:\n  epp: 4\n  placment: x\nquantize:\n  scheme: nvfp5\n  samples: 0\nname: [1, 2]\n"
    expected = ["r.yaml:4: shard.epp: unknown key; did you mean 'ep'?",
                "r.yaml:5: shard.placment: unknown key; did you mean 'placement'?",
                "r.yaml:7: quantize.scheme: Input should be 'nvfp4a16' or 'nvfp4', got 'nvfp5'",
                "r.yaml:8: quantize.samples: Input should be greater than or equal to 1, got 0",
                "r.yaml:9: name: Input should be a valid string, got [1, 2]",
                "--set verify.seed=x: verify.seed: Input should be a valid integer, got 'x'"]
    assert problems(tmp_path, text, ["verify.seed=x"]) == expected

    from fp4kit.cli import main

    monkeypatch.setattr(sys, "argv", ["fp4kit", "run", str(tmp_path / "r.yaml"), "--set", "verify.seed=x"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {tmp_path}{os.sep}{line}" if line.startswith("r.yaml")
                                                    else f"error: {line}" for line in expected]


def nested_anchors(levels: int, at: str) -> str:
    """Each anchor a list of nine aliases of the one before: 9**levels strings from a few hundred bytes."""
    lines = ['a0: &a0 ["xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", '
             '"xxxxxxxx"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\n{at}: *a{levels - 1}\n"


def test_alias_expansion_is_bounded(tmp_path):
    """Unbounded, this recipe is 9**6 strings and its error line 6.5 MB (one more level: seconds and GB)."""
    with pytest.raises(Fp4kitError) as error:
        load_recipe(write(tmp_path, BASE.format(model=tmp_path) + nested_anchors(6, "name")))
    assert str(error.value) == (f"{tmp_path / 'r.yaml'}:7: YAML aliases expand this value to 66430 values; a recipe "
                                f"holds at most {MAX_VALUES}")
    with pytest.raises(Fp4kitError, match=r"r.yaml:3: a YAML alias refers to the value that contains it"):
        load_recipe(write(tmp_path, BASE.format(model=tmp_path) + "a: &a [1, *a]\n"))
    shared = "quantize:\n  ignore: &keep [lm_head, 'mlp\\.gate$']\n  targets: *keep\nshard: {ep: 2}\n"
    recipe = load_recipe(write(tmp_path, BASE.format(model=tmp_path) + shared)).recipe
    assert recipe.quantize and recipe.quantize.ignore == recipe.quantize.targets == ["lm_head", "mlp\\.gate$"]


@pytest.mark.parametrize("case", ["long value", "long key", "deep", "huge file"])
def test_error_lines_stay_short(tmp_path, case):
    text = {"long value": BASE + "shard:\n  ep: " + "x" * 100_000 + "\n",
            "long key": BASE + "shard:\n  ep: 2\n  " + "k" * 1000 + ": 1\n",  # YAML allows 1024
            "deep": BASE + "name: " + "[" * 5000 + "\n",
            "huge file": BASE + "shard:\n  ep: 2\n" + "# filler\n" * 200_000}[case]
    with pytest.raises(Fp4kitError) as error:
        load_recipe(write(tmp_path, text.format(model=tmp_path)))
    message = str(error.value)
    assert "\n" not in message and len(message) < len(str(tmp_path)) + 200, message[:300]
    assert {"long value": "shard.ep: Input should be a valid integer, got 'xxxx", "long key": "shard.kkkk",
            "deep": "nested too deeply", "huge file": "over 1 MB"}[case] in message


def test_set_values_are_yaml_and_steps_toggle(tmp_path):
    path = write(tmp_path, BASE.format(model=tmp_path) + "layout:\n  backend: trtllm\nshard:\n  ep: 2\nverify: true\n")
    recipe = load_recipe(path, ["shard.ep=4", "layout=null", "verify.tokens=[2, 8]", "quantize.scheme=nvfp4"]).recipe
    assert recipe.steps() == ["quantize", "shard", "verify"]
    assert recipe.shard and recipe.shard.ep == 4
    assert recipe.verify and recipe.verify.tokens == [2, 8]
    assert recipe.name == "r"


def test_pipelines_doc_lists_every_recipe_family_and_quantize_key():
    """docs/pipelines.md: a row per recipe, every family the `family` key takes, every key of the quantize step."""
    from fp4kit.families import FAMILIES
    from fp4kit.pipeline.recipe import QuantizeStep

    text = (Path(__file__).parents[1] / "docs" / "pipelines.md").read_text()
    assert {p.name for p in RECIPES} <= set(re.findall(r"^\| `([\w.-]+\.yaml)` \|", text, re.MULTILINE))
    family_row = next(line for line in text.splitlines() if line.startswith("| `family` |"))
    names = FAMILIES if isinstance(FAMILIES, dict) else [f.name for f in FAMILIES]
    assert all(f"`{name}`" in family_row for name in names), family_row
    quantize = text[text.index("- `quantize` — "):text.index("- `repair` — ")]
    assert all(f"`{key}`" in quantize for key in QuantizeStep.model_fields), quantize

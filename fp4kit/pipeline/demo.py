"""`fp4kit demo`: the whole pipeline (fp4kit/data/demo.yaml: calibrated W4A4 quantize, TRT-LLM layout, EP=2 shard,
verify) on a small model of one family built offline from seeded weights, in about a minute on a CPU.

The demo's models are the tiny test fixtures (fp4kit.testing.fixtures) resized so that every layout backend accepts
them: H = 128 and I = 64 (CUTLASS: I % 64 == 0 and H % 64 == 0; Marlin: H % 128 == 0 and I % 64 == 0; TRT-LLM-gen:
16-element blocks, padding the rest itself) and 8 experts, which EP 2, 4 and 8 divide (TRT-LLM-gen and CUTLASS place E /
ep experts on each rank). `fp4kit layout --backend cutlass|marlin` and `fp4kit inspect --backend ...` on the kept
quantize output accept them as they are.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from fp4kit.errors import Fp4kitError

DEMO_HIDDEN, DEMO_INTERMEDIATE, DEMO_EXPERTS = 128, 64, 8
# the vision towers project into the text stream: their output width follows the text hidden size
_VISION_OUT = {"vision_config": {"out_hidden_size": DEMO_HIDDEN}}
DEMO_MODELS: dict[str, dict] = {
    "qwen3_moe": {"moe_intermediate_size": DEMO_INTERMEDIATE, "num_experts": DEMO_EXPERTS},
    "qwen3_vl_moe": {"moe_intermediate_size": DEMO_INTERMEDIATE, "num_experts": DEMO_EXPERTS, **_VISION_OUT},
    "glm4_moe": {"moe_intermediate_size": DEMO_INTERMEDIATE, "n_routed_experts": DEMO_EXPERTS},
    "glm4v_moe": {"moe_intermediate_size": DEMO_INTERMEDIATE, "n_routed_experts": DEMO_EXPERTS, **_VISION_OUT},
    "llama4": {"intermediate_size": DEMO_INTERMEDIATE, "num_local_experts": DEMO_EXPERTS},
    "deepseek_v3": {"moe_intermediate_size": DEMO_INTERMEDIATE, "n_routed_experts": DEMO_EXPERTS},
    "glm4_moe_lite": {"moe_intermediate_size": DEMO_INTERMEDIATE, "n_routed_experts": DEMO_EXPERTS},
    "deepseek_v32": {"moe_intermediate_size": DEMO_INTERMEDIATE, "n_routed_experts": DEMO_EXPERTS},
    "glm_moe_dsa": {"moe_intermediate_size": DEMO_INTERMEDIATE, "n_routed_experts": DEMO_EXPERTS},
    "minimax_m2": {"intermediate_size": DEMO_INTERMEDIATE, "num_local_experts": DEMO_EXPERTS},
    "gpt_oss": {"intermediate_size": DEMO_INTERMEDIATE, "num_local_experts": DEMO_EXPERTS},
    "qwen3_next": {"moe_intermediate_size": DEMO_INTERMEDIATE, "num_experts": DEMO_EXPERTS},
    "qwen3_5_moe": {"moe_intermediate_size": DEMO_INTERMEDIATE, "num_experts": DEMO_EXPERTS, **_VISION_OUT},
}
DEMO_FAMILIES = tuple(DEMO_MODELS)


def demo_overrides(family: str) -> dict:
    """The fixture config keys the demo model of ``family`` changes (fp4kit.testing.fixtures.build_fixture's
    overrides)."""
    if family not in DEMO_MODELS:
        raise Fp4kitError(f"--family {family}: no demo model; choose one of {', '.join(DEMO_FAMILIES)}")
    return {"hidden_size": DEMO_HIDDEN, **DEMO_MODELS[family]}


def build_demo_model(family: str, path: Path) -> Path:
    from fp4kit.testing.fixtures import build_fixture

    return build_fixture(family, path, overrides=demo_overrides(family))


def run_demo(keep: Path | None = None, device: str = "cpu", family: str = "qwen3_moe") -> Iterator[str]:
    """Build the demo model of ``family`` and run the demo recipe on it in ``keep`` (default: a temporary
    directory, removed at the end); yield the lines to print. Raises SystemExit(1) when a verify check failed."""
    overrides = demo_overrides(family)  # an unknown family is refused before any work
    from fp4kit.verify.backends import enable_triton_interpreter

    if device == "cpu":
        enable_triton_interpreter()  # before anything imports triton (transformers may)
    from fp4kit.pipeline import run_recipe

    with tempfile.TemporaryDirectory(prefix="fp4kit-demo-") as tmp:
        root = Path(keep) if keep else Path(tmp)
        src = build_demo_model(family, root / f"demo-{family}-bf16")
        yield (f"built a small {family} model (H {overrides['hidden_size']}, expert I {DEMO_INTERMEDIATE}, "
               f"{DEMO_EXPERTS} experts, seeded random weights) at {src}")
        recipe = resources.files("fp4kit.data").joinpath("demo.yaml")
        with resources.as_file(recipe) as recipe_path:
            summary = run_recipe(recipe_path, [f"model={src}", f"family={family}", f"quantize.device={device}",
                                               f"verify.device={device}"], root / "run")
        yield summary.markdown()
        yield f"outputs: {root / 'run'}" if keep else "outputs were in a temporary directory (--keep DIR keeps them)"
        if not summary.passed:
            raise SystemExit(1)

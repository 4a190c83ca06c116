"""`fp4kit demo`: the whole pipeline (recipes/demo.yaml: calibrated W4A4 quantize, TRT-LLM layout, EP=2 shard,
verify) on a tiny Qwen3-MoE built offline from seeded weights, in under a minute on a CPU."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path


def run_demo(workdir: Path | None = None, device: str = "cpu") -> Iterator[str]:
    from fp4kit.verify.backends import enable_triton_interpreter

    if device == "cpu":
        enable_triton_interpreter()  # before anything imports triton (transformers may)
    from fp4kit.fixtures import build_fixture
    from fp4kit.pipeline import run_recipe

    with tempfile.TemporaryDirectory(prefix="fp4kit-demo-") as tmp:
        root = Path(workdir) if workdir else Path(tmp)
        src = build_fixture("qwen3_moe", root / "tiny-qwen3-moe-bf16")
        yield f"built a tiny Qwen3-MoE (8 experts, seeded random weights) at {src}"
        recipe = resources.files("fp4kit.data").joinpath("demo.yaml")
        with resources.as_file(recipe) as recipe_path:
            summary = run_recipe(recipe_path, [f"model={src}", f"quantize.device={device}",
                                               f"verify.device={device}"], root / "run")
        yield summary.markdown()
        yield f"outputs: {root / 'run'}" if workdir else "outputs were in a temp dir (use --workdir to keep them)"
        if not summary.passed:
            raise SystemExit(1)

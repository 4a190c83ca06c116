"""fp4kit.registry: every registered dialect and backend implements its protocol, is what each command and recipe
offers, round-trips through the commands that read and write it, and is spelled nowhere else in the package."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest
import torch
from helpers import choices

from fp4kit import registry
from fp4kit.formats.base import ROLES, Dialect

PACKAGE = Path(registry.__file__).parent
DIALECT_METHODS = ("declared_by", "scheme", "owns", "find_modules", "store_scale", "planned", "encode", "decode",
                   "quantization_config", "spell_ignore")
BACKEND_FUNCTIONS = ("check_shapes", "transform", "describe", "undo", "layout_options", "shape_problems",
                     "padded_sizes", "manifest_kernel", "kernel_arguments")


@pytest.mark.parametrize("name", registry.DIALECT_NAMES)
def test_dialect_implements_the_protocol(name: str) -> None:
    dialect = registry.dialect(name)
    assert isinstance(dialect, Dialect) and dialect.name == name and dialect.title
    assert set(dialect.suffixes) == set(ROLES) and dialect.stores in ("multiplier", "divisor")
    missing = [m for m in DIALECT_METHODS if getattr(type(dialect), m) is getattr(Dialect, m)]
    assert not missing, f"{name} does not implement {missing}"


@pytest.mark.parametrize("name", registry.DIALECT_NAMES)
def test_dialect_writes_what_it_plans_and_reads_it_back(name: str) -> None:
    from fp4kit.nvfp4 import quantize_group

    dialect = registry.dialect(name)
    weight, = quantize_group([torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).bfloat16()])
    input_div = torch.tensor(0.37 / 2688, dtype=torch.float64)
    tensors = dialect.encode("model.layers.0.mlp.down_proj", weight, input_div)
    planned = dialect.planned("model.layers.0.mlp.down_proj", 32, 64, True)
    assert {t.name: (t.dtype, tuple(t.shape)) for t in planned} == {
        k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    back, back_input = dialect.decode("model.layers.0.mlp.down_proj", tensors)
    assert torch.equal(back.packed, weight.packed)
    assert torch.equal(back.block_scale.view(torch.uint8), weight.block_scale.view(torch.uint8))
    # per-tensor scales come back as the dialect stores them (fp32: exact float64 needs the metadata record)
    for read, written in ((back.global_scale_div, weight.global_scale_div), (back_input, input_div)):
        assert torch.equal(dialect.store_scale(read), dialect.store_scale(written))
    assert set(dialect.scale_names("model.layers.0.mlp.down_proj")) <= set(tensors)
    # the evidence rule: some written name is this dialect's alone
    owned = [n for n in tensors if dialect.owns(n)]
    assert owned and not any(other.owns(n) for n in owned for other in registry.dialects() if other is not dialect)


def test_dialect_choices_are_the_registry() -> None:
    from fp4kit.ep.scales import INPUT_SCALE_LEAVES
    from fp4kit.pipeline import recipe
    from fp4kit.quantize import checkpoint as quantize

    names = set(registry.DIALECT_NAMES)
    assert choices("quantize", "format") == names and set(quantize.FORMATS) == names
    assert choices("convert", "to") - {"bf16"} == names
    for step, field in ((recipe.QuantizeStep, "format"), (recipe.RepairStep, "to")):
        assert set(typing.get_args(step.model_fields[field].annotation)) == names
    assert registry.DEFAULT_DIALECT in names
    # shard reads scales without torch, so it keeps its own table: it must name every dialect's input scale
    assert INPUT_SCALE_LEAVES == {d.suffixes["input"].lstrip("."): d.largest_amax for d in registry.dialects()}


@pytest.mark.parametrize("name", registry.BACKEND_NAMES)
def test_backend_implements_the_protocol(name: str) -> None:
    module = registry.backend(name)
    assert module.BACKEND == name and isinstance(module.W4A4, bool) and module.KERNEL
    assert not [f for f in BACKEND_FUNCTIONS if not callable(getattr(module, f, None))]
    options = module.layout_options(torch.bfloat16, "flashinfer")
    kernel = module.manifest_kernel(options)
    assert {"library", "function", "description", "gate_up_input_divisor", "scalar_formulas"} <= set(kernel)
    assert module.shape_problems(128, 64) == [] and module.padded_sizes(128, 64)[0] >= 128


def test_backend_choices_are_the_registry() -> None:
    from fp4kit.layouts import directory as layout
    from fp4kit.pipeline import recipe
    from fp4kit.tools import inspect

    names = set(registry.BACKEND_NAMES)
    assert choices("layout", "backend") == names and set(layout.BACKENDS) == names
    assert set(inspect.BACKENDS) == names
    assert set(typing.get_args(recipe.LayoutStep.model_fields["backend"].annotation)) == names


@pytest.fixture(scope="module")
def demo_source(tmp_path_factory) -> Path:
    from fp4kit.pipeline.demo import build_demo_model

    return build_demo_model("qwen3_moe", tmp_path_factory.mktemp("registry") / "bf16")


@pytest.mark.parametrize("name", registry.DIALECT_NAMES)
def test_every_dialect_is_detected_converted_and_inspected(demo_source: Path, tmp_path: Path, name: str) -> None:
    from fp4kit.formats.detect import open_checkpoint
    from fp4kit.io.checkpoint import CheckpointReader
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
    from fp4kit.tools.convert import convert_checkpoint
    from fp4kit.tools.inspect import inspect_checkpoint

    quantize_checkpoint(demo_source, tmp_path / name, QuantizeOptions(format=name))
    with open_checkpoint(tmp_path / name) as ckpt:
        assert ckpt.dialect == name and ckpt.modules
    assert inspect_checkpoint(tmp_path / name).dialect == name
    for other in registry.DIALECT_NAMES:  # through every other dialect and back: the same tensors
        convert_checkpoint(tmp_path / name, tmp_path / f"{name}-{other}", other)
        convert_checkpoint(tmp_path / f"{name}-{other}", tmp_path / f"{name}-{other}-back", name)
        with CheckpointReader(tmp_path / name) as a, CheckpointReader(tmp_path / f"{name}-{other}-back") as b:
            assert sorted(a.names()) == sorted(b.names())
            assert all(a.read(n).dtype == b.read(n).dtype and torch.equal(
                a.read(n).reshape(-1).view(torch.uint8), b.read(n).reshape(-1).view(torch.uint8)) for n in a.names())


@pytest.mark.parametrize("name", registry.BACKEND_NAMES)
def test_every_backend_lays_out_and_loads(demo_source: Path, tmp_path: Path, name: str) -> None:
    from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint
    from fp4kit.layouts.runtime import load_moe_layer
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
    from fp4kit.tools.inspect import inspect_checkpoint

    scheme = "nvfp4" if registry.backend(name).W4A4 else "nvfp4a16"
    options = QuantizeOptions(scheme=scheme, samples=4, seq_len=16, batch_size=4)
    quantize_checkpoint(demo_source, tmp_path / "q", options)
    assert inspect_checkpoint(tmp_path / "q", [name]).backends[name] == "ok"
    layout_checkpoint(tmp_path / "q", tmp_path / "layout", LayoutOptions(backend=name))
    arguments = load_moe_layer(tmp_path / "layout", 0, name)
    assert any(isinstance(v, torch.Tensor) for v in arguments.values())


# Modules that may spell a registered name (None: any), and why. Any other string constant equal to a dialect's
# or backend's name, a dialect's tensor suffix or config file is wiring that belongs in the registry or its owner.
ALLOWED: dict[str, tuple[set[str] | None, str]] = {
    "registry.py": (None, "the registry"),
    "io/checkpoint.py": ({"hf_quant_config.json"}, "the I/O layer's files that writers rewrite (checked to cover all)"),
    "ep/scales.py": ({"input_global_scale", "input_scale"}, "torch-free table (checked above)"),
    "io/sources.py": ({"compressed-tensors", ".weight_packed", "modelopt", "hf_quant_config.json", ".input_scale"},
                      "quantized sources: compressed-tensors' INT, FP8 (its dropped static input scale) and MXFP4 "
                      "formats; ModelOpt's configs only recognized, to refuse them as sources"),
    "testing/fixtures.py": (None, "test fixtures"),
    "testing/synthetic.py": (None, "test fixtures"),
    "verify/backends.py": ({"marlin"}, "verify's kernel runners (a Marlin runner), not layout backends"),
    "options.py": ({"marlin"}, "verify's kernel runners (verify --backend, the recipe's verify.backend)"),
    "tools/trtllm_checks.py": ({"trtllm"}, "the engine TensorRT-LLM (inspect --engine), not the layout backend"),
    "commands/inspect.py": ({"trtllm"}, "inspect --engine's choices (the engine TensorRT-LLM), spelled without torch"),
}


def _spellings() -> set[str]:
    words = set(registry.DIALECT_NAMES) | set(registry.BACKEND_NAMES)
    for dialect in registry.dialects():
        words |= set(dialect.config_files)
        words |= {s for s in dialect.suffixes.values() if s not in (".weight", ".weight_scale")}  # too common
        words |= {s.lstrip(".") for s in words if s.startswith(".")}
    return words


def test_nothing_spells_a_registered_name_elsewhere() -> None:
    from fp4kit.formats.detect import config_files
    from fp4kit.io.checkpoint import SKIP_FILES
    from fp4kit.io.shard_io import is_side_file

    assert set(config_files()) <= SKIP_FILES
    assert all(is_side_file(Path(name)) for name in config_files())  # layout and shard copy them
    words = _spellings()
    owners = {module.removeprefix("fp4kit.").replace(".", "/") + ".py"
              for module in (*registry.DIALECTS.values(), *registry.BACKENDS.values())}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        allowed = ALLOWED.get(rel, (set(), ""))[0]
        if allowed is None or rel in owners:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                found += [f"{rel}:{node.lineno}: {word!r}" for word in words - allowed if word == node.value]
    assert not found, found

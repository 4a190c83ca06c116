"""Helpers the tests share: the one module test files import besides fp4kit (tests/test_architecture.py checks that no
test module imports another). Fixtures live in conftest.py.

- running the CLI in-process (``run_cli``) and at a pseudo-terminal (``under_terminal``), with signals that reach
  children (``reaching_children``);
- editing checkpoints (``load_all``, ``copy_with``, ``rewrite``) and adding activation scales to an NVFP4A16 one;
- small NVFP4 sources without transformers (``nvfp4_source``, ``shared_source``, ``random_moe_only_source``) and a
  quantized source's bf16 copy as the peers make it (``dequantized_bf16_copy``);
- vLLM 0.33.0's own pure-python weight preparation and loading code for the oracle tests (tests/test_vllm_*.py).
  vLLM is installed without its dependencies (`pip install --no-deps -r .ci/vllm-oracle.txt`: vllm==0.33.0 plus the
  modules its imports need, as .ci/run does); ``vllm._C`` does not load on the CPU, so the only CUDA op these
  functions call, ``gptq_marlin_repack``, is swapped for vLLM's own test reference (``marlin_utils_test``).
  Without vLLM the tests skip with the reason; with FP4KIT_REQUIRE_ORACLES=1 (CI) they fail instead.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import logging
import os
import pty
import random
import re
import shutil
import signal
import subprocess
import sys
import typing
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4kit.formats import compressed_tensors as ct

EXPERT0 = "model.layers.0.mlp.experts.0"
SQUARE = {"hidden_size": 128, "moe_intermediate_size": 128}  # square experts: every layout backend's shape rules hold


# ---- the CLI --------------------------------------------------------------------------------------------------------

def run_cli(monkeypatch, capsys, *args: object) -> tuple[int, str, str]:
    """``fp4kit ARGS`` in this process: (exit code, stdout, stderr)."""
    from fp4kit import cli

    monkeypatch.setattr(sys, "argv", ["fp4kit", *map(str, args)])
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        gc.unfreeze()  # main freezes the heap for the exit it expects; this process goes on collecting
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_result(*args: object) -> subprocess.CompletedProcess:
    """``fp4kit ARGS`` in this process through the entry point's own code (``cli.main``: the same error handling and
    exit codes as ``python -m fp4kit``), as the process it stands for: exit code, stdout and stderr. Python warnings
    raised meanwhile are recorded under a fresh interpreter's filters and appended to stderr, where a child process
    would print them. It needs no fixture, so module-scoped fixtures can call it; tests of what only a process shows
    (signals, the console script, a killed run) start one instead."""
    from fp4kit import cli

    argv = ["fp4kit", *map(str, args)]
    out, err = io.StringIO(), io.StringIO()
    saved_argv = sys.argv
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        warnings.resetwarnings()
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        sys.argv = argv
        try:
            cli.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        finally:
            sys.argv = saved_argv
            gc.unfreeze()  # main freezes the heap for the exit it expects; this process goes on collecting
    printed = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue() + printed)


def cli_commands() -> dict:
    """The CLI's subcommands as click commands, by name."""
    import typer

    from fp4kit import cli

    cli._register_commands()
    return typer.main.get_command(cli.app).commands


def choices(command: str, option: str) -> set[str]:
    """The values ``fp4kit COMMAND --OPTION`` accepts (its Literal type)."""
    hints = typing.get_type_hints(cli_commands()[command].callback, include_extras=True)
    annotation = typing.get_args(hints[option])[0]
    literal = next(a for a in (annotation, *typing.get_args(annotation)) if typing.get_origin(a) is typing.Literal)
    return set(typing.get_args(literal))


# ---- a pseudo-terminal and signals ---------------------------------------------------------------------------------

ROOT = Path(__file__).parents[1]


def under_terminal(*args: object, columns: int = 100) -> tuple[int, str, str]:
    """Run `python -m fp4kit ARGS` with stderr on a pseudo-terminal ``columns`` wide: (exit code, stdout, the
    terminal's text with colours and cursor moves removed)."""
    leader, follower = pty.openpty()
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": str(columns), "TERM": "xterm"}
    process = subprocess.Popen([sys.executable, "-m", "fp4kit", *map(str, args)], stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=follower, env=env)
    os.close(follower)
    terminal = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower side closed: the process exited
            break
        if not chunk:
            break
        terminal += chunk
    os.close(leader)
    stdout = process.stdout.read().decode()  # type: ignore[union-attr]
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.decode(errors="replace"))
    return process.wait(timeout=300), stdout, text


SENT = (signal.SIGINT, signal.SIGTERM)


def _catch(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # this process's own Ctrl-C or SIGTERM during the Popen call


@contextlib.contextmanager
def reaching_children() -> Iterator[None]:
    """Processes started in the block see SIGINT and SIGTERM at their default disposition."""
    previous = {signum: signal.getsignal(signum) for signum in SENT}
    for signum, handler in previous.items():
        if handler in (signal.SIG_IGN, signal.SIG_DFL, None):
            signal.signal(signum, _catch)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def ignored_in_parent(signum: int) -> Iterator[None]:
    """The test process ignores ``signum`` for the block, as a backgrounded suite does SIGINT."""
    previous = signal.signal(signum, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signum, previous)


# ---- editing checkpoints --------------------------------------------------------------------------------------------

def load_all(root: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def copy_with(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """``dst`` = ``src``'s side files (config, manifests) with ``tensors`` as its only safetensors file."""
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            (dst / path.name).write_bytes(path.read_bytes())
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def add_input_scales(src: Path, dst: Path) -> Path:
    """``src`` (NVFP4A16) with per-expert activation scales: compressed-tensors ``input_global_scale`` multipliers,
    one per expert for gate and up (they see the same input) and one for down, declared as the NVFP4 scheme."""
    tensors = load_all(src)
    generator = torch.Generator().manual_seed(0)
    shared: dict[tuple[str, bool], torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        parent, proj = module.rsplit(".", 1)
        key = (parent, proj == "down_proj")
        if key not in shared:
            low = 2.0 if proj == "down_proj" else 6.0  # above what random unit-scale hidden states reach
            amax = low + 2.0 * torch.rand(1, generator=generator)
            shared[key] = (448 * 6 / amax).to(torch.float32)
        tensors[f"{module}.input_global_scale"] = shared[key].clone()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = ct.quantization_config("nvfp4", config["quantization_config"]["ignore"])
    return copy_with(src, dst, tensors, config)


def text_forward(model: torch.nn.Module) -> torch.nn.Module:
    """The module that runs a text-only forward of a transformers model: Llama-4's language model (the same
    computation for text input, and the only one transformers 5.24 runs: its Llama4ForConditionalGeneration.forward
    reads ``image_outputs`` from the language model's output, which has none; models/llama4/modeling_llama4.py),
    the model itself for every other family."""
    return model.language_model if type(model).__name__ == "Llama4ForConditionalGeneration" else model


def rewrite(src: Path, dst: Path, edit: Callable[[dict], None], config_edit: Callable[[dict], None] | None = None
            ) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with ``edit(tensors)`` applied to its tensors (and to its config)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config_edit:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def with_input_scales(src: Path, dst: Path, seed: int = 0) -> Path:
    """fp4kit's NVFP4A16 output made W4A4: a bf16-valued input multiplier per module, different per expert."""
    generator = torch.Generator().manual_seed(seed)

    def add(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith(".weight_packed")]:
            value = (100 + 400 * torch.rand(1, generator=generator)).bfloat16().float()
            tensors[name.replace(".weight_packed", ".input_global_scale")] = value

    def config(cfg: dict) -> None:
        cfg["quantization_config"] = ct.quantization_config("nvfp4", cfg["quantization_config"]["ignore"])

    return rewrite(src, dst, add, config)


# ---- sources --------------------------------------------------------------------------------------------------------

def dequantized_bf16_copy(src: Path, dst: Path) -> Path:
    """SRC dequantized to bf16 by compressed-tensors' own converters (FP8BlockDequantizer, or
    CompressedTensorsDequantizer for pack-quantized INT) and saved as a plain checkpoint."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if config["quantization_config"]["quant_method"] == "fp8":
        blocked = [n.removesuffix(".weight_scale_inv") for n in tensors if n.endswith(".weight_scale_inv")]
        tensors = FP8BlockDequantizer(targets=blocked, dtype=torch.bfloat16).process(tensors)
    else:
        tensors = CompressedTensorsDequantizer(src, dtype=torch.bfloat16).process(tensors)
    dst.mkdir()
    save_file({n: t.contiguous() for n, t in tensors.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def add_wide_input_scales(src: Path, dst: Path) -> Path:
    """``src`` (NVFP4A16) with one input multiplier per expert for gate/up and one for down, amax spread over
    0.5..8 (seeded by module name), declared as the NVFP4 scheme."""
    dst.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        parent, proj = module.rsplit(".", 1)
        rng = random.Random(f"{parent}:{proj == 'down_proj'}")
        tensors[f"{module}.input_global_scale"] = torch.tensor([448 * 6 / rng.uniform(0.5, 8.0)], dtype=torch.float32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = ct.quantization_config("nvfp4", config["quantization_config"]["ignore"])
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def nvfp4_source(root: Path, hidden: int = 128, intermediate: int = 64, num_experts: int = 8, layers: int = 2,
                 w4a4: bool = True) -> Path:
    """An NVFP4 (w4a4) or NVFP4A16 compressed-tensors Qwen3-MoE checkpoint with these MoE sizes."""
    from fp4kit.quantize.checkpoint import quantize_checkpoint
    from fp4kit.testing.synthetic import write_synthetic_qwen3_moe

    bf16 = write_synthetic_qwen3_moe(root / "bf16", num_layers=layers, hidden=hidden, moe_intermediate=intermediate,
                                     num_experts=num_experts, top_k=2, num_heads=2, num_kv_heads=1, head_dim=32,
                                     vocab_size=64, threads=1)
    weight_only = root / "nvfp4a16"
    quantize_checkpoint(bf16, weight_only)
    return add_wide_input_scales(weight_only, root / "nvfp4") if w4a4 else weight_only


_BUILT: dict[tuple, Path] = {}


def shared_source(tmp_path_factory, hidden: int, intermediate: int) -> Path:
    """nvfp4_source(...) built once per test session (its sibling `nvfp4a16` directory is the weight-only one)."""
    key = (hidden, intermediate)
    if key not in _BUILT:
        _BUILT[key] = nvfp4_source(tmp_path_factory.mktemp(f"nvfp4-h{hidden}-i{intermediate}"), hidden, intermediate)
    return _BUILT[key]


def random_moe_only_source(root: Path, layers: int, num_experts: int, hidden: int, intermediate: int) -> Path:
    """A W4A4 compressed-tensors Qwen3-MoE holding only routed experts (random bytes) and routers: big layers, fast
    to write, for measuring how memory grows with the number of layers."""
    from fp4kit.io.checkpoint import PlannedTensor, ShardWriter
    from fp4kit.testing.synthetic import Qwen3MoeDims, qwen3_moe_config

    root.mkdir(parents=True)
    shapes = {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
              "down_proj": (hidden, intermediate)}
    plan = []
    for layer in range(layers):
        plan.append(PlannedTensor(f"model.layers.{layer}.mlp.gate.weight", torch.bfloat16, (num_experts, hidden)))
        for e in range(num_experts):
            for proj, (n, k) in shapes.items():
                module = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                plan += [PlannedTensor(f"{module}.weight_packed", torch.uint8, (n, k // 2)),
                         PlannedTensor(f"{module}.weight_scale", torch.float8_e4m3fn, (n, k // 16)),
                         PlannedTensor(f"{module}.weight_global_scale", torch.float32, (1,)),
                         PlannedTensor(f"{module}.input_global_scale", torch.float32, (1,))]
    writer = ShardWriter(root, plan, 10**12)
    generator = torch.Generator().manual_seed(0)
    for t in plan:
        if t.dtype == torch.float32:
            value = torch.full(t.shape, 2688.0)
        elif t.dtype == torch.bfloat16:
            value = torch.zeros(t.shape, dtype=t.dtype)
        elif t.dtype == torch.float8_e4m3fn:
            value = torch.randint(0x30, 0x50, t.shape, dtype=torch.uint8, generator=generator).view(t.dtype)
        else:
            value = torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=generator).view(t.dtype)
        writer.write(t.name, value)
    writer.finish()
    config = qwen3_moe_config(Qwen3MoeDims(layers, hidden, intermediate, num_experts, top_k=2))
    config["quantization_config"] = ct.quantization_config("nvfp4", [])
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root


# ---- vLLM 0.33.0 as an oracle ---------------------------------------------------------------------------------------

VLLM_VERSION = "0.33.0"
INSTALL = "pip install --no-deps -r .ci/vllm-oracle.txt (vLLM and the modules its imports need)"


def _unavailable(why: str, install: str = INSTALL) -> None:
    """An oracle library that cannot be imported: skip with the reason, or fail with FP4KIT_REQUIRE_ORACLES (CI)."""
    if os.environ.get("FP4KIT_REQUIRE_ORACLES"):
        pytest.fail(f"FP4KIT_REQUIRE_ORACLES is set but {why}", pytrace=False)
    pytest.skip(f"{why}; install it with {install}", allow_module_level=True)


def vllm_module(name: str) -> ModuleType:
    """``vllm.<name>``, or skip (fail in CI) when vLLM 0.33.0 cannot be imported."""
    if not torch.cuda.is_available():
        # vLLM imports triton: on the CPU the rest of the suite runs Triton's interpreter, which must be switched
        # on before triton is first imported (fp4kit/verify/backends.py)
        from fp4kit.verify.backends import enable_triton_interpreter

        enable_triton_interpreter()
    try:
        import vllm
    except ImportError as exc:
        _unavailable(f"vLLM is not installed ({exc})")
    if getattr(vllm, "__version__", None) != VLLM_VERSION:
        _unavailable(f"vLLM {getattr(vllm, '__version__', '?')} is installed, the oracles pin {VLLM_VERSION}")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    try:
        return importlib.import_module(f"vllm.{name}")
    except ImportError as exc:
        _unavailable(f"vllm.{name} does not import ({exc})")
    raise AssertionError("unreachable")


# vLLM's packed_modules_mapping for the fused Linears a quant config is asked about by their serving names
VLLM_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def fused_serving_names(modules: dict[str, str]) -> dict[str, str]:
    """The fused serving names vLLM asks a quant config about, each with the module on disk whose scheme it must get:
    qkv_proj / gate_up_proj by their first part, MLA's fused_qkv_a_proj by q_a_proj."""
    asked: dict[str, str] = {}
    for parent in {m.rsplit(".", 1)[0] for m in modules}:
        for fused, parts in VLLM_PACKED.items():
            if f"{parent}.{parts[0]}" in modules:
                asked[f"{parent}.{fused}"] = f"{parent}.{parts[0]}"
        if f"{parent}.q_a_proj" in modules:
            asked[f"{parent}.fused_qkv_a_proj"] = f"{parent}.q_a_proj"
    return asked


def vllm_ct_scheme(config: dict) -> Callable[[str], str | None]:
    """vLLM 0.33's CompressedTensorsConfig parsed from a ``quantization_config``: module name -> the fp4kit scheme it
    gives that module (None: left unquantized)."""
    ct_config = vllm_module("model_executor.layers.quantization.compressed_tensors.compressed_tensors")
    parsed = ct_config.CompressedTensorsConfig.from_config(config)
    parsed.packed_modules_mapping = dict(VLLM_PACKED)

    class RowParallelLinear(torch.nn.Module):  # vLLM matches the class target "Linear" by substring
        pass

    def resolved(name: str) -> str | None:
        scheme = parsed.get_scheme_dict(RowParallelLinear(), name)
        if scheme is None:
            return None
        weights = scheme["weights"]
        if weights.num_bits == 4:
            return "nvfp4" if scheme["input_activations"] is not None else "nvfp4a16"
        strategy = getattr(weights.strategy, "value", weights.strategy)
        return {"channel": "fp8-dynamic", "block": "fp8-block", "tensor": "fp8-static"}[strategy]

    return resolved


def vllm_module_without_torchvision(name: str) -> ModuleType:
    """``vllm.<name>`` for a module that imports torchvision only for image preprocessing (mllama4.py, through
    transformers' Llama-4 image processor), where torchvision is not installed: torchvision's wheels are built
    against one torch build and CI keeps torch's CPU build. Empty stand-in modules satisfy the import and are
    removed again; the loading code under test never touches them."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        return vllm_module(name)
    stubs = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional")
    for stub in stubs:
        sys.modules[stub] = ModuleType(stub)
    try:
        return vllm_module(name)
    finally:
        for stub in stubs:
            sys.modules.pop(stub, None)


def gptq_marlin_repack_reference(b_q_weight: torch.Tensor, size_k: int, size_n: int, num_bits: int,
                                 is_a_8bit: bool = False) -> torch.Tensor:
    """``ops.gptq_marlin_repack`` on the CPU: unpack GPTQ's [K/8, N] int32 (row 8r + i at bits 4i of row r) and run
    vLLM's reference ``marlin_weights`` with ``get_weight_perm`` (what vLLM's kernel test compares the op with)."""
    test_utils = vllm_module("model_executor.layers.quantization.utils.marlin_utils_test")
    assert num_bits == 4 and not is_a_8bit
    words = b_q_weight.view(torch.int32)
    codes = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=1).reshape(size_k, size_n)
    return test_utils.marlin_weights(codes, size_k, size_n, num_bits, test_utils.get_weight_perm(num_bits))


def patch_cuda_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = vllm_module("_custom_ops")
    monkeypatch.setattr(ops, "gptq_marlin_repack", gptq_marlin_repack_reference, raising=False)


def marlin_layer(num_experts: int, hidden: int, intermediate: int, act_dtype: torch.dtype) -> SimpleNamespace:
    """The attributes of vLLM's RoutedExperts that ``prepare_nvfp4_moe_layer_for_marlin`` reads."""
    return SimpleNamespace(num_experts=num_experts, hidden_size=hidden, intermediate_size_per_partition=intermediate,
                           params_dtype=act_dtype)


def fi_layer(num_experts: int, hidden: int) -> SimpleNamespace:
    """The attributes of vLLM's RoutedExperts that ``prepare_nvfp4_moe_layer_for_fi_or_cutlass`` reads."""
    activation = SimpleNamespace(is_gated=True)
    moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(enable_eplb=False), hidden_dim_unpadded=None,
                                 hidden_dim=hidden, intermediate_size_per_partition=None)
    return SimpleNamespace(activation=activation, moe_config=moe_config, num_experts=num_experts)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def vllm_expert_inputs(root, experts: str, num_experts: int) -> dict[str, torch.Tensor | None]:
    """One MoE layer's tensors as vLLM 0.33's MoE methods hand them to ``convert_to_nvfp4_moe_kernel_format``.

    The parameters are filled as vLLM's loaders fill them (w13 rows [w1; w3], per-expert scales [E, 2] / [E], a
    fused ModelOpt Llama-4 tensor transposed and a layer scalar broadcast to every expert as mllama4.py does), then
    turned into the divisors ``process_weights_after_loading`` passes on: compressed-tensors
    (compressed_tensors_moe_w4a4_nvfp4.py) 1 / w13_weight_global_scale[:, 0], 1 / input_global_scale; ModelOpt
    (modelopt.py, ModelOptNvFp4FusedMoE) w13_weight_scale_2[:, 0] and the input scales as stored.
    """
    tensors = load_all(Path(root))
    compressed = any(name.endswith(".weight_packed") for name in tensors)
    suffix = {"packed": ".weight_packed", "block": ".weight_scale", "global": ".weight_global_scale",
              "input": ".input_global_scale"} if compressed else {"packed": ".weight", "block": ".weight_scale",
                                                                  "global": ".weight_scale_2", "input": ".input_scale"}
    fused = f"{experts}.gate_up_proj" in tensors

    def per_expert(proj: str, kind: str) -> list[torch.Tensor | None]:
        if fused:
            leaf = "down_proj" if proj == "down_proj" else "gate_up_proj"
            name = {"packed": "", "block": "_weight_scale", "global": "_weight_scale_2", "input": "_input_scale"}[kind]
            value = tensors.get(f"{experts}.{leaf}{name}")
            if value is None:
                return [None] * num_experts
            if kind in ("packed", "block"):
                value = value.transpose(-1, -2)  # [E, K, N] on disk -> [E, N, K]
                if leaf == "gate_up_proj":
                    value = value.chunk(2, dim=-2)[0 if proj == "gate_proj" else 1]
                return list(value)
            return [value.reshape(())] * num_experts
        return [tensors.get(f"{experts}.{e}.{proj}{suffix[kind]}") for e in range(num_experts)]

    def stack(proj: str, kind: str) -> torch.Tensor | None:
        values = per_expert(proj, kind)
        if values[0] is None:
            return None
        return torch.stack([v.reshape(v.shape if kind in ("packed", "block") else ()) for v in values])

    w13 = torch.cat([stack("gate_proj", "packed"), stack("up_proj", "packed")], dim=1).contiguous()
    w13_scale = torch.cat([stack("gate_proj", "block"), stack("up_proj", "block")], dim=1).contiguous()
    w13_global = torch.stack([stack("gate_proj", "global"), stack("up_proj", "global")], dim=1).float()
    w2_global = stack("down_proj", "global").float()
    gate_in, up_in, down_in = stack("gate_proj", "input"), stack("up_proj", "input"), stack("down_proj", "input")
    a13 = None if gate_in is None else torch.stack([gate_in, up_in], dim=1).float()
    a2 = None if down_in is None else down_in.float()
    if compressed:
        w13_scale_2, w2_scale_2 = 1.0 / w13_global[:, 0].contiguous(), 1.0 / w2_global
        a13, a2 = (None if a13 is None else 1.0 / a13), (None if a2 is None else 1.0 / a2)
    else:
        w13_scale_2, w2_scale_2 = w13_global[:, 0].contiguous(), w2_global
    return {"w13": w13, "w13_scale": w13_scale, "w13_scale_2": w13_scale_2, "a13_scale": a13,
            "w2": stack("down_proj", "packed").contiguous(), "w2_scale": stack("down_proj", "block").contiguous(),
            "w2_scale_2": w2_scale_2, "a2_scale": a2}


def vllm_moe_parameters(monkeypatch, dialect: str, num_experts: int, hidden: int, inter: int) -> torch.nn.Module:
    """The expert parameters vLLM 0.33's own NVFP4 MoE methods create (create_weights, run on a bare module; one
    tensor-parallel rank, as vLLM's parameters ask its process group)."""
    parameter = vllm_module("model_executor.parameter")
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    layer = torch.nn.Module()
    method = SimpleNamespace(moe=SimpleNamespace(is_act_and_mul=True), group_size=16, use_global_sf=False,
                             quant_config=SimpleNamespace(is_checkpoint_nvfp4_serialized=True, group_size=16))
    if dialect == "compressed-tensors":
        create = vllm_module("model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
                             "compressed_tensors_moe_w4a4_nvfp4").CompressedTensorsW4A4Nvfp4MoEMethod.create_weights
    else:
        create = vllm_module("model_executor.layers.quantization.modelopt").ModelOptNvFp4FusedMoE.create_weights
    create(method, layer, num_experts, hidden, inter, torch.bfloat16, weight_loader=None,
           global_num_experts=num_experts)
    return layer


def vllm_prepare(monkeypatch, backend, inputs: dict) -> dict[str, torch.Tensor]:
    """vLLM's ``prepare_nvfp4_moe_layer_for_fi_or_cutlass`` on ``inputs`` (``vllm_expert_inputs``) for ``backend``,
    with the scalars its TRT-LLM / CUTLASS kernels derive (trtllm_nvfp4_moe.py, oracle/nvfp4.py)."""
    import flashinfer
    from flashinfer.diffusion_ops.minimax_h3_fc1_swiglu import _swizzle_sf_128x4

    fi_moe = vllm_module("model_executor.layers.quantization.utils.flashinfer_fp4_moe")
    monkeypatch.setattr(flashinfer, "nvfp4_block_scale_interleave", _swizzle_sf_128x4)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)  # swizzle_blockscale ends in .cuda()
    num_experts, _, half_h = inputs["w13"].shape
    names = ("w13", "w13_scale", "w13_scale_2", "a13_scale", "w2", "w2_scale", "w2_scale_2", "a2_scale")
    args = {name: inputs[name].clone() for name in names}
    out = fi_moe.prepare_nvfp4_moe_layer_for_fi_or_cutlass(backend, fi_layer(num_experts, 2 * half_h), **args,
                                                            is_act_and_mul=True)
    prepared = dict(zip(names, out, strict=True))
    a13, a2 = prepared["a13_scale"], prepared["a2_scale"]
    prepared.update(g1_alphas=prepared["w13_scale_2"] * a13, a1_gscale=1.0 / a13, a2_gscale=1.0 / a2,
                    g2_alphas=prepared["w2_scale_2"] * a2)
    prepared["g1_scale_c"] = prepared["g1_alphas"] * prepared["a2_gscale"]
    return prepared


MARLIN_ACT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def vllm_marlin(monkeypatch, inputs: dict, act_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """vLLM's ``prepare_nvfp4_moe_layer_for_marlin`` on ``inputs`` (``vllm_expert_inputs``)."""
    marlin_fp4 = vllm_module("model_executor.layers.quantization.utils.marlin_utils_fp4")
    patch_cuda_ops(monkeypatch)
    num_experts, twice_i, half_h = inputs["w13"].shape
    layer = marlin_layer(num_experts, 2 * half_h, twice_i // 2, act_dtype)
    w1, w1_scale, global1, w2, w2_scale, global2 = marlin_fp4.prepare_nvfp4_moe_layer_for_marlin(
        layer, inputs["w13"], inputs["w13_scale"], inputs["w13_scale_2"], inputs["w2"], inputs["w2_scale"],
        inputs["w2_scale_2"], is_act_and_mul=True)
    return {"w1": w1, "w1_scale": w1_scale, "global_scale1": global1, "w2": w2, "w2_scale": w2_scale,
            "global_scale2": global2}


def assert_same_as_marlin(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """fp4kit's Marlin tensors byte for byte ``vllm_marlin``'s (its global scales in fp4kit's dtype)."""
    for name, expected in theirs.items():
        assert same_bytes(ours[name], expected.to(ours[name].dtype) if name.startswith("global") else expected), name


# ---- SGLang as an oracle ---------------------------------------------------------------------------------------------
# SGLang's own pure-python quantization-config code, imported for the oracle tests (tests/test_sglang_*.py).
#
# SGLang is installed without its dependencies (`pip install --no-deps -r .ci/sglang-oracle.txt`: sglang==0.5.23 and
# the pure-python module its imports need, as .ci/run does). Its package imports torchvision (image processors) and
# sentencepiece (a tokenizer class) at import time, neither of which CI installs (torchvision's wheels are built
# against one torch build and CI keeps torch's CPU build): stand-in modules satisfy those imports while SGLang is
# imported, and its image-processor registrations go to an inert AutoImageProcessor; the config parsing
# under test never touches them. SGLang's registrations with transformers' Auto classes are undone afterwards, so the
# rest of the session builds fixtures with transformers' own config classes. Without SGLang the tests skip with the
# reason; with FP4KIT_REQUIRE_ORACLES=1 (CI) they fail instead.

SGLANG_VERSION = "0.5.23"
SGLANG_INSTALL = "pip install --no-deps -r .ci/sglang-oracle.txt (SGLang and the module its imports need)"
STAND_INS = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.functional",
             "torchvision.transforms.v2.functional", "torchvision.io", "torchvision.ops", "sentencepiece")




class _StandIn(ModuleType):
    """A module whose every public attribute is an inert class (only names used at import time are asked)."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *args, **kwargs: None})


class _ImageProcessorRegistry:
    """Stands in for transformers' AutoImageProcessor (which needs torchvision) while SGLang registers its image
    processors at import time."""

    @classmethod
    def register(cls, *args: object, **kwargs: object) -> None:
        pass


def _missing(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return True
    return False


def _auto_registries() -> list:
    """transformers' Auto* name -> class mappings that ``register`` calls extend (their ``_extra_content``), of the
    Auto modules imported so far (importing more here would change what SGLang's import then sees)."""
    prefix = "transformers.models.auto."
    return [value for name, module in list(sys.modules.items()) if name.startswith(prefix) and module is not None
            for value in list(vars(module).values()) if isinstance(getattr(value, "_extra_content", None), dict)]


def sglang_module(name: str) -> ModuleType:
    """``sglang.<name>``, or skip (fail in CI) when SGLang 0.5.23 cannot be imported."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        installed = version("sglang")
    except PackageNotFoundError:
        _unavailable("SGLang is not installed", SGLANG_INSTALL)
    if installed != SGLANG_VERSION:
        _unavailable(f"SGLang {installed} is installed, the oracles pin {SGLANG_VERSION}", SGLANG_INSTALL)
    if f"sglang.{name}" in sys.modules:
        return sys.modules[f"sglang.{name}"]
    import torch

    if not torch.cuda.is_available():
        # SGLang imports triton: on the CPU the rest of the suite runs Triton's interpreter, which must be switched
        # on before triton is first imported (fp4kit/verify/backends.py)
        from fp4kit.verify.backends import enable_triton_interpreter

        enable_triton_interpreter()
    import transformers
    import transformers.utils.import_utils as import_utils

    registries = _auto_registries()
    registered = {id(r): dict(r._extra_content) for r in registries}
    stand_ins = [s for s in STAND_INS if s.split(".")[0] not in sys.modules and _missing(s.split(".")[0])]
    for stub in stand_ins:
        sys.modules[stub] = _StandIn(stub)
    backend = import_utils.BACKENDS_MAPPING["torchvision"]
    image_processor = transformers.__dict__.get("AutoImageProcessor")
    if stand_ins:
        import_utils.BACKENDS_MAPPING["torchvision"] = (lambda: True, backend[1])
        transformers.AutoImageProcessor = _ImageProcessorRegistry
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(f"sglang.{name}")
    except ImportError as exc:
        _unavailable(f"sglang.{name} does not import ({exc})", SGLANG_INSTALL)
    finally:
        import_utils.BACKENDS_MAPPING["torchvision"] = backend
        if image_processor is None:
            transformers.__dict__.pop("AutoImageProcessor", None)
        else:
            transformers.AutoImageProcessor = image_processor
        for registry in _auto_registries():  # SGLang registers its own config classes (kimi_k2 among them)
            registry._extra_content.clear()
            registry._extra_content.update(registered.get(id(registry), {}))
        for stub in stand_ins:
            sys.modules.pop(stub, None)
    logging.getLogger("sglang").setLevel(logging.ERROR)
    return module


def token_calibration_file(tmp_path, vocab: int, samples: int = 12, seq_len: int = 48):
    """``calib.jsonl`` in ``tmp_path`` of ``samples`` x ``seq_len`` seeded random token ids below ``vocab``: (path,
    the ids as a tensor)."""
    import torch

    ids = torch.randint(0, vocab, (samples, seq_len), generator=torch.Generator().manual_seed(5))
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps({"input_ids": row.tolist()}) + "\n" for row in ids))
    return path, ids


def qwen3_moe_layer_inputs(model, index: int, ids) -> dict:
    """One forward of a transformers Qwen3-MoE ``model`` on ``ids``, capturing what decoder layer ``index`` reads:
    "attn" (q/k/v's input), "hidden" (the MoE block's input), "router" (the router's output: logits, weights, top
    ids) and "experts" (the experts module)."""
    import torch

    captured: dict = {}
    layer = model.model.layers[index]
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out: captured.setdefault("hidden", args[0])),
             layer.mlp.gate.register_forward_hook(lambda m, args, out: captured.setdefault("router", out)),
             layer.self_attn.q_proj.register_forward_pre_hook(lambda m, args: captured.setdefault("attn", args[0]))]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    captured["experts"] = layer.mlp.experts
    return captured

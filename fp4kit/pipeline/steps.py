"""The steps of `fp4kit run`: each calls one library function with the recipe's options and returns what it reports.

Data flow: quantize reads the model; repair reads quantize's output (or the model); layout and shard read the dialect
checkpoint (repair's, else quantize's, else the model); verify reads all of them (and the model, for
the quantized-vs-BF16 check). shard takes the dialect checkpoint,
not the layout, because fp4kit shard does not split layout outputs yet.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fp4kit.options import LAYOUT, SHARD, VERIFY, library_kwargs, quantize_kwargs
from fp4kit.pipeline.recipe import Recipe

Progress = Callable[[int, int], None] | None
SOURCE = "model"  # the upstream name of the recipe's model directory


@dataclass
class StepContext:
    recipe: Recipe
    outputs: dict[str, Path]  # step name -> its finished output directory; SOURCE -> the model directory
    progress: Progress = None
    notify: Callable[[str], None] | None = None  # a line about the step's progress (verify: each layer, warnings)

    def checkpoint(self) -> Path:
        """The newest dialect checkpoint: repair's, else quantize's, else the model."""
        return next(self.outputs[s] for s in ("repair", "quantize", SOURCE) if s in self.outputs)


def upstream(step: str, recipe: Recipe) -> list[str]:
    """What a step reads, as step names (or SOURCE); their completion keys go into the step's own key."""
    present = recipe.steps()
    if step == "quantize":
        return [SOURCE]
    if step == "verify":
        return [SOURCE, *(s for s in present if s != "verify")]
    for candidate in ("repair", "quantize") if step != "repair" else ("quantize",):
        if candidate in present:
            return [candidate]
    return [SOURCE]


def input_files(step: str, recipe: Recipe) -> list[Path]:
    """Files named in a step's options whose contents change its output."""
    if step == "quantize" and recipe.quantize and recipe.quantize.calib:
        return [Path(recipe.quantize.calib)]
    if step == "shard" and recipe.shard and recipe.shard.stats:
        return [Path(recipe.shard.stats)]
    return []


def report_dict(report: object) -> dict:
    return dataclasses.asdict(report) if dataclasses.is_dataclass(report) else dict(report)  # type: ignore[arg-type]


def run_quantize(ctx: StepContext, dst: Path) -> dict:
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    section = ctx.recipe.quantize
    assert section is not None
    options = QuantizeOptions(**quantize_kwargs(section.model_dump()), overwrite=True)
    return report_dict(quantize_checkpoint(ctx.outputs[SOURCE], dst, options, ctx.progress))


def run_repair(ctx: StepContext, dst: Path) -> dict:
    from fp4kit.io.checkpoint import parse_size
    from fp4kit.tools.convert import convert_checkpoint

    section = ctx.recipe.repair
    assert section is not None
    src = ctx.outputs.get("quantize", ctx.outputs[SOURCE])
    report = convert_checkpoint(src, dst, section.to, overwrite=True,
                                max_shard_bytes=parse_size(section.max_shard_size), progress=ctx.progress,
                                repair=section.fix)
    return report_dict(report)


def run_layout(ctx: StepContext, dst: Path) -> dict:
    from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint

    section = ctx.recipe.layout
    assert section is not None
    options = LayoutOptions(**library_kwargs(LAYOUT, section.model_dump()), overwrite=True)
    return report_dict(layout_checkpoint(ctx.checkpoint(), dst, options, ctx.progress))


def run_shard(ctx: StepContext, dst: Path) -> dict:
    from fp4kit.ep.shard import ShardOptions, shard_checkpoint

    section = ctx.recipe.shard
    assert section is not None
    options = ShardOptions(**library_kwargs(SHARD, section.model_dump()), overwrite=True)
    if options.stats is None and options.placement == "balanced":
        from fp4kit.quantize.input_scales import ROUTING_STATS_NAME

        options.stats = ctx.outputs["quantize"] / ROUTING_STATS_NAME  # written by the calibrated quantize step
    return report_dict(shard_checkpoint(ctx.checkpoint(), dst, options, ctx.progress))


def verify_device(recipe: Recipe) -> str | None:
    """The device the verify step will run on (None: no verify step)."""
    if recipe.verify is None:
        return None
    import torch

    return recipe.verify.device or ("cuda" if torch.cuda.is_available() else "cpu")


def prepare(recipe: Recipe) -> None:
    """Before any step: a CPU verify runs fp4kit's Triton kernel under TRITON_INTERPRET=1, which only works when set
    before triton is first imported, and calibration imports it (through transformers)."""
    if verify_device(recipe) == "cpu" and "triton" not in sys.modules:
        from fp4kit.verify.backends import enable_triton_interpreter

        enable_triton_interpreter()


def _backend(requested: str, device: str) -> tuple[str, list[str]]:
    from fp4kit.verify.triton_moe import triton_interpreter_active

    if device != "cpu" or requested != "auto" or triton_interpreter_active():
        return requested, []
    return "reference", ["triton was imported in this process before TRITON_INTERPRET=1 was set, so fp4kit's Triton "
                         "kernel cannot run on the CPU here: the reference ran alone"]


def run_verify(ctx: StepContext, dst: Path) -> dict:
    from fp4kit.io.output import atomic_directory
    from fp4kit.verify.checks import VerifyOptions
    from fp4kit.verify.runner import verify_checkpoint

    section, recipe = ctx.recipe.verify, ctx.recipe
    device = verify_device(recipe)
    assert section is not None and device is not None
    backend, notes = _backend(section.backend, device)
    options = VerifyOptions(
        **library_kwargs(VERIFY, section.model_dump()), ep_shards=ctx.outputs.get("shard"),
        source=ctx.outputs[SOURCE] if section.source and recipe.quantize else None,
        layouts=[ctx.outputs["layout"]] if "layout" in ctx.outputs else [],
    )
    options.backend, options.device = backend, device
    report = verify_checkpoint(ctx.checkpoint(), options, ctx.progress, ctx.notify)
    report.notes.extend(notes)
    with atomic_directory(dst) as work:
        report.write_json(work / "report.json")
    return report.to_json()


STEP_FUNCTIONS: dict[str, Callable[[StepContext, Path], dict]] = {
    "quantize": run_quantize, "repair": run_repair, "layout": run_layout, "shard": run_shard, "verify": run_verify,
}

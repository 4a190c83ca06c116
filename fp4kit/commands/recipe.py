"""`fp4kit recipe convert`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

recipe_app = typer.Typer(help="Recipe files: convert an llm-compressor recipe into an fp4kit one.",
                         no_args_is_help=False, rich_markup_mode=None)


@recipe_app.command()
def convert(
    src: Annotated[Path, typer.Argument(help="llm-compressor recipe YAML (quant_stage: ... GPTQModifier: ...)")],
    dst: Annotated[Path, typer.Argument(help="the fp4kit recipe to write")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", metavar="KEY=VALUE",
        help="set a key of the fp4kit recipe, e.g. --set model=/models/qwen3 (required: model; family is found "
             "from its config.json) --set shard.ep=4 (repeatable)")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an existing DST")] = False,
) -> None:
    """Write the fp4kit recipe that `fp4kit run SRC` would run: what llm-compressor's recipe asks and fp4kit can do,
    and one note line (printed, and a comment in DST) for each thing it cannot."""
    from fp4kit.errors import Fp4kitError
    from fp4kit.pipeline.recipe import load_recipe, write_recipe

    loaded = load_recipe(src, set_ or [])
    if not loaded.from_llm_compressor:
        raise Fp4kitError(f"{src}: not an llm-compressor recipe (no `*_stage:` mapping); fp4kit runs it as it is")
    if dst.exists() and not overwrite:
        raise Fp4kitError(f"{dst}: exists (--overwrite replaces it)")
    for note in loaded.notes:
        typer.echo(f"note: {note}", err=True)
    header = [f"converted by `fp4kit recipe convert` from {src}", *(f"note: {n}" for n in loaded.notes)]
    write_recipe(loaded, dst, header)
    typer.echo(f"wrote {dst} ({len(loaded.notes)} notes)")


def register(app: typer.Typer) -> None:
    app.add_typer(recipe_app, name="recipe")

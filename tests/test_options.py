"""fp4kit/options.py declares each option of quantize, layout, shard and verify once: the command's flag, the recipe's
key and the library record's field agree, in name, default, choices and the value that reaches the library."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import typer

from fp4kit import cli, options
from fp4kit.errors import Fp4kitError
from fp4kit.pipeline import recipe as recipes
from fp4kit.pipeline import steps

STEP_MODELS = {"quantize": recipes.QuantizeStep, "layout": recipes.LayoutStep, "shard": recipes.ShardStep,
               "verify": recipes.VerifyStep}
# the library function each command and step calls, patched to capture the options it is given
LIBRARY = {"quantize": ("fp4kit.quantize.checkpoint", "quantize_checkpoint", 2),
           "layout": ("fp4kit.layouts.directory", "layout_checkpoint", 2),
           "shard": ("fp4kit.ep.shard", "shard_checkpoint", 2),
           "verify": ("fp4kit.verify.runner", "verify_checkpoint", 1)}
# fields of the library records that are not options: paths, and what the command or step sets itself
WIRING = {"quantize": {"overwrite", "command", "cast_mxfp4", "gptq_block_size"}, "layout": {"overwrite"},
          "shard": {"overwrite"}, "verify": {"source", "ep_shards", "layouts"}}
# values other than each default, where the type alone does not give one
SAMPLES = {"device": "cuda:1", "max_shard_size": "7MB", "mse_range": "0.8:1.8", "ep": 2}


def _commands() -> dict[str, typer.core.TyperCommand]:
    cli._register_commands()
    return typer.main.get_command(cli.app).commands


def _choices(annotation: object) -> tuple | None:
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return None


def _other_value(option: options.Option, tmp_path: Path) -> object:
    """A value that is not the option's default (so it shows whether the value reaches the library)."""
    if option.name in SAMPLES:
        return SAMPLES[option.name]
    choices = _choices(option.type)
    if choices:
        return next(c for c in choices if c != option.default)
    if option.type is bool:
        return not option.default
    args = typing.get_args(option.type)
    if options._is_int_list(option.type):
        return [2, 3]
    if typing.get_origin(option.type) is list:
        return ["a", "b"]
    if Path in args:
        return str(tmp_path / f"{option.name}.file")
    if int in (option.type, *args):
        return 3
    if float in (option.type, *args):
        return 0.5
    raise AssertionError(f"no sample value for {option.name}")


def _argv(option: options.Option, value: object) -> list[str]:
    flag = option.flags[0]
    if option.type is bool:
        on, _, off = flag.partition("/")
        return [on if value else off]
    if isinstance(value, list):
        if options._is_int_list(option.type):
            return [flag, ",".join(map(str, value))]
        return [word for item in value for word in (flag, item)]
    return [flag, str(value)]


@pytest.mark.parametrize("command", list(options.COMMANDS))
def test_command_flags_are_the_declared_options(command: str) -> None:
    params = {p.name: p for p in _commands()[command].params}
    hints = typing.get_type_hints(_commands()[command].callback, include_extras=True)
    declared = [o for o in options.COMMANDS[command] if options.CLI in o.where]
    for option in declared:
        param = params[option.name]
        assert param.help == option.help and [*param.opts, *param.secondary_opts] == option.flags[0].split("/")
        assert _choices(typing.get_args(hints[option.name])[0]) == _choices(option.type), option.name
        assert param.required == (option.default is options.REQUIRED), option.name


@pytest.mark.parametrize("command", list(options.COMMANDS))
def test_recipe_keys_are_the_declared_options(command: str) -> None:
    model = STEP_MODELS[command]
    declared = [o for o in options.COMMANDS[command] if options.RECIPE in o.where]
    assert list(model.model_fields) == [o.name for o in declared]
    for option in declared:
        field = model.model_fields[option.name]
        default = options.recipe_default(command, option)
        if default is options.REQUIRED:
            assert field.is_required(), option.name
        else:
            assert field.get_default(call_default_factory=True) == default, option.name
        assert _choices(field.annotation) == _choices(option.type), option.name
    # the one documented difference: a recipe quantizes W4A4 unless told otherwise
    assert recipes.QuantizeStep().scheme == "nvfp4" and options.QUANTIZE[0].default == "nvfp4a16"


def test_library_records_take_the_declared_defaults() -> None:
    """With every option at its default, the library's own record is built: the defaults are one set."""
    from fp4kit.ep.shard import ShardOptions
    from fp4kit.layouts.directory import LayoutOptions
    from fp4kit.quantize.checkpoint import QuantizeOptions
    from fp4kit.verify.checks import VerifyOptions

    def defaults(table: tuple[options.Option, ...], **required: object) -> dict:
        return {o.name: required.get(o.name, options._list_default(o)) for o in table}

    assert QuantizeOptions(**options.quantize_kwargs(defaults(options.QUANTIZE))) == QuantizeOptions()
    assert (LayoutOptions(**options.library_kwargs(options.LAYOUT, defaults(options.LAYOUT, backend="trtllm")))
            == LayoutOptions(backend="trtllm"))
    assert ShardOptions(**options.library_kwargs(options.SHARD, defaults(options.SHARD, ep=2))) == ShardOptions(ep=2)
    verify = VerifyOptions(**options.library_kwargs(options.VERIFY, defaults(options.VERIFY)))
    assert dataclasses.replace(verify, device="cpu") == VerifyOptions()
    records = {"quantize": QuantizeOptions, "layout": LayoutOptions, "shard": ShardOptions, "verify": VerifyOptions}
    for command, record in records.items():
        fields = {o.field or o.name for o in options.COMMANDS[command] if options.CLI in o.where}
        assert {f.name for f in dataclasses.fields(record)} == fields | WIRING[command], command


class _Captured(Fp4kitError):
    pass


@pytest.mark.parametrize("command", list(options.COMMANDS))
def test_flag_and_recipe_key_give_the_library_the_same_value(command: str, tmp_path: Path, monkeypatch) -> None:
    """Every option set to a value other than its default, once as flags and once as recipe keys: the library
    function gets equal records (the paths and what only the command sets aside)."""
    import importlib

    module_name, function, position = LIBRARY[command]
    seen: list[object] = []

    def capture(*args: object, **kwargs: object) -> None:
        seen.append(args[position])
        raise _Captured("captured")

    monkeypatch.setattr(importlib.import_module(module_name), function, capture)
    table = options.COMMANDS[command]
    values = {o.name: _other_value(o, tmp_path) for o in table}
    src, dst = tmp_path / "src", tmp_path / "dst"
    argv = [command, str(src)] + ([str(dst)] if command != "verify" else [])
    for option in table:
        if options.CLI in option.where:
            argv += _argv(option, values[option.name])
    assert cli.run(argv) == 2 and len(seen) == 1, argv

    data = {"name": "r", "model": str(src), "family": "qwen3_moe", command: values}
    if command == "shard" and values["placement"] == "balanced":
        data["shard"]["stats"] = values["stats"]
    loaded = recipes.Recipe.model_validate(data)
    ctx = steps.StepContext(loaded, {steps.SOURCE: src, "quantize": tmp_path / "q"})
    monkeypatch.setattr(steps, "verify_device", lambda recipe: recipe.verify.device)
    monkeypatch.setattr(steps, "_backend", lambda requested, device: (requested, []))
    with pytest.raises(_Captured):
        steps.STEP_FUNCTIONS[command](ctx, dst)
    from_cli, from_recipe = seen
    wiring = {name: None for name in WIRING[command] - {"cast_mxfp4", "gptq_block_size"}}
    assert dataclasses.replace(from_cli, **wiring) == dataclasses.replace(from_recipe, **wiring)
    for option in table:  # and every value did arrive (none left at its default)
        if options.CLI in option.where and option.convert is None:
            got = getattr(from_cli, option.field or option.name)
            expected = values[option.name]
            assert got == (Path(expected) if isinstance(got, Path) else expected), option.name

"""Recipes: one YAML file per model describing a whole fp4kit job (docs/pipelines.md).

A recipe names the BF16 (or already NVFP4) model directory, its family, and the steps to run, each a top-level key
with its options: ``quantize``, ``repair``, ``layout``, ``shard``, ``verify``. Steps always run in that order; a step
that is absent, ``null`` or ``false`` is skipped, ``true`` or ``{}`` runs it with its defaults.

Errors name the key and where it was set: ``recipe.yaml:12: shard.ep: ...`` for the file, ``--set shard.ep=3: ...``
for a command-line override. Every check that can be made before any work is done is made here: the schema, the
family against the model's config.json, and each backend's shape and expert-parallel constraints.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator

from fp4kit.errors import Fp4kitError
from fp4kit.options import recipe_fields
from fp4kit.pipeline.llm_compressor import is_llm_compressor_recipe, translate
from fp4kit.registry import DEFAULT_DIALECT, DIALECT_NAMES

STEP_ORDER = ("quantize", "repair", "layout", "shard", "verify")
KeyPath = tuple[str | int, ...]
# A recipe is a few dozen keys. YAML aliases may repeat a value, not multiply the recipe: a few hundred bytes of
# nested anchors would otherwise expand to billions of values before any check could look at them.
MAX_RECIPE_BYTES = 1 << 20
MAX_VALUES = 10_000  # scalars, lists and mappings after alias expansion
MAX_SHOWN = 60  # characters of a value or key quoted in an error line
MAX_PROBLEMS = 50  # problems listed for one recipe


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _runs_w4a4(backend: str) -> bool:
    """Whether a layout backend's kernel needs activation scales (importing it loads torch: asked only when a recipe
    quantizes weight-only and lays out)."""
    from fp4kit.registry import backend as registered_backend

    return registered_backend(backend).W4A4


# the steps that run a command take its options, as fp4kit/options.py declares them (recipe keys are option names)
QuantizeStep = create_model("QuantizeStep", __base__=_Options, __module__=__name__, **recipe_fields("quantize"))
LayoutStep = create_model("LayoutStep", __base__=_Options, __module__=__name__, **recipe_fields("layout"))
ShardStep = create_model("ShardStep", __base__=_Options, __module__=__name__, **recipe_fields("shard"))
VerifyStep = create_model("VerifyStep", __base__=_Options, __module__=__name__, **recipe_fields("verify"))


class RepairStep(_Options):
    """fp4kit.tools.convert: rewrite in dialect ``to``; ``fix`` also puts fused groups on shared scales (convert
    --repair)."""

    to: Literal[DIALECT_NAMES] = DEFAULT_DIALECT  # type: ignore[valid-type]
    fix: bool = True
    max_shard_size: str = "5GB"


class Recipe(_Options):
    name: str
    model: str  # local directory of the source checkpoint (BF16; NVFP4 when the recipe has no quantize step)
    family: str  # fp4kit family name (fp4kit.families), checked against the model's config.json
    workdir: str | None = None
    quantize: QuantizeStep | None = None
    repair: RepairStep | None = None
    layout: LayoutStep | None = None
    shard: ShardStep | None = None
    verify: VerifyStep | None = None

    @model_validator(mode="after")
    def _steps_fit_together(self) -> Recipe:
        from fp4kit.families import FAMILIES

        names = [f.name for f in FAMILIES]
        if self.family not in names:
            raise _KeyError(("family",), f"unknown model family {self.family!r}; fp4kit knows {', '.join(names)}")
        if not self.steps():
            raise _KeyError((), f"no steps: add at least one of {', '.join(STEP_ORDER)}")
        weight_only = self.quantize is not None and self.quantize.scheme == "nvfp4a16"
        if self.layout and weight_only and _runs_w4a4(self.layout.backend):
            raise _KeyError(("layout", "backend"), f"{self.layout.backend} runs a W4A4 kernel, which needs activation "
                                                   f"scales: use quantize.scheme nvfp4, or layout.backend marlin")
        calibrated = self.quantize is not None and self.quantize.scheme == "nvfp4"
        if self.shard and self.shard.placement == "balanced" and self.shard.stats is None and not calibrated:
            raise _KeyError(("shard", "stats"), "placement balanced needs routing statistics: shard.stats: FILE, or a "
                                                "calibrated quantize step (scheme nvfp4), whose counts are used")
        return self

    def steps(self) -> list[str]:
        return [step for step in STEP_ORDER if getattr(self, step) is not None]

    def step_options(self, step: str) -> dict:
        section = getattr(self, step)
        return section.model_dump(mode="json") if section is not None else {}


class _KeyError(ValueError):
    """A cross-field problem, raised inside validation with the key it concerns."""

    def __init__(self, key: KeyPath, message: str):
        super().__init__(message)
        self.key, self.message = key, message


@dataclass
class Origins:
    """Where every key of a recipe was set, to point errors at it."""

    file: str
    lines: dict[KeyPath, int] = field(default_factory=dict)
    overrides: dict[KeyPath, str] = field(default_factory=dict)

    def where(self, key: KeyPath) -> str:
        for end in range(len(key), -1, -1):
            if key[:end] in self.overrides:
                return f"--set {self.overrides[key[:end]]}"
            if key[:end] in self.lines:
                return f"{self.file}:{self.lines[key[:end]]}"
        return self.file

    def problem(self, key: KeyPath, message: str) -> str:
        name = _clip(".".join(str(k) for k in key))
        return f"{self.where(key)}: {name + ': ' if name else ''}{message}"

    def error(self, key: KeyPath, message: str) -> Fp4kitError:
        return Fp4kitError(self.problem(key, message))


class RecipeError(Fp4kitError):
    """Every problem schema validation found, one line each (the CLI prints one ``error:`` line per problem)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = MAX_SHOWN
_shown.maxlist = _shown.maxdict = _shown.maxtuple = _shown.maxset = 4
_shown.maxlevel = 2


def _show(value: object) -> str:
    """A value as an error line quotes it: short, whatever the recipe held."""
    return _clip(_shown.repr(value))


def _clip(text: str, limit: int = MAX_SHOWN) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


@dataclass
class LoadedRecipe:
    recipe: Recipe
    origins: Origins
    path: Path
    notes: list[str] = field(default_factory=list)  # what an llm-compressor recipe asked and fp4kit does not do
    from_llm_compressor: bool = False


def _key_lines(node: yaml.Node, origins: Origins, prefix: KeyPath = ()) -> None:
    """Record the 1-based line of every mapping key and list item; refuse duplicate keys (PyYAML keeps the last)."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = (*prefix, key_node.value)
            if key in origins.lines:
                raise Fp4kitError(f"{origins.file}:{key_node.start_mark.line + 1}: {'.'.join(map(str, key))}: "
                                  f"duplicate key (first at line {origins.lines[key]})")
            origins.lines[key] = key_node.start_mark.line + 1
            _key_lines(value_node, origins, key)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            origins.lines[(*prefix, index)] = item.start_mark.line + 1
            _key_lines(item, origins, (*prefix, index))


def _check_expansion(node: yaml.Node, path: Path) -> None:
    """Refuse a document whose aliases expand it beyond MAX_VALUES values, or refer back into themselves: counted on
    the composed graph, where an alias is one shared node, in time linear in the file."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(n: yaml.Node) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if id(n) in open_nodes:
            raise Fp4kitError(f"{path}:{n.start_mark.line + 1}: a YAML alias refers to the value that contains it")
        open_nodes.add(id(n))
        if isinstance(n, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in n.value)
        elif isinstance(n, yaml.SequenceNode):
            total = 1 + sum(size(item) for item in n.value)
        else:
            total = 1
        open_nodes.discard(id(n))
        if total > MAX_VALUES:
            raise Fp4kitError(f"{path}:{n.start_mark.line + 1}: YAML aliases expand this value to {total} values; a "
                              f"recipe holds at most {MAX_VALUES}")
        sizes[id(n)] = total
        return total

    size(node)


def _read_yaml(path: Path, origins: Origins) -> dict:
    try:
        with open(path, "rb") as file:  # not a stat size: a recipe may come through a pipe, `run <(...)`
            raw = file.read(MAX_RECIPE_BYTES + 1)
    except FileNotFoundError:
        raise Fp4kitError(f"{path}: recipe file not found") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise Fp4kitError(f"{path}: over {MAX_RECIPE_BYTES >> 20} MB; a recipe is a short YAML file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Fp4kitError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_expansion(node, path)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise Fp4kitError(f"{path}{line}: not valid YAML: {_clip(problem, 200)}") from None
    except RecursionError:
        raise Fp4kitError(f"{path}: nested too deeply for a recipe") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise Fp4kitError(f"{path}:1: a recipe is a mapping of keys (model, family, quantize, ...), got "
                          f"{type(data).__name__}")
    _key_lines(node, origins)
    return data


def apply_overrides(data: dict, overrides: Sequence[str], origins: Origins) -> None:
    """``key.sub=value`` pairs; values are read as YAML scalars (``8`` is an int, ``null`` removes a step)."""
    for text in overrides:
        key_text, sep, value_text = text.partition("=")
        key = tuple(part.strip() for part in key_text.split("."))
        if not sep or not all(key):
            raise Fp4kitError(f"--set {text}: expected KEY=VALUE, e.g. --set shard.ep=8")
        try:
            value = yaml.safe_load(value_text) if value_text.strip() else None
        except yaml.YAMLError:
            value = value_text
        target = data
        for depth, part in enumerate(key[:-1]):
            if not isinstance(target.get(part), dict):
                if target.get(part) not in (None, True):
                    raise Fp4kitError(f"--set {text}: {'.'.join(key[: depth + 1])} is not a mapping of options")
                target[part] = {}
            target = target[part]
        target[key[-1]] = value
        origins.overrides[key] = text


def _normalize_steps(data: dict) -> None:
    for step in STEP_ORDER:
        if data.get(step) is True:
            data[step] = {}
        elif data.get(step) is False:
            data[step] = None


def _problems(exc: ValidationError, origins: Origins) -> list[str]:
    """One line per validation problem, in the recipe's order. A required key reported missing next to an unknown
    key that looks like it (``shard.epp`` for ``shard.ep``) is one typo: only the unknown key is reported."""
    errors = exc.errors()
    suggested: set[KeyPath] = set()
    problems: list[tuple[int, str]] = []
    for error in errors:
        key: KeyPath = tuple(error["loc"])
        if error["type"] == "extra_forbidden":
            parent = _section_model(key[:-1])
            known = list(parent.model_fields) if parent else []
            close = difflib.get_close_matches(str(key[-1]), known, n=1)
            if close:
                suggested.add((*key[:-1], close[0]))
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
            problems.append((_line(key, origins), origins.problem(key, f"unknown key{hint}")))
    for error in errors:
        key = tuple(error["loc"])
        context = error.get("ctx", {}).get("error")
        if isinstance(context, _KeyError):
            line, text = _line((*key, *context.key), origins), origins.problem((*key, *context.key), context.message)
        elif error["type"] == "extra_forbidden" or (error["type"] == "missing" and key in suggested):
            continue
        elif error["type"] == "missing":
            line, text = _line(key, origins), origins.problem(key, "missing (required)")
        elif error["type"] == "model_type":
            line, text = _line(key, origins), origins.problem(key, f"expected a mapping of options, got "
                                                                   f"{_show(error['input'])}")
        else:
            line, text = _line(key, origins), origins.problem(key, f"{error['msg']}, got {_show(error['input'])}")
        problems.append((line, text))
    problems.sort(key=lambda p: p[0])  # stable: one line's problems keep pydantic's order
    lines = [text for _, text in problems]
    if len(lines) > MAX_PROBLEMS:
        lines = [*lines[:MAX_PROBLEMS], f"{origins.file}: {len(lines) - MAX_PROBLEMS} more problems not shown"]
    return lines


def _line(key: KeyPath, origins: Origins) -> int:
    """Where a key's problem sorts: its line, or its section's; --set overrides after the file."""
    for end in range(len(key), -1, -1):
        if key[:end] in origins.overrides:
            return 1 << 30
        if key[:end] in origins.lines:
            return origins.lines[key[:end]]
    return 0


def _section_model(key: KeyPath) -> type[BaseModel] | None:
    if not key:
        return Recipe
    annotation = Recipe.model_fields.get(str(key[0]))
    if len(key) == 1 and annotation is not None:
        return next((a for a in getattr(annotation.annotation, "__args__", ()) if isinstance(a, type)
                     and issubclass(a, BaseModel)), None)
    return None


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> LoadedRecipe:
    """Read, override and validate a recipe (schema and cross-field rules; no file besides the recipe is read, but
    an llm-compressor recipe's model config.json, for its family)."""
    path = Path(path)
    origins = Origins(str(path))
    data = _read_yaml(path, origins)
    notes: list[str] = []
    llm_compressor = is_llm_compressor_recipe(data)
    if llm_compressor:
        translation = translate(data, origins.lines, str(path), set(Recipe.model_fields))
        data, origins.lines, notes = translation.data, translation.lines, translation.notes
    data.setdefault("name", path.stem)
    apply_overrides(data, overrides, origins)
    if llm_compressor:
        _complete_llm_compressor(data, path)
    _normalize_steps(data)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(_problems(exc, origins)) from None
    return LoadedRecipe(recipe, origins, path, notes, llm_compressor)


def _complete_llm_compressor(data: dict, path: Path) -> None:
    """An llm-compressor recipe names no model: --set model=DIR gives it; the family is the model's."""
    if "model" not in data:
        raise Fp4kitError(f"{path}: an llm-compressor recipe names no model: add --set model=DIR (the BF16 "
                          f"checkpoint directory)")
    if "family" not in data and isinstance(data["model"], str):
        from fp4kit.families import detect
        from fp4kit.io.shard_io import read_config

        config = Path(data["model"]) / "config.json"
        if not config.is_file():
            raise Fp4kitError(f"--set model={data['model']}: no config.json there, to find the model's family "
                              f"(or add --set family=NAME)")
        data["family"] = detect(read_config(config.parent)).name


def write_recipe(loaded: LoadedRecipe, out: Path, header: Sequence[str] = ()) -> None:
    """The recipe as an fp4kit recipe file: the keys it sets (defaults left out), ``header`` lines as comments;
    written whole or not at all."""
    import os

    document = loaded.recipe.model_dump(mode="json", exclude_unset=True)
    for step in STEP_ORDER:
        if getattr(loaded.recipe, step) is not None and document.get(step) is None:
            document[step] = {}
    text = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(document, sort_keys=False)
    partial = out.with_name(f".{out.name}.partial")
    partial.write_text(text)
    os.replace(partial, out)


def check_against_model(loaded: LoadedRecipe) -> None:
    """Checks that need the model's config.json: family, backend shape rules, EP size, step availability."""
    from fp4kit.families import detect
    from fp4kit.io.checkpoint import read_config

    recipe, origins = loaded.recipe, loaded.origins
    model = Path(recipe.model)
    if not (model / "config.json").is_file():
        raise origins.error(("model",), f"{model}: no config.json there (a local checkpoint directory is needed)")
    try:
        config = read_config(model)
        family = detect(config)
    except Fp4kitError as exc:
        raise origins.error(("model",), str(exc)) from None
    if family.name != recipe.family:
        raise origins.error(("family",), f"{recipe.family} does not match the model: its config.json "
                                         f"(model_type {config.get('model_type')!r}) is a {family.name} model")
    text = family.text_config(config)
    experts, hidden, inter = family.num_experts(text), int(text["hidden_size"]), family.moe_intermediate(text)
    _check_backend(loaded, experts, hidden, inter)


def _check_backend(loaded: LoadedRecipe, experts: int, hidden: int, inter: int) -> None:
    from fp4kit.layouts.directory import BACKENDS, LayoutOptions

    recipe, origins = loaded.recipe, loaded.origins
    ep = recipe.shard.ep if recipe.shard else 1
    if ep > experts:
        raise origins.error(("shard", "ep"), f"{ep} exceeds the model's {experts} experts per layer: some rank would "
                                             f"hold none")
    if recipe.layout is None:
        return
    backend = BACKENDS[recipe.layout.backend]
    flavor = LayoutOptions(recipe.layout.backend, recipe.layout.act_dtype, recipe.layout.cutlass_flavor
                           ).transform_options()
    try:
        backend.check_shapes(experts, hidden, inter, **flavor)
    except Fp4kitError as exc:
        raise origins.error(("layout", "backend"), f"{recipe.layout.backend}: {exc}") from None
    try:
        backend.check_shapes(experts, hidden, inter, ep=ep, **flavor)
    except Fp4kitError as exc:
        raise origins.error(("shard", "ep"), f"{ep} with layout.backend {recipe.layout.backend}: {exc}") from None


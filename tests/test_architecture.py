"""The package's shape, as docs/ARCHITECTURE.md states it: families/ alone spells the MoE name grammar, imports form no
circle, and every import runs down the layer table (a module imports only from its own layer or the layers above)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fp4kit.families import FAMILIES
from fp4kit.families.grammar import W2, W13
from fp4kit.families.moe_modules import MoEModules

PACKAGE = Path(__file__).resolve().parents[1] / "fp4kit"
ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"

# Modules outside families/ that may state grammar names, and why.
GRAMMAR_ALLOWED = {
    # the writer of FP8-block test sources keeps bf16 what the published FP8 releases keep (their router names);
    # io/ sits above families/ in the layer order, so it cannot ask a family
    "io/sources.py",
    # tiny fixtures written in the on-disk layout the real releases use (fp32 router bias, INT-packed experts)
    "testing/fixtures.py",
    # the published models' config.json values the benchmarks' synthetic checkpoints are built from (config keys such
    # as shared_expert_intermediate_size, not tensor names: the names come from transformers' classes)
    "testing/synthetic.py",
}


def _grammar_patterns() -> list[re.Pattern[str]]:
    """What spells the grammar of any family: its projection, fused-tensor, bias and shared-expert leaves as words;
    the experts container as part of a dotted name; a router leaf as a whole string; transformers' fused parameter
    names of the MoE modules."""
    words: set[str] = {MoEModules.gate_up, MoEModules.down}
    containers: set[str] = set()
    routers: set[str] = set()
    for family in FAMILIES:
        g = family.grammar
        bias_leaf = g.router_bias.rsplit(".", 1)[-1]
        # a bias that is the router Linear's own parameter (DeepSeek-V4's `gate.bias`) is spelled with its module
        words.update([*g.projections, *g.fused_tensors, *g.shared_experts,
                      g.router_bias if bias_leaf == "bias" else bias_leaf])
        containers.add(g.experts)
        routers.update(g.routers)
    # the fused-MoE kernels' own argument names (fp4kit's w13 / w2, families.grammar.W13 and W2; vLLM's and
    # FlashInfer's w1 for gate/up): MiniMax's checkpoint names w1 / w2 / w3 share them, so spelling one of those
    # outside families/ names a kernel operand, not the grammar
    words -= {W13, W2, "w1", "w3"}
    return [re.compile(rf"(?<![A-Za-z0-9])({'|'.join(map(re.escape, sorted(words)))})"),
            re.compile(rf"(\.({'|'.join(containers)})\b|\b({'|'.join(containers)})\.)"),
            re.compile(rf"^({'|'.join(map(re.escape, sorted(routers)))})$")]


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def grammar_constants(source: str, patterns: list[re.Pattern[str]]) -> list[tuple[int, str]]:
    """(line, text) of every string constant (f-string parts included, docstrings not) that spells a grammar name."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            and any(p.search(node.value) for p in patterns)]


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            nodes.update(id(n) for n in ast.walk(node))
    return nodes


def import_graph(type_checking: bool) -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in it (functions included; ``type_checking``: the
    imports under ``if TYPE_CHECKING:`` too). ``from package import submodule`` imports the submodule."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = set() if type_checking else _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                deps.update(submodules)
                if len(submodules) < len(node.names):
                    deps.add(base)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def documented_layers() -> dict[str, int]:
    """Top-level module or folder of the package -> its row in docs/ARCHITECTURE.md's layer table (0 = top)."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("| layer | modules | what |"):].split("\n\n", 1)[0].splitlines()[2:]
    layers: dict[str, int] = {}
    for row, line in enumerate(table):
        modules = line.split("|")[2]
        for entry in re.findall(r"`([^`]+)`", modules):
            top = entry.split("/", 1)[0].removesuffix(".py")
            assert layers.setdefault(top, row) == row, f"{entry} is in two layers of the table"
    return layers


def layer_of_module(name: str, layers: dict[str, int]) -> int:
    parts = name.split(".")
    if len(parts) == 1 or parts[1] == "__main__":  # the package's root and `python -m fp4kit`: outside the layers
        return -1 if len(parts) == 1 else len(layers)
    assert parts[1] in layers, f"{name}: docs/ARCHITECTURE.md's layer table does not place {parts[1]}"
    return layers[parts[1]]


def test_grammar_names_are_spelled_only_in_families():
    patterns = _grammar_patterns()
    spelled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("families/") or relative in GRAMMAR_ALLOWED:
            continue
        spelled += [f"fp4kit/{relative}:{line}: {text!r}" for line, text in grammar_constants(path.read_text(),
                                                                                              patterns)]
    assert not spelled, "MoE names spelled outside fp4kit/families/ (ask the family's grammar):\n" + "\n".join(spelled)


@pytest.mark.parametrize("snippet", ['NAME = "model.layers.0.mlp.experts.3.gate_proj"', 'leaf = f"{x}.down_proj"',
                                     'ROUTER = "router"', 'BIAS = "e_score_correction_bias"',
                                     'x = f"{block}.experts"', 'y = ("gate_up_proj", 1)'])
def test_the_grammar_check_finds_a_spelled_name(snippet):
    assert grammar_constants(snippet, _grammar_patterns())


def test_the_grammar_check_leaves_docstrings_and_other_words():
    source = '"""down_proj of the experts.3 module."""\nHEAD = "experts"\nKIND = "gateway"\n'
    assert grammar_constants(source, _grammar_patterns()) == []


def test_the_allowed_modules_still_need_it():
    """An entry of the allow-list that no longer spells a name goes."""
    patterns = _grammar_patterns()
    for relative in GRAMMAR_ALLOWED:
        assert grammar_constants((PACKAGE / relative).read_text(), patterns), relative


def test_no_import_circles():
    assert cycles(import_graph(type_checking=True)) == []


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_follow_the_documented_layers():
    """Imports that run (TYPE_CHECKING ones only name types) go to the same layer or one above."""
    layers = documented_layers()
    graph = import_graph(type_checking=False)
    upward = [f"{a} -> {b}" for a, deps in sorted(graph.items()) for b in sorted(deps)
              if layer_of_module(b, layers) > layer_of_module(a, layers)]
    assert not upward, "imports against docs/ARCHITECTURE.md's layer order:\n" + "\n".join(upward)


def test_every_package_folder_is_in_the_layer_table():
    layers = documented_layers()
    for path in PACKAGE.iterdir():
        if path.name.startswith(("_", ".")) or path.name in ("data",) or path.suffix not in ("", ".py"):
            continue
        if path.is_dir() and not (path / "__init__.py").exists():
            continue
        assert path.name.removesuffix(".py") in layers, f"{path.name} is in no layer of docs/ARCHITECTURE.md"


TESTS = Path(__file__).resolve().parent
TEST_HELPERS = "helpers"  # tests/helpers.py: what test files share; fixtures live in conftest.py


def imports_of_test_modules(source: str, test_modules: set[str]) -> list[tuple[int, str]]:
    """(line, module) of each import in ``source`` of a module of tests/ other than the helpers, or of the ``tests``
    package itself, wherever the import stands (module level or inside a function)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom):  # a relative import: the tests are no package
            names = ["." * node.level + (node.module or "")]
        else:
            continue
        found += [(node.lineno, name) for name in names
                  if name.startswith(".") or name.split(".")[0] == "tests"
                  or (name.split(".")[0] in test_modules and name.split(".")[0] != TEST_HELPERS)]
    return found


def test_no_test_module_imports_another():
    """Test files share code through tests/helpers.py only: a test module imported by another runs its module-level
    code (oracle imports, fixtures) twice over and ties the two files' edits together."""
    test_modules = {path.stem for path in TESTS.glob("*.py")}
    imported = [f"tests/{path.name}:{line}: {name}" for path in sorted(TESTS.glob("*.py"))
                for line, name in imports_of_test_modules(path.read_text(), test_modules)]
    assert not imported, "test modules importing other test modules (move what they share to tests/helpers.py):\n" + (
        "\n".join(imported))


@pytest.mark.parametrize("snippet", ["from test_cli import choices", "import test_verify",
                                     "def f():\n    from test_verify import square", "from tests.helpers import x",
                                     "import conftest", "from . import helpers"])
def test_the_test_import_check_finds_one(snippet):
    assert imports_of_test_modules(snippet, {"test_cli", "test_verify", "conftest", "helpers"})


def test_the_test_import_check_allows_the_helpers_and_libraries():
    source = "from helpers import run_cli\nimport helpers\nfrom fp4kit import cli\nimport pytest\n"
    assert imports_of_test_modules(source, {"helpers", "test_cli"}) == []

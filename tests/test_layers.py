"""The package's layers, as written in ``docs/architecture.md``, hold in its
code: every import of every module of ``python/async_array`` (function-level
ones included), read with ``ast``, goes to the module's own layer or a lower
one; the modules import in no cycle; the producers (layer 6) import none of
each other; and no private name (a leading underscore) is imported from
another module, except from the Rust core ``_core``: what modules share is a
module-level API of a lower layer."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "async_array"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# Lowest first. A module belongs to the layer of its top-level name in the
# package (the modules of the _safetensors package are all layer 6).
LAYERS = [
    ("L0", ["_core"]),
    ("L1", ["_errors", "_runtime", "_jax_hooks"]),
    ("L2", ["_spec", "_buffer", "_multiprocess"]),
    ("L3", ["_handoff", "_source", "_array"]),
    ("L4", ["_convert"]),
    ("L5", ["_leaves", "_per_shard", "_waits"]),
    ("L6", ["_wrap", "_map", "_jit", "_shards", "_safetensors"]),
    ("L7", ["__init__", "__main__"]),
]
PRODUCERS = "L6"
LAYER = {name: n for n, (_, names) in enumerate(LAYERS) for name in names}


def layer_text() -> str:
    """The layer list as ``docs/architecture.md`` quotes it, one line a layer."""
    return "\n".join(f"{label}  {' '.join(names)}" for label, names in LAYERS)


def module_name(path: Path) -> str:
    """``async_array._safetensors._plan`` for ``_safetensors/_plan.py``; a
    package's ``__init__.py`` is the package itself."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
MODULES["async_array._core"] = PACKAGE / "_core.pyi"  # the extension, by its stub
MODULES["async_array.__init__"] = MODULES.pop("async_array")


def top(module: str) -> str:
    """The module's top-level name in the package: its layer's key."""
    return module.split(".")[1]


def is_module(name: str) -> bool:
    return name in MODULES or (name == "async_array")


def imports_of(module: str) -> list[tuple[str, list[str], int]]:
    """Every import of ``module`` inside the package: (the module imported
    from, the names taken from it, line), with ``from . import _x`` read as
    an import of the module ``_x``."""
    path = MODULES[module]
    if module == "async_array.__init__":
        package = "async_array"
    else:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return imports_in(path.read_text(), package)


def imports_in(text: str, package: str) -> list[tuple[str, list[str], int]]:
    """:func:`imports_of` for source ``text`` of a module in ``package``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "async_array":
                    found.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin.split(".")[0] != "async_array":
                continue
            names = [alias.name for alias in node.names]
            submodules = [n for n in names if is_module(f"{origin}.{n}")]
            for n in submodules:
                found.append((f"{origin}.{n}", [], node.lineno))
            rest = [n for n in names if n not in submodules]
            if rest or not submodules:
                found.append((origin, rest, node.lineno))
    return found


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        if module == "async_array._core":
            continue
        for origin, _, _ in imports_of(module):
            if origin == "async_array":
                origin = "async_array.__init__"
            if origin in MODULES and origin != module:
                graph[module].add(origin)
    return graph


def test_every_module_has_a_layer():
    assert sorted({top(m) for m in MODULES} - set(LAYER)) == []
    assert sorted(set(LAYER) - {top(m) for m in MODULES}) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "async_array._core"))
def test_imports_go_to_the_same_layer_or_lower(module):
    mine = LAYER[top(module)]
    upward = []
    for origin, _, line in imports_of(module):
        target = "__init__" if origin == "async_array" else top(origin)
        if LAYER[target] > mine:
            upward.append(f"line {line}: {origin} ({LAYERS[LAYER[target]][0]})")
    assert upward == [], f"{module} ({LAYERS[mine][0]}) imports from a higher layer"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "async_array._core"))
def test_producers_import_none_of_each_other(module):
    if LAYERS[LAYER[top(module)]][0] != PRODUCERS:
        return
    peers = []
    for origin, _, line in imports_of(module):
        target = "__init__" if origin == "async_array" else top(origin)
        if LAYERS[LAYER[target]][0] == PRODUCERS and target != top(module):
            peers.append(f"line {line}: {origin}")
    assert peers == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "async_array._core"))
def test_no_private_name_is_imported_from_another_module(module):
    private = [
        f"line {line}: {name} from {origin}"
        for origin, names, line in imports_of(module)
        if origin != "async_array._core"
        for name in names
        if name.startswith("_")
    ]
    assert private == []


def test_the_modules_import_in_no_cycle():
    graph = edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            assert cycle is None, " -> ".join(cycle)


def test_the_import_reader_sees_function_level_and_relative_imports():
    text = "import os\n\n\ndef f():\n    from ._buffer import aligned_array\n"
    text += "    from .. import _core\n"
    assert imports_in(text, "async_array._safetensors") == [
        ("async_array._safetensors._buffer", ["aligned_array"], 5),
        ("async_array._core", [], 6),
    ]
    assert imports_in("from . import _core, _spec\n", "async_array") == [
        ("async_array._core", [], 1),
        ("async_array._spec", [], 1),
    ]


def test_architecture_doc_quotes_the_layer_list():
    assert layer_text() in ARCHITECTURE.read_text()


def test_architecture_doc_gives_each_source_file_a_row():
    text = ARCHITECTURE.read_text()
    rows = {line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| `")}
    files = {
        f"`{p.relative_to(PACKAGE)}`" for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts
    }
    missing = sorted(f for f in files if not any(row.startswith(f) for row in rows))
    assert missing == []

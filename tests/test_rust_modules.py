"""The Rust crates' module graph, read from their sources: no module of either
crate depends on itself through others, and the core names no PyO3 at all
(its Cargo.toml has no pyo3, so no file of it can use one either)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CRATES = {"core": ROOT / "rust" / "core", "py": ROOT / "rust" / "py"}

# A path that starts at the crate root or the parent module: `crate::a::b`, `super::c`.
PATH = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+|::\{)")


def module_of(src: Path, file: Path) -> tuple[str, ...]:
    parts = file.relative_to(src).with_suffix("").parts
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return tuple(parts)


def without_tests(text: str) -> str:
    """The file less its unit tests, which may use anything of their module."""
    cut = text.find("#[cfg(test)]\nmod tests {")
    return text if cut < 0 else text[:cut]


def module_graph(crate: Path) -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    src = crate / "src"
    files = {module_of(src, f): f for f in sorted(src.rglob("*.rs"))}
    graph: dict[tuple[str, ...], set[tuple[str, ...]]] = {m: set() for m in files if m}
    for module in graph:
        for start, rest in PATH.findall(without_tests(files[module].read_text())):
            names = tuple(n for n in rest.split("::") if n and n != "{")
            base = () if start == "crate" else module[:-1]
            path = base + names
            # The longest prefix that is a module: `crate::a::f` names module `a`.
            target = next((path[:k] for k in range(len(path), 0, -1) if path[:k] in graph), base)
            if target and target != module:
                graph[module].add(target)
    return graph


def cycle_in(graph: dict[tuple[str, ...], set[tuple[str, ...]]]) -> list[str] | None:
    state: dict[tuple[str, ...], str] = {}
    stack: list[tuple[str, ...]] = []

    def visit(m: tuple[str, ...]) -> list[str] | None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return ["::".join(x) for x in [*stack[stack.index(n) :], n]]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.parametrize("crate", sorted(CRATES))
def test_no_module_of_a_crate_depends_on_itself(crate):
    graph = module_graph(CRATES[crate])
    assert len(graph) >= 8, sorted(graph)  # the parser found the modules
    assert cycle_in(graph) is None, f"module cycle: {' -> '.join(cycle_in(graph) or [])}"


def test_the_cycle_check_sees_a_cycle():
    graph = {("a",): {("b",)}, ("b",): {("c",)}, ("c",): {("a",)}, ("d",): set()}
    assert cycle_in(graph) == ["a", "b", "c", "a"]


def test_the_core_names_no_pyo3():
    core = CRATES["core"]
    users = [
        str(f.relative_to(ROOT))
        for f in [core / "Cargo.toml", *sorted(core.rglob("*.rs"))]
        if re.search(r"\bpyo3\b", f.read_text(), re.I)
    ]
    assert users == []

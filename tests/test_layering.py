"""The import rules of docs/ARCHITECTURE.md: bridge -> runner, bridge -> encoders, nothing back.

Checked on the source (AST), so a lazy import inside a function is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "runner": {"encoders", "bridge"},
    "encoders": {"runner", "bridge"},
}


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_wing_does_not_import_the_hall_or_the_other_wing(package):
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imported_top_levels(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "import direction violated:\n" + "\n".join(offenders)


def test_layering_check_sees_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom bridge.wire import x\n\ndef f():\n    import encoders.api\n")
    assert _imported_top_levels(probe) == {"os", "bridge", "encoders"}


# ----------------------------------------------------------------------------- no import cycles
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve_import(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _runtime_nodes(tree: ast.Module, top_level_only: bool, type_only: bool = False) -> list[ast.AST]:
    """The nodes whose imports run: all of them (functions included) or the module level only, less
    `if TYPE_CHECKING:` bodies (type hints, never imported at run time) unless `type_only`: a reader
    follows a type-only import as any other, so the structure checks count them."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if _is_type_checking_block(node) and not type_only:
            todo.extend(node.orelse)
            continue
        out.append(node)
        if not top_level_only:
            todo.extend(ast.iter_child_nodes(node))
    return out


def import_graph(
    package: str, top_level_only: bool = False, type_only: bool = True
) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (AST; imports inside functions too, unless
    `top_level_only`), type-only imports too unless not `type_only`. `from pkg import sub` counts as
    importing the submodule `pkg.sub` when one exists. Importing `a.b.c` also runs the `__init__` of `a.b`
    for a module outside `a.b`; those edges are included, so a cycle through a package's `__init__` is
    found too."""
    files = {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = _runtime_nodes(tree, top_level_only, type_only)
        targets: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_import(node, module, is_package)
                if not base:
                    continue
                targets.add(base)
                targets.update(
                    f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in files
                )
        edges: set[str] = set()
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                inside = module == name or module.startswith(name + ".")
                if name in files and name != module and not inside:
                    edges.add(name)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


#: packages whose import graph must stay acyclic
ACYCLIC_PACKAGES = ("bridge", "encoders", "runner")


@pytest.mark.parametrize("package", ACYCLIC_PACKAGES)
def test_package_import_graph_has_no_cycle(package):
    cycle = find_cycle(import_graph(package))
    assert cycle is None, f"import cycle in {package}: {' -> '.join(cycle)}"


def test_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": set()}
    assert find_cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]
    assert find_cycle({"p.a": {"p.b"}, "p.b": set()}) is None


def test_type_checking_imports_are_not_edges():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.b\nimport c\n")
    imports = [n for n in _runtime_nodes(tree, False) if isinstance(n, ast.Import)]
    names = {alias.name for n in imports for alias in n.names}
    assert names == {"c"}


def test_runner_top_level_is_the_public_api_and_subpackages():
    """runner/ holds its public API modules, the types the engine and the worker both speak (the request,
    the step's plan and result, the HF config reader, the environment variables) and its subpackages; no
    module of it, Triton kernel files aside, is over 500 lines."""
    top = sorted(p.name for p in (ROOT / "runner").iterdir() if p.name != "__pycache__")
    assert top == ["__init__.py", "config.py", "engine", "envs.py", "hf_config.py", "layers", "llm.py",
                   "multimodal", "outputs.py", "request.py", "sampling_params.py", "step_io.py", "warmup.py",
                   "worker"]
    texts = {p: p.read_text() for p in (ROOT / "runner").rglob("*.py")}
    long = [str(p.relative_to(ROOT)) for p, text in texts.items()
            if len(text.splitlines()) > 500 and "@triton.jit" not in text]
    assert not long, f"over 500 lines: {long}"


#: runner's floors, top down: a module imports (type-only imports included) only modules of its own floor
#: or of floors below it
RUNNER_FLOORS = (
    ("runner.llm", "runner.warmup"),  # the offline API over the engine
    ("runner.engine",),  # requests, scheduling, the core that owns a step
    ("runner.worker",),  # the model and everything on the device
    ("runner.multimodal",),  # encoder protocol, encoder cache, item tables
    ("runner.layers",),  # attention and kernels
    ("runner.config", "runner.request", "runner.step_io", "runner.outputs", "runner.sampling_params",
     "runner.hf_config", "runner.envs"),  # the types and settings every floor speaks
)


def _floor(module: str) -> int | None:
    for i, prefixes in enumerate(RUNNER_FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None  # runner/__init__.py: the lazy public face


def test_runner_imports_only_run_down_its_floors():
    """The engine above the worker, the worker above multimodal and the layers, all above the shared
    types: nothing imports back up, type hints included."""
    up = []
    for module, targets in import_graph("runner").items():
        floor = _floor(module)
        for target in targets:
            if floor is not None and _floor(target) is not None and _floor(target) < floor:
                up.append(f"{module} -> {target}")
    assert not up, "imports back up: " + ", ".join(sorted(up))


def test_encoders_registry_is_a_leaf():
    assert import_graph("encoders")["encoders.registry"] == set()


def test_inference_api_does_not_load_the_training_package():
    """`import bridge.api` (module-level imports, followed transitively) reaches no bridge.training
    module; the training package reaches the API (evaluation uses it), never the reverse at import."""
    graph = import_graph("bridge", top_level_only=True)
    seen, todo = set(), ["bridge.api"]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    assert not [m for m in seen if m.startswith("bridge.training")], sorted(seen)

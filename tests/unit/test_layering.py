"""The layering of the source tree, read with `ast`: the three processes never import each
other (what two of them use lives in `common/`), the engine runs without Redis or gRPC (nor
does any project module it imports, at any depth), the client speaks only the public
protocol, kernels import nothing of kvgate but themselves, nothing outside `tests/` imports
`tests`, bench/ never imports the `kvgate` command that loads it by name, and no module
imports itself through a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "gateway", "scheduler", "executor", "engine", "common", "kernels", "client", "kvgate",
    "bench", "deploy", "protos", "tests",
)  # fmt: skip

# package -> the kvgate packages it may import (besides itself); every package is listed
ALLOWED = {
    "gateway": {"common", "protos"},
    "scheduler": {"common", "protos"},
    "executor": {"common", "protos", "kernels", "engine"},
    "engine": {"common", "kernels"},
    "common": {"protos"},
    "kernels": set(),
    "client": {"common", "protos"},
    "kvgate": {"client"},  # the clients under the project's name
    "protos": set(),
    "deploy": {"common", "protos"},
    "bench": set(PACKAGES) - {"tests"},
    "tests": set(PACKAGES),
}
# package -> third-party modules neither it nor any project module it imports may import
FORBIDDEN_LIBRARIES = {"engine": {"redis", "grpc"}, "kernels": {"redis", "grpc"}}
# package -> project modules it must not import: the `kvgate` command loads bench.cli by name,
# so bench importing the command module back would be a circle at run time
FORBIDDEN_MODULES = {"bench": {"client.cli"}}
# top-level folders that hold Python files but are no package of the project
NOT_PACKAGES = {"build", "shared"}


def imported_names(path: Path, root: Path = ROOT) -> set[str]:
    """Every absolute name a module imports, at any depth of its code: `import a.b` gives
    a.b, `from a import b` (or a relative form of it) gives a.b, whether b is a submodule or
    a name defined in a."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = _relative_base(path.relative_to(root), node.level)
                module = ".".join(filter(None, [base, module]))
            names.update(".".join(filter(None, [module, alias.name])) for alias in node.names)
    return names


def _relative_base(relative_path: Path, level: int) -> str:
    """The package a relative import of this level names, from a module's path."""
    package = list(relative_path.parent.parts)
    return ".".join(package[: len(package) - level + 1])


def imported_packages(path: Path, root: Path = ROOT) -> set[str]:
    """The top-level kvgate packages a module imports."""
    return {name.split(".")[0] for name in imported_names(path, root)} & set(PACKAGES)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    return sorted(
        path
        for package in packages
        for path in (root / package).rglob("*.py")
        if "_pb2" not in path.name
    )


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of these packages it imports (names that are not modules, such
    as a function imported from a module, resolve to that module)."""
    paths = {module_name(path, root): path for path in sources(root, packages)}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets = set()
        for name in imported_names(path, root):
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_imported_packages_sees_every_import_form(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import gateway.service\nfrom executor import engine\n"
        "def f():\n    import scheduler as s\nfrom . import sibling\nimport numpy\n"
    )
    assert imported_names(module, tmp_path) == {
        "gateway.service", "executor.engine", "scheduler", "sibling", "numpy"
    }  # fmt: skip
    assert imported_packages(module, tmp_path) == {"gateway", "executor", "scheduler"}


def layer_violations(root: Path, package: str, allowed: set[str]) -> dict[str, list[str]]:
    """module path -> the kvgate packages it imports outside `allowed` (and its own)."""
    wrong = {}
    for path in sources(root, (package,)):
        extra = imported_packages(path, root) - allowed - {package}
        if extra:
            wrong[str(path.relative_to(root))] = sorted(extra)
    return wrong


def reachable(graph: dict[str, set[str]], starts: set[str]) -> set[str]:
    """The modules `starts` import, at any depth, and themselves."""
    seen, todo = set(starts), list(starts)
    while todo:
        for child in graph.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def library_violations(
    root: Path, packages: tuple[str, ...], package: str, forbidden: set[str]
) -> dict[str, list[str]]:
    """module -> the forbidden libraries it imports, for every module of `package` and every
    project module those import at any depth."""
    graph = import_graph(root, packages)
    paths = {module_name(path, root): path for path in sources(root, packages)}
    starts = {module for module in graph if module.split(".")[0] == package}
    wrong = {}
    for module in sorted(reachable(graph, starts)):
        names = {name.split(".")[0] for name in imported_names(paths[module], root)} & forbidden
        if names:
            wrong[module] = sorted(names)
    return wrong


def module_violations(root: Path, package: str, forbidden: set[str]) -> dict[str, list[str]]:
    """module path -> the forbidden project modules it imports (or names from them)."""
    wrong = {}
    for path in sources(root, (package,)):
        names = {
            n
            for n in imported_names(path, root)
            for f in forbidden
            if n == f or n.startswith(f + ".")
        }
        if names:
            wrong[str(path.relative_to(root))] = sorted(names)
    return wrong


def top_level_packages(root: Path) -> set[str]:
    """Every top-level folder holding Python source, with or without an __init__.py."""
    return {
        folder.name
        for folder in root.iterdir()
        if folder.is_dir() and not folder.name.startswith(".") and next(folder.rglob("*.py"), None)
    } - NOT_PACKAGES


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_its_layer_allows(package):
    assert sources(packages=(package,)), f"no modules under {package}/"
    wrong = layer_violations(ROOT, package, ALLOWED[package])
    assert not wrong, f"{package}/ may import only {sorted(ALLOWED[package])}; found {wrong}"


def test_every_top_level_package_has_a_layer():
    found = top_level_packages(ROOT)
    assert found <= set(PACKAGES), f"packages without a rule: {sorted(found - set(PACKAGES))}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN_LIBRARIES))
def test_library_packages_import_no_network_client(package):
    forbidden = FORBIDDEN_LIBRARIES[package]
    wrong = library_violations(ROOT, PACKAGES, package, forbidden)
    assert not wrong, f"{package}/ runs without {sorted(forbidden)}; found {wrong}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN_MODULES))
def test_no_package_imports_a_module_forbidden_to_it(package):
    wrong = module_violations(ROOT, package, FORBIDDEN_MODULES[package])
    assert not wrong, f"{package}/ must not import {sorted(FORBIDDEN_MODULES[package])}: {wrong}"


def test_a_planted_forbidden_import_is_found(tmp_path):
    """Each check on a planted tree: engine/ importing the gateway, and Redis through a common
    module it imports; a folder without __init__.py importing tests; bench importing the
    command."""
    files = {
        "engine/step.py": "def f():\n    from gateway import service\nfrom common import urls\n",
        "common/urls.py": "import redis\n",
        "gateway/service.py": "",
        "newpkg/mod.py": "import tests.helpers\n",
        "bench/load.py": "from client.cli import main\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    packages = ("engine", "common", "gateway", "newpkg", "bench")
    assert layer_violations(tmp_path, "engine", ALLOWED["engine"]) == {
        "engine/step.py": ["gateway"]
    }
    assert library_violations(tmp_path, packages, "engine", {"redis", "grpc"}) == {
        "common.urls": ["redis"]
    }
    assert "newpkg" in top_level_packages(tmp_path) - set(PACKAGES)
    assert layer_violations(tmp_path, "newpkg", set()) == {"newpkg/mod.py": ["tests"]}
    assert module_violations(tmp_path, "bench", {"client.cli"}) == {
        "bench/load.py": ["client.cli.main"]
    }


def test_no_module_imports_itself_through_a_circle():
    found = cycles(import_graph(ROOT, PACKAGES))
    assert not found, f"import circles (each a set of modules that import each other): {found}"


def test_a_planted_circle_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import g\n")
    (package / "b.py").write_text("def g():\n    from pkg import c\n")
    (package / "c.py").write_text("from . import a\n")
    (package / "d.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]

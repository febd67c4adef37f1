"""The layering of the source tree, read with `ast`: the three processes never import each
other (what two of them use lives in `common/`), `common/` imports no process, and kernels
import nothing of kvgate but themselves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = ("gateway", "scheduler", "executor")
KVGATE_PACKAGES = (*PROCESSES, "common", "kernels", "client", "bench", "deploy", "protos")

# package -> the kvgate packages it may import (besides itself)
ALLOWED = {
    "gateway": {"common", "protos"},
    "scheduler": {"common", "protos"},
    "executor": {"common", "protos", "kernels"},
    "common": {"protos"},
    "kernels": set(),
}


def imported_packages(path: Path) -> set[str]:
    """The top-level kvgate packages a module imports, at any depth of its code."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {name.split(".")[0] for name in names} & set(KVGATE_PACKAGES)


def test_imported_packages_sees_every_import_form(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import gateway.service\nfrom executor import engine\n"
        "def f():\n    import scheduler as s\nfrom . import sibling\nimport numpy\n"
    )
    assert imported_packages(module) == {"gateway", "executor", "scheduler"}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_layer_allows(package):
    modules = sorted((ROOT / package).rglob("*.py"))
    assert modules, f"no modules under {package}/"
    allowed = ALLOWED[package] | {package}
    wrong = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) - allowed)
        for path in modules
        if "_pb2" not in path.name and imported_packages(path) - allowed
    }
    assert not wrong, f"{package}/ may import only {sorted(allowed)}; found {wrong}"

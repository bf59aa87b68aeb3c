"""The package layout of DESIGN.md: every import arrow runs one way. A module may import from its own
package and from the packages listed below it here; nothing else (function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "difftrain"

# package -> the difftrain packages it may import (besides its own)
ALLOWED = {
    "errors": set(),
    "tokens": set(),
    "words": set(),
    "images": {"errors"},
    "config": {"errors"},
    "models": {"config", "errors", "tokens", "words"},
    "data": {"config", "errors", "models", "tokens", "words"},
    "diffusion": {"data", "models", "tokens"},
    "shapes": {"config", "data", "errors", "models", "tokens", "words"},
    "sources": {"data", "errors", "shapes"},
    "parallel": {"config", "errors", "models", "tokens"},
}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        out |= {n.split(".")[1] for n in names if n.startswith("difftrain.")}
    return out


def _package_imports() -> dict[str, set[str]]:
    deps: dict[str, set[str]] = {}
    for f in SRC.rglob("*.py"):
        package = f.relative_to(SRC).parts[0].removesuffix(".py")
        deps.setdefault(package, set()).update(_imports(f) - {package})
    return deps


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_lower_packages_import_only_what_is_below_them(package):
    deps = _package_imports()
    assert deps.get(package, set()) <= ALLOWED[package], \
        f"difftrain.{package} imports {sorted(deps[package] - ALLOWED[package])}"


def test_no_import_cycles_between_packages():
    deps = _package_imports()

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for d in deps.get(todo.pop(), ()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return seen

    assert not [p for p in deps if p in reach(p)]


def test_the_trainer_knows_no_data_world_and_builds_no_source():
    text = (SRC / "train" / "trainer.py").read_text()
    imported = _imports(SRC / "train" / "trainer.py")
    assert "shapes" not in imported and "sources" not in imported
    assert "StoreLoader" not in text and "ShapesLoader" not in text and "flow_loss" not in text

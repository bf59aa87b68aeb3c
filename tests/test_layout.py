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
    "sources": {"config", "data", "errors", "shapes"},
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


def _cycles(deps: dict[str, set[str]]) -> dict[str, list[str]]:
    """The nodes of ``deps`` (name -> names it imports) that reach themselves, with what they import."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for d in deps.get(todo.pop(), ()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return seen

    return {m: sorted(deps[m]) for m in deps if m in reach(m)}


def test_no_import_cycles_between_packages():
    assert not _cycles(_package_imports())


def test_the_trainer_knows_no_data_world_and_builds_no_source():
    text = (SRC / "train" / "trainer.py").read_text()
    imported = _imports(SRC / "train" / "trainer.py")
    assert "shapes" not in imported and "sources" not in imported
    assert "StoreLoader" not in text and "ShapesLoader" not in text and "flow_loss" not in text


def _train_module_imports() -> dict[str, set[str]]:
    """Inside ``difftrain.train``: each module's imports of the package's other modules (function-level and type-only
    imports included: every ``import`` statement in the file)."""
    out = {}
    for f in (SRC / "train").glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                if node.module == "difftrain.train":              # from difftrain.train import faults, ...
                    names |= {f"difftrain.train.{a.name}" for a in node.names}
        out[f.stem] = {n.split(".")[2] for n in names if n.startswith("difftrain.train.")} - {f.stem}
    return out


# the objectives' modules: what a run trains for, plugged into the trainer through ``contract``
OBJECTIVES = {"objectives", "dpo"}


def test_nothing_in_train_imports_the_trainer_but_the_entry_points():
    deps = _train_module_imports()
    importers = {m for m, d in deps.items() if "trainer" in d}
    assert importers <= {"__init__"}, f"train modules importing the trainer: {sorted(importers - {'__init__'})}"
    outside = {f.relative_to(SRC).as_posix() for f in SRC.rglob("*.py") if "train" not in f.relative_to(SRC).parts[:1]
               and "difftrain.train.trainer" in f.read_text()}
    # entry points: the command line and its progress display
    assert outside <= {"cli.py", "progress.py"}, sorted(outside)


def test_the_trainer_imports_no_objective():
    deps = _train_module_imports()
    assert not deps["trainer"] & OBJECTIVES, sorted(deps["trainer"] & OBJECTIVES)
    for module in ("contract", "build", "outputs", "records", "checkpoint", "adapters"):
        assert not deps[module] & (OBJECTIVES | {"trainer"}), (module, sorted(deps[module]))


def test_no_import_cycles_between_train_modules():
    cycles = _cycles(_train_module_imports())
    assert not cycles, cycles

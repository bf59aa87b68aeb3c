"""The core install and its extras: ``pip install -e .`` is enough for the demo (train, sample, evaluate, report),
and a command that needs an extra that is not installed says which one and how to install it (exit 2, one line).

The subprocesses run the CLI with an import hook that makes every module of the extras missing, as it is after a
core install (the test environment itself has every extra).
"""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from difftrain.extras import EXTRAS, extra_of, missing_extra_message

ROOT = Path(__file__).resolve().parents[1]

WITHOUT_EXTRAS = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Missing())
from difftrain.cli import main
code = main(sys.argv[2:])
loaded = sorted({m.split(".")[0] for m in sys.modules} & BLOCKED)
print(f"extras-loaded: {loaded}", file=sys.stderr)
sys.exit(code)
"""

# the distribution each extra lists -> the module it installs
MODULE_OF = {"pylance": "lance", "ray": "ray", "pyarrow": "pyarrow", "imagehash": "imagehash", "diffusers": "diffusers",
             "transformers": "transformers", "peft": "peft", "torchao": "torchao"}


def _without(extras: dict[str, tuple[str, ...]], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    blocked = ",".join(m for mods in extras.values() for m in mods)
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, blocked, *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def _name(requirement: str) -> str:
    for sep in "[=<>! ":
        requirement = requirement.split(sep)[0]
    return requirement.lower()


def test_pyproject_core_holds_no_extra_and_each_extra_is_known_to_the_cli():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = meta["optional-dependencies"]
    core = {_name(r) for r in meta["dependencies"]}
    for extra in EXTRAS:
        names = {_name(r) for r in optional[extra]}
        assert names and not names & core, (extra, names & core)
        for dist in names:                   # every package of an extra is one the CLI's message can name
            assert extra_of(MODULE_OF[dist]) == extra, (extra, dist)
    assert optional["all"] == [f"difftrain[{','.join(EXTRAS)}]"]
    assert "difftrain[all]" in optional["test"]


def test_the_message_names_the_module_the_extra_and_the_command():
    e = ModuleNotFoundError("No module named 'ray.data'", name="ray.data")
    msg = missing_extra_message(e, "prepare")
    assert "'difftrain prepare' needs ray" in msg and "pip install 'difftrain[data]'" in msg
    assert "difftrain[hf]" in missing_extra_message(ModuleNotFoundError(name="transformers"), "train")
    assert missing_extra_message(ModuleNotFoundError(name="numpy"), "train") is None      # not an extra's module
    # the package installed but a module of it missing: another version than the pinned one, not a missing extra
    msg = missing_extra_message(ModuleNotFoundError(name="torchao.no_such_module"), "sample")
    assert "the installed torchao lacks" in msg and "difftrain[fp8]" in msg
    assert extra_of(None) is None and extra_of("torch") is None


@pytest.mark.slow
def test_the_demo_runs_on_the_core_install_and_the_data_path_names_its_extra(tmp_path):
    small = ["model.hidden=32", "model.heads=2", "model.double_blocks=1", "model.single_blocks=1",
             "model.axes_dims_rope=[4, 6, 6]", "text.dim=16", "data.image_size=32", "train.steps=3",
             "train.threads=1", "eval.n=2", "sample.steps=2"]
    r = _without(EXTRAS, "demo", "--out", "d", "--no-progress", *[a for s in small for a in ("--set", s)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1])["steps"] == 3
    assert "extras-loaded: []" in r.stderr
    r = _without(EXTRAS, "report", "d/run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]

    # the data path without its extra: one line naming the extra, exit 2, no traceback
    r = _without(EXTRAS, "prepare", "shapes-store", "--no-progress", cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "'difftrain prepare' needs" in r.stderr and "pip install 'difftrain[data]'" in r.stderr
    assert "Traceback" not in r.stderr
    # a missing module outside the extras is a broken install: its traceback is shown, not hidden
    r = _without({"x": ("PIL",)}, "demo", "--out", "d2", "--no-progress",
                 *[a for s in small for a in ("--set", s)], cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" in r.stderr and "PIL" in r.stderr

"""Every command block of README.md and docs/*.md runs, as written, in a folder laid out as a user's is.

What is a command block: a fenced block whose language is ``bash``, ``sh``, ``shell`` or ``console``.
Unlabelled blocks are text (file layouts, printed tables) and are not run.

A ``toml`` block is a file when the line just above it names one and ends with a colon (the whole config,
`mine.toml`:): it is written under that name into the doc's folder before the blocks below it run. Any
other toml block is a reference snippet and is not written.

Where they run: each doc file gets a fresh folder holding (links to) the session's fixture, the things the
docs say a user has: a tiny FLUX.1 pipeline saved by diffusers at ``models/FLUX.1-dev`` (random weights:
1 double + 1 single block, a 16-channel VAE, tiny T5 and CLIP with their tokenizers), a folder of images
with ``.txt`` captions at ``my-photos/``, the repository's ``src/`` and ``bench/`` (the docs' ``bench/...``
commands are run from a checkout), and what docs/dpo.md's first block names as the user's own: a trained
run ``RUN``, ``prompts.jsonl``, the raters' ``rankings.jsonl`` and ``dpo.toml``. A doc's blocks run in
order, each in its own ``bash -e -o pipefail``, so a later block sees what an earlier one wrote.

The one change to any command: ``DIFFTRAIN_MAX_STEPS`` (docs/configuration.md) caps ``train.steps`` for
every block alike. A ``difftrain-rate serve`` / ``difftrain rate serve`` line runs as start, probe (its
``/`` answers over HTTP), stop.

A block that cannot run here is listed in ``MARKS`` with one reason of ``REASONS``, keyed by (doc file,
its first command line without a trailing comment). A command block that is neither run nor marked fails
``test_every_command_block_is_run_or_marked``, and so does a mark that names no block. ``XFAIL`` lists
blocks that fail for a known open bug: they still run, and one that passes fails the test (strike it).

``python tests/test_docs.py --count`` prints {"run": N, "marked": {reason: n}, "xfail": n} as JSON.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 2
BLOCK_TIMEOUT_S = 300
COMMAND_LANGS = {"bash", "sh", "shell", "console"}
REASONS = {
    "gpu": "needs a GPU",
    "nodes": "needs several nodes",
    "network": "needs the internet or a package registry",
    "server": "a long-running server that cannot be probed here",
}

# (doc file, first command line) -> (reason, why)
MARKS: dict[tuple[str, str], tuple[str, str]] = {
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . "
                  "&& difftrain demo"): ("network", "pip installs torch and the package"),
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e "
                  "'./rate[postgres]' -e '.[test]' && python -m pytest -q"): ("network", "pip installs"),
    ("README.md", "pip install -e '.[data]'"): ("network", "pip install; its other lines run in docs/data-path.md"),
    ("docs/distributed.md", "difftrain train shapes-tiny --run-dir runs/a --set train.steps=200"):
        ("nodes", "torchrun --nnodes 8; its other lines run in README.md"),
    ("docs/rating.md", "pip install ./rate"): ("network", "pip install of the rating app"),
}

# (doc file, first command line) -> why it fails today (an open issue). Strike a line once its block passes.
XFAIL: dict[tuple[str, str], str] = {}


@dataclass
class Block:
    doc: str
    line: int           # 1-based line of the opening fence
    lang: str
    body: str
    above: str          # the last non-blank line before the fence

    @property
    def key(self) -> tuple[str, str]:
        return (self.doc, first_command(self.body))


def first_command(body: str) -> str:
    """The block's first line that is not a comment, with a trailing '  # comment' cut and spaces collapsed."""
    for raw in body.splitlines():
        s = raw.strip()
        if s and not s.startswith("#"):
            s = re.split(r"\s+#\s", s, maxsplit=1)[0]
            return " ".join(s.rstrip("\\").split())
    return ""


def doc_files() -> list[str]:
    return ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))


def blocks(doc: str) -> list[Block]:
    lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        out.append(Block(doc, start + 1, lang, "\n".join(body) + "\n", above))
        i += 1
    return out


def command_blocks(doc: str) -> list[Block]:
    return [b for b in blocks(doc) if b.lang in COMMAND_LANGS]


def file_name(block: Block) -> str | None:
    """The file a toml block is, when the line above it names it and ends with a colon."""
    if block.lang != "toml" or not block.above.endswith(":"):
        return None
    names = re.findall(r"`([\w./-]+\.toml)`", block.above)
    return names[-1] if names else None


def count() -> dict:
    run, marked, xfail = 0, Counter(), 0
    for doc in doc_files():
        for b in command_blocks(doc):
            if b.key in MARKS:
                marked[MARKS[b.key][0]] += 1
            else:
                run += 1
                xfail += b.key in XFAIL
    return {"run": run, "marked": {r: marked[r] for r in REASONS}, "xfail": xfail}


# ---------------------------------------------------------------------------------------------- the fixture


def save_tiny_flux(folder: Path) -> None:
    """A FLUX.1-shaped pipeline with random weights, saved by diffusers as a snapshot from the hub would be."""
    from tiny_flux import save_tiny_flux_pipeline
    save_tiny_flux_pipeline(folder)


def save_photos(folder: Path, n: int = 4, size: int = 512) -> None:
    """n distinct images (a coloured disc on a coloured ground) at size x size, each with a .txt caption."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    colours = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
    yy, xx = np.mgrid[:size, :size]
    for i in range(n):
        name, fg = list(colours.items())[i % len(colours)]
        bg = np.array([90 + 20 * i, 90, 140 - 10 * i], np.uint8)
        img = np.broadcast_to(bg, (size, size, 3)).copy()
        cx, cy, r = size * (0.3 + 0.05 * i), size * 0.5, size * 0.2
        img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = fg
        Image.fromarray(img).save(folder / f"photo_{i}.png")
        (folder / f"photo_{i}.txt").write_text(f"a photo of a {name} disc, number {i}\n")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e["DIFFTRAIN_MAX_STEPS"] = str(MAX_STEPS)
    e.pop("PYTHONPATH", None)
    return e


def save_dpo_inputs(folder: Path) -> None:
    """What docs/dpo.md's first block takes as the user's: a trained run RUN, prompts, rankings, dpo.toml."""
    subprocess.run(["difftrain", "train", "shapes-tiny", "--run-dir", "RUN"], cwd=folder, env=env(), check=True,
                   capture_output=True, timeout=BLOCK_TIMEOUT_S)
    prompts = ["a large red circle in the top left", "a small blue square in the middle",
               "a large green triangle in the bottom right", "a small yellow circle in the top right",
               "a large blue triangle in the middle left"]   # 4 prompts' 20 pairs train (one is held out): 16 a step
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                                                  for i, p in enumerate(prompts)))
    (folder / "rankings.jsonl").write_text("".join(
        json.dumps({"prompt_id": f"p{i}", "rater": rater, "order": [f"p{i}-{k}" for k in order]}) + "\n"
        for i in range(len(prompts)) for rater, order in (("ann", (0, 1, 2, 3)), ("bob", (0, 1, 3, 2)))))
    (folder / "dpo.toml").write_text('extends = "shapes-dpo"\n\n[dpo]\ninit = "RUN"\npairs = "pairs/round1.parquet"\n')


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory) -> Path:
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("docs-fixture")
    save_tiny_flux(folder / "models" / "FLUX.1-dev")
    save_photos(folder / "my-photos")
    save_dpo_inputs(folder)
    for name in ("src", "bench"):
        (folder / name).symlink_to(ROOT / name)
    return folder


# ---------------------------------------------------------------------------------------------- running


# A server line runs as start, probe, stop: bash functions named as the commands wrap their 'serve'.
SERVE_PRELUDE = r"""
__serve() {  # start "$@" in the background, wait until http://127.0.0.1:PORT/ answers, stop it
  local port=8000 prev=
  for a in "$@"; do [ "$prev" = --port ] && port=$a; prev=$a; done
  set -m; "$@" & local pid=$!; set +m      # its own process group: the stop reaches its children too
  for i in $(seq 1 120); do
    if python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/', timeout=2)" \
        2>/dev/null; then kill -- -$pid; wait $pid 2>/dev/null || true; return 0; fi
    kill -0 $pid 2>/dev/null || { wait $pid || true; echo "the server exited before it answered" >&2; return 1; }
    sleep 0.5
  done
  kill -- -$pid; wait $pid 2>/dev/null || true; echo "server on port $port never answered" >&2; return 1
}
difftrain-rate() { if [ "$1" = serve ]; then __serve command difftrain-rate "$@"; else command difftrain-rate "$@"; fi; }
difftrain() { if [ "$1 $2" = "rate serve" ]; then __serve command difftrain "$@"; else command difftrain "$@"; fi; }
"""


@dataclass
class Result:
    block: Block
    rc: int
    seconds: float
    tail: str


def run_block(block: Block, cwd: Path) -> Result:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", SERVE_PRELUDE + block.body], cwd=cwd, env=env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=BLOCK_TIMEOUT_S)
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += f"\n(timed out after {BLOCK_TIMEOUT_S} s)"
    tail = "\n".join(out.rstrip().splitlines()[-15:])
    return Result(block, rc, time.perf_counter() - t0, tail)


def run_doc(doc: str, fixture: Path, work: Path) -> list[Result]:
    work.mkdir(parents=True)
    for entry in fixture.iterdir():
        (work / entry.name).symlink_to(entry)
    results = []
    for b in blocks(doc):
        name = file_name(b)
        if name:
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_text(b.body)
        elif b.lang in COMMAND_LANGS and b.key not in MARKS:
            results.append(run_block(b, work))
    return results


def _describe(r: Result) -> str:
    return (f"{r.block.doc}:{r.block.line} `{r.block.key[1]}` exit {r.rc} after {r.seconds:.0f} s:\n"
            + "\n".join("    " + line for line in r.tail.splitlines()))


# ---------------------------------------------------------------------------------------------- tests


def test_every_command_block_is_run_or_marked():
    keys = Counter(b.key for doc in doc_files() for b in command_blocks(doc))
    assert all(k[1] for k in keys), "a command block with no command"
    assert not [k for k, n in keys.items() if n > 1 and k in MARKS], "two blocks share a marked key"
    stale = [k for k in (*MARKS, *XFAIL) if k not in keys]
    assert not stale, f"marks that name no block (strike or update them): {stale}"
    assert all(reason in REASONS for reason, _ in MARKS.values())
    assert not set(MARKS) & set(XFAIL)
    print(json.dumps(count()))


def test_max_steps_env_caps_train_steps(monkeypatch, tmp_path):
    from difftrain.config import load_config
    from difftrain.errors import UserError

    monkeypatch.delenv("DIFFTRAIN_MAX_STEPS", raising=False)
    assert load_config(None, ["train.steps=50"]).train.steps == 50
    monkeypatch.setenv("DIFFTRAIN_MAX_STEPS", "3")
    assert load_config(None, ["train.steps=50"]).train.steps == 3          # capped after --set
    assert load_config(None, ["train.steps=1"]).train.steps == 1           # never raised
    assert load_config(None, ["sample.steps=20"]).sample.steps == 3        # the sampler's Euler steps too
    cfg = tmp_path / "c.toml"
    cfg.write_text('extends = "shapes-dpo"\n')
    assert load_config(cfg).train.steps == 3                               # dpo trains train.steps too
    monkeypatch.setenv("DIFFTRAIN_MAX_STEPS", "a few")
    with pytest.raises(UserError, match="DIFFTRAIN_MAX_STEPS"):
        load_config(None)


DOCS_WITH_COMMANDS = [d for d in doc_files() if any(b.key not in MARKS for b in command_blocks(d))]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("doc", DOCS_WITH_COMMANDS)
def test_doc_commands_run_as_written(doc, fixture_dir, tmp_path):
    results = run_doc(doc, fixture_dir, tmp_path / "work")
    for r in results:
        print(f"{r.block.doc}:{r.block.line} exit {r.rc} {r.seconds:.1f} s  {r.block.key[1]}")
    failed = [r for r in results if r.rc != 0 and r.block.key not in XFAIL]
    passed_xfail = [r for r in results if r.rc == 0 and r.block.key in XFAIL]
    assert not failed, "blocks that fail:\n" + "\n".join(map(_describe, failed))
    assert not passed_xfail, "blocks in XFAIL that pass (strike them): " + ", ".join(
        f"{r.block.doc}:{r.block.line}" for r in passed_xfail)
    xfailed = [r for r in results if r.rc != 0]
    if xfailed:
        pytest.xfail("; ".join(f"{r.block.doc}:{r.block.line}: {XFAIL[r.block.key]}" for r in xfailed))


if __name__ == "__main__":
    if sys.argv[1:] == ["--count"]:
        print(json.dumps(count()))
    else:
        sys.exit(f"usage: {sys.argv[0]} --count  (or run it under pytest)")

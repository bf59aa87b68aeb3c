"""How often a compiled, store-fed run compiles: the shapes-store preset's last stage (three 48-pixel aspect
buckets; text-to-image, edits and keyframes; ``text.padding = "masked"``, so the text sequence takes a rung
of its ladder, 8 or 16 tokens here) trained with ``train.compile = true`` from a small shapes export.

Each micro-batch's (task, image tokens, text tokens) is read from the run's metrics (``shapes``), and the compiled
graphs from its ``recompiles`` counter. Blocks compile with static shapes, one graph per block kind (double-
and single-stream) per distinct shape, so the bound is ``2 x distinct_keys``. Prints one JSON object:
``distinct_keys`` (each key and the step it first appeared), ``text_lengths``, ``graphs``,
``graphs_per_key`` (at most 2), ``graphs_after_all_keys_seen`` (0: nothing recompiles once every shape
has been met) and ``steps``.

    python bench/store_recompiles.py [--steps 120] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

STAGE = ('data.stages=[{name = "low", start_step = 0, buckets = [[48, 48], [48, 80], [80, 48]], '
         'global_batch = 32}]')


def cli(*args: str, cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "difftrain.cli", *args], cwd=cwd, check=True, capture_output=True,
                          text=True, env=env).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    args = ap.parse_args()
    from difftrain.config import preset_path
    from difftrain.shapes.export import export_shapes

    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        cfg = root / "store.toml"
        cfg.write_text(preset_path("shapes-store").read_text())
        sets = [STAGE, f"train.steps={args.steps}", "train.compile=true", "train.log_every=1",
                "train.checkpoint_every=0", "train.threads=1"]
        flags = [a for s in sets for a in ("--set", s)]
        export_shapes(root / "shapes-export", seed=0, n=(600, 240, 240), sizes=(48,))
        cli("prepare", str(cfg), "--no-progress", *flags, cwd=root)
        cli("train", str(cfg), "--run-dir", "run", "--no-progress", *flags, cwd=root)
        rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "shapes" in r]
        first: dict[tuple, int] = {}
        for r in rows:
            for shape in r["shapes"]:
                first.setdefault(tuple(shape), r["step"])
        graphs = sum(r.get("recompiles", 0) for r in rows)
        last_new = max(first.values())
        after = sum(r.get("recompiles", 0) for r in rows if r["step"] > last_new)
        print(json.dumps({
            "steps": len(rows), "graphs": graphs,
            "distinct_keys": [{"task": k[0], "image_tokens": k[1], "text_tokens": k[2], "first_step": s}
                              for k, s in sorted(first.items(), key=lambda kv: kv[1])],
            "text_lengths": sorted({k[2] for k in first}),
            "graphs_per_key": round(graphs / len(first), 2),
            "graphs_after_all_keys_seen": after}))


if __name__ == "__main__":
    main()

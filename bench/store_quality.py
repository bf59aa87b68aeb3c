"""Is a model trained from the latent store as good as one trained on the fly? The shapes-store preset (its
model, steps, global batch and task mixture) trained twice through the preset's curriculum (its stages of
resolution and aspect buckets): once from the store (``shapes export --config``, ``prepare``, ``train``), once
on the fly (``data.source = "shapes"``, which renders each step's bucket as the export lays scenes out). Both
are evaluated with ``difftrain eval`` on the same prompts at every bucket of the last stage (the mean; each
bucket listed). Prints one JSON object: both runs' accuracies and ``store_minus_fly_pp`` (percentage points)
per accuracy.

    python bench/store_quality.py [--steps 4000] [--n 256] [--dir DIR] [--set KEY=VALUE ...]
        [--align 16] [--store-only] [--quick] [--parallel]

``--align 8`` exports scenes half a token off on aspect canvases (with ``--set model.positions="corner"`` and
4:3 buckets, ``--set 'data.stages=...'``) to reproduce the earlier broken path. ``--quick`` is the data path's
quality gate: text-to-image only, the first stage's three 48-pixel buckets, 1,000 steps, n = 32, the store run only
(5 minutes on two threads: ``--quick --check --set train.threads=2``, run before a change to the data path lands;
it was part of the test suite until the suite's time budget could no longer hold it). ``--check`` exits 1 unless
every bucket of the store run clears ``BAR`` (the working path does; the earlier layout misses).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ACC = ("t2i_color_acc", "t2i_position_acc", "t2i_shape_acc", "t2i_acc", "edit_acc", "keyframe_acc",
       "one_shape_rate")
QUICK = ["train.steps=1000", "data.t2i_weight=1.0", "data.edit_weight=0.0", "data.keyframe_weight=0.0",
         "train.checkpoint_every=0", 'data.stages=[{name = "low", start_step = 0, '
         'buckets = [[48, 48], [48, 80], [80, 48]], global_batch = 32}]']


def cli(*args: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "difftrain.cli", *args], cwd=cwd, check=True, capture_output=True,
                         text=True)
    return out.stdout


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def store_run(root: Path, overrides: list[str], n: int, align: int = 16, epochs: float = 1.0) -> dict:
    """Export sized for the run, prepare, train from the store, eval at every bucket of the last stage."""
    from difftrain.config import load_config, preset_path
    from difftrain.shapes.export import export_plan, export_shapes

    root.mkdir(parents=True, exist_ok=True)
    cfg_path = root / "store.toml"
    cfg_path.write_text(preset_path("shapes-store").read_text())
    cfg = load_config(cfg_path, overrides)
    t0 = time.perf_counter()
    plan = export_plan(cfg, epochs, align=align)
    export_shapes(root / "shapes-export", seed=0, **plan)
    prep = json.loads(cli("prepare", str(cfg_path), "--no-progress", *sets(overrides), cwd=root).splitlines()[-1])
    t1 = time.perf_counter()
    cli("train", str(cfg_path), "--run-dir", "run", "--no-progress", *sets(overrides), cwd=root)
    t2 = time.perf_counter()
    ev = json.loads(cli("eval", "run", "--json", "--n", str(n), cwd=root).splitlines()[-1])
    return {"eval": ev, "export_n": list(plan["n"]), "prepare_kept": prep["kept"],
            "prepare_s": round(t1 - t0, 1), "train_s": round(t2 - t1, 1)}


def fly_run(root: Path, overrides: list[str], n: int) -> dict:
    from difftrain.config import preset_path

    root.mkdir(parents=True, exist_ok=True)
    cfg_path = root / "fly.toml"
    cfg_path.write_text(preset_path("shapes-store").read_text())
    fly = overrides + ['data.source="shapes"']    # the same curriculum: each step renders a bucket of its stage
    t0 = time.perf_counter()
    cli("train", str(cfg_path), "--run-dir", "run", "--no-progress", *sets(fly), cwd=root)
    t1 = time.perf_counter()
    ev = json.loads(cli("eval", "run", "--json", "--n", str(n), cwd=root).splitlines()[-1])
    return {"eval": ev, "train_s": round(t1 - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    ap.add_argument("--n", type=int, default=256, help="eval prompts per task")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--align", type=int, default=16, help="export margins' unit in pixels (8: the earlier layout)")
    ap.add_argument("--epochs", type=float, default=None,
                    help="export size: passes of the run over each scene (default: shapes export's 1; --quick 16)")
    ap.add_argument("--store-only", action="store_true", help="skip the on-the-fly run")
    ap.add_argument("--parallel", action="store_true", help="train the two runs at the same time")
    ap.add_argument("--quick", action="store_true", help="the quality gate's setting (see the module docstring)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every bucket of the store run clears BAR")
    args = ap.parse_args()
    overrides = (QUICK if args.quick else []) + args.overrides
    if args.steps:
        overrides.append(f"train.steps={args.steps}")
    n = 32 if args.quick and args.n == 256 else args.n
    epochs = args.epochs or (16.0 if args.quick else 1.0)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(args.dir) if args.dir else Path(tmp)
        out: dict = {"overrides": overrides, "n": n, "align": args.align, "epochs": epochs}
        both = not (args.store_only or args.quick)
        with ThreadPoolExecutor(max_workers=2 if args.parallel else 1) as pool:
            # Each run is its own processes; --parallel overlaps them (one torch thread each suits 2 cores).
            store_job = pool.submit(store_run, root / "store", overrides, n, args.align, epochs)
            fly_job = pool.submit(fly_run, root / "fly", overrides, n) if both else None
            store = out["store"] = store_job.result()
            fly = out["fly"] = fly_job.result() if fly_job else None
        if fly is not None:
            out["store_minus_fly_pp"] = {k: round(100 * (store["eval"][k] - fly["eval"][k]), 1) for k in ACC
                                         if store["eval"].get(k) is not None and fly["eval"].get(k) is not None}
        if args.check:
            out["missed"] = missed(store["eval"])
        print(json.dumps(out))
        if args.check and (out["missed"] is None or any(out["missed"].values())):
            sys.exit(1)


# the gate (docs/data-path.md): colour and position >= 0.85 and shape >= 0.4 at every bucket of the last stage
BAR = {"t2i_color_acc": 0.85, "t2i_position_acc": 0.85, "t2i_shape_acc": 0.4}


def missed(ev: dict) -> dict | None:
    """{bucket: {accuracy: value}} of what falls below ``BAR``; None when the eval has no buckets to judge."""
    buckets = ev.get("buckets") or []
    if not buckets or set(ev.get("by_bucket", {})) != set(buckets):
        return None
    return {b: {k: ev["by_bucket"][b][k] for k in BAR if ev["by_bucket"][b][k] < BAR[k]} for b in buckets}


if __name__ == "__main__":
    main()

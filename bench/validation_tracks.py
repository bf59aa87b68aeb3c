"""Does the flow-matching validation loss track quality? One shapes-world run (the demo's preset) with
``[validation]`` every ``--every`` steps; at the same steps the shapes evaluator judges the same (EMA) weights by
pixels on ``--n`` seen prompts per task. Prints one JSON line:

- ``points``: per evaluation, the step, ``val_loss``, ``val_loss_ema`` and the evaluator's accuracies (t2i colour,
  position, shape, edits, keyframes) and their mean ``acc_mean``;
- ``validation_loss_vs_acc_spearman``: Spearman's rank correlation between ``val_loss_ema`` and ``acc_mean`` over the
  points (negative = the loss falls as accuracy rises: it tracks quality); ``..._raw`` the same for the raw weights'
  loss (``val_loss``) against the same accuracies;
- ``wall_s``, ``steps``, ``every``, ``n``.

    python bench/validation_tracks.py [--steps 1500] [--every 150] [--n 64] [--config shapes-tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ACC_KEYS = ("t2i_color_acc", "t2i_position_acc", "t2i_shape_acc", "edit_acc", "keyframe_acc")


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho (average ranks for ties)."""
    def ranks(x):
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        for v in np.unique(x):                      # ties share their mean rank
            r[x == v] = r[x == v].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(np.sqrt((ra ** 2).sum() * (rb ** 2).sum()))
    return float((ra * rb).sum() / den) if den else float("nan")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="shapes-tiny")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--every", type=int, default=150)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    from difftrain.config import load_config, preset_path
    from difftrain.evaluate import evaluate
    from difftrain.shapes import world_from_config
    from difftrain.train import build_trainer

    t0 = time.perf_counter()
    cfg = load_config(preset_path(args.config), [
        f"train.steps={args.steps}", "train.minutes=0", f"validation.every={args.every}", "validation.n=64",
        "train.checkpoint_every=0", "train.sample_every=0", f"train.log_every={args.every}"])
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="validation-tracks-"))
    trainer = build_trainer(cfg, root / "run")
    world = world_from_config(cfg.data, cfg.eval.seed)
    accs: dict[int, dict] = {}

    def judge(step, total, stats):
        if step % args.every and step != total:
            return
        with torch.no_grad(), trainer.ema.applied(trainer.model):
            trainer.model.eval()
            m, _ = evaluate(trainer.pipeline(), world, args.n, cfg.sample.steps, cfg.sample.cfg_scale,
                            cfg.sample.seed, cfg.eval.keyframe_given, heldout=False)
        accs[step] = {k: m[k] for k in ACC_KEYS}

    summary = trainer.fit(judge)
    trainer.close()
    if summary.get("preempted"):          # SIGTERM / SIGINT: the trainer saved and stopped; so does the bench
        sys.exit(f"stopped by a signal at step {summary['steps']} of {args.steps}: no figures (the run: {root / 'run'})")
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r for r in rows if "val_loss" in r}
    points = []
    for step in sorted(set(val) & set(accs)):
        a = accs[step]
        points.append({"step": step, "val_loss": val[step]["val_loss"], "val_loss_ema": val[step]["val_loss_ema"],
                       **a, "acc_mean": round(float(np.mean([a[k] for k in ACC_KEYS])), 4)})
    out = {"steps": args.steps, "every": args.every, "n": args.n, "points": points,
           "validation_loss_vs_acc_spearman": round(spearman([p["val_loss_ema"] for p in points],
                                                             [p["acc_mean"] for p in points]), 4),
           "validation_loss_vs_acc_spearman_raw": round(spearman([p["val_loss"] for p in points],
                                                                 [p["acc_mean"] for p in points]), 4),
           "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()

"""The attention autotuner on this machine: every attention shape of the shapes presets, each eligible backend
timed (forward and backward: training), the winner per shape, and how good the tuner's choice is when measured
again.

For each preset: ``parallel.tune.tune`` over ``attention_shapes`` (the presets' tasks and text rungs at their
micro-batch), then every backend timed again on every shape (fresh inputs, another round of repetitions):
``tuner_regret`` = the hybrid's total time (each shape's tuned winner, re-measured) over the total of each
shape's re-measured fastest backend (1.0 = the tuner picked every shape's fastest; target <= 1.05), and the
hybrid's speed-up over the best single backend and over SDPA's own choice.

    python bench/attention.py [--presets shapes-tiny shapes-store] [--reps 20] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    from difftrain.config import load_config, preset_path
    from difftrain.diffusion.pipeline import pick_device
    from difftrain.parallel.dist import batch_split
    from difftrain.parallel.tune import attention_shapes, summary, time_backend, tune

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["shapes-tiny", "shapes-store"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = pick_device()
    out = {"device": str(device), "threads": torch.get_num_threads(), "dtype": a.dtype, "presets": {}}
    for preset in a.presets:
        cfg = load_config(preset_path(preset), [])
        micro = batch_split(cfg.train.global_batch, cfg.train.micro_batch, 1)[0]
        shapes = attention_shapes(cfg, micro, a.dtype)
        results = tune(shapes, device, True, None, reps=a.reps)
        again = {s.key: {n: time_backend(n, s, device, True, a.reps) for n in results[s.key]["ms"]} for s in shapes}
        hybrid = sum(again[k][results[k]["winner"]] for k in again)
        fastest = sum(min(v.values()) for v in again.values())
        out["presets"][preset] = {
            "shapes": {k: {"winner": r["winner"], "ms": r["ms"], "ms_again": {n: round(t, 4) for n, t in again[k].items()},
                           "rejected": r["rejected"]} for k, r in results.items()},
            "tuner_regret": round(hybrid / fastest, 3), **summary(results)}
    out["tuner_regret"] = max(p["tuner_regret"] for p in out["presets"].values())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

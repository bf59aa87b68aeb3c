"""Scaling and compilation on this CPU machine, with real ``difftrain train`` processes (gloo, one thread
per rank). Prints one JSON object:

- ``step_time_1rank`` / ``step_time_2rank``: mean step seconds (steps after warm-up) of the same run at
  the same global batch on 1 process and on 2 under torchrun (FSDP2); the ideal ratio is 0.5;
- ``scaling_efficiency`` = step_time_1rank / (2 x step_time_2rank);
- ``compile_speedup``: eager over compiled mean step time (1 process, after compilation);
- ``recompiles``: graphs compiled during the compiled run (first compilations included), and
  ``distinct_shapes``: the distinct (image tokens, text tokens) shapes its batches had;
- ``compile_cache_warm_speedup``: the compiled run's first-step time (where compilation happens) with a cold
  cache over the same with the cache the first run left (a restarted job), fresh processes both.

    python bench/scale_cpu.py [--steps 40] [--config shapes-tiny] [--set train.global_batch=128 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETS = ["train.minutes=0", "train.checkpoint_every=0", "train.log_every=1", "train.threads=1", "train.ema_decay=0",
        "train.sample_every=0"]


def run(cfg: str, run_dir: Path, sets: list[str], nproc: int = 1) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "difftrain", "train", cfg, "--run-dir", str(run_dir), "--no-progress"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *cmd[1:]]
    for s in SETS + sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, wall


def mean_step(rows: list[dict], skip: int) -> float:
    return statistics.mean(r["data_s"] + r["step_s"] for r in rows if r["step"] > skip)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="shapes-tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--compile-steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the means")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override for every run")
    args = ap.parse_args()
    SETS.extend(args.sets)
    root = Path(tempfile.mkdtemp(prefix="scale_cpu_"))
    steps = [f"train.steps={args.steps}"]
    one, _ = run(args.config, root / "one", steps)
    two, _ = run(args.config, root / "two", steps, nproc=2)
    t1, t2 = mean_step(one, args.skip), mean_step(two, args.skip)

    # Compilation: t2i only keeps the shape count small enough for a benchmark on two cores.
    cache = root / "compile_cache"
    csets = [f"train.steps={args.compile_steps}", "train.compile=true", f"train.compile_cache={cache}",
             "data.t2i_weight=1", "data.edit_weight=0", "data.keyframe_weight=0"]
    eager, _ = run(args.config, root / "eager", csets[:1] + csets[3:])
    cold, cold_wall = run(args.config, root / "cold", csets)
    warm, warm_wall = run(args.config, root / "warm", csets)
    skip_c = max(args.skip, 2)
    first = lambda rows: rows[0]["data_s"] + rows[0]["step_s"]   # noqa: E731
    out = {
        "step_time_1rank": round(t1, 4), "step_time_2rank": round(t2, 4), "ratio_2rank_over_1rank": round(t2 / t1, 3),
        "scaling_efficiency": round(t1 / (2 * t2), 3),
        "compile_speedup": round(mean_step(eager, skip_c) / mean_step(cold, skip_c), 3),
        "recompiles": int(sum(r.get("recompiles", 0) for r in cold)),
        "recompiles_warm_run": int(sum(r.get("recompiles", 0) for r in warm)),
        "distinct_shapes": len({tuple(r["seq"]) for r in cold}),
        "compile_first_step_cold_s": round(first(cold), 2), "compile_first_step_warm_s": round(first(warm), 2),
        "compile_cache_warm_speedup": round(first(cold) / first(warm), 2),
        "compile_run_wall_cold_s": round(cold_wall, 1), "compile_run_wall_warm_s": round(warm_wall, 1),
        "config": args.config, "overrides": args.sets, "steps": args.steps,
        "global_batch_note": "same global batch on 1 and 2 ranks",
        "threads_per_rank": 1, "cpu_count": os.cpu_count(),
    }
    print(json.dumps(out))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Fault-injection harness: a small training job under torchrun (2 gloo ranks, one thread each) meets one
fault per run, at a random step, with automatic restart (``--max-restarts``) and, for a preemption, this
script acting as the launcher that requeues. Prints one JSON object.

Faults: ``kill`` (SIGKILL of a random rank), ``killsave`` (SIGKILL of rank 0 while a checkpoint is being
sealed), ``corrupt`` (the newest checkpoint damaged, then a kill), ``enospc`` (a checkpoint write fails with
ENOSPC), ``nan`` (a non-finite loss), ``hang`` (one rank stops; the watchdog ends it), ``sigterm``
(preemption: every rank stops at one step, checkpoints, the launcher requeues).

Per fault: ``recovered`` (the job finished with no person involved), ``recovery_seconds`` (the fault ->
the first step after the resume; for faults that need no restart, 0), ``steps_lost`` (steps run twice),
``final_state_identical`` (every checkpoint tensor file of the final step byte-equal to the uninterrupted
run's; for ``nan``, to a run that skips the same step) and ``stream_identical`` (per rank and step the same
sample ids, every step present). ``goodput``: wall time of the steps that count over the wall time of all
faulted jobs (process starts included). ``goodput_at_1_fault_per_hour``: projected from the measured mean
recovery time, the mean lost work at the run's checkpoint interval (half an interval of steps) and the
measured checkpoint stall per interval, at the reference run's measured step time (``--step-seconds`` to
project for another).

    python bench/chaos.py [--steps 40] [--every 5] [--seed 0] [--faults kill,killsave,...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from difftrain.config import load_config, to_toml
from difftrain.train.metrics import read_events, read_metrics

TINY = ["model.hidden=32", "model.heads=2", "model.double_blocks=1", "model.single_blocks=1",
        "model.axes_dims_rope=[4, 6, 6]", "text.dim=16", "text.max_tokens=16", "data.image_size=32",
        "data.frames=3", "data.world_size=64", "train.global_batch=8", "train.minutes=0", "train.warmup_steps=1",
        "train.log_every=1", "train.lr=1e-3", "sample.steps=3", "eval.n=4", "train.ema_decay=0.9",
        "train.threads=1", "train.schedule=constant", "health.hang_seconds=10", "health.straggler_every=0"]
ALL = ("kill", "killsave", "corrupt", "enospc", "nan", "hang", "sigterm")


def torchrun(cfg: Path, run: Path, faults: str, samples: Path, restarts: int = 3) -> tuple[int, float, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={restarts}", "-m", "difftrain", "train", str(cfg), "--run-dir", str(run), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIFFTRAIN_FAULTS": faults, "DIFFTRAIN_SAMPLE_LOG": str(samples)}
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)       # a timeout kills the workers too
    try:
        _, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return -9, time.time() - t0, "timed out after 900 s\n" + err[-2000:]
    return proc.returncode, time.time() - t0, err[-2000:]


class Tensors(dict):
    """name -> tensor; equal when the same names hold bit-identical tensors of the same dtype."""

    def __eq__(self, other):
        import torch
        return self.keys() == other.keys() and all(
            self[k].dtype == other[k].dtype and torch.equal(self[k], other[k]) for k in self)


def final_files(run: Path, step: int) -> dict[str, Tensors]:
    """Every tensor of the final checkpoint, per shard file (the headers may order them differently)."""
    from safetensors.torch import load_file
    d = run / "checkpoints" / f"step_{step:08d}"
    return {f.name: Tensors(load_file(str(f))) for f in sorted(d.glob("*.safetensors"))}


def stream(samples: Path) -> tuple[dict, bool]:
    """(rank, step) -> ids of the last draw, and whether every replay drew the same ids as the first time."""
    out, consistent = {}, True
    for r in range(2):
        p = Path(f"{samples}.rank{r}")
        for line in (p.read_text().splitlines() if p.is_file() else []):
            row = json.loads(line)
            key = (r, row["step"])
            consistent &= out.get(key, row["ids"]) == row["ids"]
            out[key] = row["ids"]
    return out, consistent


def fired_at(run: Path) -> float | None:
    times = [float(f.read_text().split()[0]) for f in (run / "faults").glob("*") if f.is_file()]
    return min(times) if times else None


def analyse(kind: str, run: Path, samples: Path, wall: float, rc: int, ref: dict, steps: int) -> dict:
    rows = read_metrics(run)
    events = read_events(run)
    t_fault = fired_at(run)
    # a restart is a new start of the job after the fault, resumed from a checkpoint or (none left) from step 0
    starts = [e for e in events if e["kind"] == "start" and t_fault and e["time"] > t_fault]
    recovery = 0.0
    lost = 0
    if starts:
        first = [m for m in rows if "loss" in m and m.get("time", 0) > starts[0]["time"]]
        recovery = (first[0]["time"] - t_fault) if first else None
        before = [m["step"] for m in rows if "loss" in m and m.get("time", 0) <= t_fault]
        lost = max(0, (max(before) if before else 0) - starts[0]["step"])
    resumes = starts
    got = final_files(run, steps)
    s, consistent = stream(samples)
    counted = sum(m.get("data_s", 0) + m.get("step_s", 0) for m in {m["step"]: m for m in rows if "loss" in m}.values())
    return {"kind": kind, "recovered": rc == 0 and bool(got), "exit_code": rc,
            "recovery_seconds": None if recovery is None else round(recovery, 2), "steps_lost": lost,
            "restarts": len(resumes), "final_state_identical": bool(got) and got == ref["files"],
            "stream_identical": consistent and s == ref["stream"], "wall_seconds": round(wall, 2),
            "counted_step_seconds": round(counted, 2),
            "checkpoint_stall_s": [e.get("stall_s") for e in events if e["kind"] == "checkpoint"],
            "skipped": [e["step"] for e in events if e["kind"] == "skip"],
            "checkpoint_failed": [e["step"] for e in events if e["kind"] == "checkpoint_failed"],
            "checkpoint_skipped": [e["step"] for e in events if e["kind"] == "checkpoint_skipped"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="checkpoint interval (steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", default=",".join(ALL))
    ap.add_argument("--step-seconds", type=float, default=0.0,
                    help="step time the goodput is projected for (default: the reference run's measured mean)")
    ap.add_argument("--keep", default=None, help="keep the run directories here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    kinds = [k for k in args.faults.split(",") if k]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "job.toml"
    cfg.write_text(to_toml(load_config(None, TINY + [f"train.steps={args.steps}",
                                                     f"train.checkpoint_every={args.every}"])))

    def reference(name: str, skip: list[int] | None = None) -> dict:
        run, samples = root / name, root / f"{name}.samples"
        if skip:
            run.mkdir(parents=True, exist_ok=True)
            (run / "skip_steps.json").write_text(json.dumps(skip))
        rc, wall, err = torchrun(cfg, run, "", samples, restarts=0)
        if rc != 0:
            raise SystemExit(f"reference run failed:\n{err}")
        rows = [m for m in read_metrics(run) if "loss" in m]
        step_s = sum(m.get("data_s", 0) + m.get("step_s", 0) for m in rows) / max(1, len(rows))
        return {"files": final_files(run, args.steps), "stream": stream(samples)[0], "wall": wall, "step_s": step_s}

    ref = reference("reference")
    out = []
    for kind in kinds:
        run, samples = root / kind, root / f"{kind}.samples"
        step = rng.randint(args.every + 2, args.steps - args.every)
        rank = rng.randint(0, 1)
        spec = {"kill": f"kill@{step}:{rank}", "killsave": f"killsave@{(step // args.every) * args.every}:0",
                "corrupt": f"corrupt@{max(2 * args.every, (step // args.every) * args.every) + 2}:0", "enospc": f"enospc@{(step // args.every) * args.every}:{rank}",
                "nan": f"nan@{step}:{rank}", "hang": f"hang@{step}:{rank}", "sigterm": f"sigterm@{step}:{rank}"}[kind]
        rc, wall, err = torchrun(cfg, run, spec, samples)
        if kind == "sigterm" and rc == 0 and (run / "requeue.json").is_file():
            requeue_at = time.time()         # the launcher's part: the marker says requeue
            rc, wall2, err = torchrun(cfg, run, spec, samples)
            wall += wall2
        want = ref
        if kind == "nan":
            skipped = [e["step"] for e in read_events(run) if e["kind"] == "skip"]
            want = reference("nan-reference", skipped)
        row = analyse(kind, run, samples, wall, rc, want, args.steps)
        if kind == "sigterm":    # a planned stop: the "recovery" is the requeued job's start to its first step
            ev = [e for e in read_events(run) if e["kind"] == "start"]
            rows = [m for m in read_metrics(run) if "loss" in m and ev and m.get("time", 0) > ev[-1]["time"]]
            row["recovery_seconds"] = round(rows[0]["time"] - requeue_at, 2) if rows and rc == 0 else None
            row["steps_lost"] = 0
        if kind in ("enospc", "nan"):
            row["recovery_seconds"] = 0.0
        row["spec"] = spec
        if rc != 0:
            row["stderr_tail"] = err[-800:]
        out.append(row)
        print(json.dumps({k: row[k] for k in ("kind", "spec", "recovered", "recovery_seconds", "steps_lost",
                                                 "final_state_identical")}), file=sys.stderr, flush=True)

    counted = sum(r["counted_step_seconds"] for r in out)
    wall = sum(r["wall_seconds"] for r in out)
    restarts = [r for r in out if r["kind"] in ("kill", "killsave", "corrupt", "hang") and r["recovery_seconds"]]
    rec = sum(r["recovery_seconds"] for r in restarts) / max(1, len(restarts))
    stalls = [s for r in out for s in r["checkpoint_stall_s"] if s is not None]
    stall = sum(stalls) / max(1, len(stalls))
    step_seconds = args.step_seconds or ref["step_s"]
    interval_s = args.every * step_seconds
    lost_s = interval_s / 2
    projected = 1 - (rec + lost_s) / 3600 - stall / interval_s
    print(json.dumps({
        "faults": [{k: r[k] for k in ("kind", "spec", "recovered", "recovery_seconds", "steps_lost",
                                       "final_state_identical", "stream_identical", "restarts", "wall_seconds",
                                       *(("stderr_tail",) if "stderr_tail" in r else ()))} for r in out],
        "goodput": round(counted / wall, 4) if wall else None,
        "goodput_at_1_fault_per_hour": round(projected, 4),
        "projection": {"mean_recovery_s": round(rec, 2), "checkpoint_interval_steps": args.every,
                       "step_seconds": round(step_seconds, 4), "lost_work_s": round(lost_s, 3), "mean_checkpoint_stall_s": round(stall, 4)},
        "reference_wall_seconds": round(ref["wall"], 2), "steps": args.steps, "world": 2,
        "all_recovered": all(r["recovered"] for r in out),
        "all_identical": all(r["final_state_identical"] and r["stream_identical"] for r in out),
    }, indent=None))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

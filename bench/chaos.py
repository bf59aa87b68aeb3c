"""Fault-injection harness: a small training job under torchrun (2 gloo ranks, one thread each) meets one
fault per run, at a random step, with automatic restart (``--max-restarts``) and, for a preemption, this
script acting as the launcher that requeues. Prints one JSON object.

Faults: ``kill`` (SIGKILL of a random rank), ``killsave`` (SIGKILL of rank 0 while a checkpoint is being
sealed), ``corrupt`` / ``truncate`` (the newest checkpoint's largest file damaged or cut short, then a kill),
``enospc`` (a checkpoint write fails with ENOSPC), ``enospc_partial`` (ENOSPC half way through a shard), ``nan`` (a
non-finite loss), ``hang`` (one rank stops; the watchdog ends it), ``sigterm`` (preemption from inside a worker:
every rank stops at one step, checkpoints, the launcher requeues), ``agent_sigterm`` (SIGTERM to the torchrun
agent, as schedulers send it), ``anytime`` (SIGKILLs at random moments, each recording the phase it hit:
``phases_hit``), ``nodekill`` / ``nodestop`` (one of two torchrun agents' nodes lost, ``bench/node_loss.py``:
``detect_s``, ``rendezvous_s``, ``resume_s``) and ``store`` (a kill in a job fed from a latent store the script
prepares, the store loader's state in the checkpoint), ``store_read_error_resume`` (in that store-fed job a rank's
row reads as damaged, within ``data.max_error_rate``, whenever its step is read; the job is killed after the next
checkpoint and resumes, whichever checkpoint it finds: the run's read-error totals come back with it; compared with
the same job meeting the same bad row unkilled),
``rank0_seal_failure`` (rank 0 alone fails to seal a blocking save: every rank ends with the error, ``error_on_every_rank_s``
after the fault, and torchrun restarts the job from the previous checkpoint), ``blocking_save_kill`` (SIGKILL of
rank 0 part way through a blocking save, ``train.async_checkpoint = false``: shards written, no marker),
``double_only_kill`` (a kill in a job whose model has no single-stream blocks: its last double block has no text
output weights, and the restart resumes it; compared with the same model unkilled), ``store_cp_read_error`` (the
store-fed job at ``parallel.cp = 2``: both context-parallel peers meet the same damaged row, counted once
(``data_errors_at_end`` = 1), then a kill after the next checkpoint; compared with the same cp = 2 job unkilled) and
``validation_read_error`` (the store-fed job with a held-out validation source: one rank's share of the validation
rows reads as damaged at one validation; every rank skips that validation (``validation_skipped_at``) and the job
goes on without a restart or a hang; compared with the same job without the fault).

Per fault: ``recovered`` (the job finished with no person involved), ``recovery_seconds`` (the fault ->
the first step after the resume; for faults that need no restart, 0), ``steps_lost`` (steps run twice),
``final_state_identical`` (every checkpoint tensor file of the final step byte-equal to the uninterrupted
run's; for ``nan``, to a run that skips the same step) and ``stream_identical`` (per rank and step the same
sample ids, every step present). ``goodput``: wall time of the steps that count over the wall time of all
faulted jobs (process starts included). ``goodput_at_1_fault_per_hour``: projected from the measured mean
recovery time, the mean lost work at the run's checkpoint interval (half an interval of steps) and the
measured checkpoint stall per interval, at the reference run's measured step time (``--step-seconds`` to
project for another).

``goodput_projected_24b_64gpu``: the dit-24b preset on 64 H200s, its assumptions in the JSON.

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
import threading
import time
from pathlib import Path

from difftrain.config import load_config, to_toml
from difftrain.train.metrics import read_events, read_metrics

TINY = ["model.hidden=32", "model.heads=2", "model.double_blocks=1", "model.single_blocks=1",
        "model.axes_dims_rope=[4, 6, 6]", "text.dim=16", "text.max_tokens=16", "data.image_size=32",
        "data.frames=3", "data.world_size=64", "train.global_batch=8", "train.minutes=0", "train.warmup_steps=1",
        "train.log_every=1", "train.lr=1e-3", "sample.steps=3", "eval.n=4", "train.ema_decay=0.9",
        "train.threads=1", "train.schedule=constant", "health.hang_seconds=10", "health.straggler_every=0"]
ALL = ("kill", "killsave", "corrupt", "truncate", "enospc", "enospc_partial", "nan", "hang", "sigterm",
       "agent_sigterm", "anytime", "nodekill", "nodestop", "store", "store_read_error_resume", "rank0_seal_failure",
       "blocking_save_kill", "double_only_kill", "store_cp_read_error", "validation_read_error")
STORE_KINDS = ("store", "store_read_error_resume", "store_cp_read_error", "validation_read_error")
BLOCKING = ("rank0_seal_failure", "blocking_save_kill")     # faults of the blocking save path (async_checkpoint off)
RESTARTING = ("kill", "killsave", "corrupt", "truncate", "hang", "anytime", "store", "store_read_error_resume",
              "rank0_seal_failure", "blocking_save_kill", "double_only_kill", "store_cp_read_error")
DWELL_S = 0.05       # 'anytime': every phase lasts at least this long, so a poll of the board can land in it


def torchrun(cfg: Path, run: Path, faults: str, samples: Path, restarts: int = 3, env: dict | None = None,
             during=None) -> tuple[int, float, str]:
    """One job under torchrun (2 ranks); ``during(proc)``, if given, runs in a thread while it does (a harness
    acting on the job from outside: signals to the agent, kills at random moments)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={restarts}", "-m", "difftrain", "train", str(cfg), "--run-dir", str(run), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIFFTRAIN_FAULTS": faults, "DIFFTRAIN_SAMPLE_LOG": str(samples),
           **(env or {})}
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)       # a timeout kills the workers too
    if during is not None:
        threading.Thread(target=during, args=(proc,), daemon=True).start()
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


def _node_loss():
    """bench/node_loss.py as a module (the two-agent harness and its process helpers)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("node_loss", Path(__file__).with_name("node_loss.py"))
    nl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nl)
    return nl


def anytime_killer(board: Path, rng: random.Random, kills: list[dict], max_kills: int = 8):
    """``during`` for the 'anytime' fault: SIGKILL a rank at random wall-clock moments (a uniform wait of 0.3-2 s
    after the job last came back), each recording the phases the rank was in (``difftrain.train.phases``), until
    every phase was hit or ``max_kills``. A kill aimed at a phase not yet hit waits, after its random wait, for a
    rank to be in it (polled every 2 ms; phases last at least DWELL_S)."""
    from difftrain.train.phases import PHASES, read
    alive = _node_loss().alive

    def run(proc: subprocess.Popen) -> None:
        todo = list(PHASES)
        while proc.poll() is None and todo and len(kills) < max_kills:
            time.sleep(rng.uniform(0.3, 2.0))
            target, deadline = todo[0], time.time() + 30
            while proc.poll() is None and time.time() < deadline:
                hit = None
                for r in rng.sample([0, 1], 2):
                    got = read(f"{board}.rank{r}")
                    if got and target in got[1] and alive(got[0]):
                        hit = (r, *got)
                        break
                if hit is None:
                    time.sleep(0.002)
                    continue
                r, pid, active = hit
                t = time.time()
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                kills.append({"time": t, "rank": r, "phases": active, "aimed": target})
                todo = [p for p in todo if p not in active]
                # the next kill waits for the restarted job: a new worker's board shows a live pid again
                while proc.poll() is None and alive(pid):
                    time.sleep(0.01)
                back = time.time() + 120
                while proc.poll() is None and time.time() < back:
                    now = [read(f"{board}.rank{q}") for q in (0, 1)]
                    if all(x and x[0] != pid and alive(x[0]) for x in now):
                        break
                    time.sleep(0.05)
                break
            else:
                todo.append(todo.pop(0))       # not met in 30 s: aim at the next one first
    return run


def agent_signaller(samples: Path, sent: list[float], after_steps: int):
    """``during`` for 'agent_sigterm': SIGTERM to the torchrun agent itself, as SLURM's --signal and a pod's
    termination deliver it, once rank 0 has logged ``after_steps`` steps."""
    def run(proc: subprocess.Popen) -> None:
        log = Path(f"{samples}.rank0")
        while proc.poll() is None:
            if log.is_file() and len(log.read_text().splitlines()) >= after_steps:
                sent.append(time.time())
                proc.send_signal(signal.SIGTERM)
                return
            time.sleep(0.02)
    return run


def recovery_after(run: Path, t: float) -> float | None:
    """Seconds from ``t`` to the first step finished by a start of the job after ``t``."""
    starts = [e["time"] for e in read_events(run) if e["kind"] == "start" and e["time"] > t]
    if not starts:
        return None
    rows = [m["time"] for m in read_metrics(run) if "loss" in m and m.get("time", 0) > starts[0]]
    return round(rows[0] - t, 2) if rows else None


def node_loss_rows(root: Path, kinds: list[str], seed: int) -> list[dict]:
    """The two node losses (``bench/node_loss.py``): two torchrun agents, one node SIGKILLed (it comes back
    later) or SIGSTOPped; against an uninterrupted run of the same config."""
    nl = _node_loss()
    ref = nl.reference(root / "node-reference")
    rows = []
    for kind in kinds:
        mode = "kill" if kind == "nodekill" else "stop"
        t0 = time.time()
        try:
            r = nl.scenario(root / kind, mode, rejoin=(mode == "kill"), slow_s=0.5)
        except RuntimeError as e:
            rows.append({"kind": kind, "spec": mode, "recovered": False, "recovery_seconds": None, "steps_lost": None,
                         "final_state_identical": False, "stream_identical": False, "restarts": None,
                         "wall_seconds": round(time.time() - t0, 2), "stderr_tail": str(e)[-800:]})
            continue
        cmp = nl.compare(ref, Path(r["run"]), root / kind / "samples")
        rows.append({
            "kind": kind, "spec": f"{mode} one of two nodes after step {r['lost_after_step']}"
                                  + ("; it comes back" if r.get("rejoin") else ""),
            "recovered": r["finished"], "recovery_seconds": round(r["detect_s"] + r["rendezvous_s"] + r["resume_s"], 2),
            "detect_s": r["detect_s"], "rendezvous_s": r["rendezvous_s"], "resume_s": r["resume_s"],
            "rejoin_s": r.get("rejoin_s"), "worlds": r["worlds"], "steps_lost": 0,
            # the world size changes, so the gradient sums add in another order: equal to float rounding
            "final_state_identical": None, "final_state_max_abs_diff": cmp["final_state_max_abs_diff"],
            "final_state_within_1e-6": cmp["final_state_max_abs_diff"] is not None
                                       and cmp["final_state_max_abs_diff"] <= 1e-6,
            "stream_identical": cmp["stream_identical"], "restarts": len(r["worlds"]) - 1,
            "wall_seconds": round(time.time() - t0, 2), "counted_step_seconds": 0.0, "checkpoint_stall_s": []})
    return rows


def project_24b(write_gbps: float, staging_gbps: float, read_gbps: float, restart_overhead_s: float,
                gpus: int = 64) -> dict:
    """Goodput of the dit-24b preset on ``gpus`` H200s under the interruption rate Llama 3 reported (466 in 54
    days on 16,384 GPUs, scaled to the job's GPU count). Checkpoint bytes from the model's parameter count
    (fp32 weights, AdamW's two fp32 moments, fp32 EMA: 16 bytes a parameter); the async save stalls training for
    its device-to-host copy of each GPU's shard; the interval is Young's optimum sqrt(2 x stall x MTBI), at least
    one write; an interruption costs the restart overhead, the load and, on average, half an interval plus the
    save in flight."""
    import math
    from difftrain.config import load_config, preset_path
    from difftrain.models import config_dit_params
    from difftrain.parallel.memory import inventory

    cfg = load_config(preset_path("dit-24b"), [])
    params = inventory(config_dit_params(cfg), cfg).numel      # the planner's count (the trained parameters)
    ckpt = params * 16
    rate_gpu_h = 466 / (54 * 24 * 16384)
    mtbi_s = 3600 / (rate_gpu_h * gpus)
    stall_s = ckpt / gpus / (staging_gbps * 1e9)
    write_s = ckpt / (write_gbps * 1e9)
    load_s = ckpt / (read_gbps * 1e9)
    interval_s = max(write_s, math.sqrt(2 * stall_s * mtbi_s))
    per_failure_s = restart_overhead_s + load_s + interval_s / 2 + write_s
    goodput = (1 - stall_s / interval_s) * (1 - per_failure_s / mtbi_s)
    return {"goodput": round(goodput, 4), "assumptions": {
        "model": "dit-24b", "dit_params": params, "gpus": gpus, "checkpoint_bytes": ckpt,
        "checkpoint_bytes_per_param": "16 (fp32 weights 4, AdamW moments 8, EMA 4)",
        "interruptions": "466 in 54 days on 16,384 GPUs (Llama 3), scaled linearly to the GPU count",
        "mtbi_hours": round(mtbi_s / 3600, 1), "write_gbps": write_gbps, "read_gbps": read_gbps,
        "staging_gbps_per_gpu": staging_gbps, "restart_overhead_s": restart_overhead_s,
        "stall_per_checkpoint_s": round(stall_s, 2), "write_s": round(write_s, 1), "load_s": round(load_s, 1),
        "checkpoint_interval_s": round(interval_s, 1), "cost_per_interruption_s": round(per_failure_s, 1)}}


def error_seen_by_every_rank(run: Path, t_fault: float | None, text: str) -> float | None:
    """Seconds from the fault to the last rank's first log line holding ``text`` (None if a rank never logged
    it): how long the ranks took to hear of a failure on one of them."""
    if t_fault is None:
        return None
    seen = []
    for r in range(2):
        path = run / "logs" / f"rank_{r}.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
        times = [x["time"] for x in lines if text in x.get("msg", "") and x.get("time", 0) >= t_fault]
        if not times:
            return None
        seen.append(min(times) - t_fault)
    return round(max(seen), 2)


def store_config(root: Path, steps: int, every: int) -> Path:
    """A store-fed job: the shapes world exported small, prepared into a latent store (Ray Data, Lance), and the
    chaos job's model trained from it over one stage of two 32-pixel buckets."""
    from difftrain.config import preset_path

    export, store = root / "store-export", root / "store"
    cli = [sys.executable, "-m", "difftrain"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cli + ["shapes", "export", str(export), "--n", "96", "64", "48"], check=True, env=env,
                   capture_output=True)
    sources = "[" + ", ".join([
        f'{{name = "shapes_t2i", kind = "folder", path = "{export}/t2i"}}',
        f'{{name = "shapes_t2i_shards", kind = "webdataset", path = "{export}/shards"}}',
        f'{{name = "shapes_edit", kind = "manifest", task = "edit", path = "{export}/edit/manifest.jsonl"}}',
        f'{{name = "shapes_keyframes", kind = "keyframes", path = "{export}/keyframes"}}']) + "]"
    stage = '[{name = "s", start_step = 0, buckets = [[48, 48], [48, 80]], global_batch = 8}]'
    cfg = root / "store-job.toml"
    cfg.write_text(to_toml(load_config(preset_path("shapes-store"), [
        o for o in TINY if not o.startswith(("data.image_size", "data.world_size"))] + [
        "autoencoder.factor=8", "model.axes_dims_rope=[4, 6, 6]", f"data.sources={sources}",
        f"data.store={store}", f"data.stages={stage}", "data.image_size=48", f"train.steps={steps}",
        f"train.checkpoint_every={every}", "train.sample_every=0", "data.max_error_rate=0.01"])))
    subprocess.run(cli + ["prepare", str(cfg), "--no-progress"], check=True, env=env, capture_output=True)
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="checkpoint interval (steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", default=",".join(ALL))
    ap.add_argument("--step-seconds", type=float, default=0.0,
                    help="step time the goodput is projected for (default: the reference run's measured mean)")
    ap.add_argument("--keep", default=None, help="keep the run directories here")
    ap.add_argument("--write-gbps", type=float, default=20.0,
                    help="projection: the shared file system's write bandwidth for one job, GB/s")
    ap.add_argument("--read-gbps", type=float, default=40.0, help="projection: its read bandwidth, GB/s")
    ap.add_argument("--staging-gbps", type=float, default=20.0,
                    help="projection: device-to-host copy bandwidth of one GPU (the async save's stall), GB/s")
    ap.add_argument("--restart-overhead-s", type=float, default=180.0,
                    help="projection: detection, rendezvous, process start and compilation after a failure, s")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    kinds = [k for k in args.faults.split(",") if k]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "job.toml"
    cfg.write_text(to_toml(load_config(None, TINY + [f"train.steps={args.steps}",
                                                     f"train.checkpoint_every={args.every}"])))
    blocking_cfg = root / "job-blocking.toml"
    blocking_cfg.write_text(to_toml(load_config(None, TINY + [f"train.steps={args.steps}",
                                                              f"train.checkpoint_every={args.every}",
                                                              "train.async_checkpoint=false"])))

    double_cfg = root / "job-double-only.toml"
    double_cfg.write_text(to_toml(load_config(None, TINY + [f"train.steps={args.steps}",
                                                            f"train.checkpoint_every={args.every}",
                                                            "model.double_blocks=2", "model.single_blocks=0"])))

    def reference(name: str, skip: list[int] | None = None, config: Path | None = None) -> dict:
        run, samples = root / name, root / f"{name}.samples"
        if skip:
            run.mkdir(parents=True, exist_ok=True)
            (run / "skip_steps.json").write_text(json.dumps(skip))
        rc, wall, err = torchrun(config or cfg, run, "", samples, restarts=0)
        if rc != 0:
            raise SystemExit(f"reference run failed:\n{err}")
        rows = [m for m in read_metrics(run) if "loss" in m]
        step_s = sum(m.get("data_s", 0) + m.get("step_s", 0) for m in rows) / max(1, len(rows))
        return {"files": final_files(run, args.steps), "stream": stream(samples)[0], "wall": wall, "step_s": step_s}

    ref = reference("reference")
    out = []
    node_kinds = [k for k in kinds if k in ("nodekill", "nodestop")]
    for kind in [k for k in kinds if k not in node_kinds and k not in STORE_KINDS]:
        run, samples = root / kind, root / f"{kind}.samples"
        step = rng.randint(args.every + 2, args.steps - args.every)
        rank = rng.randint(0, 1)
        saved = (step // args.every) * args.every
        spec = {"kill": f"kill@{step}:{rank}", "killsave": f"killsave@{saved}:0",
                "corrupt": f"corrupt@{max(2 * args.every, saved) + 2}:0",
                "truncate": f"truncate@{max(2 * args.every, saved) + 2}:0",
                "enospc": f"enospc@{saved}:{rank}", "enospc_partial": f"enospc_partial@{saved}:{rank}",
                "nan": f"nan@{step}:{rank}", "hang": f"hang@{step}:{rank}", "sigterm": f"sigterm@{step}:{rank}",
                "agent_sigterm": "", "anytime": "", "rank0_seal_failure": f"sealfail@{saved}:0",
                "blocking_save_kill": f"killsave@{saved}:0", "double_only_kill": f"kill@{step}:{rank}"}[kind]
        env, during, kills, sent, restarts = None, None, [], [], 3
        if kind == "anytime":
            board = root / "anytime.board"
            env = {"DIFFTRAIN_PHASE_BOARD": str(board), "DIFFTRAIN_PHASE_DWELL_S": str(DWELL_S)}
            during, restarts = anytime_killer(board, rng, kills), 10
        if kind == "agent_sigterm":
            during = agent_signaller(samples, sent, step)
        job = blocking_cfg if kind in BLOCKING else double_cfg if kind == "double_only_kill" else cfg
        rc, wall, err = torchrun(job, run, spec, samples, restarts, env, during)
        requeue_at = None
        if kind in ("sigterm", "agent_sigterm") and (run / "requeue.json").is_file():
            requeue_at = time.time()         # the launcher's part: the marker says requeue, whatever rc says
            first_rc = rc
            rc, wall2, err = torchrun(cfg, run, spec, samples)
            wall += wall2
        want = ref
        if kind == "double_only_kill":
            want = reference("double-only-reference", config=double_cfg)
        if kind == "nan":
            skipped = [e["step"] for e in read_events(run) if e["kind"] == "skip"]
            want = reference("nan-reference", skipped)
        row = analyse(kind, run, samples, wall, rc, want, args.steps)
        if kind in ("sigterm", "agent_sigterm"):    # a planned stop: the requeued job's start to its first step
            row["recovery_seconds"] = recovery_after(run, requeue_at) if requeue_at and rc == 0 else None
            row["steps_lost"] = 0
            if kind == "agent_sigterm":
                row["agent_exit_code"] = first_rc if requeue_at else None
                row["signalled_after_step"] = step
        if kind == "anytime":
            for k in kills:
                k["recovery_seconds"] = recovery_after(run, k["time"])
            row["kills"] = [{key: k[key] for key in ("rank", "phases", "aimed", "recovery_seconds")} for k in kills]
            row["phases_hit"] = sorted({p for k in kills for p in k["phases"]})
            rec = [k["recovery_seconds"] for k in kills]
            row["recovery_seconds"] = max(rec) if rec and None not in rec else None
            row["restarts"] = len(kills)
        if kind in ("enospc", "enospc_partial", "nan"):
            row["recovery_seconds"] = 0.0
        if kind == "rank0_seal_failure":
            row["error_on_every_rank_s"] = error_seen_by_every_rank(run, fired_at(run), "sealing the checkpoint failed")
            row["recovered"] = row["recovered"] and row["error_on_every_rank_s"] is not None \
                and row["error_on_every_rank_s"] <= 30
        row["spec"] = spec or {"agent_sigterm": f"SIGTERM to the torchrun agent after step {step}",
                               "anytime": "SIGKILL of a rank at random moments, until every phase was hit"}[kind]
        if rc != 0:
            row["stderr_tail"] = err[-800:]
        out.append(row)
        print(json.dumps({k: row[k] for k in ("kind", "spec", "recovered", "recovery_seconds", "steps_lost",
                                                 "final_state_identical")}), file=sys.stderr, flush=True)
    out += node_loss_rows(root, node_kinds, args.seed)
    store_kinds = [k for k in kinds if k in STORE_KINDS]
    scfg = store_config(root, args.steps, args.every) if store_kinds else None
    variants = {}
    if scfg is not None:      # the same store and job, at cp = 2, and with a held-out validation source
        variants["cp2"] = root / "store-job-cp2.toml"
        variants["cp2"].write_text(to_toml(load_config(scfg, ["parallel.cp=2", "parallel.dp_shard=1"])))
        variants["val"] = root / "store-job-val.toml"
        variants["val"].write_text(to_toml(load_config(scfg, [
            "validation.source=shapes_t2i_shards", f"validation.every={args.every}", "validation.n=6",
            "validation.timesteps=2"])))

    def store_reference(name: str, faults: str, config: Path | None = None) -> dict:
        run, samples = root / name, root / f"{name}.samples"
        rc, _, err = torchrun(config or scfg, run, faults, samples, restarts=0)
        if rc != 0:
            raise SystemExit(f"{name} run failed:\n{err}")
        return {"files": final_files(run, args.steps), "stream": stream(samples)[0]}

    for kind in store_kinds:
        step, rank = rng.randint(args.every + 2, args.steps - args.every), rng.randint(0, 1)
        job = scfg
        if kind == "store":   # a store-fed job: the store loader's state is in the checkpoint; a rank is killed
            sref, spec, label = store_reference("store-reference", ""), f"kill@{step}:{rank}", " (store-fed)"
        elif kind == "validation_read_error":     # one rank's validation rows damaged once: skipped on every rank
            job, at = variants["val"], 2 * args.every
            sref = store_reference("store-validation-reference", "", job)
            spec, label = f"valunreadable@{at}:{rank}", " (store-fed, validation every checkpoint interval)"
        else:                 # a bad row (damaged for good), then a kill: the read-error totals resume whole
            bad = args.every + 2
            who = "*" if kind == "store_cp_read_error" else rank      # cp peers read the same rows
            bad_spec = f"unreadable@{bad}:{who}"
            job = variants["cp2"] if kind == "store_cp_read_error" else scfg
            sref = store_reference(f"{kind}-reference", bad_spec, job)
            kill = (bad // args.every + 1) * args.every + 2
            spec, label = f"{bad_spec},kill@{kill}:{1 - rank}", " (store-fed, the row unreadable in both runs)"
            if kind == "store_cp_read_error":
                label = " (store-fed at cp = 2, the row unreadable on both peers in both runs)"
        run, samples = root / kind, root / f"{kind}.samples"
        rc, wall, err = torchrun(job, run, spec, samples)
        row = analyse(kind, run, samples, wall, rc, sref, args.steps)
        row["spec"] = spec + label
        if kind in ("store_read_error_resume", "store_cp_read_error"):
            row["data_errors_at_end"] = max((m.get("data_errors", 0) for m in read_metrics(run)), default=None)
        if kind == "store_cp_read_error":         # one damaged row, counted once whatever cp is
            row["recovered"] = row["recovered"] and row["data_errors_at_end"] == 1
        if kind == "validation_read_error":
            events = read_events(run)
            row["validation_skipped_at"] = [e["step"] for e in events if e["kind"] == "validation_skipped"]
            row["recovery_seconds"] = 0.0
            row["recovered"] = row["recovered"] and row["validation_skipped_at"] == [at] and row["restarts"] == 0
        if rc != 0:
            row["stderr_tail"] = err[-800:]
        out.append(row)

    counted = sum(r["counted_step_seconds"] for r in out)
    wall = sum(r["wall_seconds"] for r in out)
    restarts = [r for r in out if r["kind"] in RESTARTING and r["recovery_seconds"]]
    rec = sum(r["recovery_seconds"] for r in restarts) / max(1, len(restarts))
    stalls = [s for r in out for s in r.get("checkpoint_stall_s", []) if s is not None]
    stall = sum(stalls) / max(1, len(stalls))
    step_seconds = args.step_seconds or ref["step_s"]
    interval_s = args.every * step_seconds
    lost_s = interval_s / 2
    projected = 1 - (rec + lost_s) / 3600 - stall / interval_s
    single = [r["recovery_seconds"] for r in out if r["kind"] not in ("nodekill", "nodestop")]
    keys = ("kind", "spec", "recovered", "recovery_seconds", "steps_lost", "final_state_identical", "stream_identical",
            "restarts", "wall_seconds", "kills", "phases_hit", "agent_exit_code", "detect_s", "rendezvous_s",
            "resume_s", "rejoin_s", "worlds", "final_state_max_abs_diff", "final_state_within_1e-6",
            "error_on_every_rank_s", "data_errors_at_end", "validation_skipped_at", "stderr_tail")
    print(json.dumps({
        "faults": [{k: r[k] for k in keys if k in r} for r in out],
        "fault_kinds": len(out),
        "phases_hit": sorted({p for r in out for p in r.get("phases_hit", [])}),
        "max_recovery_seconds": max(single) if single and None not in single else None,
        "goodput": round(counted / wall, 4) if wall else None,
        "goodput_at_1_fault_per_hour": round(projected, 4),
        "projection": {"mean_recovery_s": round(rec, 2), "checkpoint_interval_steps": args.every,
                       "step_seconds": round(step_seconds, 4), "lost_work_s": round(lost_s, 3), "mean_checkpoint_stall_s": round(stall, 4)},
        "goodput_projected_24b_64gpu": project_24b(args.write_gbps, args.staging_gbps, args.read_gbps,
                                                   args.restart_overhead_s),
        "reference_wall_seconds": round(ref["wall"], 2), "steps": args.steps, "world": 2,
        "all_recovered": all(r["recovered"] for r in out),
        "all_identical": all((r["final_state_identical"] or r.get("final_state_within_1e-6")) and r["stream_identical"]
                             for r in out),
    }, indent=None))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

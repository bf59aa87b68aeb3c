"""A lost node, loud or silent, and the job that continues on fewer nodes: two torchrun agents on this machine
(``--nnodes 1:2``, one worker each, c10d rendezvous with agent A hosting the store, ``is_host`` set explicitly)
train a small job; after the checkpoint of step ``--every`` the other node (agent B and its worker) is lost:

- ``kill``: SIGKILL of B's agent and worker (a node that dies; its sockets close). A's worker meets a closed
  connection in its next collective, fails, and A's agent re-forms the job on one node (``last_call_timeout``
  after it alone has joined) from the newest checkpoint; the store loader is elastic, so the sample stream is
  the same;
- ``stop``: SIGSTOP of both (a node that hangs: its sockets stay open). A's worker waits in a collective
  until ``parallel.timeout_minutes``, then fails, and the job re-forms as above;
- with ``--rejoin``, a new agent for the lost node starts once the one-node job has run two steps: A's agent
  sees a node waiting and stops its worker with SIGTERM, which the trainer treats as a preemption (every rank
  stops after one step, checkpoints); the agents re-form the two-node job from that checkpoint.

The agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the rendezvous store shared as the workers'
store (torch's default), an agent that joins a later round as a non-zero rank waits for a store address the
round's rank 0, which built its own in an earlier round, never publishes, and the rejoin times out after 60 s.

Per scenario: ``detect_s`` (loss -> the survivor's worker has exited), ``rendezvous_s`` (-> its new worker
process exists), ``resume_s`` (-> the first step after the resume has finished), for a rejoin ``rejoin_s``
(the node's agent starts -> the first two-node step has finished), the worlds the job ran at, and whether the
job finished. ``tests/test_node_loss.py`` checks the final weights and sample stream against an uninterrupted
run.

    python bench/node_loss.py [--modes kill,stop] [--rejoin] [--steps 12] [--every 4]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["model.hidden=32", "model.heads=2", "model.double_blocks=1", "model.single_blocks=1",
        "model.axes_dims_rope=[4, 6, 6]", "text.dim=16", "text.max_tokens=16", "data.image_size=32",
        "data.frames=3", "data.world_size=64", "train.global_batch=8", "train.minutes=0", "train.warmup_steps=1",
        "train.log_every=1", "train.lr=1e-3", "sample.steps=3", "eval.n=4", "train.ema_decay=0.9",
        "train.threads=1", "train.schedule=constant", "health.hang_seconds=120", "health.straggler_every=0"]
# Collectives time out after 15 s once the first two steps are done: how a silent loss is detected.
TIMEOUTS = ["parallel.timeout_minutes=0.25", "parallel.startup_steps=2"]
LAST_CALL_S = 2          # how long a rendezvous round waits for more nodes once the minimum (1) has joined
# A lost agent stays a participant of the finished round until its keep-alive lapses (interval x attempts):
# the survivor's new round waits for that. torch's defaults are 5 s x 3.
KEEP_ALIVE = (1, 3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts its workers in sessions of their own, so a process group
    is not the node)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


class Job:
    """One run directory trained by up to two agents on this machine."""

    def __init__(self, root: Path, cfg: Path, env: dict | None = None, slow_s: float = 1.0):
        self.root, self.cfg, self.port = root, cfg, free_port()
        self.run, self.samples = root / "run", root / "samples"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                    # every step sleeps on every rank (nothing computed changes), so a loss lands mid-run
                    "DIFFTRAIN_FAULTS": "slow@1:*", "DIFFTRAIN_SLOW_S": str(slow_s),
                    "DIFFTRAIN_SAMPLE_LOG": str(self.samples), **(env or {})}
        self.agents: dict[str, subprocess.Popen] = {}

    def start(self, name: str, host: bool) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
               "--max-restarts=3", "--monitor-interval=0.5", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id=nodeloss{self.port}",
               f"--rdzv-conf=is_host={'true' if host else 'false'},last_call_timeout={LAST_CALL_S},"
               f"join_timeout=120,read_timeout=60,keep_alive_interval={KEEP_ALIVE[0]},"
               f"keep_alive_max_attempt={KEEP_ALIVE[1]}",
               "-m", "difftrain", "train", str(self.cfg), "--run-dir", str(self.run), "--no-progress"]
        log = open(self.root / f"{name}.out", "w")
        self.agents[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                             start_new_session=True)
        return self.agents[name]

    def log(self, name: str) -> str:
        return (self.root / f"{name}.out").read_text(errors="replace")

    def events(self) -> list[dict]:
        path = self.run / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    def steps(self) -> list[dict]:
        path = self.run / "metrics.jsonl"
        if not path.exists():
            return []
        return [m for m in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if "loss" in m]

    def wait_for(self, what, timeout: float, why: str):
        deadline = time.monotonic() + timeout
        while True:
            got = what()
            if got:
                return got
            dead = [n for n, p in self.agents.items() if p.poll() is not None]
            if time.monotonic() > deadline or (dead and "A" in dead):
                raise RuntimeError(f"{why}: not within {timeout} s (agents ended: {dead})\n"
                                   + "\n".join(f"--- {n}\n{self.log(n)[-2500:]}" for n in self.agents))
            time.sleep(0.05)

    def kill_all(self) -> None:
        for p in self.agents.values():
            signal_all(process_tree(p.pid), signal.SIGCONT)
            signal_all(process_tree(p.pid), signal.SIGKILL)


def scenario(root: Path, mode: str, rejoin: bool, steps: int = 12, every: int = 4, slow_s: float = 1.0,
             extra: list[str] | None = None, timeout: float = 300) -> dict:
    """One run of two agents losing B (``mode`` 'kill' or 'stop') after the checkpoint of step ``every``."""
    if mode not in ("kill", "stop"):
        raise ValueError(f"mode must be 'kill' or 'stop', got {mode!r}")
    job = Job(root, job_config(root, steps, every, extra), slow_s=slow_s)
    out: dict = {"mode": mode, "rejoin": rejoin}
    try:
        a = job.start("A", host=True)
        job.start("B", host=False)
        job.wait_for(lambda: any(e["kind"] == "checkpoint" and e["step"] == every for e in job.events()), timeout,
                     f"the checkpoint of step {every}")
        workers = [p for p in process_tree(a.pid) if p != a.pid]
        node = process_tree(job.agents["B"].pid)
        t_loss = time.time()
        signal_all(node, signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        job.wait_for(lambda: not any(alive(p) for p in workers), timeout, "the survivor's worker to fail")
        t_detect = time.time()
        new = job.wait_for(lambda: [p for p in process_tree(a.pid) if p != a.pid and p not in workers and alive(p)],
                           timeout, "a new worker on the surviving node")
        t_spawn = time.time()
        resumed = job.wait_for(lambda: [e for e in job.events() if e["kind"] == "start" and e["world"] == 1],
                               timeout, "the one-node job to start")[0]
        first = job.wait_for(lambda: [m for m in job.steps() if m["time"] >= resumed["time"]], timeout,
                             "a step of the one-node job")[0]
        out.update(lost_after_step=every, resumed_at_step=resumed["step"],
                   detect_s=round(t_detect - t_loss, 2), rendezvous_s=round(t_spawn - t_detect, 2),
                   resume_s=round(first["time"] - t_spawn, 2), survivor_new_workers=len(new))
        if rejoin:
            job.wait_for(lambda: [m for m in job.steps() if m["time"] >= resumed["time"]
                                  and m["step"] >= resumed["step"] + 2], timeout, "two steps of the one-node job")
            t_back = time.time()
            job.start("B2", host=False)
            again = job.wait_for(lambda: [e for e in job.events() if e["kind"] == "start" and e["world"] == 2
                                          and e["time"] >= t_back], timeout, "the two-node job to re-form")[0]
            first2 = job.wait_for(lambda: [m for m in job.steps() if m["time"] >= again["time"]], timeout,
                                  "a step of the re-formed two-node job")[0]
            stops = [e for e in job.events() if e["kind"] == "preempt" and e["time"] >= t_back]
            out.update(rejoin_s=round(first2["time"] - t_back, 2), rejoined_at_step=again["step"],
                       survivor_stopped_at=[e["step"] for e in stops])
        rc = {}
        for name in [n for n in job.agents if n != "B"]:          # B is the lost node
            rc[name] = job.agents[name].wait(timeout=timeout)
        out["agent_exit"] = rc
        out["worlds"] = [(e["step"], e["world"]) for e in job.events() if e["kind"] == "start"]
        done = [m["step"] for m in job.steps()]
        out["finished"] = bool(done) and max(done) == steps and all(v == 0 for v in rc.values())
    finally:
        job.kill_all()
    out["run"] = str(job.run)
    return out


def job_config(root: Path, steps: int = 12, every: int = 4, extra: list[str] | None = None) -> Path:
    from difftrain.config import load_config, to_toml

    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "job.toml"
    cfg.write_text(to_toml(load_config(None, TINY + TIMEOUTS + [
        f"train.steps={steps}", f"train.checkpoint_every={every}", "train.keep_checkpoints=10"] + (extra or []))))
    return cfg


def batches(samples: Path) -> dict[int, list[int]]:
    """step -> the sample ids drawn for it over every rank and attempt (sorted; a replayed step draws the same)."""
    out: dict[int, set[int]] = {}
    for f in sorted(samples.parent.glob(samples.name + ".rank*")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row["step"], set()).update(row["ids"])
    return {k: sorted(v) for k, v in sorted(out.items())}


def reference(root: Path, steps: int = 12, every: int = 4) -> dict:
    """The same job on two ranks of one agent, uninterrupted: its exported weights and its batches."""
    from safetensors.torch import load_file

    cfg = job_config(root, steps, every)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIFFTRAIN_SAMPLE_LOG": str(root / "samples")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "difftrain", "train", str(cfg), "--run-dir", str(root / "run"), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the reference run failed:\n{proc.stderr[-3000:]}")
    return {"weights": load_file(str(root / "run" / "export" / "model.safetensors")),
            "batches": batches(root / "samples")}


def compare(ref: dict, run: Path, samples: Path) -> dict:
    """How a finished run's exported weights and batches compare with the reference's."""
    from safetensors.torch import load_file

    path = run / "export" / "model.safetensors"
    if not path.is_file():
        return {"final_state_max_abs_diff": None, "stream_identical": False}
    w = load_file(str(path))
    same_keys = w.keys() == ref["weights"].keys()
    worst = max((w[k].float() - ref["weights"][k].float()).abs().max().item() for k in w) if same_keys else None
    return {"final_state_max_abs_diff": worst, "stream_identical": batches(samples) == ref["batches"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="kill,stop")
    ap.add_argument("--rejoin", action="store_true", help="the lost node comes back (a new agent joins)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--slow-s", type=float, default=1.0, help="seconds every step sleeps (lands the loss mid-run)")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            r = scenario(Path(tmp) / mode, mode, args.rejoin, args.steps, args.every, args.slow_s)
            r.pop("run")
            results.append(r)
    print(json.dumps({"scenarios": results, "collective_timeout_s": 15, "last_call_timeout_s": LAST_CALL_S,
                      "keep_alive_s": KEEP_ALIVE[0] * KEEP_ALIVE[1]}))


if __name__ == "__main__":
    main()

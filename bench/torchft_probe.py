"""How fast does torchft (replica-group fault tolerance) bring back a killed replica on this CPU machine?

A comparison point for our restart-from-checkpoint path. torchft is NOT a dependency of this project and is
not installed in its venv: run this script with a Python that has ``torchft`` (0.2.0) installed, e.g. a
separate venv that sees the project's torch (``/tmp/ftv/bin/python bench/torchft_probe.py``).

The experiment (CPU only, gloo, one torch thread per process):

* the main process runs a torchft ``LighthouseServer`` (min_replicas=1, short join/heartbeat timeouts);
* it starts two replica groups of one process each (this script with ``--worker``): each runs its own
  ``TCPStore``, a ``torchft.Manager`` with a ``ProcessGroupGloo`` and AdamW wrapped in
  ``torchft.optim.OptimizerWrapper`` (``zero_grad`` -> ``manager.start_quorum``, ``step`` ->
  ``manager.should_commit``); the gradients are averaged with ``manager.allreduce`` (one flat buffer), or, with
  ``--grad-sync ddp``, by torchft's ``DistributedDataParallel`` wrapper (its comm hook calls
  ``manager.allreduce``); an MLP of ~147k parameters, batch 32 of random data seeded per (replica, step);
* when replica 1 has committed ``--kill-step`` steps the main process SIGKILLs it and at once starts a new
  process with the same replica id; torchft heals it in its first quorum from replica 0's live state (the
  state dict is fetched over the manager's HTTP checkpoint transport), while replica 0 keeps training;
* the workers stop together once they have reached ``--steps`` and trained ``--joint-steps`` steps together
  after the heal (both replicas see the same quorums, so they agree on when), and save their final model
  and optimizer tensors with safetensors.

By default (``--grad-sync both``) the ``manager.allreduce`` run is the result, and ``--ddp-runs`` runs with
torchft's DDP wrapper are summarized under ``ddp_wrapper``. With torchft 0.2.0 and torch 2.13 the DDP wrapper
does not survive a peer that dies during an allreduce: ``_ManagedWork.wait`` swallows the gloo error
(reporting it to the manager) and ``torchft/ddp.py _comm_hook`` then fails ``assert fut._fut`` inside
backward, which leaves torch's DDP reducer mid-reduction, so every later forward raises
"!unmarked_param_indices.empty() INTERNAL ASSERT FAILED" and no step commits again (the restarted replica
heals, then breaks the same way in its first allreduce). A kill that lands outside a collective (e.g. while
both wait in the quorum) is survived. The runs report which happened (``survivor_uncommitted_iterations`` > 0:
the kill hit an allreduce); a worker gives up after ``--max-stall`` s without a commit.

Prints one JSON object: ``kill_to_first_step_s`` (the kill -> the restarted replica's first committed step),
``survivor_max_step_gap_s`` (the longest gap between consecutive committed steps of replica 0 around the
failure), ``survivor_steps_during_outage``, ``healed_state_equal`` (the two replicas' final parameters
``torch.equal``), ``steps``, ``world``, ``torchft_version``, a breakdown of the restart and the settings used.
When a torchft call fails the JSON says which call and the error (``errors``, ``warnings``) instead of a
traceback. Exit status 1 when the main run reports errors.

    /tmp/ftv/bin/python bench/torchft_probe.py [--steps 200] [--kill-step 60] [--grad-sync both] [--budget 150]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

T_START = time.time()  # before any heavy import: the restarted worker's "process started" time

IN_DIM, HIDDEN, CLASSES, BATCH = 128, 320, 10, 32
WORLD = 2
NEED_TORCHFT = "torchft is not importable: run with a Python that has torchft installed (e.g. /tmp/ftv/bin/python)"


# --------------------------------------------------------------------------------------------------- worker

def worker(args: argparse.Namespace) -> int:
    log = open(args.log, "a", buffering=1)
    ident = {"replica": args.replica, "attempt": args.attempt, "pid": os.getpid()}

    def emit(**row) -> None:
        log.write(json.dumps({**ident, **row}) + "\n")

    emit(event="start", time=T_START)
    stage = "import torch"
    try:
        import torch
        torch.set_num_threads(1)
        stage = "import torchft"
        try:
            import torchft  # noqa: F401
        except Exception as e:  # noqa: BLE001
            emit(event="error", stage=stage, error=f"{NEED_TORCHFT}: {e!r}", time=time.time())
            return 3
        from datetime import timedelta

        import torch.distributed as dist
        from torch import nn

        from torchft.ddp import DistributedDataParallel
        from torchft.manager import Manager
        from torchft.optim import OptimizerWrapper
        from torchft.process_group import ProcessGroupGloo
        emit(event="imported", time=time.time())

        stage = "torch.distributed.TCPStore(is_master=True) for the replica group"
        store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        emit(event="store", time=time.time())

        torch.manual_seed(1234)  # same init everywhere (torchft also syncs step 0 from the primary: init_sync)
        mlp = nn.Sequential(nn.Linear(IN_DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                            nn.Linear(HIDDEN, CLASSES))
        inner = torch.optim.AdamW(mlp.parameters(), lr=1e-3)

        def state_dict() -> dict:
            return {"model": mlp.state_dict(), "optim": inner.state_dict()}

        def load_state_dict(sd: dict) -> None:
            mlp.load_state_dict(sd["model"])
            inner.load_state_dict(sd["optim"])

        emit(event="model", time=time.time())
        stage = "torchft.process_group.ProcessGroupGloo(timeout=...)"
        pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout))
        stage = "torchft.manager.Manager(...)"
        manager = Manager(
            pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
            replica_id=str(args.replica), store_addr="localhost", store_port=store.port, rank=0, world_size=1,
            lighthouse_addr=args.lighthouse, timeout=timedelta(seconds=args.timeout),
            quorum_timeout=timedelta(seconds=args.quorum_timeout), connect_timeout=timedelta(seconds=10))
        emit(event="manager", time=time.time())

        model, grad_sync = mlp, "Manager.allreduce of the flat gradients"
        if args.grad_sync == "ddp":
            stage = "torchft.ddp.DistributedDataParallel(manager, model)"
            model, grad_sync = DistributedDataParallel(manager, mlp), "torchft.ddp.DistributedDataParallel"
        stage = "torchft.optim.OptimizerWrapper(manager, AdamW)"
        opt = OptimizerWrapper(manager, inner)
        params = list(mlp.parameters())
        loss_fn = nn.CrossEntropyLoss()
        emit(event="ready", time=time.time(), grad_sync=grad_sync)

        if args.go:  # start barrier so both first quorums see both replicas
            stage = "waiting for the start signal"
            t_wait = time.time()
            while not os.path.exists(args.go):
                if time.time() - t_wait > 90 or time.time() > args.deadline:
                    raise TimeoutError("no start signal from the main process")
                time.sleep(0.01)

        ppid = os.getppid()
        streak = failing = 0
        last_commit = time.time()
        while True:
            if time.time() > args.deadline:
                emit(event="deadline", step=manager.current_step(), time=time.time())
                break
            if os.getppid() != ppid:  # the main process died: do not linger
                return 4
            t0 = time.time()
            before = manager.current_step()
            stage = "OptimizerWrapper.zero_grad -> Manager.start_quorum / wait_quorum (quorum, PG reconfigure, heal)"
            opt.zero_grad()
            manager.wait_quorum()
            q = time.time() - t0
            base = manager.current_step()  # a heal sets the step to the source replica's in the quorum
            stage = "forward"
            g = torch.Generator().manual_seed(1_000_003 * (args.replica + 1) + before)
            x = torch.randn(BATCH, IN_DIM, generator=g)
            y = torch.randint(0, CLASSES, (BATCH,), generator=g)
            try:
                loss = loss_fn(model(x), y)
                stage = "backward (DDP comm hook -> Manager.allreduce over gloo)"
                loss.backward()
                if model is mlp:
                    flat = torch.cat([p.grad.reshape(-1) for p in params])
                    manager.allreduce(flat).wait()
                    off = 0
                    for p in params:
                        n = p.numel()
                        p.grad.copy_(flat[off:off + n].view_as(p.grad))
                        off += n
            except Exception as e:  # noqa: BLE001 - a peer died mid-step: let torchft skip the step (no commit)
                emit(event="warning", stage=stage, error=repr(e)[:500], step=before, time=time.time(),
                     traceback=traceback.format_exc()[-1200:])
                manager.report_error(e)
                loss = torch.tensor(float("nan"))
            stage = "OptimizerWrapper.step -> Manager.should_commit"
            opt.step()
            step = manager.current_step()
            committed = step > base
            n = manager.num_participants()
            err = manager.errored()
            emit(step=step, time=time.time(), participants=n, committed=committed, healed=base != before,
                 quorum_s=round(q, 6), iter_s=round(time.time() - t0, 6), loss=round(loss.item(), 5),
                 error=None if err is None else repr(err.original_exception)[:300])
            streak = streak + 1 if committed and n == WORLD else 0
            failing = 0 if committed else failing + 1
            last_commit = time.time() if committed else last_commit
            if failing >= args.max_failing or time.time() - last_commit > args.max_stall:
                stage = "training loop"
                raise RuntimeError(f"stuck: no commit for {failing} iterations / {time.time() - last_commit:.1f}s, "
                                   f"last error: {None if err is None else repr(err.original_exception)[:300]}")
            if step >= args.steps and streak >= args.joint_steps:
                break

        stage = "saving the final state (safetensors)"
        tensors = {f"model/{k}": v.detach().clone().contiguous() for k, v in mlp.state_dict().items()}
        for pid, st in inner.state_dict()["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"optim/{pid}/{k}"] = v.detach().clone().contiguous().reshape(-1)
        try:
            from safetensors.torch import save_file
            save_file(tensors, args.out)
        except ImportError:
            torch.save(tensors, args.out)
        emit(event="done", step=manager.current_step(), time=time.time())
        stage = "Manager.shutdown"
        manager.shutdown(wait=False)
        return 0
    except Exception as e:  # noqa: BLE001 - report the failing call precisely, in the log the main process reads
        emit(event="error", stage=stage, error=repr(e)[:2000], traceback=traceback.format_exc()[-4000:],
             time=time.time())
        return 2
    finally:
        log.flush()


# ----------------------------------------------------------------------------------------------------- main

class Tail:
    """Reads the JSON lines a worker appends to its log, incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.pos, self.buf, self.rows = path, 0, "", []

    def poll(self) -> list[dict]:
        try:
            with open(self.path) as f:
                f.seek(self.pos)
                data = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            return []
        self.buf += data
        *lines, self.buf = self.buf.split("\n")
        new = []
        for line in lines:
            try:
                new.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        self.rows += new
        return new


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--attempt", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    ap.add_argument("--log", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--go", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=200, help="train at least this many steps")
    ap.add_argument("--joint-steps", type=int, default=20, help="and this many steps together after the heal")
    ap.add_argument("--kill-step", type=int, default=60, help="SIGKILL replica 1 once it has committed this step")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for everything; children killed after")
    ap.add_argument("--join-timeout-ms", type=int, default=1000)
    ap.add_argument("--quorum-tick-ms", type=int, default=100)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=10.0, help="Manager timeout (collectives, commit, heal)")
    ap.add_argument("--quorum-timeout", type=float, default=30.0, help="Manager quorum_timeout")
    ap.add_argument("--pg-timeout", type=float, default=5.0, help="ProcessGroupGloo timeout")
    ap.add_argument("--max-failing", type=int, default=200,
                    help="a worker gives up after this many consecutive iterations without a commit")
    ap.add_argument("--max-stall", type=float, default=6.0,
                    help="or after this many seconds without a commit (once training has started)")
    ap.add_argument("--grad-sync", choices=("allreduce", "ddp", "both"), default="both",
                    help="allreduce: Manager.allreduce of the flat grads; ddp: torchft's DDP wrapper; both: "
                         "the allreduce run is the result, a DDP-wrapper run is summarized under ddp_wrapper_run")
    ap.add_argument("--ddp-runs", type=int, default=3, help="with --grad-sync both: DDP-wrapper runs (each <=25s)")
    ap.add_argument("--workdir", default="", help="keep logs and final states here (default: a temp dir)")
    args = ap.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.worker:
        rc = worker(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # do not wait on torchft's background threads
    return run(args)


def run(args: argparse.Namespace) -> int:
    t_main = time.time()
    try:
        import importlib.metadata as md

        import torch
        torch.set_num_threads(1)
        from torchft.coordination import LighthouseServer  # noqa: F401
        versions = {"torchft_version": md.version("torchft"), "torch_version": torch.__version__}
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"error": f"{NEED_TORCHFT}: {e!r}", "python": sys.executable}))
        return 2
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="torchft_probe_"))
    if args.grad_sync == "both":
        modes = ["allreduce"] + [f"ddp{i}" for i in range(args.ddp_runs)]
    else:
        modes = [args.grad_sync]
    result: dict = {**versions}
    ddp_runs: list[dict] = []
    for mode in modes:
        left = t_main + args.budget - time.time()
        side = mode.startswith("ddp") and len(modes) > 1
        if side and left < 20:
            ddp_runs.append({"skipped": f"only {left:.0f}s of the budget left"})
            continue
        r = experiment(args, mode.rstrip("0123456789"), work / mode, min(left, 25.0) if side else left)
        if side:
            keys = ("recovered", "victim_step_at_kill", "survivor_uncommitted_iterations", "kill_to_first_step_s",
                    "survivor_max_step_gap_s", "healed_state_equal", "final_step", "errors", "warnings", "workdir")
            d = {k: r[k] for k in keys if k in r}
            for w in d.get("warnings", []):
                w["traceback_tail"] = w.get("traceback_tail", "")[-250:]
            for e in d.get("errors", []):
                e.pop("traceback", None)
            ddp_runs.append(d)
        else:
            result.update(r)
    if ddp_runs:
        done = [d for d in ddp_runs if "skipped" not in d]
        hit = [d for d in done if d.get("survivor_uncommitted_iterations")]
        result["ddp_wrapper"] = {
            "grad_sync": "torchft.ddp.DistributedDataParallel",
            "recovered": f"{sum(bool(d.get('recovered')) for d in done)}/{len(done)} runs",
            "recovered_when_the_kill_hit_an_allreduce": f"{sum(bool(d.get('recovered')) for d in hit)}/{len(hit)}",
            "runs": ddp_runs,
        }
    result["total_wall_s"] = round(time.time() - t_main, 2)
    print(json.dumps(result, indent=1))
    return 1 if result.get("errors") else 0


def experiment(args: argparse.Namespace, mode: str, work: Path, budget: float) -> dict:
    from torchft.coordination import LighthouseServer

    deadline = time.time() + budget
    result: dict = {"world": f"{WORLD} replica groups x 1 process (gloo, CPU, 1 thread each)", "errors": [],
                    "warnings": []}
    work.mkdir(parents=True, exist_ok=True)
    for old in list(work.glob("r*_*")) + [work / "go"]:
        old.unlink(missing_ok=True)
    go = work / "go"
    result["workdir"] = str(work)
    result["settings"] = {k: getattr(args, k) for k in ("steps", "joint_steps", "kill_step", "join_timeout_ms",
                                                       "quorum_tick_ms", "heartbeat_timeout_ms", "timeout",
                                                       "quorum_timeout", "pg_timeout")}
    result["settings"]["model_params"] = (IN_DIM * HIDDEN + HIDDEN) + (HIDDEN * HIDDEN + HIDDEN) + (
        HIDDEN * CLASSES + CLASSES)
    result["settings"]["batch"] = BATCH
    result["settings"]["max_stall_s"] = args.max_stall

    procs: dict[tuple[int, int], subprocess.Popen] = {}
    tails: dict[tuple[int, int], Tail] = {}
    files: list = []
    lighthouse = None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t_kill = None

    def spawn(replica: int, attempt: int, barrier: bool) -> None:
        key = (replica, attempt)
        log = work / f"r{replica}_a{attempt}.jsonl"
        out = open(work / f"r{replica}_a{attempt}.stderr", "w")
        files.append(out)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--replica", str(replica),
               "--attempt", str(attempt), "--lighthouse", lighthouse.address(), "--log", str(log),
               "--out", str(work / f"r{replica}_final.safetensors"), "--deadline", str(deadline - 8),
               "--steps", str(args.steps), "--joint-steps", str(args.joint_steps), "--grad-sync", mode,
               "--max-failing", str(args.max_failing), "--max-stall", str(args.max_stall),
               "--timeout", str(args.timeout),
               "--quorum-timeout", str(args.quorum_timeout), "--pg-timeout", str(args.pg_timeout)]
        procs[key] = subprocess.Popen(cmd + (["--go", str(go)] if barrier else []), stdout=out,
                                      stderr=subprocess.STDOUT, env=env)
        tails[key] = Tail(log)

    def poll_all() -> None:
        for t in tails.values():
            t.poll()

    def ready(key) -> bool:
        return any(r.get("event") == "ready" for r in tails[key].rows)

    try:
        try:
            lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=args.join_timeout_ms,
                                          quorum_tick_ms=args.quorum_tick_ms,
                                          heartbeat_timeout_ms=args.heartbeat_timeout_ms)
            result["lighthouse"] = lighthouse.address()
        except Exception as e:  # noqa: BLE001
            result["errors"].append({"call": "torchft.coordination.LighthouseServer(bind='[::]:0', ...)",
                                     "error": repr(e)})
            return result

        spawn(0, 0, True)
        spawn(1, 0, True)
        # start barrier: both managers up (heartbeating the lighthouse), then both start their first quorum
        while time.time() < deadline:
            poll_all()
            if all(ready(k) for k in procs) or any(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.02)
        if not all(ready(k) for k in procs):
            result["errors"].append({"call": "worker startup", "error": "a worker did not get ready"})
            return analyse(result, procs, tails, work)
        go.touch()
        t_go = time.time()

        victim = (1, 0)
        recovering = False
        while time.time() < deadline:
            poll_all()
            if not recovering:
                done = [r for r in tails[victim].rows if "event" not in r and r.get("committed")]
                if done and done[-1]["step"] >= args.kill_step:
                    t_kill = time.time()
                    os.kill(procs[victim].pid, signal.SIGKILL)
                    spawn(1, 1, False)  # same replica id, new process: torchft must heal it
                    procs[victim].wait(timeout=10)
                    recovering = True
                    continue
            rcs = [p.poll() for k, p in procs.items() if not (recovering and k == victim)]
            if any(rc not in (None, 0) for rc in rcs) or all(rc is not None for rc in rcs):
                break  # a worker failed (reported below), or everyone finished
            time.sleep(0.01)
        else:
            result["errors"].append({"call": "main", "error": f"budget of {budget:.0f}s exhausted; children killed"})
        poll_all()
        result["go_to_kill_s"] = round(t_kill - t_go, 3) if t_kill else None
        return analyse(result, procs, tails, work, t_kill=t_kill, args=args)
    finally:
        for p in procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(timeout=5)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        for f in files:
            f.close()
        if lighthouse is not None:
            try:
                lighthouse.shutdown()
            except Exception:  # noqa: BLE001
                pass


def analyse(result: dict, procs: dict, tails: dict, work: Path, t_kill: float | None = None,
            args: argparse.Namespace | None = None) -> dict:
    warn: dict[tuple, dict] = {}
    for (r, a), t in sorted(tails.items()):
        t.poll()
        for row in t.rows:
            if row.get("event") in ("error", "deadline"):
                result["errors"].append({"replica": r, "attempt": a, **{k: row[k] for k in
                                                                        ("event", "stage", "error", "step",
                                                                         "traceback") if k in row}})
            elif row.get("event") == "warning":  # deduplicated: first occurrence, with its traceback, and a count
                w = warn.setdefault((r, a, row.get("stage"), row.get("error")),
                                    {"replica": r, "attempt": a, "stage": row.get("stage"), "error": row.get("error"),
                                     "first_at_step": row.get("step"), "count": 0,
                                     "traceback_tail": (row.get("traceback") or "")[-700:]})
                w["count"] += 1
        rc = procs[(r, a)].poll()
        if rc not in (None, 0) and not (rc == -signal.SIGKILL and (r, a) == (1, 0) and t_kill):
            if not any(row.get("event") == "error" for row in t.rows):
                tail = (work / f"r{r}_a{a}.stderr").read_text(errors="replace")[-1500:]
                result["errors"].append({"replica": r, "attempt": a, "exit_code": rc, "output_tail": tail})
    result["warnings"] = list(warn.values())

    def rows(key) -> list[dict]:
        return [x for x in tails[key].rows if "event" not in x] if key in tails else []

    def committed(key) -> list[dict]:
        return [x for x in rows(key) if x.get("committed")]

    def ev(key, name) -> float | None:
        hit = [x["time"] for x in (tails[key].rows if key in tails else []) if x.get("event") == name]
        return hit[0] if hit else None

    s0, old, new = committed((0, 0)), committed((1, 0)), committed((1, 1))
    gs = {x.get("grad_sync") for t in tails.values() for x in t.rows if x.get("event") == "ready"}
    if gs:
        result["grad_sync"] = sorted(gs)[0] if len(gs) == 1 else sorted(gs)
    result["final_step"] = {"replica0": s0[-1]["step"] if s0 else None,
                            "replica1": (new or old)[-1]["step"] if (new or old) else None}
    result["steps"] = result["final_step"]["replica0"]
    if s0:
        pre = [x for x in s0 if t_kill is None or x["time"] < t_kill]
        result["step_s_median_both_replicas"] = median([b["time"] - a["time"] for a, b in zip(pre, pre[1:])])
        result["quorum_s_median_both_replicas"] = median([x["quorum_s"] for x in pre])
    if t_kill is None:
        result["recovered"] = False
        result.update(compare(work))
        return result
    result["victim_step_at_kill"] = old[-1]["step"] if old else None
    first = new[0] if new else None
    t_first = first["time"] if first else None
    result["recovered"] = first is not None
    result["kill_to_first_step_s"] = round(t_first - t_kill, 3) if first else None
    start, imported, ready = ev((1, 1), "start"), ev((1, 1), "imported"), ev((1, 1), "ready")
    store, built, manager = ev((1, 1), "store"), ev((1, 1), "model"), ev((1, 1), "manager")
    heal_rows = [x for x in rows((1, 1)) if x.get("healed")]
    result["restart_breakdown_s"] = {
        "kill_to_new_process_running": round(start - t_kill, 3) if start else None,
        "python_torch_torchft_imports": round(imported - start, 3) if imported and start else None,
        "tcpstore_start": round(store - imported, 3) if store and imported else None,
        "model_and_optimizer_init (the first torch.optim use imports torch._dynamo)":
            round(built - store, 3) if built and store else None,
        "manager_init (ManagerServer + lighthouse connect + HTTP checkpoint server)":
            round(manager - built, 3) if manager and built else None,
        "model_optimizer_wrappers": round(ready - manager, 3) if ready and manager else None,
        "ready_to_first_committed_step": round(t_first - ready, 3) if first and ready else None,
        "heal_quorum_s (lighthouse wait + PG reconfigure + state fetch)": heal_rows[0]["quorum_s"] if heal_rows
        else None,
    }
    if first:
        result["restarted_first_step"] = first["step"]
        result["restarted_healed"] = bool(heal_rows)
        result["restarted_first_step_participants"] = first["participants"]
    if s0:
        t_end = t_first if first else s0[-1]["time"]
        pairs = [(a, b) for a, b in zip(s0, s0[1:]) if b["time"] > t_kill and a["time"] < t_end + 2.0]
        gaps = sorted(((b["time"] - a["time"], a["time"] - t_kill, a["step"]) for a, b in pairs), reverse=True)
        result["survivor_max_step_gap_s"] = round(gaps[0][0], 3) if gaps else None
        result["survivor_top_gaps"] = [{"gap_s": round(g, 3), "starts_s_after_kill": round(o, 3), "after_step": st}
                                       for g, o, st in gaps[:3]]
        outage = [x for x in s0 if t_kill < x["time"] < t_end]
        result["survivor_steps_during_outage"] = len(outage)
        solo = [x for x in s0 if x["time"] > t_kill]
        result["survivor_first_commit_after_kill_s"] = round(solo[0]["time"] - t_kill, 3) if solo else None
        result["survivor_step_s_median_alone"] = median([b["time"] - a["time"] for a, b in zip(outage, outage[1:])])
        fails = [x for x in rows((0, 0)) if not x.get("committed")]
        result["survivor_uncommitted_iterations"] = len(fails)
        result["survivor_errors_seen"] = sorted({x["error"][:200] for x in fails if x.get("error")})[:3]
        heal0 = [x for x in s0 if first and abs(x["step"] - first["step"]) == 0]
        result["survivor_quorum_s_at_heal"] = heal0[0]["quorum_s"] if heal0 else None
        after = [x for x in s0 if first and x["time"] >= t_first]
        result["step_s_median_after_heal"] = median([b["time"] - a["time"] for a, b in zip(after, after[1:])])
    result.update(compare(work))
    return result


def compare(work: Path) -> dict:
    a, b = work / "r0_final.safetensors", work / "r1_final.safetensors"
    if not (a.exists() and b.exists()):
        return {"healed_state_equal": None, "healed_state_note": "a final state file is missing"}
    import torch
    try:
        from safetensors.torch import load_file
        sa, sb = load_file(str(a)), load_file(str(b))
    except Exception:  # noqa: BLE001 - the worker fell back to torch.save
        sa, sb = torch.load(a), torch.load(b)

    def eq(prefix: str) -> tuple[bool, float]:
        ka = sorted(k for k in sa if k.startswith(prefix))
        kb = sorted(k for k in sb if k.startswith(prefix))
        if ka != kb or not ka:
            return False, float("nan")
        same = all(torch.equal(sa[k], sb[k]) for k in ka)
        return same, max(float((sa[k].float() - sb[k].float()).abs().max()) for k in ka)

    m, md = eq("model/")
    o, od = eq("optim/")
    return {"healed_state_equal": m, "healed_max_abs_diff": md, "healed_optimizer_state_equal": o,
            "healed_optimizer_max_abs_diff": od}


if __name__ == "__main__":
    sys.exit(main())

"""Health checks of a running job: loss spikes, a hang watchdog, stragglers, preemption signals, and
per-rank structured logs.

- ``SpikeDetector``: a robust z-score of the loss against the median and MAD of a trailing window.
- ``Watchdog``: a thread per rank; if the training loop has not reported progress for ``timeout`` seconds
  (``startup_timeout`` before the first step), it writes every thread's stack to
  ``RUN/hang/rank_R.txt`` and ends the process with ``HANG_EXIT_CODE``, so that the launcher
  (``torchrun --max-restarts``) restarts the job from its newest checkpoint.
- ``Preemption``: SIGTERM / SIGUSR1 set a flag; the trainer folds it into a collective so that all ranks
  agree on the step to stop after, checkpoint, and leave ``RUN/requeue.json`` for the launcher script.
- ``JsonLogHandler``: ``RUN/logs/rank_R.jsonl``, one JSON object a line with time, run id, rank, step,
  level, logger and message.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import signal
import sys
import statistics
import threading
import time
from collections import deque
from pathlib import Path

import torch

log = logging.getLogger("difftrain.health")

HANG_EXIT_CODE = 86
REQUEUE_MARKER = "requeue.json"
LEAD_FILE = "preemption.json"


class SpikeDetector:
    """Robust z-score ``(x - median) / (1.4826 MAD)`` of each value against the previous ``window`` values;
    reports values above ``threshold`` once the window holds at least ``min_count`` values."""

    def __init__(self, window: int = 200, threshold: float = 8.0, min_count: int = 20):
        self.values: deque[float] = deque(maxlen=window)
        self.threshold, self.min_count = threshold, min_count

    def update(self, x: float) -> float | None:
        z = None
        if len(self.values) >= self.min_count and math.isfinite(x):
            med = statistics.median(self.values)
            mad = statistics.median(abs(v - med) for v in self.values)
            scale = 1.4826 * mad if mad > 0 else max(abs(med) * 1e-6, 1e-12)
            z = (x - med) / scale
        if math.isfinite(x):
            self.values.append(x)
        return z if z is not None and z > self.threshold else None


class Watchdog:
    def __init__(self, run_dir: str | Path, rank: int, timeout: float, startup_timeout: float,
                 on_fire=None, exit_code: int = HANG_EXIT_CODE):
        self.path = Path(run_dir) / "hang" / f"rank_{rank}.txt"
        self.rank, self.timeout, self.startup_timeout = rank, timeout, startup_timeout
        self.on_fire, self.exit_code = on_fire, exit_code
        self.last = time.monotonic()
        self.step: int | None = None
        self.what = "start-up"
        self.steady = False          # False until a step has finished: the start-up allowance applies
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Watchdog":
        """Start watching (again, after ``stop``); a no-op while watching or with no timeout."""
        if self.timeout > 0 and not (self._thread is not None and self._thread.is_alive()):
            self._stop = threading.Event()
            self.last = time.monotonic()
            self._thread = threading.Thread(target=self._run, args=(self._stop,), name="difftrain-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int, what: str = "training") -> None:
        self.last, self.step, self.what = time.monotonic(), step, what

    def stop(self) -> None:
        self._stop.set()

    def mark_steady(self) -> None:
        """A step has finished: build, load, compile and the first step are behind; hang_seconds from now."""
        self.steady = True

    def _limit(self) -> float:
        return self.timeout if self.steady else self.startup_timeout

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self.last
            if idle > self._limit():
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w") as f:
            f.write(f"rank {self.rank}: no progress for {idle:.0f} s (limit {self._limit():.0f} s) "
                    f"after step {self.step} ({self.what}); stacks of every thread:\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        log.error("rank %d: no progress for %.0f s after step %s (%s): stacks written to %s; exiting with %d so "
                  "that the launcher restarts the job", self.rank, idle, self.step, self.what, self.path,
                  self.exit_code)
        if self.on_fire is not None:
            try:
                self.on_fire(idle)
            except Exception:
                pass
        for h in logging.getLogger().handlers + logging.getLogger("difftrain").handlers:
            try:
                h.flush()
            except Exception:
                pass
        os._exit(self.exit_code)


class Preemption:
    """SIGTERM and SIGUSR1 (what SLURM sends ahead of a time limit with ``--signal``) set ``requested``, and so does
    SIGINT (Ctrl-C): the run stops after the step in flight with a checkpoint, as for a preemption. A second Ctrl-C
    exits at once (KeyboardInterrupt). Installed only in the main thread."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._old = {}

    def install(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    @property
    def interrupted(self) -> bool:
        """The stop was asked for from the keyboard (not by a scheduler: no requeue)."""
        return self.requested == "SIGINT"

    def _handler(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested is not None:
            raise KeyboardInterrupt      # a second Ctrl-C: out now, the stop's checkpoint is not waited for
        if signum == signal.SIGINT and self.requested is None:
            sys.stderr.write("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again to exit at once)\n")
        self.requested = self.requested or signal.Signals(signum).name

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()


class PreemptLead:
    """The time a preemption needs between the scheduler's signal and its kill, measured as the run goes: the
    longest of the last ``window`` steps (a signal is answered after the step in flight), the newest
    checkpoint's write (a preemption's checkpoint is blocking) and a margin (``margin_s``, at least a quarter).

    After each checkpoint rank 0 writes ``RUN/preemption.json``: the figures, ``lead_needed_s`` and
    ``shutdown_timeout_s`` (what torchrun's ``--shutdown-timeout`` should give the workers; the launch scripts
    read it). When the scheduler's configured lead (``health.preempt_lead_s``: SLURM's ``--signal=SIG@N``,
    Kubernetes' ``terminationGracePeriodSeconds``) is shorter than the need, it warns once per start: the
    next preemption's checkpoint would be killed part way (the previous checkpoint stays intact)."""

    def __init__(self, run_dir: str | Path, configured_s: float, on_event=None, margin_s: float = 15.0,
                 window: int = 100):
        self.path = Path(run_dir) / LEAD_FILE
        self.configured_s, self.margin_s = configured_s, margin_s
        self.on_event = on_event or (lambda *a, **k: None)
        self._steps: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.warned = False

    def step(self, seconds: float) -> None:
        with self._lock:
            self._steps.append(seconds)

    def need(self, save_s: float) -> dict:
        with self._lock:
            step_s = max(self._steps, default=0.0)
        base = step_s + save_s
        needed = base + max(self.margin_s, 0.25 * base)
        return {"step_s": round(step_s, 3), "save_s": round(save_s, 3), "margin_s": round(needed - base, 3),
                "lead_needed_s": round(needed, 1), "shutdown_timeout_s": math.ceil(needed),
                "configured_lead_s": self.configured_s or None}

    def saved(self, step: int, write_s: float) -> dict:
        """Record the need after a checkpoint written in ``write_s`` seconds (rank 0); warn if it is not met."""
        rec = {"step": step, "time": round(time.time(), 3), **self.need(write_s)}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(rec) + "\n")
        os.replace(tmp, self.path)
        if self.configured_s and self.configured_s < rec["lead_needed_s"] and not self.warned:
            self.warned = True
            log.warning("health.preempt_lead_s = %g s is shorter than a preemption needs here: %.1f s (a step of "
                        "%.1f s, a checkpoint of %.1f s, a margin); give the scheduler's signal a longer lead "
                        "(SLURM --signal=USR1@%d, Kubernetes terminationGracePeriodSeconds: %d) and set "
                        "health.preempt_lead_s to it", self.configured_s, rec["lead_needed_s"], rec["step_s"],
                        rec["save_s"], rec["shutdown_timeout_s"] + 5, rec["shutdown_timeout_s"] + 5)
            self.on_event("preempt_lead_short", step, configured_s=self.configured_s,
                          needed_s=rec["lead_needed_s"])
        return rec


def write_requeue_marker(run_dir: str | Path, step: int, reason: str) -> Path:
    path = Path(run_dir) / REQUEUE_MARKER
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "reason": reason, "time": time.time()}) + "\n")
    os.replace(tmp, path)
    return path


class JsonLogHandler(logging.Handler):
    """One JSON object a line per log record, with the run id, the rank and the current step."""

    def __init__(self, path: str | Path, run_id: str, rank: int):
        super().__init__(logging.INFO)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self.run_id, self.rank = run_id, rank
        self.step: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            doc = {"time": round(record.created, 3), "run_id": self.run_id, "rank": self.rank, "step": self.step,
                   "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
            self._file.write(json.dumps(doc) + "\n")
            self._file.flush()
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        try:
            self._file.close()
        finally:
            super().close()


def run_id() -> str:
    """torchrun's run id (shared by all ranks and restarts of a job), else the SLURM job id, else a new one."""
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(key) and os.environ[key] != "none":
            return os.environ[key]
    return f"local-{os.getpid()}-{int(time.time())}"


def stragglers(times: list[float], factor: float) -> list[int]:
    """Ranks whose time exceeds ``factor`` x the median of all ranks' times."""
    if len(times) < 2:
        return []
    med = statistics.median(times)
    return [r for r, t in enumerate(times) if med > 0 and t > factor * med]


class StepHealth:
    """What the loop does about unhealthy steps, on every rank alike (the verdicts come from reduced values):

    - a non-finite loss or gradient skips the update; its step is remembered in ``RUN/skip_steps.json``
      (not only in checkpoints), so that a replay from an older checkpoint never trains on that batch again;
      after ``health.rollback_after`` in a row, ``bad_step`` asks for a rollback (LR x ``rollback_lr_factor``);
    - a loss spike (robust z-score per task: the tasks' loss levels differ more than a spike within one)
      is logged with the sample ids of the batch, gathered from every rank;
    - every ``straggler_every`` steps, each rank's busy time (step time less its waits in collectives: the
      slowest rank waits least) is gathered, and ranks above ``straggler_factor`` x the median reported.
    """

    def __init__(self, hc, run_dir: Path, is_main: bool, world: int, device, event):
        self.hc, self.is_main, self.world, self.device, self.event = hc, is_main, world, device, event
        self.skip_file = Path(run_dir) / "skip_steps.json"
        self.skip_steps: set[int] = set(self._read_skip_file())
        self.consecutive_bad = self.skipped_steps = self.rollbacks = 0
        self.lr_scale = 1.0
        self.spikes: dict[str, SpikeDetector] | None = {} if hc.spike_z > 0 else None
        self.straggler_info: dict = {}
        self.busy = 0.0

    def state_dict(self) -> dict:
        return {"rollbacks": self.rollbacks, "skipped_steps": self.skipped_steps, "lr_scale": self.lr_scale,
                "skip_steps": sorted(self.skip_steps)}

    def load_state_dict(self, info: dict) -> None:
        self.rollbacks = int(info.get("rollbacks", 0))
        self.skipped_steps = int(info.get("skipped_steps", 0))
        self.lr_scale = float(info.get("lr_scale", 1.0))
        self.skip_steps |= {int(x) for x in info.get("skip_steps", [])}

    def _read_skip_file(self) -> list[int]:
        try:
            return [int(x) for x in json.loads(self.skip_file.read_text())]
        except (OSError, ValueError, TypeError):
            return []

    def good_step(self) -> None:
        self.consecutive_bad = 0

    def bad_step(self, step: int, loss: float, grad_norm: float) -> bool:
        """A skipped (non-finite) step, numbered from 1: count it and remember its batch. True when the state
        must be rolled back to the newest checkpoint; raises when that is not allowed or was done too often."""
        hc = self.hc
        self.skipped_steps += 1
        self.consecutive_bad += 1
        self.skip_steps.add(step)
        if self.is_main:
            tmp = self.skip_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(sorted(self.skip_steps)))
            os.replace(tmp, self.skip_file)
        log.warning("step %d skipped: loss %s, grad norm %s (%d in a row, %d in all)", step, loss, grad_norm,
                    self.consecutive_bad, self.skipped_steps)
        self.event("skip", step, loss=str(loss), grad_norm=str(grad_norm), consecutive=self.consecutive_bad)
        if hc.rollback_after == 0:
            raise FloatingPointError(f"step {step}: loss {loss} / grad norm {grad_norm} is not finite "
                                     "(health.rollback_after = 0; lower train.lr or raise train.warmup_steps)")
        if self.consecutive_bad < hc.rollback_after:
            return False
        if self.rollbacks >= hc.max_rollbacks:
            raise FloatingPointError(f"step {step}: {self.consecutive_bad} non-finite steps in a row after "
                                     f"{self.rollbacks} rollbacks (health.max_rollbacks): lower train.lr")
        return True

    def no_checkpoint(self, step: int) -> FloatingPointError:
        return FloatingPointError(f"step {step}: {self.consecutive_bad} non-finite steps in a row and no checkpoint "
                                  "to roll back to: lower train.lr or raise train.warmup_steps")

    def rolled_back(self, before: dict, step: int, path: Path) -> None:
        """After the state was loaded from ``path``: keep the skips and counts of the run so far (``before``)."""
        self.skip_steps |= set(before["skip_steps"])
        self.rollbacks, self.skipped_steps = before["rollbacks"] + 1, before["skipped_steps"]
        self.lr_scale *= self.hc.rollback_lr_factor
        self.consecutive_bad = 0
        log.warning("rolled back to %s (step %d); batches of steps %s will be skipped; LR x %.3g", path.name, step,
                    sorted(x for x in self.skip_steps if x >= step), self.lr_scale)
        self.event("rollback", step, path=str(path), skip_steps=sorted(self.skip_steps), lr_scale=self.lr_scale)

    def spike(self, step: int, loss: float, task: str, sample_ids: list) -> None:
        if self.spikes is None:
            return
        z = self.spikes.setdefault(task, SpikeDetector(self.hc.spike_window, self.hc.spike_z)).update(loss)
        if z is None:
            return
        ids = torch.cat([torch.as_tensor(i, dtype=torch.int64).flatten() for i in sample_ids]).to(self.device)
        if torch.distributed.is_initialized():
            n = torch.tensor([ids.numel()], device=self.device)
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
            padded = torch.full((int(n),), -1, dtype=torch.int64, device=self.device)
            padded[: ids.numel()] = ids
            out = [torch.empty_like(padded) for _ in range(self.world)]
            torch.distributed.all_gather(out, padded)
            ids = torch.cat(out)
        ids = sorted({int(x) for x in ids.tolist() if x >= 0})
        log.warning("step %d: loss spike %.4g (robust z %.1f), task %s, %d samples (ids in events.jsonl)", step,
                    loss, z, task, len(ids))
        self.event("spike", step, loss=loss, z=round(z, 2), task=task, sample_ids=ids)

    def stragglers(self, step: int, busy_s: float, rank: int) -> None:
        self.busy += busy_s
        hc = self.hc
        if not hc.straggler_every or step % hc.straggler_every:
            return
        t = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        t[rank] = self.busy
        self.busy = 0.0
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(t)
        times = t.tolist()
        slow = stragglers(times, hc.straggler_factor)
        median = sorted(times)[len(times) // 2]
        if slow:
            log.warning("step %d: straggler rank(s) %s: busy %s s vs median %.3f s over the last %d steps", step,
                        slow, [round(times[r], 3) for r in slow], median, hc.straggler_every)
            self.event("straggler", step, ranks=slow, busy_s=[round(x, 4) for x in times])
        self.straggler_info = {"stragglers": len(slow),
                               "busy_max_over_median": round(max(times) / max(1e-9, median), 3)}

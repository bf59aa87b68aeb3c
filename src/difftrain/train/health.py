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
import statistics
import threading
import time
from collections import deque
from pathlib import Path

log = logging.getLogger("difftrain.health")

HANG_EXIT_CODE = 86
REQUEUE_MARKER = "requeue.json"


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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Watchdog":
        if self.timeout > 0:
            self._thread = threading.Thread(target=self._run, name="difftrain-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int, what: str = "training") -> None:
        self.last, self.step, self.what = time.monotonic(), step, what

    def stop(self) -> None:
        self._stop.set()

    def _limit(self) -> float:
        return self.startup_timeout if self.step is None else self.timeout

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
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
    """SIGTERM and SIGUSR1 (what SLURM sends ahead of a time limit with ``--signal``) set ``requested``;
    installed only in the main thread."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.requested: str | None = None
        self._old = {}

    def install(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()


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
